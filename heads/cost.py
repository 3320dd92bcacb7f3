"""Each serving step's draft budget from measured cost: the `"tree": "auto"` policy (pure torch).

Speculation pays only when the extra tokens a step accepts outweigh what its extra rows cost.
On a GPU a decode step is memory-bound and extra rows are nearly free; on a CPU the target is
compute-bound after a few rows and every drafted node costs about as much as a token. Neither
is assumed: `StepCostModel` fits, online, from the engine's own steps

    seconds(step) ~ a + b * target_rows + c * drafted_nodes

(least squares over a window of recent steps, coefficients kept >= 0), and `best_budget` picks
the node budget n per request that maximises expected tokens per second for the current batch
of B drafting requests:

    B * E(n) / seconds(B * (1 + n) rows, B * n drafted nodes)

where E(n) = expected tokens per request per step of the best n-node tree under the head's
measured acceptance rates (`expected_lengths`; E(0) = 1). n = 0 drafts nothing: a step costs
what it costs without speculation, so `auto` is never slower than no speculation beyond the
model's error and its exploration steps. A better head raises E(n) and the same model then
chooses larger trees: nothing to retune.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from .tree import build_static_paths, expected_acceptance_length

BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the budgets `auto` chooses among


def expected_lengths(rates: Sequence[Sequence[float]], max_nodes: int, chain: bool
                     ) -> dict[int, float]:
    """{n: E(n)} for the budgets n <= max_nodes in BUDGETS (and max_nodes itself).

    chain: E(n) = 1 + sum_{d=1..n} prod_{j<=d} rates[j-1][0]; else the best static n-node tree
    (heads.tree.build_static_paths; a dynamic tree does at least about as well). A rate table
    shorter than n (depths or ranks) caps E at what the table allows."""
    budgets = sorted({b for b in BUDGETS if b <= max_nodes} | {max_nodes})
    out = {0: 1.0}
    for n in budgets[1:]:
        if chain:
            e, p = 1.0, 1.0
            for d in range(n):
                p *= rates[min(d, len(rates) - 1)][0]
                e += p
            out[n] = e
            continue
        m = n
        while m > 0:  # the most nodes the table holds, up to n
            try:
                out[n] = expected_acceptance_length(build_static_paths(rates, m), rates)
                break
            except ValueError:
                m -= 1
        else:
            out[n] = 1.0
    return out


class StepCostModel:
    """Online least-squares model of a step's seconds from (target rows, drafted nodes)."""

    def __init__(self, window: int = 256, min_samples: int = 12) -> None:
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self._coef: tuple[float, float, float] | None = None

    def add(self, rows: int, drafted: int, seconds: float) -> None:
        """One step: target rows it ran, draft nodes it proposed, wall seconds. A sample more
        than 4x slower than the model predicts (an idle gap, a stall) is dropped."""
        if seconds <= 0 or rows <= 0:
            return
        coef = self.fit()
        if coef is not None and seconds > 4 * self.predict(rows, drafted):
            return
        self.samples.append((float(rows), float(drafted), float(seconds)))
        self._coef = None

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) >= 0, or None before `min_samples` steps or without spread in the rows."""
        if self._coef is not None or len(self.samples) < self.min_samples:
            return self._coef
        s = torch.tensor(list(self.samples), dtype=torch.float64)
        X = torch.stack([torch.ones(len(s), dtype=torch.float64), s[:, 0], s[:, 1]], 1)
        y = s[:, 2]
        if s[:, 0].max() == s[:, 0].min():
            return None
        cols = [0, 1, 2] if s[:, 1].max() > s[:, 1].min() else [0, 1]
        while True:  # drop a column whose coefficient comes out negative and refit
            sol = torch.linalg.lstsq(X[:, cols], y[:, None]).solution[:, 0]
            neg = [c for c, v in zip(cols, sol.tolist(), strict=True) if v < 0 and c != 0]
            if not neg:
                break
            cols = [c for c in cols if c != neg[0]]
        coef = [0.0, 0.0, 0.0]
        for c, v in zip(cols, sol.tolist(), strict=True):
            coef[c] = max(v, 0.0)
        self._coef = (coef[0], coef[1], coef[2])
        return self._coef

    def predict(self, rows: float, drafted: float) -> float:
        a, b, c = self.fit() or (0.0, 0.0, 0.0)
        return a + b * rows + c * drafted


def best_budget(model: StepCostModel, batch: int, lengths: dict[int, float]) -> int:
    """The budget in `lengths` with the most expected tokens per second for `batch` drafting
    requests (ties: the smaller budget); the largest before the model is fitted."""
    if model.fit() is None or batch <= 0:
        return max(lengths)

    def rate(n: int) -> float:
        return batch * lengths[n] / max(model.predict(batch * (1 + n), batch * n), 1e-9)

    return max(sorted(lengths), key=lambda n: (rate(n), -n))
