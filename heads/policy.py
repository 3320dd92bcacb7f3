"""`"tree": "auto"`: which draft configuration a serving step runs, from measured tokens/s.

Speculation pays only when the tokens a step gains outweigh what its drafting and extra rows
cost, and both sides depend on the machine (a GPU verifies 64 rows for the price of one, a
2-core CPU does not), the batch size, the temperature and the text. Nothing of that is
modelled here; it is measured. The policy chooses among a few fixed draft configurations, the
*arms* (`arms_for`): drafting nothing, chains of 1-4 head nodes (where the spec has lookup
nodes, for greedy requests each chain also with the request's prompt-lookup proposal grafted:
the graft pays where rows are cheap, at batch 1, and loses where they are not) and the head's
trees up to the spec's size. Whatever an arm's verification costs (CPU tree attention,
a GPU kernel), its realized tokens per second per request is what ranks it: nothing to retune
per machine.

`ArmBandit` keeps, per *context* (the batch of drafting requests rounded up to a power of two,
and whether most of them sample), per arm, a decayed sum of tokens per request and seconds of
the steps it ran (per request: a context spans batches, 5-8 requests, and a CPU step costs
about the same at either end, so plain tokens/s would favour whichever arm ran while the queue
was fuller). It plays an arm for a window of `window` steps; a step counts for its arm only
when the step before it ran the same arm in the same context (so the drafts it verified were
that arm's too) and it ran no prefill chunk (`observe`'s `usable`). At each window's end:

1. the arms are ordered by size; the smallest not measured yet in this context is played while
   the largest measured one ran at least `sweep` times the best rate (larger trees cost more
   rows: where one size already loses, the next is measured only once a later measurement,
   by exploration, puts the arm below it near the best). The arm that stops the sweep is first
   played for a second window: what a window accepts varies with its text several-fold (one
   measured 19.7 tokens/s per request where the same arm's later windows measured 55-65), and
   one unlucky window would otherwise keep every larger arm unmeasured until exploration
   returns to it;
2. else every `explore_every`-th window plays the measured arm, other than the best, with the
   highest optimistic rate `rate * (1 + bonus / sqrt(steps / window))`, if that beats the best's
   rate: a near-best arm soon, one at half the best's rate only when its measurement has
   decayed to a few steps;
3. else the arm with the best measured rate (tokens per request / seconds).

All arms' sums in a context decay by `decay` at each of its windows, so what was measured long
ago weighs less and a stale arm's optimism grows back: the text and the machine drift.
Exploration costs at most one window in `explore_every`, spent on arms that may beat the best.

An arm's tokens are measured on its own windows' text, and what a window's text accepts varies
more than the arms differ at batch 8 (the same arm's window rates move ~25 %). So an arm's
tokens are *post-stratified* on one thing every arm with a head observes alike: whether the
target took the first token the head drafted below the root (`first`: the head's top-1 token at
the root; its drafted token for a sampled chain). That is the head's guess on the text, not the
arm's, so its rate `p` is pooled over every step of the context, whichever arm ran it. An arm's
rate counts its requests' tokens as `p` x its mean tokens when the first draft was taken +
(1 - p) x its mean when it was not (for `chain:1`: exactly 1 + p), instead of at its own windows'
rate of first-draft hits: an arm measured on hard text is not ranked below one measured on easy
text for the text's sake.

The machine drifts too: a 2-core CPU shared with other work runs the same steps 10-40 % faster
or slower over minutes, and an arm last measured in a slow spell would stay ranked below the
one running now. So the sums are kept at one speed: `speed` is the machine's speed now against
it, and a window's seconds are added to its arm's sums times `speed` (`_close`). `speed` moves
after a window whose arm's sums hold at least 4 windows of steps (the arm played most, mostly),
by `track` (in log) of how much faster or slower the window ran than those sums predict; an
arm's few windows cannot move it on their own text's luck.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NONE = "none"  # the arm that drafts nothing


def arms_for(head_nodes: int, max_depth: int | None, lookup: int, sampled: bool,
             tree_of: Callable[[int], str] | None = None) -> list[str]:
    """The arms (tree spec strings, `NONE` for no drafts) of a sampling class, by size:
    nothing; chains of 1..4 head nodes (at most `max_depth` and `head_nodes`), for greedy
    requests each followed by itself with `lookup` nodes grafted (a sampled request's chain is
    drawn from the head's q, which a graft would turn into a tree); and where the head's spec
    branches (`tree_of(n)`: its n-node tree), its trees of 8, 16, 32 and `head_nodes` nodes
    (each with the lookup nodes)."""
    depth = min(4, head_nodes, max_depth or 4)
    grafts = ["", f"+lookup:{lookup}"] if lookup and not sampled else [""]
    arms = [NONE] + [f"chain:{k}{g}" for k in range(1, depth + 1) for g in grafts]
    if tree_of is not None:
        tail = f"+lookup:{lookup}" if lookup else ""
        arms += [tree_of(n) + tail for n in sorted({8, 16, 32, head_nodes})
                 if depth < n <= head_nodes]
    return arms


def context(batch: int, sampled: int) -> tuple[int, bool]:
    """(batch rounded up to a power of two, most requests sample)."""
    return 1 << max(batch - 1, 0).bit_length(), 2 * sampled > batch


@dataclass
class Arm:
    tokens: float = 0.0  # per request
    seconds: float = 0.0
    steps: float = 0.0
    windows: int = 0  # windows it was chosen for (not decayed)
    # per request, of its requests whose first draft was (not) taken: how many, their tokens
    hit: float = 0.0
    hit_tokens: float = 0.0
    miss: float = 0.0
    miss_tokens: float = 0.0

    FIELDS = ("tokens", "seconds", "steps", "hit", "hit_tokens", "miss", "miss_tokens")

    def decay(self, f: float) -> None:
        for k in self.FIELDS:
            setattr(self, k, getattr(self, k) * f)

    def add(self, other: Arm, seconds: float = 1.0) -> None:
        """Add `other`'s sums, its seconds scaled by `seconds`."""
        for k in self.FIELDS:
            setattr(self, k, getattr(self, k) + getattr(other, k) * (seconds if k == "seconds"
                                                                     else 1.0))

    def rate(self, p: float | None = None) -> float:
        """Tokens/s per request; `p`: the context's rate of taken first drafts, which the
        requests whose first draft is known are counted at (module doc)."""
        if self.seconds <= 0:
            return 0.0
        tokens = self.tokens
        if p is not None and self.hit > 0 and self.miss > 0:
            mean = p * self.hit_tokens / self.hit + (1 - p) * self.miss_tokens / self.miss
            tokens += (self.hit + self.miss) * mean - self.hit_tokens - self.miss_tokens
        return tokens / self.seconds


class ArmBandit:
    """Plan each step's arm (`plan`), learn from its outcome (`observe`). See the module doc."""

    def __init__(self, arms: dict[bool, Sequence[str]], window: int = 8,
                 explore_every: int = 8, bonus: float = 0.5, decay: float = 0.95,
                 sweep: float = 0.85, track: float = 0.5) -> None:
        self.arms = {sampled: list(a) for sampled, a in arms.items()}  # per sampling class
        self.window, self.explore_every = window, explore_every
        self.bonus, self.decay, self.sweep, self.track = bonus, decay, sweep, track
        self.stats: dict[tuple[int, bool], list[Arm]] = {}  # per context, per arm: at speed 1
        self.speed = 1.0  # the machine's speed now, against the one the sums are kept at
        self.running = Arm()  # the current window's steps (`_close` adds them to its arm)
        self.first: dict[tuple[int, bool], list[float]] = {}  # per context: [taken, known]
        self.windows: dict[tuple[int, bool], int] = {}  # windows started per context
        self.ctx: tuple[int, bool] | None = None  # the context and arm of the current window
        self.arm = 0
        self.left = 0  # steps left in the current window
        self.last: tuple | None = None  # (context, arm) of the step before (None: unusable)

    def plan(self, batch: int, sampled: int = 0) -> str:
        """The arm (a tree spec string or `NONE`) for a step of `batch` drafting requests,
        `sampled` of them sampling (T > 0)."""
        ctx = context(batch, sampled)
        if ctx != self.ctx or self.left <= 0:
            self._close()
            self.ctx, self.left = ctx, self.window
            self.arm = self._choose(ctx)
            self.stats[ctx][self.arm].windows += 1
        self.left -= 1
        return self.arms[ctx[1]][self.arm]

    def observe(self, tokens: int, seconds: float, usable: bool = True,
                requests: int = 1, first: tuple[int, int, int, int] | None = None) -> None:
        """The outcome of the step `plan` planned last: the tokens the step gave to its
        `requests` requests (1 + accepted drafts each, which the previous step's drafts earned)
        and its seconds (the verification of those drafts and this step's drafting). It counts
        for its arm when the step before ran the same arm in the same context (the drafts it
        verified were that arm's), unless not `usable` (a step that prefills is priced by the
        prompt). `first`: of its requests whose previous step drafted with the head, (how many
        had their first draft taken, their tokens, how many not, their tokens); these count
        for the context's rate of taken first drafts whatever arm drafted them."""
        now = (self.ctx, self.arm)
        if first is not None and first[0] + first[2]:
            pool = self.first.setdefault(self.ctx, [0.0, 0.0])
            pool[0] += first[0]
            pool[1] += first[0] + first[2]
        if usable and self.last == now and seconds > 0:
            a = self.running
            r = max(requests, 1)
            a.tokens += tokens / r
            a.seconds += seconds
            a.steps += 1
            if first is not None:
                a.hit += first[0] / r
                a.hit_tokens += first[1] / r
                a.miss += first[2] / r
                a.miss_tokens += first[3] / r
        self.last = now

    def idle(self) -> None:
        """A step that ran no arm (nothing could draft): the next step verifies no arm's drafts."""
        self.last = None

    def _close(self) -> None:
        """Add the window that ends to its arm's sums, at speed 1: first, where the arm's
        sums hold at least 4 windows of steps, move `speed` by `track` of (in log) how much
        faster or slower the window ran than they predict at today's speed (module doc)."""
        w, self.running = self.running, Arm()
        if self.ctx is None or w.steps <= 0 or w.seconds <= 0:
            return
        a, p = self.stats[self.ctx][self.arm], self.taken(self.ctx)
        if a.steps >= 4 * self.window and (before := a.rate(p)) > 0 and (now := w.rate(p)) > 0:
            self.speed *= (now / (before * self.speed)) ** self.track
        a.add(w, seconds=self.speed)

    def taken(self, ctx: tuple[int, bool]) -> float | None:
        """The context's rate of taken first drafts (None before one is known)."""
        pool = self.first.get(ctx)
        return pool[0] / pool[1] if pool and pool[1] > 0 else None

    def rates(self, ctx: tuple[int, bool]) -> dict[str, float]:
        """Measured tokens/s per request, per arm of a context (arms not measured yet left
        out)."""
        p = self.taken(ctx)
        return {name: a.rate(p) * self.speed for name, a in zip(
            self.arms[ctx[1]], self.measured(ctx), strict=False) if a.steps}

    def measured(self, ctx: tuple[int, bool]) -> list[Arm]:
        """The sums per arm of a context (at speed 1), the window running now included."""
        arms = list(self.stats.get(ctx, ()))
        if ctx == self.ctx and self.running.steps:
            arms[self.arm] = a = dataclasses.replace(arms[self.arm])
            a.add(self.running, seconds=self.speed)
        return arms

    def best(self, ctx: tuple[int, bool]) -> str | None:
        r = self.rates(ctx)
        return max(r, key=r.get) if r else None

    def _choose(self, ctx: tuple[int, bool]) -> int:
        arms = self.stats.setdefault(ctx, [Arm() for _ in self.arms[ctx[1]]])
        n = self.windows[ctx] = self.windows.get(ctx, 0) + 1
        for a in arms:  # what was measured long ago weighs less
            a.decay(self.decay)
        if ctx in self.first:
            self.first[ctx] = [x * self.decay for x in self.first[ctx]]
        p = self.taken(ctx)
        rate = [a.rate(p) for a in arms]
        seen = [i for i, a in enumerate(arms) if a.steps > 0]
        best = max(seen, key=rate.__getitem__, default=0)
        frontier = len(seen)  # arms are ordered by size: the next one not measured yet
        pick = self._sweep(arms, rate, frontier, best)
        if pick is not None:
            return pick
        if n % self.explore_every or len(arms) == 1:
            return best

        def optimistic(i: int) -> float:
            return rate[i] * (1 + self.bonus / math.sqrt(max(arms[i].steps, 1.0)
                                                         / self.window))

        pick = max((i for i in seen if i != best), key=optimistic, default=best)
        return pick if optimistic(pick) > rate[best] else best

    def _sweep(self, arms: list[Arm], rate: list[float], frontier: int,
               best: int) -> int | None:
        """The arm the sweep plays (module doc, 1.), or None once it stopped."""
        if frontier == len(arms):
            return None
        if frontier == 0 or rate[frontier - 1] >= self.sweep * rate[best]:
            return frontier  # sweep up while the largest arm measured is near the best
        if arms[frontier - 1].windows < 2:
            return frontier - 1  # it stops the sweep: measured in a second window first
        return None
