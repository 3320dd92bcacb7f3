"""Shared test setup.

The suite runs in parallel (`-n auto --dist loadfile` in pyproject.toml: pytest-xdist, each test
file whole in one worker, so a file's shared engines stay shared). Each worker owns its share
of the CPUs, its affinity set before torch starts: the worker's process and everything it starts
(engines, `vllm serve`, the CLI) inherit it, torch sizes its thread pool from it, and the engines
bind vLLM's OpenMP threads to it (`scripts/engine.py` `engine_env`). On a 2-core machine that is one core per worker: one worker's
engine computes while the other imports vLLM or starts an engine, which is single-threaded
work. `-n 0` runs the suite in one process on every core.

Tiny models run many small ops: one intra-op thread is far faster than two fighting over cores
(and than oversubscription when other work runs). Tests that run the real SmolLM2 ask for the
worker's cores with the `torch_threads` fixture.
"""

import os

MAX_WORKERS = 4  # engines hold ~2-3 GiB each: more workers than this only add memory


def _worker_cpus() -> list[int] | None:
    """This xdist worker's share of the CPUs (None outside a worker)."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not name or not count:
        return None
    cpus, i, n = sorted(os.sched_getaffinity(0)), int(name.removeprefix("gw")), int(count)
    per = max(1, len(cpus) // n)
    return cpus[i * per:(i + 1) * per] or [cpus[i % len(cpus)]]


if (_cpus := _worker_cpus()) is not None:  # before torch sizes its thread pool from it
    os.sched_setaffinity(0, _cpus)

import pytest  # noqa: E402
import torch  # noqa: E402

# The files that take longest (2-14 minutes each on a 2-core CPU), longest first, start first so
# that no worker is left with one of them at the end; the others follow in collection order.
HEAVY_FILES = ("test_plugin_engine.py", "test_reference.py", "test_serve.py", "test_bundle.py",
               "test_models.py", "test_cli.py")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per CPU this process may use, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    def weight(item):
        name = item.path.name
        return HEAVY_FILES.index(name) if name in HEAVY_FILES else len(HEAVY_FILES)

    items.sort(key=weight)  # stable: each file's tests keep their order


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def torch_threads():
    """Use every core of this process (this worker's share) for this test (real-model tests)."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))


def pytest_report_header(config):
    """Every test log names the machine that judged it (AMX and AVX2-only CPUs differ)."""
    from treedraft.heads.machine import describe

    return f"treedraft machine: {describe()}"


def pytest_configure(config):
    # tests/vllm_run.py is imported by name from the tests
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
