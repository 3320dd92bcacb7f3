"""What this machine computes fast: CPU model, the ISA flags that matter, and the dtype to use.

The fleet mixes Intel CPUs with AMX (bf16 matmuls fast) and AMD EPYC CPUs with AVX2 only (no
AVX-512: bf16 matmuls several times slower than float32, and vLLM's bf16 oneDNN GEMM cannot be
built there, so vLLM falls back to torch). Every default that depends on it is chosen here, from
the machine, and every number we print says which machine it came from (`describe()`).

    python -m treedraft.training.machine     # CPU model, flags, the dtype treedraft picks

Pure torch: `torch.cpu.get_capabilities()` (cpuinfo) reads the flags on every OS; the
decisions take a `CpuInfo` so both branches are testable on either kind of machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLAGS = ("avx2", "avx512_f", "avx512_bf16", "amx_bf16")  # printed with every number
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]  # names as in torch.cpu.get_capabilities(): avx2, avx512_f, amx_bf16

    @property
    def fast_bf16(self) -> bool:
        """bf16 matmuls in hardware (AMX tiles or AVX512-BF16 dot products)."""
        return bool(self.flags & {"amx_bf16", "avx512_bf16"})


def cpu_info() -> CpuInfo:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = frozenset(k for k, v in caps.items() if v is True)
    if not caps:  # older torch: the private probes vLLM itself uses
        probes = {"avx2": "_is_avx2_supported", "avx512_f": "_is_avx512_supported",
                  "avx512_bf16": "_is_avx512_bf16_supported",
                  "amx_bf16": "_is_amx_tile_supported"}
        flags = frozenset(f for f, fn in probes.items() if getattr(torch.cpu, fn, bool)())
    return CpuInfo(model=str(caps.get("cpu_name") or "unknown CPU"), flags=flags)


def describe(info: CpuInfo | None = None) -> str:
    """One line for logs and reports, e.g. 'AMD EPYC: avx2 yes, avx512_f no, ... -> float32'."""
    info = info or cpu_info()
    flags = ", ".join(f"{f} {'yes' if f in info.flags else 'no'}" for f in FLAGS)
    return f"{info.model}: {flags} (default dtype {default_dtype('cpu', info)})"


def default_dtype(device: str | torch.device = "cpu", info: CpuInfo | None = None) -> str:
    """'bfloat16' where bf16 matmuls are fast (CUDA with bf16, CPUs with AMX/AVX512-BF16),
    'float32' elsewhere (AVX2-only CPUs: bf16 ~3.5x slower than float32 there, measured)."""
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if (info or cpu_info()).fast_bf16 else "float32"


def resolve_dtype(requested: str, device: str | torch.device = "cpu",
                  info: CpuInfo | None = None) -> str:
    """The user's dtype wins; 'auto' becomes `default_dtype` of this machine."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype {requested!r}; valid values: {', '.join(DTYPE_CHOICES)}")
    return default_dtype(device, info) if requested == "auto" else requested


if __name__ == "__main__":
    print(describe())
