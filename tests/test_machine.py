"""The machine and the workload decide the dtype: serving (vLLM's kernels) in bf16 where the CPU
has it in hardware (AMX or AVX512-BF16), training (torch's GEMMs) in bf16 only with AMX (with
AVX512-BF16 alone torch's bf16 GEMMs are slower than float32, measured), float32 on AVX2-only
CPUs; the user's choice always wins. Every branch runs on every machine (the CPU is described,
not probed), and the probe itself reads this machine."""

import pytest

from treedraft.heads.machine import CpuInfo, cpu_info, default_dtype, describe, resolve_dtype
from treedraft.training.config import TrainConfig

AMX = CpuInfo("Intel Xeon (test)", frozenset({"avx2", "avx512_f", "avx512_bf16", "amx_bf16"}))
AVX512_BF16 = CpuInfo("AMD EPYC Genoa (test)", frozenset({"avx2", "avx512_f", "avx512_bf16"}))
AVX2 = CpuInfo("AMD EPYC (test)", frozenset({"avx2"}))


@pytest.mark.parametrize(("info", "serve", "train"), [
    (AMX, "bfloat16", "bfloat16"), (AVX512_BF16, "bfloat16", "float32"),
    (AVX2, "float32", "float32")])
def test_auto_dtype_follows_the_cpu_and_the_workload(info, serve, train):
    assert default_dtype("cpu", info) == default_dtype("cpu", info, "serve") == serve
    assert resolve_dtype("auto", "cpu", info) == resolve_dtype("auto", "cpu", info, "serve") == serve
    assert default_dtype("cpu", info, "train") == resolve_dtype("auto", "cpu", info, "train") == train
    assert f"(dtype: serving {serve}, training {train})" in describe(info)


def test_training_config_resolves_auto_for_training(monkeypatch):
    from treedraft.heads import machine

    monkeypatch.setattr(machine, "cpu_info", lambda: AVX512_BF16)
    cfg = TrainConfig(dtype="auto")
    assert cfg.compute_dtype() == "float32"  # torch's autocast GEMMs: AMX only
    assert cfg.compute_dtype(workload="serve") == "bfloat16"  # a vLLM generation engine
    assert TrainConfig(dtype="bfloat16").compute_dtype() == "bfloat16"


@pytest.mark.parametrize("info", [AMX, AVX2])
def test_the_users_dtype_wins(info):
    assert resolve_dtype("bfloat16", "cpu", info) == "bfloat16"
    assert resolve_dtype("float32", "cpu", info) == "float32"


def test_bad_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'fp8'.*auto, float32, bfloat16"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match="workload 'infer'; valid values: serve, train"):
        default_dtype("cpu", AVX2, "infer")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        TrainConfig(dtype="fp8").validate()


def test_this_machine_is_described_with_the_flags_that_matter():
    info = cpu_info()
    line = describe(info)
    for flag in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16"):
        assert f"{flag} {'yes' if flag in info.flags else 'no'}" in line
    assert info.fast_bf16 == bool({"amx_bf16", "avx512_bf16"} & info.flags)
    assert info.fast_bf16_training == ("amx_bf16" in info.flags)
    # the training default is 'auto' and resolves to this machine's choice for training
    assert TrainConfig().dtype == "auto"
    assert TrainConfig().compute_dtype() == default_dtype("cpu", info, "train")


def test_each_test_worker_owns_its_share_of_the_cpus():
    """Parallel tests (tests/conftest.py): each worker runs on its own cores, and the engines
    it starts bind their OpenMP threads to those."""
    import os

    from treedraft.scripts.engine import engine_env

    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("one process (-n 0): every CPU")
    n = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    mine = sorted(os.sched_getaffinity(0))
    assert 1 <= len(mine) <= max(1, (os.cpu_count() or 1) // n)  # a share, not every CPU
    assert engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, mine))
