"""`"tree": "auto"`: which draft configuration a serving step runs, from measured tokens/s.

Speculation pays only when the tokens a step gains outweigh what its drafting and extra rows
cost, and both sides depend on the machine (a GPU verifies 64 rows for the price of one, a
2-core CPU does not), the batch size, the temperature and the text. Nothing of that is
modelled here; it is measured. The policy chooses among a few fixed draft configurations, the
*arms* (`arms_for`): drafting nothing, chains of 1-4 head nodes (where the spec has lookup
nodes, for greedy requests each chain also with the request's prompt-lookup proposal grafted,
a few nodes and all the spec's (`grafts`): the graft pays where rows are cheap, at batch 1, and
where replies copy their prompt, and loses where neither holds) and the head's trees up to the
spec's size. Whatever an arm's verification costs (CPU tree attention,
a GPU kernel), its realized tokens per second per request is what ranks it: nothing to retune
per machine.

`ArmBandit` keeps, per *context* (the batch of drafting requests rounded up to a power of two,
and whether most of them sample), per arm, a decayed sum of tokens per request and seconds of
the steps it ran (per request: a context spans batches, 5-8 requests, and a CPU step costs
about the same at either end, so plain tokens/s would favour whichever arm ran while the queue
was fuller). It plays an arm for a window of `window` steps; a step counts for its arm only
when the step before it ran the same arm in the same context (so the drafts it verified were
that arm's) and it ran no prefill chunk (`observe`'s `usable`). Along the size order the rate
is taken to rise to the best arm and fall after it (more drafted nodes accept more tokens and
cost more rows; a *unimodal* bandit, as in rate adaptation for radio links), so the policy
plays and explores only the best arm and its *neighbours* (`neighbours`: the next arm either way
along the head's nodes, for a chain itself with the next graft of lookup nodes either way, and
from every arm drafting nothing, which gives exactly one token a request at the lowest cost and
wins where rows are dear however the chains compare); arms further away wait until the best
moves next to them. At each window's end:

1. a context with nothing measured plays the best arm of the nearest batch context of its
   sampling class (a queue draining from 8 requests to 4 starts where 8 ended), else nothing;
2. else a neighbour of the best arm played in fewer than two windows, or never measured (its
   windows cut short by a change of context), is played: what a
   window accepts varies with its text several-fold (one measured 19.7 tokens/s per request
   where the same arm's later windows measured 55-65), and one unlucky window would otherwise
   keep the walk from passing it until exploration returns to it;
3. else every `explore_every`-th window plays the neighbour with the highest optimistic rate
   `rate * (1 + bonus / sqrt(steps / window))`, if that beats the best's rate;
4. else the arm with the best measured rate (tokens per request / seconds).

When a neighbour overtakes the best, the walk moves one arm along and measures the new
neighbours. All arms' sums in a context decay by `decay` at each of its windows, so what was
measured long ago weighs less and a stale neighbour's optimism grows back: the text and the
machine drift. Exploration costs at most one window in `explore_every`, spent on arms next to
the best.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NONE = "none"  # the arm that drafts nothing


def grafts(lookup: int) -> tuple[int, ...]:
    """The lookup nodes a greedy chain arm may graft where the spec has `lookup`: all of them
    and, from 8 up, a quarter (what the prompt's n-grams propose pays with the text: on
    Qwen2.5-Coder's HumanEval replies, which copy the prompt's code, a chain of 2 with 16 lookup
    nodes ran 3.2x no speculation and `auto` with 4-node grafts only 2.1x; on SmolLM2's replies
    16 ran a few percent behind 4: scripts/BENCHMARKS.md, "How many lookup nodes a chain
    grafts")."""
    return (lookup // 4, lookup) if lookup >= 8 else (lookup,) if lookup else ()


def arms_for(head_nodes: int, max_depth: int | None, lookup: int, sampled: bool,
             tree_of: Callable[[int], str] | None = None) -> list[str]:
    """The arms (tree spec strings, `NONE` for no drafts) of a sampling class, by size:
    nothing; chains of 1..4 head nodes (at most `max_depth` and `head_nodes`), for greedy
    requests each followed by itself with each of `grafts(lookup)` lookup nodes grafted (sampled
    requests' grafted chains, drawn from q, ran 0.98x a chain of 3 at T=1 on MT-bench:
    scripts/BENCHMARKS.md, "Lookup nodes after a sampled chain"); and where the head's spec
    branches (`tree_of(n)`: an n-node tree; plugin/proposer.AutoArms passes the head's own kind
    for greedy requests, static trees, drawn from q, for sampled ones), its trees of 8, 16, 32
    and `head_nodes` nodes (each with the `lookup` nodes)."""
    depth = min(4, head_nodes, max_depth or 4)
    tails = [""] + ([f"+lookup:{n}" for n in grafts(lookup)] if not sampled else [])
    arms = [NONE] + [f"chain:{k}{t}" for k in range(1, depth + 1) for t in tails]
    if tree_of is not None:
        tail = f"+lookup:{lookup}" if lookup else ""
        arms += [tree_of(n) + tail for n in sorted({8, 16, 32, head_nodes})
                 if depth < n <= head_nodes]
    return arms


def neighbours(arms: Sequence[str]) -> list[list[int]]:
    """Per arm, the indices of its neighbours. The arms sit on a grid: head nodes one way (none,
    chains of 1..4, then the trees by size), grafted lookup nodes the other (plain, then each
    graft size); a chain's neighbours are the chains one node shorter and longer with the same
    graft and itself with the next graft either way. Drafting nothing and the trees take any
    graft: their neighbours are the next chain or tree along with every graft. Drafting nothing
    is also a neighbour of every arm: it wins wherever rows are dear (a sampled batch of 8 on
    a CPU), however the chains compare among themselves, so the walk must not need a falling
    line of chains to reach it."""
    chains = [a.partition("+") for a in arms if a.startswith("chain:")]
    depths = sorted({int(head[6:]) for head, _, _ in chains})
    sizes = sorted({int(graft.rpartition(":")[2]) for _, _, graft in chains if graft})
    where, trees = [], 0  # (head position, graft position or None: any); trees so far
    for a in arms:
        head, _, graft = a.partition("+")
        if a == NONE:
            where.append((0, None))
        elif head.startswith("chain:"):
            where.append((1 + depths.index(int(head[6:])),
                          1 + sizes.index(int(graft.rpartition(":")[2])) if graft else 0))
        else:  # a tree, after the chains in size order
            trees += 1
            where.append((len(depths) + trees, None))

    def near(a: tuple, b: tuple) -> bool:
        if abs(a[0] - b[0]) == 1:
            return a[1] is None or b[1] is None or a[1] == b[1]
        return a[0] == b[0] and None not in (a[1], b[1]) and abs(a[1] - b[1]) == 1

    out = [[j for j, b in enumerate(where) if near(a, b)] for a in where]
    if NONE in arms:  # drafting nothing is a neighbour of every arm
        k = arms.index(NONE)
        out = [js if i == k or k in js else sorted([k, *js]) for i, js in enumerate(out)]
    return out


def context(batch: int, sampled: int) -> tuple[int, bool]:
    """(batch rounded up to a power of two, most requests sample)."""
    return 1 << max(batch - 1, 0).bit_length(), 2 * sampled > batch


@dataclass
class Arm:
    tokens: float = 0.0  # per request
    seconds: float = 0.0
    steps: float = 0.0
    windows: int = 0  # windows it was chosen for (not decayed)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def leader(arms: Sequence[Arm]) -> int | None:
    """The index of the measured arm with the best rate (the first on a tie), None if none is
    measured."""
    seen = [i for i, a in enumerate(arms) if a.steps]
    return max(seen, key=lambda i: arms[i].rate) if seen else None


class ArmBandit:
    """Plan each step's arm (`plan`), learn from its outcome (`observe`). See the module doc."""

    def __init__(self, arms: dict[bool, Sequence[str]], window: int = 8,
                 explore_every: int = 8, bonus: float = 0.5, decay: float = 0.95) -> None:
        self.arms = {sampled: list(a) for sampled, a in arms.items()}  # per sampling class
        self.window, self.explore_every = window, explore_every
        self.bonus, self.decay = bonus, decay
        self.near = {sampled: neighbours(a) for sampled, a in self.arms.items()}
        self.stats: dict[tuple[int, bool], list[Arm]] = {}
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
            self.ctx, self.left = ctx, self.window
            self.arm = self._choose(ctx)
            self.stats[ctx][self.arm].windows += 1
        self.left -= 1
        return self.arms[ctx[1]][self.arm]

    def observe(self, tokens: int, seconds: float, usable: bool = True,
                requests: int = 1) -> None:
        """The outcome of the step `plan` planned last: the tokens the step gave to its
        `requests` requests (1 + accepted drafts each, which the previous step's drafts earned)
        and its seconds (the verification of those drafts and this step's drafting). It counts
        for its arm when the step before ran the same arm in the same context (the drafts it
        verified were that arm's), unless not `usable` (a step that prefills is priced by the
        prompt)."""
        now = (self.ctx, self.arm)
        if usable and self.last == now and seconds > 0:
            a = self.stats[self.ctx][self.arm]
            a.tokens += tokens / max(requests, 1)
            a.seconds += seconds
            a.steps += 1
        self.last = now

    def idle(self) -> None:
        """A step that ran no arm (nothing could draft): the next step verifies no arm's drafts."""
        self.last = None

    def rates(self, ctx: tuple[int, bool]) -> dict[str, float]:
        """Measured tokens/s per request, per arm of a context (arms not measured yet left
        out)."""
        return {name: a.rate for name, a in zip(self.arms[ctx[1]], self.stats.get(ctx, ()),
                                                 strict=False) if a.steps}

    def best(self, ctx: tuple[int, bool]) -> str | None:
        i = leader(self.stats.get(ctx, ()))
        return None if i is None else self.arms[ctx[1]][i]

    def _choose(self, ctx: tuple[int, bool]) -> int:
        arms = self.stats.setdefault(ctx, [Arm() for _ in self.arms[ctx[1]]])
        n = self.windows[ctx] = self.windows.get(ctx, 0) + 1
        for a in arms:  # what was measured long ago weighs less
            a.tokens *= self.decay
            a.seconds *= self.decay
            a.steps *= self.decay
        best = leader(arms)
        if best is None:
            return self._start(ctx)
        near = self.near[ctx[1]][best]
        fresh = [i for i in near if arms[i].windows < 2 or not arms[i].steps]
        if fresh:  # a neighbour measured in fewer than two windows, or in none that counted
            return fresh[0]
        if n % self.explore_every or not near:
            return best

        def optimistic(i: int) -> float:
            return arms[i].rate * (1 + self.bonus / math.sqrt(max(arms[i].steps, 1.0)
                                                              / self.window))

        pick = max(near, key=optimistic)
        return pick if optimistic(pick) > arms[best].rate else best

    def _start(self, ctx: tuple[int, bool]) -> int:
        """A context's first arm: the best of the nearest batch context of its sampling class
        already measured (the larger batch on a tie), else drafting nothing."""
        others = [(abs(c[0].bit_length() - ctx[0].bit_length()), -c[0], i)
                  for c, arms in self.stats.items()
                  if c != ctx and c[1] == ctx[1] and (i := leader(arms)) is not None]
        return min(others)[2] if others else 0
