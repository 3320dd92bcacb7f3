"""The head's linear layers on vLLM's CPU GEMM kernels (vLLM's `layers.utils` CPU dispatch).

vLLM runs the target's linears through `dispatch_cpu_unquantized_gemm`: prepacked weights and
oneDNN / AMX micro-kernels (sgl-kernel for small ones). In bfloat16 torch's own `F.linear` is
1.5-3x slower at decode sizes (1-3 rows) on this CPU, and the head's matmuls are most of a
drafting step. `use_vllm_gemm` routes every `nn.Linear` of a loaded head through the same
dispatch. Drafts only: their speed changes, never exactness (acceptance verifies any draft).

The weights stay in place (`remove_weight=False`), so the head module is unchanged for anything
else that reads them. float32 keeps torch's kernels (no gain there, measured), and so does a CPU
without AMX/AVX512-BF16: vLLM's oneDNN bf16 GEMM cannot be built on an AVX2-only CPU (vLLM logs a
failure and falls back to `F.linear` per layer), so routing there only adds the warning.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.platforms import current_platform

from treedraft.training.machine import CpuInfo, cpu_info

logger = init_logger("vllm.treedraft")
PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return layer.cpu_linear(x, layer.weight, layer.bias)


def use_vllm_gemm(head: nn.Module, info: CpuInfo | None = None) -> int:
    """Route the head's bf16/fp16 nn.Linear layers through vLLM's CPU GEMM dispatch where the
    CPU computes bf16 in hardware (`info`: this machine by default); returns how many."""
    if not current_platform.is_cpu() or not (info or cpu_info()).fast_bf16:
        return 0
    n = 0
    for layer in head.modules():
        if not isinstance(layer, nn.Linear) or layer.weight.dtype not in PACKED_DTYPES:
            continue
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layer.forward = _forward.__get__(layer)  # bound: instance attribute, not a class patch
        n += 1
    if n:
        logger.info("treedraft head: %d linear layers on vLLM's CPU GEMM kernels", n)
    return n
