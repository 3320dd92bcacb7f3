"""What this machine computes fast: CPU model, the ISA flags that matter, and the dtype to use.

The fleet mixes Intel CPUs with AMX (bf16 matmuls fast), Intel CPUs with AVX512-BF16 but no AMX
(vLLM's kernels run bf16 faster than float32, torch's own GEMMs slower) and AMD EPYC CPUs with
AVX2 only (no AVX-512: bf16 matmuls several times slower than float32, and vLLM's bf16 oneDNN
GEMM cannot be built there, so vLLM falls back to torch). So the dtype depends on the workload:

| CPU | serving (vLLM's kernels) | training (torch autocast GEMMs) |
| --- | --- | --- |
| AMX | bfloat16 | bfloat16 |
| AVX512-BF16, no AMX | bfloat16 (vLLM no-spec 31.5 vs 23.6 tok/s at batch 1) | float32 (bf16 GEMM 170 vs 310 GFLOP/s; training 140 vs 197 tok/s) |
| AVX2 only | float32 | float32 |

Every default that depends on it is chosen here, from the machine, and every number we print
says which machine it came from (`describe()`).

    python -m treedraft.heads.machine        # CPU model, flags, the dtype treedraft picks

Pure torch: `torch.cpu.get_capabilities()` (cpuinfo) reads the flags on every OS; the
decisions take a `CpuInfo` so both branches are testable on either kind of machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLAGS = ("avx2", "avx512_f", "avx512_bf16", "amx_bf16")  # printed with every number
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
WORKLOADS = ("serve", "train")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]  # names as in torch.cpu.get_capabilities(): avx2, avx512_f, amx_bf16

    @property
    def fast_bf16(self) -> bool:
        """bf16 in hardware (AMX tiles or AVX512-BF16 dot products): vLLM's CPU kernels (its
        oneDNN GEMM, attention) run bf16 faster than float32 here."""
        return bool(self.flags & {"amx_bf16", "avx512_bf16"})

    @property
    def fast_bf16_training(self) -> bool:
        """bf16 faster than float32 in torch's own GEMMs at training shapes: AMX only. With
        AVX512-BF16 and no AMX (an Intel Xeon) torch's bf16 matmul runs at 170 GFLOP/s
        against 310 in float32, and a training step 1.4x slower."""
        return "amx_bf16" in self.flags


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
    """One line for logs and reports, e.g. 'AMD EPYC: avx2 yes, avx512_f no, ... (dtype:
    serving float32, training float32)'."""
    info = info or cpu_info()
    flags = ", ".join(f"{f} {'yes' if f in info.flags else 'no'}" for f in FLAGS)
    return (f"{info.model}: {flags} (dtype: serving {default_dtype('cpu', info, 'serve')}, "
            f"training {default_dtype('cpu', info, 'train')})")


def default_dtype(device: str | torch.device = "cpu", info: CpuInfo | None = None,
                  workload: str = "serve") -> str:
    """'bfloat16' where bf16 is fast for `workload` (module docstring's table), else 'float32'.

    serve: vLLM's kernels: CUDA with bf16, CPUs with AMX or AVX512-BF16. train: torch's autocast
    GEMMs: CUDA with bf16, CPUs with AMX. AVX2-only CPUs: float32 for both (bf16 ~3.5x slower)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}; valid values: {', '.join(WORKLOADS)}")
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    info = info or cpu_info()
    fast = info.fast_bf16 if workload == "serve" else info.fast_bf16_training
    return "bfloat16" if fast else "float32"


def resolve_dtype(requested: str, device: str | torch.device = "cpu",
                  info: CpuInfo | None = None, workload: str = "serve") -> str:
    """The user's dtype wins; 'auto' becomes `default_dtype` of this machine and workload."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype {requested!r}; valid values: {', '.join(DTYPE_CHOICES)}")
    return default_dtype(device, info, workload) if requested == "auto" else requested


if __name__ == "__main__":
    print(describe())
