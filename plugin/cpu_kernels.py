"""The head's linear layers and RMS norms on vLLM's CPU kernels.

vLLM runs the target's linears through `dispatch_cpu_unquantized_gemm`: prepacked weights and
oneDNN / AMX micro-kernels (sgl-kernel for small ones). At decode sizes (1-16 rows) torch's own
`F.linear` is slower: 1.5-3x in bfloat16 on an AMX CPU, and about 2x in float32 on a 2-core
AVX2-only AMD EPYC (the shipped head's commit of 2 pairs 2.1 ms against 3.7, a
`dynamic:10,3,3` tree 7.1 ms against 18.9 at batch 1), and the head's matmuls are most of a
drafting step. `use_vllm_gemm` routes every `nn.Linear` of a loaded head through the same
dispatch; the weights stay in place (`remove_weight=False`), so the head module is unchanged for
anything else that reads them.

`use_vllm_rms_norm` runs the head's `RMSNorm`s (heads/eagle.py, their torch twin) as one call
of vLLM's CPU `rms_norm` each, where torch takes about eight ops (2.5 us against 13 us per call
at 3 rows x 576 in bf16; the shipped head runs 15 norms in a chain-of-3 step: its drafting
took 3.26 ms a step against 3.49 on a 2-core AMD EPYC, scripts/BENCHMARKS.md, "Where a chain
step's drafting goes").

Routed: float32 heads on any CPU, bf16/fp16 heads where the CPU computes bf16 in hardware
(AMX/AVX512-BF16). A bf16 head on an AVX2-only CPU keeps torch's kernels: vLLM's oneDNN bf16
GEMM cannot be built there (vLLM logs a failure and falls back to `F.linear` per layer), so
routing would only add the warning. Drafts only: their speed changes (and their last bits of
rounding), never exactness (acceptance verifies any draft).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.platforms import current_platform

from treedraft.heads.eagle import RMSNorm
from treedraft.heads.machine import CpuInfo, cpu_info

logger = init_logger("vllm.treedraft")
PACKED_DTYPES = (torch.bfloat16, torch.float16)


def _routed_dtypes(info: CpuInfo | None) -> tuple[torch.dtype, ...]:
    return (torch.float32, *PACKED_DTYPES) if (info or cpu_info()).fast_bf16 else (
        torch.float32,)


def _forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return layer.cpu_linear(x, layer.weight, layer.bias)


def use_vllm_gemm(head: nn.Module, info: CpuInfo | None = None) -> int:
    """Route the head's float32 nn.Linear layers, and its bf16/fp16 ones where the CPU computes
    bf16 in hardware (`info`: this machine by default), through vLLM's CPU GEMM dispatch;
    returns how many."""
    if not current_platform.is_cpu():
        return 0
    dtypes = _routed_dtypes(info)
    n = 0
    for layer in head.modules():
        if not isinstance(layer, nn.Linear) or layer.weight.dtype not in dtypes:
            continue
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layer.forward = _forward.__get__(layer)  # bound: instance attribute, not a class patch
        n += 1
    if n:
        logger.info("treedraft head: %d linear layers on vLLM's CPU GEMM kernels", n)
    return n


def _has_op(name: str) -> bool:
    """vLLM's C++ op `torch.ops._C.<name>` is loaded (vLLM loads its CPU build's ops at start)."""
    try:
        getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != norm.weight.dtype:  # the torch twin casts; vLLM's kernel takes one dtype
        return RMSNorm.forward(norm, x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    torch.ops._C.rms_norm(out, rows, norm.weight, norm.eps)
    return out.view(x.shape)


def use_vllm_rms_norm(head: nn.Module, info: CpuInfo | None = None) -> int:
    """Route the head's `RMSNorm`s of the dtypes `use_vllm_gemm` routes through vLLM's CPU
    `rms_norm` kernel; returns how many."""
    if not current_platform.is_cpu() or not _has_op("rms_norm"):
        return 0
    dtypes = _routed_dtypes(info)
    n = 0
    for norm in head.modules():
        if isinstance(norm, RMSNorm) and norm.weight.dtype in dtypes:
            norm.forward = _rms_norm.__get__(norm)
            n += 1
    return n
