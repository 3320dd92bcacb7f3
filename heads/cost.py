"""Each serving step's draft budget from measured cost: the `"tree": "auto"` policy (pure torch).

Speculation pays only when the extra tokens a step accepts outweigh what its extra rows cost.
On a GPU a decode step is memory-bound and extra rows are nearly free; on a CPU the target is
compute-bound after a few rows and a drafted node costs about as much as a token. Neither is
assumed: `StepCostModel` fits, online, from the engine's own steps

    seconds(step) ~ a + b * decode_rows + p * prefill_rows + c * verified_drafts + d * drafted
                      + v * verifying_requests

(least squares, coefficients kept >= 0): a plain decode row, a row of a prefill chunk (cheaper per
row on a CPU: one large GEMM), a drafted token verified this step (its row), a node drafted this
step (the head's forwards) and a request whose drafts this step verifies (its tree's attention,
verification and KV compaction, per request: at batch 4 a request's tree costs ~5.8 ms and each of
its rows ~0.7 ms; priced per row alone, ~2.2 ms, a one-node draft looks three times cheaper than it
is; `treedraft bench`, 2-core AVX2 AMD EPYC) each have their own price. Where the engine times its
drafting phase itself (`drafting_seconds`), that time leaves the step's and is fitted on its own,
per drafting request and per drafted node: fitted from whole steps, drafting and verifying share
one column in practice (a step verifies what the step before drafted), and at batch 1 their fitted
sum moves between 3.6 and 28 ms per node across refits on a drifting 2-core CPU.

`best_budget` picks the node budget n per request that maximises expected
tokens per second for the current batch of B drafting requests:

    B * E(n) / seconds(decode B, verified B * n, drafted B * n)

where E(n) = expected tokens per request per step of the best n-node tree under the head's
acceptance rates (`expected_lengths`; E(0) = 1), scaled online by how well the head actually
accepts (`Acceptance`: temperature, domain), per budget drafted (a first node can accept far
above the table where a second adds little). n = 0 drafts nothing: a step then costs what it
costs without speculation. A better head raises E(n) and the same model then chooses larger
trees: nothing to retune.

Prompt-lookup nodes (`+lookup:L` in the spec) cost no head forward, only their verified rows, and
earn what the request's own history predicts: much where the model repeats itself (SmolLM2 on
MT-bench at 256 tokens, batch 1, T=0: `chain:1+lookup:4` 1.39x no-spec where one head node gives
1.07x; `treedraft bench`, 2-core AVX2 AMD EPYC), nothing on fresh text. What they earn changes
within a reply, so the choice is per request and step: `LookupValue` keeps, per match length of the
request's best lookup proposal (1..4 tokens of its history's suffix seen before), what grafting
earned (extra tokens on lookup-only nodes) and cost (lookup-only nodes verified), and
`BudgetPolicy.graft` grafts a request's lookup nodes when their extra tokens per second beat the
step's own:

    g_k / (l_k * c + v') > LOOKUP_TAKE * tokens(step) / seconds(step)

(c: the fitted seconds per verified draft row; v': the fitted seconds per verifying request
where the request drafts no head node, else 0; a match length grafted stays grafted down to
LOOKUP_KEEP times the right-hand side, both factors above 1). What is measured fades step by step over an optimistic prior, so a match length left
out is grafted again after a while and measured anew: what lookup earns changes within a reply,
and an estimate that is never refreshed stays wrong.

What a head and a lookup earn depends on the request's temperature: a greedy request accepts a
draft when it is the target's argmax, a sampled one with the target's probability of it (at
T=1 the head accepts x0.55-0.62 of what it does at T=0). Both estimates are kept
per temperature class (`GREEDY`, `SAMPLED`), so that a server with both kinds of requests, or
a benchmark that runs T=0 and then T=1 in one engine, does not price one class's drafts with
the other's acceptance; a step mixing them expects the mix of its requests.

`BudgetPolicy` is the whole policy: it drafts nothing until the model has seen what drafting
costs, and then only where drafting promises more than `MARGIN` over drafting nothing; it
explores one budget up (and down) at an interval that doubles while the choice holds, so
exploration costs little once the answer is clear, and goes back to frequent exploration when
the choice changes. A choice verifies at most about twice the rows a measured step verified
(at least one node per request, or 16 rows): the linear cost fit is trusted near what it has seen, and
larger budgets are reached step by step. Where no plain step was measured for a while, an exploration down drafts
nothing: the model's plain steps must be of the machine as it is now (a start-up stall left
slow plain steps beside fast drafting ones and every row looked free, `StepCostModel`).

Above the policy, `OutcomeGuard` checks what it realized: per batch size, windows of the
policy's own steps and windows of plain steps (nothing drafted) are compared by tokens per
second as they came out, and the arm that realized more runs, the other probed now and then.
"""

from __future__ import annotations

import math
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


FEATURES = ("decode rows", "prefill rows", "verified drafts", "drafted nodes",
            "verifying requests")


class StepCostModel:
    """Online least-squares model of a step's seconds from its `FEATURES` counts.

    Steps that verify or draft are kept in their own window, so that a long run of plain steps
    (auto choosing 0) never pushes out what the model knows about drafting. A plain step refits
    the model only every `refit_every` steps (a fit is ~0.7 ms of the step it serves in the
    engine, 2-3 % of a small CPU step; every 8 steps it would still be ~0.1 ms of each plain
    step at batch 16), a step that drafted every `DRAFT_REFIT_EVERY` steps; at once where
    the step is news: a drafting step while few were seen or one that verified more rows than
    any before, a plain step far faster than the model's (`STALE_AFTER`)."""

    # a plain step after at least STALE_AFTER steps without one that runs STALE_RATIO times
    # faster than the plain steps kept predict replaces them: they were measured on a slower
    # machine (a start-up stall, a neighbour that has left). Kept, they price every row of a
    # faster present at ~0 (175 ms a step + 0 ms a verified row at batch 1, and auto drafts
    # 24-32 nodes where one pays); slower plain steps than predicted are not evidence of
    # that (the 4x rule in `add` drops stalls, a plain step beside drafting ones is noisy)
    STALE_AFTER, STALE_RATIO = 32, 1.5
    # a step that drafted refits the model at once while it is news (few drafting steps seen,
    # more rows verified than ever), else after this many steps: at batch 1 every step drafts,
    # and a refit at each is ~0.7 ms of a ~30 ms step
    DRAFT_REFIT_EVERY = 8

    def __init__(self, window: int = 256, min_samples: int = 12, refit_every: int = 32) -> None:
        self.plain: deque[tuple[float, ...]] = deque(maxlen=window)
        self.steps = 0  # steps added (dropped ones too)
        self._plain_at = 0  # self.steps at the newest plain sample
        self.drafting: deque[tuple[float, ...]] = deque(maxlen=window // 4)
        # (drafting requests, drafted nodes, seconds) of steps whose drafting phase was timed
        self.draft_times: deque[tuple[float, float, float]] = deque(maxlen=window // 4)
        self._draft_coef: tuple[float, float] | None = None
        self._draft_stale = 0  # drafting phases timed since `draft_fit` was last invalidated
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._coef: tuple[float, ...] | None = None
        self._fitted = False
        self._stale = 0  # plain steps added since the last fit
        self._max_verified = 0.0
        # bumped whenever what `fit`, `draft_fit`, `knows_*` or `max_verified` return may have
        # changed: a policy's choice computed at one version holds until the next
        self.version = 0

    @property
    def samples(self) -> list[tuple[float, ...]]:
        return [*self.plain, *self.drafting]

    def add(self, seconds: float, decode: int = 0, prefill: int = 0, verified: int = 0,
            drafted: int = 0, drafting_seconds: float | None = None, requests: int = 0,
            verifying: int = 0) -> None:
        """One step: its wall seconds and counts. A sample more than 4x slower than the model
        predicts (an idle gap, a stall) is dropped, unless it verified more rows than any step
        before (the price of a row, mispriced, is what it measures); a plain step far faster than the kept ones
        after a while without one replaces them (`STALE_AFTER`). `drafting_seconds` (the
        step's drafting phase, timed by the caller) with `requests` (how many requests
        drafted): the drafting cost is fitted from those times and the rest of the step from
        the rest; `verifying`: how many requests had drafts verified (`verified` in all)."""
        if drafting_seconds is not None and seconds > 0 and decode + prefill > 0:
            if drafted and requests:
                self.draft_times.append((float(requests), float(drafted), drafting_seconds))
                self._draft_stale += 1
                if (len(self.draft_times) < self.min_samples
                        or self._draft_stale >= self.DRAFT_REFIT_EVERY):
                    self._draft_coef, self._draft_stale = None, 0
                    self.version += 1
            seconds, drafted = seconds - drafting_seconds, 0
        x = (float(decode), float(prefill), float(verified), float(drafted), float(verifying))
        if seconds <= 0 or decode + prefill <= 0:
            return
        self.steps += 1
        predicted = self.predict(*x) if self.fit() is not None else None
        # (a step that verified more rows than any before is what the fit lacks, not a stall)
        if predicted is not None and seconds > 4 * predicted and verified <= self._max_verified:
            return
        plain = not (verified or drafted)
        stale = (plain and predicted is not None and self.plain_age >= self.STALE_AFTER
                 and self.STALE_RATIO * seconds < predicted)
        if stale:  # the steps kept were measured on a slower machine: drafting ones too
            self.plain.clear()
            self.drafting.clear()
            self.draft_times.clear()
            self._draft_coef = None
        if plain:
            self._plain_at = self.steps
        # a drafting step is news while few were seen or it verified more rows than any before
        news = not plain and (len(self.drafting) < self.min_samples
                              or verified > self._max_verified)
        (self.plain if plain else self.drafting).append((*x, float(seconds)))
        self._max_verified = max(self._max_verified, float(verified))
        self._stale += 1
        if (news or stale or self._coef is None
                or self._stale >= (self.refit_every if plain else self.DRAFT_REFIT_EVERY)):
            self._coef, self._fitted = None, False
            self.version += 1

    @property
    def plain_age(self) -> int:
        """Steps since the newest plain step (one that neither verified nor drafted)."""
        return self.steps - self._plain_at

    @property
    def knows_verifying(self) -> bool:
        """Whether steps that verified drafts were measured."""
        return any(s[2] > 0 for s in self.drafting)

    @property
    def max_verified(self) -> float:
        """The most draft rows one measured step verified so far (0: none yet): beyond about
        twice that, what a row costs is extrapolated (`best_budget`'s trust region). Kept over
        the whole run, not the window: a region that shrank as rare large steps left the window
        would make the choices take turns."""
        return self._max_verified

    @property
    def knows_drafting(self) -> bool:
        """Whether steps that verified and steps that drafted were both measured."""
        return self.knows_verifying and (bool(self.draft_times)
                                         or any(s[3] > 0 for s in self.drafting))

    def draft_fit(self) -> tuple[float, float]:
        """(seconds per drafting request, seconds per drafted node) >= 0 from the timed drafting
        phases (least squares, a small ridge: with one node per request the two share the
        cost); (0, 0) before any was timed."""
        if self._draft_coef is None:
            if not self.draft_times:
                return 0.0, 0.0
            s = torch.tensor(list(self.draft_times), dtype=torch.float64)
            X, y = s[:, :2], s[:, 2]
            scale = X.abs().amax(0).clamp_min(1.0)
            A = torch.cat([X / scale, torch.eye(2, dtype=torch.float64) * 1e-3 * len(s) ** 0.5])
            sol = torch.linalg.lstsq(A, torch.cat([y, y.new_zeros(2)])[:, None]).solution[:, 0]
            r, d = (sol / scale).tolist()
            if r < 0:  # one of them alone: the ratio of sums
                r, d = 0.0, float(y.sum() / X[:, 1].sum())
            elif d < 0:
                r, d = float(y.sum() / X[:, 0].sum()), 0.0
            self._draft_coef = (r, d)
        return self._draft_coef

    def fit(self) -> tuple[float, ...] | None:
        """(a, b, p, c, d, v) >= 0 (module docstring), or None before `min_samples` steps or
        without spread in the rows. A feature that never varied gets 0 (the intercept holds
        it)."""
        if self._fitted:
            return self._coef
        self._fitted, self._stale = True, 0
        samples = self.samples
        if len(samples) < self.min_samples:
            return None
        s = torch.tensor(samples, dtype=torch.float64)
        rows = s[:, 0] + s[:, 1]
        if rows.max() == rows.min() and not self.drafting:
            return None
        k = len(FEATURES)
        X = torch.cat([torch.ones(len(s), 1, dtype=torch.float64), s[:, :k]], 1)
        y = s[:, k]
        cols = [0] + [j + 1 for j in range(k) if s[:, j].max() > s[:, j].min()]
        scale = X.abs().amax(0).clamp_min(1.0)
        while True:  # drop a column whose coefficient comes out negative and refit
            # a small ridge on the (scaled) features: a feature seen in one odd step (a lone
            # prefill in a window of decodes) cannot take the others' cost with it
            A = X[:, cols] / scale[cols]
            ridge = torch.diag(torch.tensor([0.0 if c == 0 else 1e-3 for c in cols],
                                            dtype=torch.float64)) * len(s) ** 0.5
            sol = torch.linalg.lstsq(torch.cat([A, ridge]),
                                     torch.cat([y, y.new_zeros(len(cols))])[:, None]
                                     ).solution[:, 0] / scale[cols]
            # a negative coefficient leaves the fit, the intercept too (last): clipped instead,
            # it kept the slope that paid for it (-1.7 s + 60 ms per row fitted the difference
            # between steps of 31 and 32 rows; clipped, a step of 32 rows cost 1.9 s)
            neg = [c for c, v in zip(cols, sol.tolist(), strict=True) if v < 0]
            neg = [c for c in neg if c != 0] or neg
            if not neg or cols == neg:
                break
            cols = [c for c in cols if c != neg[0]]
        coef = [0.0] * (k + 1)
        for c, v in zip(cols, sol.tolist(), strict=True):
            coef[c] = max(v, 0.0)
        self._coef = tuple(coef)
        return self._coef

    @property
    def coefficients(self) -> tuple[float, ...]:
        """`fit()`, or zeros before there is one."""
        return self.fit() or (0.0,) * (len(FEATURES) + 1)

    def predict(self, decode: float, prefill: float = 0.0, verified: float = 0.0,
                drafted: float = 0.0, requests: float = 0.0, verifying: float = 0.0) -> float:
        """Seconds of a step; `requests`: how many of its requests draft (`drafted` nodes),
        `verifying`: how many have drafts verified (`verified` in all)."""
        return self.predictor()(decode, prefill, verified, drafted, requests, verifying)

    def predictor(self):
        """`predict` with the current fit bound once (a policy prices every budget each step:
        one fit lookup instead of one per budget)."""
        a, b, p, c, d, v = self.coefficients
        r, dn = self.draft_fit()

        def predict(decode, prefill=0.0, verified=0.0, drafted=0.0, requests=0.0, verifying=0.0):
            return (a + b * decode + p * prefill + c * verified + d * drafted + v * verifying
                    + (r * requests + dn * drafted if drafted else 0.0))

        return predict


def step_rate(model: StepCostModel, batch: int, lengths: dict[int, float], n: int,
              predict=None) -> float:
    """Expected tokens per second of a step where `batch` decoding requests each draft `n`
    nodes (E(n) tokens per request from `lengths`): each of them verifies a tree of n.
    `predict`: the model's `predictor()` when the caller prices several budgets."""
    k = batch if n else 0
    seconds = (predict or model.predict)(batch, 0, batch * n, batch * n, k, k)
    return batch * lengths[n] / max(seconds, 1e-9)


def budget_rates(model: StepCostModel, batch: int, lengths: dict[int, float],
                 measured: dict[int, float] | None = None) -> dict[int, float]:
    """Expected tokens per second of each budget in `lengths` for `batch` decoding requests
    (`step_rate`), where `measured` (budget -> seconds of a measured step at this batch) says
    what a budget costs: measured budgets at what they cost, the others at the fit's price
    scaled as the nearest measured budget below (else above) came out against the fit;
    `measured[0]`, a plain step's seconds, prices drafting nothing and, as the nearest below,
    the budgets with no measured one below them."""
    predict = model.predictor()
    rate = {n: step_rate(model, batch, lengths, n, predict) for n in lengths}
    if measured:
        scale = {m: measured[m] * rate[m] / (batch * lengths[m]) for m in measured if m in rate}
        for n in rate:
            near = max((m for m in scale if m <= n), default=None)
            near = min(scale, default=None) if near is None else near
            if near is not None and (n or near == 0):
                rate[n] /= scale[near]
    return rate


# rows a choice may verify whatever was measured (`best_budget`'s trust region): a wrong guess
# of this size costs one step a few tens of ms on a 2-core CPU
TRUST_ROWS = 16


def best_budget(model: StepCostModel, batch: int, lengths: dict[int, float],
                margin: float = 0.0, current: int | None = None, hysteresis: float = 0.0,
                trust: float | None = None, measured: dict[int, float] | None = None) -> int:
    """The budget in `lengths` with the most expected tokens per second for `batch` decoding
    requests (ties: the smaller budget); 0 until the model knows what drafting costs, and 0
    unless drafting is expected to beat no drafting by more than `margin` (x100 %). `current`
    (the budget chosen so far) stays unless another is expected to beat it by more than
    `hysteresis` (x100 %): near-equal budgets do not take turns on measurement noise.
    `trust`: only budgets whose step verifies at most max(batch, TRUST_ROWS, trust x the most
    rows a measured step verified) rows are considered, so a fit is never extrapolated far (a
    one-request, one-node exploration against noisy start-up steps can price a row at ~0, and
    the fit alone would then draft 60 nodes for each of 16 requests, ~1,000 rows in one step);
    the budgets beyond are reached as explorations and choices measure more rows.
    `measured`: budget -> seconds of a step at this batch measured where every request drafted
    that budget (`BudgetPolicy.measured`); they replace the fit's prediction there (a linear
    price per row and per drafted node misses what a tree's shape costs: at batch 1 on a 2-core
    CPU two more head nodes cost ~5 ms, and priced by the fit 4 nodes looked best where 2 pay
    ~9 % more)."""
    if model.fit() is None or batch <= 0 or not model.knows_drafting:
        return 0
    measured = measured or {}
    if trust is not None:
        cap = max(batch, TRUST_ROWS, trust * model.max_verified)
        lengths = {n: e for n, e in lengths.items()
                   if n == 0 or batch * n <= cap or n in measured}
    rate = budget_rates(model, batch, lengths, measured).__getitem__
    best = max(sorted(lengths), key=lambda n: (rate(n), -n))
    if current in lengths and (1.0 + hysteresis) * rate(current) >= rate(best):
        best = current
    return best if rate(best) > (1.0 + margin) * rate(0) else 0


GREEDY, SAMPLED = 0, 1  # temperature classes of requests: estimates are kept per class


class LookupValue:
    """What grafted prompt-lookup nodes earn, per match length k of the request's proposal:
    sums over grafts of extra tokens accepted on lookup-only nodes and of lookup-only nodes
    verified, decayed every step (`step`), over an optimistic prior (PRIOR_WEIGHT grafts of
    `prior_nodes` nodes earning `prior` tokens each) that never decays: a match length that is
    no longer grafted drifts back to the prior and is grafted again, so what it earns is
    measured again (a reply that starts repeating itself, a batch that shrank)."""

    PRIOR, PRIOR_WEIGHT = 0.5, 0.25
    # sampled requests: a lookup token is accepted with the target's probability of it, not
    # whenever it is the argmax; a lower prior re-tries a match length that earned nothing
    # less eagerly
    PRIOR_SAMPLED = 0.25

    def __init__(self, decay: float = 0.99, prior_nodes: float = 4.0,
                 prior: float = PRIOR) -> None:
        self.decay, self.prior_nodes, self.prior = decay, prior_nodes, prior
        self._sums: dict[int, list[float]] = {}  # k -> [grafts, nodes, tokens] measured

    def add(self, match: int, nodes: int, tokens: int) -> None:
        s = self._sums.setdefault(match, [0.0, 0.0, 0.0])
        s[0], s[1], s[2] = s[0] + 1, s[1] + nodes, s[2] + tokens

    def step(self) -> None:
        for s in self._sums.values():
            s[0], s[1], s[2] = (self.decay * x for x in s)

    def value(self, match: int) -> tuple[float, float]:
        """(extra tokens, lookup-only nodes) per graft at match length `match`."""
        g, n, t = self._sums.get(match, (0.0, 0.0, 0.0))
        w = self.PRIOR_WEIGHT
        return (t + w * self.prior * self.prior_nodes) / (g + w), (n + w * self.prior_nodes) / (g + w)

    def said(self) -> str:
        return ", ".join(f"k={k} {self.value(k)[0]:.2f} tokens/{self.value(k)[1]:.1f} nodes"
                         for k in sorted(self._sums)) or "untried"


class HeadBesideLookup:
    """What a step gives a greedy request that grafts its lookup proposal, per head budget m:
    counterfactual, from each such step whose head drafted a chain of n nodes. At T=0 the
    accepted path follows the head's chain for `a_head` nodes and the lookup's for `a_lookup`
    (a node both proposed counts for both; once the path leaves a chain it never returns to
    it), and a chain of m <= n nodes is a prefix of the one drafted, so with m head nodes that
    step would have given 1 + max(min(a_head, m), a_lookup) tokens. Budgets up to n are
    compared on the steps that drafted n or more only, the same steps for every budget:
    budgets measured at different places of a reply are never compared (lookup grafts where
    the reply repeats itself, and there a head node beyond the first adds little: at batch 1,
    T=0 `chain:1+lookup:4` is 7 % faster than 3 head nodes beside lookup, while pooled per
    budget a 4th node, measured on other steps, looks worth +1.1 tokens). Decayed sums per
    budget drafted, each decayed when that budget
    is drafted again."""

    # (decayed) grafted requests' steps that drafted n or more before budgets up to n compare
    MIN_WEIGHT = 4.0

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        # head budget drafted n -> [decayed steps, tokens with m = 0..n head nodes]
        self._sums: dict[int, list[float]] = {}

    def add(self, drafted: int, a_head: int, a_lookup: int) -> None:
        """A grafted step drafted a head chain of `drafted` nodes (0: lookup alone) and accepted
        `a_head` of its nodes and `a_lookup` of the lookup's."""
        n, d = max(drafted, 0), self.decay
        s = self._sums.setdefault(n, [0.0] * (n + 2))
        s[0] = d * s[0] + 1.0
        for m in range(n + 1):
            s[m + 1] = d * s[m + 1] + 1.0 + max(min(a_head, m), a_lookup)

    def tokens(self, budget: int) -> dict[int, float]:
        """{m: expected tokens of a grafted step with m head nodes} for m = 0..`budget`, from
        the steps that drafted `budget` nodes or more; {} while they weigh under MIN_WEIGHT."""
        weight, tokens = 0.0, [0.0] * (budget + 1)
        for n, s in self._sums.items():
            if n >= budget:
                weight += s[0]
                for m in range(budget + 1):
                    tokens[m] += s[m + 1]
        return {m: t / weight for m, t in enumerate(tokens)} if weight >= self.MIN_WEIGHT else {}

    def said(self) -> str:
        """What budgets 0..n give, n the largest budget with enough steps ("0:2.69 1:2.88")."""
        n = max((n for n in self._sums if self.tokens(n)), default=None)
        return "-" if n is None else " ".join(f"{m}:{t:.2f}" for m, t in self.tokens(n).items())


class OutcomeGuard:
    """Whether `auto` drafts at all at a batch size, from what its drafting realized there
    against drafting nothing: the check behind "never slower" that no estimate can give.

    The policy prices budgets and grafts from fitted and measured step costs and observed
    acceptance; each piece is an estimate, and where drafting earns about what it costs their
    errors decide (at batch 16, T=0 on the 2-core AMD EPYC, with every estimate saying its
    grafts and one-node steps pay, `auto` without this guard runs 0.96-0.98x no-spec;
    `treedraft bench`). So steps run in
    windows of WINDOW steps per (batch size, mostly sampled) key, each window either `auto`'s
    own (ON: the policy chooses) or plain (OFF: nothing drafted, no lookup). The arm that leads
    runs; the other is probed for one window now and then, and each probe is compared with the
    leader's windows right before and after it (realized tokens per second: its steps' tokens
    over their seconds): step times drift within a run (contexts grow; in a benchmark whose
    replies all have one length, 3x over a wave of requests), and arms compared over their own
    recent windows, measured at different times, read 1.06-1.17x apart where both draft
    nothing. The ON / OFF ratios of the comparisons are averaged in log space,
    older ones fading by DECAY, and decide the lead: ON where they average above LEAD. The
    probe interval (windows of the leader between probes) starts at PROBE_MIN, doubles up to
    PROBE_CLOSE while comparisons confirm the leader, returns to PROBE_MIN when the lead
    changes or one comparison alone disagrees, and is PROBE_MAX where one arm leads by CLEAR or
    more (batch 1: ~1.8x, one plain window per ~1,000 steps). ON runs FIRST windows before the first probe: the policy learns in
    them. Where the arms realize about the same, the probing costs about nothing; where they
    differ, the probes are rare. The caller records only steps whose drafts and verification
    both ran under one arm, with no prefill rows (`record`)."""

    WINDOW = 16
    FIRST = 4
    # windows of the leader between probes: from PROBE_MIN, doubling up to PROBE_CLOSE where
    # the arms are within CLEAR of each other, PROBE_MAX where one leads by CLEAR or more
    PROBE_MIN, PROBE_CLOSE, PROBE_MAX = 4, 16, 64
    CLEAR = 1.2
    DECAY = 0.7
    # `auto` leads only where its windows realized this much over the plain ones beside them: a
    # tie goes to plain ("never slower"). At batch 16, T=0 on the AMD EPYC, where nothing pays,
    # the comparisons drift between 0.97x and 1.03x, and a lead taken on a 1.03x reading ran
    # lookup steps at 71 ms against 43 for plain ones (0.943x no-spec); where drafting pays on
    # this machine it realizes 1.3-2.3x (batch 1 and 4, T=0; `treedraft bench`)
    LEAD = 1.04

    def __init__(self) -> None:
        self._state: dict = {}

    def _get(self, key) -> dict:
        st = self._state.get(key)
        if st is None:
            st = self._state[key] = {
                "arm": True, "left": self.WINDOW, "window": [0.0, 0.0],
                "lead": True,  # the arm that runs between probes
                "before": None,  # rate of the leader's last window
                "probe": None,  # rate of a probe window waiting for the leader's next one
                "log": 0.0, "weight": 0.0, "compared": 0,  # decayed log(ON / OFF) comparisons
                "interval": self.PROBE_MIN, "since": 0}
        return st

    def allows(self, key) -> bool:
        """Whether `auto`'s policy chooses this step's drafts at `key` (else nothing is
        drafted): the arm of the current window there."""
        return self._get(key)["arm"]

    def ratio(self, key) -> float | None:
        """Realized tokens per second of `auto`'s own windows over plain ones at `key` (each
        probe against the leader's windows beside it, decayed), or None before a comparison."""
        st = self._state.get(key)
        if st is None or not st["weight"]:
            return None
        return math.exp(st["log"] / st["weight"])

    def record(self, key, tokens: float, seconds: float, arm: bool) -> None:
        """A step at `key` under `arm` (its drafts and their verification both) gave `tokens`
        in `seconds`; a step of another arm than the current window's is ignored."""
        st = self._get(key)
        if arm != st["arm"] or seconds <= 0:
            return
        st["window"][0] += tokens
        st["window"][1] += seconds
        st["left"] -= 1
        if st["left"] <= 0:
            self._close(st)

    def _close(self, st: dict) -> None:
        arm, (tokens, seconds) = st["arm"], st["window"]
        rate = tokens / seconds
        st["window"], st["left"] = [0.0, 0.0], self.WINDOW
        if arm != st["lead"]:  # a probe: compared once the leader's next window closes
            st["probe"], st["arm"] = rate, st["lead"]
            return
        before, st["before"] = st["before"], rate
        if st["probe"] is not None and before is not None and rate > 0 and st["probe"] > 0:
            probe, st["probe"] = st["probe"], None
            r = probe / (0.5 * (before + rate))  # the probed arm against the leader beside it
            on_off = math.log(r if not st["lead"] else 1.0 / r)
            st["log"] = self.DECAY * st["log"] + on_off
            st["weight"] = self.DECAY * st["weight"] + 1.0
            st["compared"] += 1
            bar = math.log(self.LEAD)
            lead = st["log"] / st["weight"] > bar
            ahead = math.exp(abs(st["log"]) / st["weight"])
            if lead != st["lead"] or (on_off > bar) != lead:
                # a new leader, or this comparison alone disagreed: check again soon
                st["interval"], st["since"] = self.PROBE_MIN, 0
            else:
                st["interval"] = (self.PROBE_MAX if ahead >= self.CLEAR
                                  else min(2 * st["interval"], self.PROBE_CLOSE))
            if lead != st["lead"]:
                st["lead"], st["before"] = lead, None
                st["arm"] = lead
                return
        st["since"] += 1
        if st["since"] >= (st["interval"] if st["compared"] else self.FIRST):
            st["arm"], st["since"] = not st["lead"], 0

    def said(self) -> str:
        """e.g. '(16, False): auto 1.03x plain (5 comparisons, auto leads)' per compared key."""
        parts = []
        for key, st in sorted(self._state.items(), key=lambda kv: str(kv[0])):
            r = self.ratio(key)
            if r is None:
                continue
            parts.append(f"{key}: auto {r:.2f}x plain ({st['compared']} comparisons, "
                         f"{'auto' if st['lead'] else 'plain'} leads)")
        return ", ".join(parts) or "-"


class Acceptance:
    """How the head accepts in this engine against what its rate table promises: kappa =
    observed extra tokens / expected extra tokens (decayed sums with a prior of 1), so that
    E(n) = 1 + kappa * (E_table(n) - 1) follows temperature and domain.

    One factor for the whole table assumes every depth and rank gains alike; they do not. On
    text the model repeats, the first node accepts far above the table while a second one
    adds little (SmolLM2, MT-bench x 256, batch 1: x1.7 at one node, and drafting two costs
    9 % of the tokens/s of one; `treedraft bench`, 2-core AVX2 AMD EPYC). So what each budget
    earned is kept too
    (`add(..., budget=n)`), and `at(n)` is that budget's own factor shrunk towards the factor
    of the budget below it (the smallest towards `kappa`) with `BUDGET_PRIOR` expected tokens
    of weight: a budget never drafted expects what the one below it measured, not the table's
    shape, and so is explored one step up at a time."""

    BUDGET_PRIOR = 0.5  # weight of the budget below's factor, in expected extra tokens
    # what a budget measured fades by `decay` per observation of that budget and by this per
    # observation of another: a budget the policy left keeps what it measured (the choice
    # between it and the one drafted now rests on both), for a few hundred steps
    STALE_DECAY = 0.998

    def __init__(self, decay: float = 0.98, prior: float = 2.0) -> None:
        self.decay, self.observed, self.expected = decay, prior, prior
        self._budgets: dict[int, list[float]] = {}  # budget -> [observed, expected] decayed
        self.version = 0  # observations added (what depends on them may be cached by it)

    def add(self, expected_extra: float, observed_extra: float, budget: int | None = None,
            overall: bool = True) -> None:
        """`overall=False`: `budget`'s own factor only (a counterfactual reading of a step
        already counted at the budget it drafted)."""
        if expected_extra <= 0:
            return
        self.version += 1
        if overall:
            self.observed = self.decay * self.observed + observed_extra
            self.expected = self.decay * self.expected + expected_extra
        if budget is not None:
            s = self._budgets.setdefault(budget, [0.0, 0.0])
            for b, t in self._budgets.items():  # (a counterfactual reading fades its own only:
                if b != budget and not overall:  # one step gives up to CHAIN_MAX of them)
                    continue
                d = self.decay if b == budget else self.STALE_DECAY
                t[0], t[1] = d * t[0], d * t[1]
            s[0], s[1] = s[0] + observed_extra, s[1] + expected_extra

    @property
    def kappa(self) -> float:
        return min(self.observed / self.expected, 4.0)

    def said(self) -> str:
        """The factor of each budget drafted lately ("1 x1.70, 2 x1.27"), or "-"."""
        k = self.at(self._budgets)
        return ", ".join(f"{n} x{k[n]:.2f}" for n in sorted(k)) or "-"

    def at(self, budgets) -> dict[int, float]:
        """{n: factor} for the budgets n >= 1 in `budgets` (see the class docstring)."""
        out, below = {}, self.kappa
        for n in sorted(b for b in budgets if b >= 1):
            o, e = self._budgets.get(n, (0.0, 0.0))
            below = out[n] = min((o + self.BUDGET_PRIOR * below) / (e + self.BUDGET_PRIOR), 4.0)
        return out


class ChainRates:
    """Acceptance per depth of the chains sampled requests (T > 0) draw from the head's q: at
    depth d, of the chains that reached it (n >= d nodes, d - 1 of them accepted), the share
    that accepted node d too (decayed counts, `PRIOR` trials of prior weight at the table's
    conditional rate times the class's factor `kappa`). E(n) = 1 + sum over d <= n of the
    product of the rates up to d: every chain teaches each depth it reached, and what one more
    node adds is a product of rates, not a difference of two noisy means. Read per budget
    (`Acceptance.at`), the budgets' means at T=1 move by ~0.1 tokens each over ~50 steps
    where a third node adds ~0.03, enough to pick 3-4 nodes or one where two pay most (batch
    1, the shipped smollm2-135m-eagle head: two nodes 0.71 tokens, four 0.74)."""

    PRIOR = 2.0

    def __init__(self, table: dict[int, float], decay: float = 0.98) -> None:
        self.table = dict(table)  # E(n) of the head's rate table: its budgets, the prior
        self.prior = self.table_rates(table) or [0.0]
        self.decay = decay
        self._trials: dict[int, float] = {}
        self._hits: dict[int, float] = {}
        self.version = 0

    @property
    def seen(self) -> bool:
        return bool(self._trials)

    def trials(self, depth: int) -> float:
        """Chains that reached `depth` (decayed)."""
        return self._trials.get(depth, 0.0)

    def add(self, drafted: int, got: int) -> None:
        """A chain of `drafted` nodes of which the first `got` were accepted."""
        for d in range(1, drafted + 1):
            self._trials[d] = self.decay * self._trials.get(d, 0.0) + 1.0
            self._hits[d] = self.decay * self._hits.get(d, 0.0) + float(got >= d)
            if got < d:
                break
        self.version += 1

    @staticmethod
    def table_rates(table: dict[int, float]) -> list[float]:
        """The conditional rates of the chain budgets 1, 2, ... of `table` (E(1) - 1, then
        (E(d) - E(d-1)) / (E(d-1) - E(d-2)))."""
        rates, d = [], 1
        while d in table and d - 1 in table:
            prev = table[d - 1] - table[d - 2] if d >= 2 else 1.0
            rates.append(min(max((table[d] - table[d - 1]) / prev, 0.0), 1.0) if prev > 0
                         else 0.0)
            d += 1
        return rates

    def lengths(self, kappa: float) -> dict[int, float]:
        """E(n) for each budget n of the table (its chain budgets' rates the prior, the deepest
        of them for depths beyond)."""
        prior = self.prior
        out, e, p, d = {}, 1.0, 1.0, 0
        for n in sorted(self.table):
            while d < n:
                d += 1
                r = min(kappa * prior[min(d, len(prior)) - 1], 1.0)
                t, h = self._trials.get(d, 0.0), self._hits.get(d, 0.0)
                p *= (h + self.PRIOR * r) / (t + self.PRIOR)
                e += p
            out[n] = e
        return out


class BudgetPolicy:
    """Each step's node budget (see the module docstring): `choose` before drafting, `observe`
    what the last step's drafts earned, `step_done` with the step's counts and seconds."""

    EXPLORE_MIN, EXPLORE_MAX = 4, 256  # steps between explorations: doubles while choice holds
    # requests an exploration up from drafting nothing drafts for (the engine picks those with
    # the fewest pairs to catch up): at batch 32 all of them made ~1,000 pairs of catch-up
    # commits in one step; 4 at batch 4, T=1 (where no budget pays on the AVX2 CPU) spend ~40 ms
    # of catch-up per exploration, 14-22 explorations in 485 steps. One measures as
    # well: the head's acceptance is checked teacher-forced on its catch-up, and what a drafting
    # request and a verified row cost is fitted from every step that drafts
    EXPLORE_REQUESTS = 1
    # (every request exploring at batch <= 4 measures the all-drafting step whole, but at batch
    # 4, T=1 on the AMD EPYC its explorations take 43-47 ms against ~36 and `auto` runs ~1 %
    # slower for the same choice)
    # drafting must promise this much over drafting nothing ("never slower" is the contract);
    # 0.10 keeps the one pass at batch 1 on an AVX2 CPU (one node: +7 % predicted, +10 %
    # measured) out of reach, so 0.05 with exploration to correct the rest
    MARGIN = 0.05
    # another budget must promise this much over the current choice to replace it: at batch 1
    # on the AVX2 CPU budgets 1, 2 and 3 come within 2 % of each other; without it the choice
    # changes every few steps and each change restarts frequent exploration (70 explorations
    # in 181 steps)
    HYSTERESIS = 0.03
    # a choice verifies at most max(batch, TRUST_ROWS, TRUST x the most rows one measured step
    # verified): the cost fit is not extrapolated far beyond what was measured (`best_budget`)
    TRUST = 2.0
    # a match length is grafted once it earns LOOKUP_TAKE x the bar and stays grafted while it
    # earns LOOKUP_KEEP x (an estimate from a few dozen noisy grafts dips below where it was
    # taken). Both above 1: a graft is kept on the estimate of what it earned, and the match
    # lengths kept are those whose noisy estimates came out high (at batch 16, T=0, taken at
    # x1.05 and kept down to x0.85, grafts make `auto` 0.967x no-spec against 0.988x without
    # lookup; `treedraft bench --continuous`, 48 MT-bench first turns)
    LOOKUP_TAKE, LOOKUP_KEEP = 1.25, 1.05
    # a budget's step cost measured at a batch size (`measured_step`) replaces the fit's price
    # there once MEASURED_MIN steps were measured; each measurement fades by MEASURED_DECAY per
    # later one of the same (batch, budget) (step times drift slowly: ~20 steps of memory)
    MEASURED_MIN, MEASURED_DECAY = 4, 0.95
    # once MEASURED_MIN steps were measured, a measurement enters a mean no further than this
    # (x100 %) from it: at batch 1, T=1 on the AMD EPYC, steps at 2 head nodes measured 29.5 ms
    # at the median but up to 43 now and then, and their mean (10 steps) moved between 28.3 and
    # 35.8 ms over a run, more than the 0.3 ms a second node costs there; a budget left behind
    # keeps such a mean until explored again. Clipped and over 20 steps: 28.6-32.2
    MEASURED_CLIP = 0.15
    # a measurement not refreshed for this many steps is dropped (the machine drifts, contexts
    # grow; a budget measured dear in a noisy spell would otherwise be priced so for good)
    MEASURED_STALE = 512
    # a choice climbs to the next budget once the one below was chosen this many steps at that
    # batch (or measured: `_plan`): MEASURED_MIN measured steps, and the first step after a
    # change verifies the old budget's drafts
    CLIMB = MEASURED_MIN + 2
    # every GRAFT_REFRESH-th step whose requests all graft drafts the head's own choice, so the
    # budgets above a smaller one taken beside lookup are measured again (`graft_budget`)
    GRAFT_REFRESH = 8
    # a step of mostly sampled requests that drafts nothing explores every EXPLORE_MIN steps
    # until their chains were tried this many times at depth 1 (`ChainRates`, decayed): at
    # batch 1, T=1 a run's first ~13-30 draws read x0.37-0.45 of the table where steady
    # drafting reads ~x0.7; without this, `auto` chooses nothing, its explorations back off to
    # one in 256 steps, and it drafts nothing for hundreds of steps. Sampled requests have no
    # teacher-forced check to learn from meanwhile
    CHAIN_EVIDENCE = 30

    def __init__(self, lengths: dict[int, float], lookup: bool = False) -> None:
        self.table = dict(lengths)  # E(n) of the head's rate table
        self.model = StepCostModel()
        # per temperature class (GREEDY, SAMPLED): the head's acceptance against its table and
        # what lookup grafts earn; None: the spec grafts no lookup
        self.acceptance = (Acceptance(), Acceptance())
        self.chains = ChainRates(lengths)  # sampled requests' q-drawn chains, per depth
        self.lookup = (LookupValue(), LookupValue(prior=LookupValue.PRIOR_SAMPLED)
                       ) if lookup else None
        # greedy requests that graft: tokens per head budget beside the lookup
        self.beside = HeadBesideLookup() if lookup else None
        # per batch size: `auto`'s drafting against plain steps, as realized
        self.guard = OutcomeGuard()
        self._graft_steps = 0  # steps `graft_budget` answered (GRAFT_REFRESH)
        self._sampled = 0.0  # the share of sampled requests in the step planned last
        self.interval = self.EXPLORE_MIN
        self._since = 0  # steps since the last exploration
        self._up = False  # the last exploration went up (they alternate where both exist)
        self._choice = 0
        # (seconds per verified row, per verifying request, tokens per second, batch) of the
        # planned step
        self._bar = None
        self._grafting: set[int] = set()  # match lengths grafted now
        self._lengths = None  # (key, lengths()) of the last call
        # (batch, budget) -> [decayed seconds, decayed steps, steps, model step of the last,
        # decayed lookup-only rows (0 here)] measured (`measured_step`)
        self._measured: dict[tuple[int, int], list[float]] = {}
        # the same for steps that verified lookup-only rows beside the head's (`beside_cost`,
        # `lookup_row_price`)
        self._beside: dict[tuple[int, int], list[float]] = {}
        self._planned = None  # (what `_plan` read, what it answered)
        # (batch, budget) -> [steps it was chosen (not explorations), model step of the last]
        self._used: dict[tuple[int, int], list[int]] = {}
        # batch -> decayed sums of lookup-only grafting steps (1, n, n^2, y, n*y: n grafts, y
        # seconds over a plain step), [measurements, model step of the last] (`graft_cost`)
        self._grafts: dict[int, list[float]] = {}

    @property
    def choice(self) -> int:
        """The budget the model chose last (what `choose` returns when it does not explore)."""
        return self._choice

    def graft(self, match: int, sampled: bool = False, head: int = 0) -> bool:
        """Whether a request of the step `choose` planned last grafts its lookup proposal, whose
        match length is `match` (0: it has none): where the lookup nodes' extra tokens per
        second beat the step's own (module docstring); `sampled`: the request samples (T > 0);
        `head`: the head nodes it drafts this step (none: the graft alone makes its drafts a
        tree to verify, and pays what a verifying request costs too)."""
        if self.lookup is None or match <= 0 or self._bar is None:
            return False
        g, bar = self._graft_value(match, sampled, head)
        key = (bool(sampled), match)
        if g > (self.LOOKUP_KEEP if key in self._grafting else self.LOOKUP_TAKE) * bar:
            self._grafting.add(key)
            return True
        self._grafting.discard(key)
        return False

    def may_graft(self, matches, sampled: bool = False, head: int = 0) -> bool:
        """Whether `graft` could say yes this step, for a request of class `sampled` drafting
        `head` head nodes, at any match length in `matches`. False lets the engine skip finding
        each request's match length in a step where no lookup can pay; the match lengths are
        then dropped from the grafted set, as `graft` would have dropped them."""
        if self.lookup is None or self._bar is None:
            return False
        low = min(self.LOOKUP_KEEP, self.LOOKUP_TAKE)  # the lower of graft's two bars
        for match in matches:
            g, bar = self._graft_value(match, sampled, head)
            if g > low * bar:
                return True
        self._grafting.difference_update((bool(sampled), m) for m in matches)
        return False

    def _graft_value(self, match: int, sampled: bool, head: int) -> tuple[float, float]:
        """(extra tokens a graft at match length `match` earns, the tokens the step's own rate
        makes in the time its nodes cost): `graft`'s two sides, before LOOKUP_TAKE / LOOKUP_KEEP."""
        c, v, rate, batch = self._bar
        g, nodes = self.lookup[sampled].value(match)
        cost = nodes * c + (0.0 if head else v)
        if not head and (measured := self.graft_seconds(batch)) is not None:
            cost = max(cost, measured)  # what such grafts were measured to add at this batch
        return g, cost * rate

    def kappa(self, sampled: float | None = None) -> float:
        """The head's acceptance against its table for a step whose share of sampled requests is
        `sampled` (default: the step planned last)."""
        s = self._sampled if sampled is None else sampled
        return (1.0 - s) * self.acceptance[GREEDY].kappa + s * self.acceptance[SAMPLED].kappa

    def lengths(self, sampled: float | None = None) -> dict[int, float]:
        """E(n) per request of a step whose share of sampled requests is `sampled` (default:
        the step planned last): greedy requests' by each budget's own measured factor
        (`Acceptance.at`), sampled ones' per depth of their chains (`ChainRates`) once one was
        observed."""
        s = self._sampled if sampled is None else sampled
        key = (s, self.chains.version, *(a.version for a in self.acceptance))
        if self._lengths is None or self._lengths[0] != key:  # (unchanged between observations)
            greedy = self.acceptance[GREEDY].at(self.table)
            if self.chains.seen:
                chains = self.chains.lengths(self.acceptance[SAMPLED].kappa)
                samp = {n: chains[n] - 1.0 for n in self.table}
            else:  # no sampled chain yet: the class's factors (its prior) on the table
                factor = self.acceptance[SAMPLED].at(self.table)
                samp = {n: factor[n] * (e - 1.0) for n, e in self.table.items() if n}
            self._lengths = key, {n: 1.0 + (1.0 - s) * greedy[n] * (e - 1.0) + s * samp[n]
                                  if n else e for n, e in self.table.items()}
        return dict(self._lengths[1])

    def best(self, batch: int, lengths: dict[int, float] | None = None) -> int:
        return self._plan(batch, lengths or self.lengths())[0]

    def _plan(self, batch: int, lengths: dict[int, float]) -> tuple[int, float | None]:
        """(`best_budget` for `batch` requests, the expected tokens per second of that budget
        (`budget_rates`; None before the model knows verifying)), computed again only when
        something they read changed: the model's fit (`StepCostModel.version`), `lengths` (by
        more than 0.01 tokens), the measured step costs at this batch (by more than ~1 %), the
        current choice. Pricing every budget is ~0.1-0.5 ms of each step in the engine (batch
        16, 2-core CPU), a cost paid where `auto` drafts nothing and is meant to
        cost nothing; the choice moves on changes of a few % (`HYSTERESIS`).

        Budgets are priced as measured (`priced`), and a choice climbs the budgets one at a
        time (`CLIMB`): where the best is beyond the budget above the largest one chosen CLIMB
        times at this batch lately or priced there (1 where none is) and beyond the current
        choice, the choice is the larger of those two: a step towards what pays, measured on the
        way (the rung itself need not pay: where one node does not but four would, waiting for
        one to pay leaves `auto` at 0 for good). The fit, from lookup grafts and one-request
        explorations, can price 4 head nodes for each of 16 requests as paying where one costs
        1.7x a plain step (batch 16, T=0, AMD EPYC); climbing, the step at one node is measured
        first."""
        measured = self.priced(batch)
        steps = self.model.steps
        top = max([n for (b, n), (count, last) in self._used.items()
                   if b == batch and count >= self.CLIMB and steps - last <= self.MEASURED_STALE]
                  + list(measured), default=0)
        cap = min((b for b in lengths if b > top), default=top)
        key = (batch, id(self.model), self.model.version,
               tuple((n, round(e, 2)) for n, e in lengths.items()),
               tuple(sorted((n, round(math.log(v), 2)) for n, v in measured.items())),
               self._choice, cap, self.MARGIN, self.HYSTERESIS, self.TRUST)
        if self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        n = best_budget(self.model, batch, lengths, self.MARGIN, self._choice, self.HYSTERESIS,
                        self.TRUST, measured)
        n = min(n, max(cap, self._choice))  # one budget up towards it (or stay)
        rate = (budget_rates(self.model, batch, {n: lengths[n]}, measured)[n]
                if self.model.fit() is not None and self.model.knows_verifying else None)
        self._planned = key, (n, rate)
        return n, rate

    def measured_step(self, batch: int, budget: int, seconds: float, lookup_rows: int = 0
                      ) -> None:
        """A step of `batch` decoding requests verified `budget` head nodes each (all of them;
        0: a plain step, `plain_seconds`) and drafted for the next: in `seconds`, its drafting
        counted as if it drafted `budget` again (what a step costs where that budget is kept).
        `lookup_rows`: lookup-only rows it verified beside the head's, which file the step under
        its own key (`beside_cost`). Priced out at the fit's price of a verified row instead
        (0.7-1.4 ms at batch 1 on the AMD EPYC, where one costs the forward almost nothing),
        the steps of the budget drafted beside lookup most (one node) come out 4-6 ms cheaper
        than those of the next, and one node is chosen where two pay."""
        if budget < 0 or batch < 1 or seconds <= 0:
            return
        if lookup_rows > 0:
            self._measure((batch, budget), seconds, self._beside, lookup_rows)
        else:
            self._measure((batch, budget), seconds)

    def _measure(self, key, seconds: float, store: dict | None = None, rows: int = 0) -> None:
        store = self._measured if store is None else store
        m = store.setdefault(key, [0.0, 0.0, 0, 0, 0.0])
        d = self.MEASURED_DECAY
        if m[2] >= self.MEASURED_MIN and m[1] > 0:  # robust: a stall moves the mean little
            mean, c = m[0] / m[1], self.MEASURED_CLIP
            seconds = min(max(seconds, mean / (1.0 + c)), mean * (1.0 + c))
        m[0], m[1], m[2], m[3] = d * m[0] + seconds, d * m[1] + 1.0, m[2] + 1, self.model.steps
        m[4] = d * m[4] + rows

    def _mean(self, key, store: dict | None = None) -> float | None:
        m = (self._measured if store is None else store).get(key)
        if m is None or m[2] < self.MEASURED_MIN or self.model.steps - m[3] > self.MEASURED_STALE:
            return None
        return m[0] / m[1]

    def beside_cost(self, batch: int, budget: int) -> tuple[float, float] | None:
        """(seconds, lookup-only rows) of a mean step at `batch` decoding requests that verified
        `budget` head nodes each and lookup rows beside them, as measured (MEASURED_MIN steps,
        not stale), or None."""
        seconds = self._mean((batch, budget), self._beside)
        if seconds is None:
            return None
        m = self._beside[(batch, budget)]
        return seconds, m[4] / m[1]

    def lookup_row_price(self, batch: int) -> float:
        """Seconds a lookup-only row adds to a step at `batch` that drafts head nodes: the
        measured steps beside lookup against those of the same head budget without it, over
        their mean lookup rows (weighted by steps, never below 0), where some budget has both;
        else the fit's price of a verified row."""
        num = den = 0.0
        for (b, n), m in self._beside.items():
            if b != batch or (beside := self.beside_cost(b, n)) is None:
                continue
            if (alone := self._mean((b, n))) is None or beside[1] <= 0:
                continue
            num += m[1] * (beside[0] - alone)
            den += m[1] * beside[1]
        if den > 0:
            return max(num / den, 0.0)
        return self.model.coefficients[3]

    def plain_seconds(self, batch: int) -> float | None:
        """Seconds of a step at `batch` decoding requests that verifies and drafts nothing, as
        measured (`measured_step(batch, 0, ...)`), or None."""
        return self._mean((batch, 0))

    def measured_graft(self, batch: int, seconds: float, grafts: int = 1) -> None:
        """A step at `batch` decoding requests that verified `grafts` lookup-only grafts (no head
        node) took `seconds` more than a plain step there (`graft_cost`)."""
        if batch < 1 or grafts < 1:
            return
        m = self._grafts.setdefault(batch, [0.0] * 5 + [0, 0])
        d, n = self.MEASURED_DECAY, float(grafts)
        for i, v in enumerate((1.0, n, n * n, seconds, n * seconds)):
            m[i] = d * m[i] + v
        m[5], m[6] = m[5] + 1, self.model.steps

    def graft_cost(self, batch: int) -> tuple[float, float] | None:
        """(seconds a step pays once for verifying any lookup-only graft, seconds per graft), a
        least-squares line through the steps measured at `batch` (else at the nearest batch size
        within NEAR x that has MEASURED_MIN of them, not stale), or None. Per graft alone the
        price hides the step's own: at batch 16, T=0 a step verifying one graft costs ~10 ms
        more than a plain one where the average over steps of 1-10 grafts prices a graft at
        ~6 ms, and `auto` priced so runs 0.956x no-spec."""
        steps = self.model.steps
        for b in sorted((b for b in self._grafts if batch / self.NEAR <= b <= batch * self.NEAR),
                        key=lambda b: (abs(b - batch), b)):
            m = self._grafts[b]
            if m[5] < self.MEASURED_MIN or steps - m[6] > self.MEASURED_STALE:
                continue
            s0, s1, s2, t0, t1 = m[:5]
            det = s0 * s2 - s1 * s1
            if det <= 0.01 * s0 * s2:  # (about) one number of grafts a step: all per graft
                return 0.0, t0 / s1
            per = (s0 * t1 - s1 * t0) / det
            once = (t0 - per * s1) / s0
            if per < 0:
                return t0 / s0, 0.0
            if once < 0:
                return 0.0, t1 / s2
            return once, per
        return None

    def graft_seconds(self, batch: int) -> float | None:
        """What one more lookup-only graft was measured to add to a step at `batch` requests
        (`graft_cost`), or None. A graft is priced at no less: at batch 16-32 on a 2-core CPU
        the fit prices one at ~3-5 ms where grafting steps take ~13-30 ms more than plain ones,
        and `auto` priced by the fit runs 0.95x no-spec."""
        cost = self.graft_cost(batch)
        return None if cost is None else cost[1]

    def grafts_pay(self, grafts: Sequence[tuple[int, bool]]) -> bool:
        """Whether the lookup-only grafts `graft` took for a step that drafts no head node,
        (match length, sampled) each, together pay what the step pays once for verifying any
        (`graft_cost`): their extra tokens beat LOOKUP_TAKE x what the step's own rate makes
        in their time."""
        if not grafts or self._bar is None:
            return bool(grafts)
        cost = self.graft_cost(self._bar[3])
        if cost is None or cost[0] <= 0:
            return True
        tokens = bar = 0.0
        for match, sampled in grafts:
            g, b = self._graft_value(match, sampled, 0)
            tokens, bar = tokens + g, bar + b
        return tokens > self.LOOKUP_TAKE * (bar + cost[0] * self._bar[2])

    def measured(self, batch: int) -> dict[int, float]:
        """budget -> seconds of a step at `batch` decoding requests that each verify and draft
        that budget, for the budgets measured MEASURED_MIN times or more at that batch."""
        return {n: mean for (b, n) in self._measured
                if b == batch and n >= 1 and (mean := self._mean((b, n))) is not None}

    # the batch sizes whose measured costs `priced` carries to a batch with none: within 2x
    NEAR = 2.0

    def priced(self, batch: int) -> dict[int, float]:
        """budget -> seconds of a step at `batch` decoding requests: `measured(batch)`, or where
        nothing was measured at this batch, what was measured at the nearest batch size within
        NEAR x, scaled by the plain steps' ratio between the two (measured, else the fit's). A
        batch shrinking as requests finish (16, 15, 14, ...) would otherwise meet every size
        with the fit's price alone, and try the head at each again.

        With them, budget 0 at this batch's measured plain step (`plain_seconds`), where one
        is: a measured budget against the fit's plain step compared a step's whole cost with a
        line through steps of every batch size and prefill, which prices a plain step at batch
        4 ~2 ms (8 %) below what it measures."""
        here = self._priced(batch)
        if (plain := self.plain_seconds(batch)) is not None:
            here[0] = plain
        return here

    def _priced(self, batch: int) -> dict[int, float]:
        here = self.measured(batch)
        if here or batch < 1:
            return here
        sizes = {b for (b, n) in self._measured
                 if b != batch and n >= 1
                 and batch / self.NEAR <= b <= batch * self.NEAR}
        for near in sorted(sizes, key=lambda b: (abs(b - batch), b)):
            there = self.measured(near)
            if not there:
                continue
            plain = [self.plain_seconds(b) or self.model.predict(b) for b in (batch, near)]
            if min(plain) <= 0:
                return {}
            return {n: v * plain[0] / plain[1] for n, v in there.items()}
        return {}

    def choose(self, batch: int, sampled: int = 0, held: bool = False) -> tuple[int, bool]:
        """(budget, explored) for a step with `batch` drafting requests, `sampled` of them
        sampling (T > 0); then `graft` says, per request, whether its lookup nodes are
        grafted. `held`: the outcome guard holds the step plain; it still explores on the
        policy's schedule, and is otherwise (0, False) without counting as a chosen step.
        Held steps that never explored would leave a sampled class stuck: at batch 1, T=1 its
        first ~30 steps read x0.37 of the table, the guard holds plain (the policy drafts
        nothing: a tie), and the policy would run only in the guard's rare probe windows,
        drafting nothing there, for the whole run."""
        self._sampled = min(max(sampled, 0), batch) / batch if batch > 0 else 0.0
        lengths = self.lengths()
        n, rate = self._plan(batch, lengths)
        if n != self._choice:  # a new answer: check it again soon (not while held: a choice
            # that takes turns at a batch of 3-4 requests in a queue would explore every few
            # held steps, 125 explorations in 3,011 steps at batch 4, T=1)
            self._choice = n
            if not held:
                self.interval = self.EXPLORE_MIN
        self._since += 1
        self._bar = None
        if self.lookup is not None:
            for value in self.lookup:
                value.step()
            if rate is not None:
                coef = self.model.coefficients
                self._bar = (self.lookup_row_price(batch), coef[5], rate, batch)
        up = [b for b in self.table if b > n]
        down = [b for b in self.table if b < n]
        if not n and 2 * self._sampled > 1 and self.chains.trials(1) < self.CHAIN_EVIDENCE:
            self.interval = self.EXPLORE_MIN  # mostly sampled, drafting nothing on few draws
        if self._since < self.interval or not (up or down):
            if n and not held:
                self._use(batch, n)
            return (0 if held else n), False
        self._since, self.interval = 0, min(2 * self.interval, self.EXPLORE_MAX)
        self._up = not self._up if (up and down) else bool(up)
        if not self._up and self.model.plain_age >= StepCostModel.STALE_AFTER:
            return 0, True  # measure a plain step now and then (StepCostModel.STALE_AFTER)
        return (min(up) if self._up else max(down)), True

    def explorers(self, batch: int, explored: bool) -> int | None:
        """How many of the `batch` requests draft in a step `choose` returned `explored` for:
        EXPLORE_REQUESTS in an exploration up from drafting nothing, else None (all)."""
        few = self.EXPLORE_REQUESTS
        return few if explored and self._choice == 0 and batch > few else None

    def observe_lookup(self, match: int, nodes: int, tokens: int, sampled: bool = False
                       ) -> None:
        """A request's grafted lookup proposal of match length `match` was verified: `nodes`
        lookup-only nodes, `tokens` of them accepted; `sampled`: the request samples."""
        if self.lookup is not None:
            self.lookup[sampled].add(match, nodes, tokens)

    def observe_beside(self, drafted: int, a_head: int, a_lookup: int) -> None:
        """A greedy request grafted its lookup proposal beside a head chain of `drafted` nodes:
        `a_head` of the chain's nodes and `a_lookup` of the lookup's were accepted
        (`HeadBesideLookup`)."""
        if self.beside is not None:
            self.beside.add(drafted, a_head, a_lookup)

    def graft_budget(self, batch: int, n: int, lookup_rows: int, cap: int | None = None
                     ) -> int:
        """The head budget for a step of `batch` greedy requests that all graft lookup
        (`lookup_rows` lookup nodes in all) where the head alone would draft `n` (`choose`): the
        budget 0 <= m <= n with the most tokens per second beside the lookup (`HeadBesideLookup`,
        each budget priced by its steps measured beside lookup, else as `_plan` prices it plus
        the lookup rows at `lookup_row_price`; 0, the lookup alone, at `lookup_alone_seconds`),
        unless it beats n by no more than HYSTERESIS; n where what a budget
        gives is not known yet, and every GRAFT_REFRESH-th such step (the budgets up to n are
        measured again). `cap`: beside lookup the head drafts at most `cap` nodes (its chains;
        the caller's head trees are larger): where n is a larger tree the answer is at most
        cap. A tree's factor is read only on the steps that drafted it, not beside the chains
        it is compared with, and beside lookup its extra nodes are mostly redundant: at batch 1,
        T=0 on the AMD EPYC 6-node trees with lookup grafted (~38-48 ms a step against ~31 ms
        for 2-node chains, the same tokens per step) run 11-14 % below `chain:2+lookup:4`
        (`treedraft bench`)."""
        top = n if cap is None else min(n, cap)
        best = self._beside_best(batch, top, lookup_rows)
        if best != n:  # the step counts as one at the budget drafted, not n (climbing: `_plan`)
            used = self._used.get((batch, n))
            if used is not None and used[0] > 0:
                used[0] -= 1
            if best:
                self._use(batch, best)
        return best

    def _beside_best(self, batch: int, n: int, lookup_rows: int) -> int:
        """`graft_budget`'s choice among the budgets 0..n (no climbing bookkeeping); 0: the
        lookup alone, no head node (`lookup_alone_seconds`)."""
        if self.beside is None or n < 1 or batch < 1 or self.model.fit() is None:
            return n
        self._graft_steps += 1
        if self._graft_steps % self.GRAFT_REFRESH == 0:
            return n
        lengths = self.lengths()
        tokens = self.beside.tokens(n)  # every budget up to n, on the same steps
        budgets = [m for m in lengths if 1 <= m <= n]
        if n not in lengths or not tokens:
            return n
        rate = budget_rates(self.model, batch, {m: lengths[m] for m in budgets},
                            self.priced(batch))
        row = self.lookup_row_price(batch) * lookup_rows
        alone = self.lookup_alone_seconds(batch, lookup_rows)

        def beside(m: int) -> float:  # tokens per second of budget m beside the lookup: its
            # steps beside lookup as measured, else the head's step and the lookup rows' price
            if not m:
                return batch * tokens[0] / alone
            measured = self.beside_cost(batch, m)
            seconds = (measured[0] if measured is not None else
                       batch * lengths[m] / max(rate[m], 1e-12) + row)
            return batch * tokens[m] / seconds

        best = max([0, *budgets] if alone else budgets, key=lambda m: (beside(m), -m))
        if best == n or beside(best) <= (1.0 + self.HYSTERESIS) * beside(n):
            return n
        return best

    def lookup_alone_seconds(self, batch: int, lookup_rows: int) -> float | None:
        """Seconds of a step at `batch` decoding requests that all graft their lookup proposal
        (`lookup_rows` nodes in all) and draft no head node: a plain step (measured, else the
        fit's) plus what grafts alone were measured to add (`graft_cost`), else the fit's price
        of a verifying request and of a verified row. Such a step verifies the lookup's trie
        (often a chain: no tree attention) and runs no head forward: at batch 1, T=0 on the AMD
        EPYC a grafting step takes ~38 ms beside a 1-2 node head chain and ~31 ms beside none,
        for 3.8 against 3.4 tokens."""
        plain = self.plain_seconds(batch) or self.model.predict(batch)
        cost = self.graft_cost(batch)
        if cost is not None:
            seconds = plain + cost[0] + cost[1] * batch
        else:
            coef = self.model.coefficients
            seconds = plain + coef[5] * batch + coef[3] * lookup_rows
        return seconds if seconds > 0 else None

    def _use(self, batch: int, n: int) -> None:
        """A step at `batch` drafted `n` head nodes by choice (climbing, `_plan`)."""
        used = self._used.setdefault((batch, n), [0, 0])
        used[0], used[1] = used[0] + 1, self.model.steps

    def observe(self, expected_extra: float, observed_extra: float, sampled: bool = False,
                budget: int | None = None, drafted: bool = True) -> None:
        """Drafts of requests of one class (`sampled`: T > 0) were verified: the head's table
        expected `expected_extra` tokens beyond the one a step always gives, they got
        `observed_extra`; `budget`: the head nodes each of them drafted (a key of the table),
        whose own factor learns from it too (`Acceptance.at`). `drafted=False`: what `budget`
        would have got on steps that drafted a longer chain (greedy: a chain of `budget` nodes
        is a prefix of it), which teaches that budget's own factor only."""
        self.acceptance[sampled].add(expected_extra, observed_extra, budget, overall=drafted)

    def observe_chain(self, drafted: int, got: int) -> None:
        """A sampled request's chain of `drafted` head nodes, drawn from q, was verified: its
        first `got` were accepted (`ChainRates`)."""
        self.chains.add(drafted, got)

    def step_done(self, seconds: float, decode: int, prefill: int, verified: int,
                  drafted: int, drafting_seconds: float | None = None, requests: int = 0,
                  verifying: int = 0) -> None:
        self.model.add(seconds, decode, prefill, verified, drafted, drafting_seconds, requests,
                       verifying)
