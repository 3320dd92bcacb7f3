"""`treedraft load` (scripts/load.py) without a server: the workload is fixed by its seed and
covers every request shape, the report's percentiles and comparison are right, and anything but
a loopback URL is refused before a request is sent."""

from __future__ import annotations

import argparse

import pytest

from treedraft.scripts.load import KINDS, _body, add_arguments, compare, percentile, run, workload


def test_workload_is_seeded_and_covers_every_shape():
    a, b = workload(48, 0, 512), workload(48, 0, 512)
    assert a == b and a != workload(48, 1, 512)
    assert {r["kind"] for r in a} == set(KINDS)
    greedy = [r for r in a if r["temperature"] == 0]
    assert greedy and len(greedy) < len(a)  # T=0 answers to compare, and sampled requests
    near = next(r for r in a if r["kind"] == "near_max_len")
    path, body = _body(near, "m")
    assert path == "/v1/chat/completions" and "max_tokens" not in body  # runs to the context
    assert len(near["prompt"].split()) == 512 - 96
    path, body = _body(next(r for r in a if r["kind"] == "logprobs"), "m")
    assert path == "/v1/completions" and body["logprobs"] == 2
    assert _body(next(r for r in a if r["kind"] == "disconnect"), "m")[1]["stream"] is True


def test_percentiles_and_comparison():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.99) == 2.0
    a = {"greedy": {"1": "x", "2": "y", "3": "z"}}
    b = {"greedy": {"1": "x", "2": "Y", "4": "w"}}
    assert compare(a, b) == ["2"]


def test_only_loopback_servers():
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="loopback"):
        run(p.parse_args(["--url", "http://example.com:8000"]))
