"""The machine decides the dtype: bf16 only where the CPU has it in hardware (AMX or
AVX512-BF16), float32 on AVX2-only CPUs; the user's choice always wins. Both branches run on
every machine (the CPU is described, not probed), and the probe itself reads this machine."""

import pytest

from treedraft.training.config import TrainConfig
from treedraft.training.machine import CpuInfo, cpu_info, default_dtype, describe, resolve_dtype

AMX = CpuInfo("Intel Xeon (test)", frozenset({"avx2", "avx512_f", "avx512_bf16", "amx_bf16"}))
AVX512_BF16 = CpuInfo("AMD EPYC Genoa (test)", frozenset({"avx2", "avx512_f", "avx512_bf16"}))
AVX2 = CpuInfo("AMD EPYC (test)", frozenset({"avx2"}))


@pytest.mark.parametrize(("info", "want"), [(AMX, "bfloat16"), (AVX512_BF16, "bfloat16"),
                                            (AVX2, "float32")])
def test_auto_dtype_follows_the_cpu(info, want):
    assert default_dtype("cpu", info) == want
    assert resolve_dtype("auto", "cpu", info) == want
    assert f"default dtype {want}" in describe(info)


@pytest.mark.parametrize("info", [AMX, AVX2])
def test_the_users_dtype_wins(info):
    assert resolve_dtype("bfloat16", "cpu", info) == "bfloat16"
    assert resolve_dtype("float32", "cpu", info) == "float32"


def test_bad_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'fp8'.*auto, float32, bfloat16"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        TrainConfig(dtype="fp8").validate()


def test_this_machine_is_described_with_the_flags_that_matter():
    info = cpu_info()
    line = describe(info)
    for flag in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16"):
        assert f"{flag} {'yes' if flag in info.flags else 'no'}" in line
    assert info.fast_bf16 == bool({"amx_bf16", "avx512_bf16"} & info.flags)
    # the training default is 'auto' and resolves to this machine's choice
    assert TrainConfig().dtype == "auto"
    assert TrainConfig().compute_dtype() == default_dtype("cpu", info)
