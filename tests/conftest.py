"""Shared test setup.

Tiny models run many small ops: on this 2-core machine one intra-op thread is far faster
than two fighting over cores (and than oversubscription when other work runs). Tests that
run the real SmolLM2 ask for more threads with the `torch_threads` fixture.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def torch_threads():
    """Use every core for this test (real-model tests)."""
    import os

    torch.set_num_threads(os.cpu_count() or 1)


def pytest_report_header(config):
    """Every test log names the machine that judged it (AMX and AVX2-only CPUs differ)."""
    from treedraft.heads.machine import describe

    return f"treedraft machine: {describe()}"


def pytest_configure(config):
    # tests/vllm_run.py is imported by name from the tests
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
