"""heads/cost.py: the `"tree": "auto"` policy (pure; the engine test runs it inside vLLM)."""

from __future__ import annotations

import pytest

from treedraft.heads.cost import StepCostModel, best_budget, expected_lengths
from treedraft.heads.tree import build_static_paths, expected_acceptance_length

RATES = [[0.43, 0.12, 0.05], [0.34, 0.1], [0.33], [0.33]]  # about the shipped EAGLE head


def test_expected_lengths_of_chains_and_trees():
    e = expected_lengths([[0.5], [0.5]], 3, chain=True)
    assert e == {0: 1.0, 1: 1.5, 2: 1.75, 3: 1.875}  # the last depth's rate repeats
    t = expected_lengths(RATES, 8, chain=False)
    assert list(t) == [0, 1, 2, 3, 4, 6, 8]
    assert t[4] == pytest.approx(expected_acceptance_length(build_static_paths(RATES, 4), RATES))
    assert all(t[a] < t[b] for a, b in zip(list(t), list(t)[1:]))  # more nodes, more tokens
    assert expected_lengths(RATES, 64, chain=False)[64] >= t[8]  # capped by the table


def fitted(a: float, b: float, c: float) -> StepCostModel:
    m = StepCostModel()
    for rows, drafted in [(1, 0), (8, 0), (100, 0), (4, 3), (32, 30), (12, 10), (64, 48),
                          (200, 0), (9, 8), (40, 3), (2, 1), (16, 16), (24, 0)]:
        m.add(rows, drafted, a + b * rows + c * drafted)
    return m


def test_cost_model_recovers_its_coefficients_and_drops_stalls():
    m = fitted(0.005, 0.0006, 0.0003)
    assert m.fit() == pytest.approx((0.005, 0.0006, 0.0003), rel=1e-6)
    m.add(10, 0, 5.0)  # an idle gap between requests: dropped
    assert len(m.samples) == 13 and m.predict(10, 0) == pytest.approx(0.011)
    assert StepCostModel().fit() is None  # nothing measured yet
    flat = StepCostModel(min_samples=2)
    flat.add(4, 0, 0.1)
    flat.add(4, 0, 0.1)
    assert flat.fit() is None  # rows never varied: no slope to trust


def test_budget_follows_cost_and_batch():
    lengths = expected_lengths(RATES, 16, chain=False)
    assert best_budget(StepCostModel(), 4, lengths) == 16  # unfitted: draft the full tree
    cpu = fitted(0.005, 0.0006, 0.0003)  # every row costs about what a token is worth
    assert best_budget(cpu, 8, lengths) == 0
    gpu = fitted(0.020, 1e-6, 1e-6)  # memory-bound: extra rows are nearly free
    assert best_budget(gpu, 8, lengths) == 16
    mid = fitted(0.050, 0.001, 0.0002)  # a fixed cost per step that small batches do not fill
    small, large = best_budget(mid, 1, lengths), best_budget(mid, 64, lengths)
    assert small > 0 and large == 0 and small > large
