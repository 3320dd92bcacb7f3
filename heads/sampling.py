"""Target-side sampling and lossless token-tree verification: the pure-torch reference.

Features:
- `SamplingParams` + `process_logits`: the target distribution exactly as vLLM 0.32's sampler
  builds it (float32 logits / temperature, top-k, top-p as in `apply_top_k_top_p`, float32
  softmax); greedy when temperature < 1e-5. Works on any batch shape [..., V].
- `sample`: plain sampling from that distribution (greedy -> argmax, else `draw`).
- `draw` / `draw_rows`: one token from a distribution by the inverse CDF of one uniform (the
  draws of sampled chains and of verification; vLLM's chain rejection sampler's recovered tokens
  on CPU: plugin/sampler.py); `gumbel_keys`: the Gumbel-top-k keys by which
  `draft_sampled_trees` draws each node's children without replacement, one block for a
  request's level (`draw_without_replacement`: the same draw for one distribution).
- `verify_tree`: verification of a drafted token tree, greedy or sampled. The committed tokens
  have exactly the target's distribution whatever the draft proposed (proof next to the code).
- Sampled chains (T > 0): `draft_chain` samples each draft token from q = the head's
  distribution under the request's temperature/top-k/top-p and keeps q (`draft_chains`: the
  requests of a serving step in lockstep, one head forward per level); `verify_chain` is
  speculative sampling (accept with min(1, p/q), else resample from norm(max(0, p - q)), plus a
  bonus token), the rule vLLM's rejection sampler applies when it is given draft probabilities.
  Measured on the shipped EAGLE head (MT-bench, T=1): depth-1 acceptance 0.26 with sampled
  drafts against 0.18 with argmax drafts (one-hot q).
- Sampled fixed-shape trees (static, paths): `draft_sampled_trees` draws every node's children
  without replacement from q; `verify_tree` tests them recursively against it (`q` argument).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .common import batched
from .tree import Device, DraftTree, GrowingTree, fixed_steps, in_lockstep, validate_parents

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it mean greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # < SAMPLING_EPS -> greedy
    top_k: int = 0  # 0 or -1 -> off
    top_p: float = 1.0  # 1 -> off
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
            raise ValueError(
                f"temperature = {self.temperature!r} must be a finite number >= 0 (0 = greedy)"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(
                f"top_k = {self.top_k!r} must be an integer >= 1, or 0 / -1 to disable it"
            )
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p = {self.top_p!r} must be in (0, 1] (1 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def make_generator(params: SamplingParams, device: Device = None) -> torch.Generator | None:
    """A generator seeded with `params.seed`, or None (torch's global RNG) when there is no seed."""
    if params.seed is None:
        return None
    device = torch.device("cpu") if device is None else device
    return torch.Generator(device=device).manual_seed(params.seed)


@functools.lru_cache(maxsize=64)
def _one_minus_float32(p: float) -> float:
    """1 - p computed in float32, as vLLM does with its float32 top-p tensor."""
    return float(1 - torch.tensor(p, dtype=torch.float32))


def _apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """vLLM `apply_top_k_top_p`'s top-p on float32 logits [..., V]; dropped tokens -> -inf.

    Ascending sort, cumulative softmax mass; drop tokens whose cumulative mass (own included) is
    <= 1 - p, i.e. keep a token iff the mass strictly above it is < p; always keep the largest.
    Ties: vLLM's unstable sort leaves their order open; we sort stably so that among equal
    logits the higher token id is dropped first (deterministic, and consistent with argmax).
    """
    desc, idx = logits.sort(dim=-1, descending=True, stable=True)
    asc, idx = desc.flip(-1), idx.flip(-1)  # [..., V] ascending, ties: higher id first
    cum = asc.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= _one_minus_float32(top_p)
    drop[..., -1] = False  # at least one token
    return torch.empty_like(logits).scatter_(-1, idx, asc.masked_fill(drop, float("-inf")))


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """float32 logits [..., V] after temperature, top-k, top-p (dropped: -inf); sampling only."""
    x = logits.float() / params.temperature  # new tensor: the caller's logits are left alone
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1] k-th largest
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        x = _apply_top_p(x, params.top_p)
    return x


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Target probabilities float32 [..., V] exactly as plain sampling would draw from them.

    Greedy params give the one-hot of argmax (first index among ties, like torch.argmax).
    """
    if params.greedy:
        best = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, best, 1.0)
    return filter_logits(logits, params).softmax(dim=-1)


DRAW_BLOCK = 256  # `draw_rows`: entries per block of the two-level inverse CDF


def draw_rows(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Row n of `probs` [N, V] (>= 0) -> one index drawn with probability probs[n, i] / sum(row n),
    by inverting the row's cumulative sum at `uniforms[n]` (float64 in [0, 1)). Rows with a zero
    sum give -1. An index of probability 0 is never drawn.

    Two levels, so the cost stays that of reading the rows once: float32 sums of blocks of
    DRAW_BLOCK entries, the float64 cumulative sum over the blocks picks a block, then the float64
    cumulative sum inside that one block picks the index (relative error ~1e-7 of a probability,
    the float32 inputs' own precision). A float64 cumulative sum over the whole rows costs 20 ms
    for 32 rows of 49k on a 2-core AVX2 CPU, `exponential_` noise over them (vLLM's Gumbel draws)
    47 ms; this 1-2 ms."""
    if probs.dim() != 2 or uniforms.shape != probs.shape[:1]:
        raise ValueError(f"draw_rows takes probs [N, V] and uniforms [N], got "
                         f"{tuple(probs.shape)} and {tuple(uniforms.shape)}")
    N, V = probs.shape
    if N == 0:  # e.g. a sampled step where no request has a draft position
        return torch.empty(0, dtype=torch.long, device=probs.device)
    x = probs.float()
    if V % DRAW_BLOCK:
        x = torch.nn.functional.pad(x, (0, DRAW_BLOCK - V % DRAW_BLOCK))
    blocks = x.view(N, -1, DRAW_BLOCK)  # [N, nb, B]
    c = blocks.sum(-1).double().cumsum(-1)  # [N, nb]
    total = c[:, -1:]
    u = uniforms.to(torch.float64).view(N, 1) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total
    b = torch.searchsorted(c, u, right=True).clamp_(max=c.shape[1] - 1)  # [N, 1] chosen block
    below = torch.where(b > 0, c.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    inner = blocks.gather(1, b.unsqueeze(-1).expand(N, 1, DRAW_BLOCK)).squeeze(1)  # [N, B]
    ci = inner.double().cumsum(-1)
    r = torch.minimum(u - below, torch.nextafter(ci[:, -1:], torch.zeros_like(u)))  # r < block mass
    i = torch.searchsorted(ci, r, right=True).clamp_(max=DRAW_BLOCK - 1)
    out = (b * DRAW_BLOCK + i).squeeze(1)
    return out.masked_fill_(total.squeeze(1) <= 0, -1)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> int:
    """One index of `probs` [V] (>= 0, any positive sum), index i with probability
    probs[i] / sum(probs): `draw_rows` at one float64 uniform. An index of probability 0 is never
    drawn.

    torch.multinomial makes ~V random numbers for one sample on a CPU: 1.3 ms at V = 49k on a
    2-core AVX2 machine against 0.1 ms here, and most of a sampled verification's time."""
    if probs.dim() != 1:
        raise ValueError(f"draw takes one distribution [V], got shape {tuple(probs.shape)}")
    return int(draw_each(probs[None], [generator])[0])


def draw_each(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """`draw` for every row of `probs` [N, V] in one `draw_rows`: row n's uniform comes from
    generators[n] (None: torch's global RNG), drawn in row order, so each row gets what `draw`
    one row at a time gives it."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device)
                   for g in generators])
    out = draw_rows(probs, u)
    if bool((out < 0).any()):
        raise ValueError("draw needs probabilities with a positive sum")
    return out


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token from logits [V]: argmax when greedy, else `draw` from `process_logits`."""
    if logits.dim() != 1:
        raise ValueError(f"sample takes one row of logits [V], got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(logits.argmax())
    return draw(process_logits(logits, params), generator)


def _children_lists(
    tree_tokens: Tensor, parents: Tensor | Sequence[int], target_logits: Tensor
) -> tuple[list[int], list[list[int]]]:
    tokens = tree_tokens.tolist()
    par = validate_parents(parents)
    if tree_tokens.dim() != 1 or len(par) != len(tokens):
        raise ValueError(
            f"tree_tokens {tuple(tree_tokens.shape)} and parents ({len(par)}) must both be [N+1]"
        )
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tokens):
        raise ValueError(
            f"target_logits must be [N+1={len(tokens)}, V], got {tuple(target_logits.shape)}"
        )
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(par)):
        children[par[i]].append(i)  # increasing index = draft order
    return tokens, children


def _verify_greedy(
    tokens: list[int], children: list[list[int]], target_logits: Tensor
) -> tuple[list[int], int]:
    best = target_logits.argmax(dim=-1).tolist()  # [N+1] target's greedy token after each node
    accepted, node = [], 0
    while True:
        match = next((c for c in children[node] if tokens[c] == best[node]), None)
        if match is None:
            return accepted, best[node]
        accepted.append(match)
        node = match


def _fallback_token(filtered: Tensor, raw: Tensor, rejected: list[int]) -> int:
    """Most likely non-rejected token, for when float rounding left no residual mass.

    Exact arithmetic never gets here (the residual has mass 1 - sum p(rejected) > 0 whenever a
    rejection happened with probability > 0); in float32 it can underflow to 0. Prefer the
    tokens top-k/top-p kept (finite `filtered` [V]); if all were rejected, use the raw logits [V].
    """
    for scores in (filtered, raw.float()):
        scores = scores.clone()
        scores[rejected] = float("-inf")
        if torch.isfinite(scores).any():
            return int(scores.argmax())
    raise ValueError(
        "every token of the vocabulary was rejected: tree children must be distinct tokens"
    )


def _verify_sampled(
    tokens: list[int],
    children: list[list[int]],
    target_logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    q: Mapping[int, Tensor] | None = None,
) -> tuple[list[int], int]:
    # Rule at a node with target distribution p and children c_1..c_m (draft order, one-hot
    # proposals): accept c_j with prob p(c_j); on reject set p(c_j) = 0 and renormalise; if no
    # child is accepted, sample the bonus token from the final p.
    # Exactness (induction on m): the token emitted at the node is distributed as p. m = 0: it is
    # sampled from p. m >= 1: P(emit c_1) = p(c_1); for x != c_1, P(emit x) = (1 - p(c_1)) *
    # p'(x) with p' = p without c_1, renormalised, by induction on the remaining m - 1 children,
    # = (1 - p(c_1)) * p(x) / (1 - p(c_1)) = p(x). If the emitted token is a child's, we continue
    # at that child, whose target row is the target's conditional given the path so far; else
    # verification stops. By induction on depth, the committed sequence has the target's joint
    # distribution. Duplicate child tokens stay exact: after the first rejection p(c) = 0.
    # Children drawn from distributions (`q[c]`, e.g. the head's under the request's sampling
    # parameters) come first among their siblings, c_1..c_k, each drawn from its q with the
    # tokens of the earlier drawn siblings removed and renormalised (q_i; sampling without
    # replacement when they share one q: `draft_sampled_trees`). They are tested as in
    # speculative sampling, recursively: with p_1 = p, accept c_i with min(1, p_i/q_i)(x_i),
    # else go on with p_{i+1} = norm(max(0, p_i - q_i)). P(emit x at step i) = min(p_i, q_i)(x)
    # + (1 - sum min(p_i, q_i)) p_{i+1}(x) = p_i(x) whatever the later steps draw, as long as
    # they emit p_{i+1} (induction; p_{i+1} depends on the earlier draws only through q_i, and
    # the one-hot rule above, for any children that follow, emits it). A rejected x_i has
    # p_i(x_i) < q_i(x_i), so p_{i+1}(x_i) = 0: later siblings (drawn ones exclude it, one-hot
    # ones are duplicates) see it removed. Exact for any number of drawn children fixed
    # before they are drawn (fixed tree shapes; not a shape pruned by its own draws).
    # Rows are processed only for the nodes the walk visits (accepted path + the last node):
    # row-wise, so identical to processing all N+1 rows at once, and far cheaper for big trees.
    # One uniform per node for that node's own accept test: a fixed number of draws per call.
    uniforms = torch.rand(len(tokens), generator=generator, device=target_logits.device,
                          dtype=torch.float64).tolist()
    accepted, node = [], 0
    while True:
        filtered = filter_logits(target_logits[node], params)  # [V] float32
        probs = filtered.softmax(dim=-1)  # [V], exactly as process_logits
        kids = children[node]
        residual, rejected = probs, []
        drawn = [c for c in kids if q and c in q]
        if kids[:len(drawn)] != drawn:
            raise ValueError(f"node {node}: children drawn from q must come first among their "
                             "siblings (the others are one-hot proposals)")
        hit = None
        for c in drawn:
            x = tokens[c]
            qi = q[c].to(probs.device, torch.float32)
            if rejected:  # without the earlier drawn siblings' tokens, renormalised
                qi = qi.clone()
                qi[rejected] = 0.0
                mass = float(qi.sum())
                qi = qi / mass if mass > 0 else qi
                pn = residual / float(residual.sum())
            else:
                pn = residual  # p itself: normalised
            if qi[x] > 0 and uniforms[c] < float(pn[x]) / float(qi[x]):
                hit = c
                break
            residual = (pn - qi).clamp_(min=0)
            rejected.append(x)
            if not residual.sum() > 0:  # p_i <= q_i everywhere yet x rejected: rounding only
                return accepted, _fallback_token(filtered, target_logits[node], rejected)
        if hit is not None:
            accepted.append(hit)
            node = hit
            continue
        kids = kids[len(drawn):]
        p_kid = residual[[tokens[c] for c in kids]].double().tolist() if kids else []
        remaining = float(residual.double().sum())  # residual mass (1 up to rounding, or r's)
        for c, p_c in zip(kids, p_kid, strict=True):
            p_c = 0.0 if tokens[c] in rejected else p_c  # a repeated token was removed
            if remaining > 0 and uniforms[c] < p_c / remaining:  # p'(c) = p(c) / residual mass
                accepted.append(c)
                node = c
                break
            rejected.append(tokens[c])
            remaining -= p_c
        else:
            if not rejected:  # a leaf: plain sampling from p
                return accepted, draw(probs, generator)
            residual = residual.clone()  # [V]
            residual[rejected] = 0.0
            if not residual.sum() > 0:
                return accepted, _fallback_token(filtered, target_logits[node], rejected)
            return accepted, draw(residual, generator)


def verify_tree(
    tree_tokens: Tensor,
    parents: Tensor | Sequence[int],
    target_logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    q: Mapping[int, Tensor] | None = None,
) -> tuple[list[int], int]:
    """Accepted node ids along one root->node path (root excluded) and the next token to commit.

    tree_tokens [N+1] (tokens[0] = root), parents [N+1], target_logits [N+1, V] where row i is the
    target's logits for the token after node i. Greedy: follow the child whose token is the
    target's argmax; the bonus is the argmax at the last accepted node. Sampling: see the rule in
    `_verify_sampled`; `generator` (on target_logits' device) makes it reproducible.
    q: node -> the distribution [V] that node's token was drawn from (the head's q under the
    request's sampling parameters: a sampled head chain, `draft_chains`, or tree,
    `draft_sampled_trees`, lookup nodes grafted after them), without the tokens of its earlier
    drawn siblings; drawn nodes come first among their siblings, every other node is a one-hot
    proposal. Greedy verification ignores it.
    """
    tokens, children = _children_lists(tree_tokens, parents, target_logits)
    if params.greedy:
        return _verify_greedy(tokens, children, target_logits)
    return _verify_sampled(tokens, children, target_logits, params, generator, q)


# ----------------------------------------------------------------------------- sampled chains


def _chain(tokens: list[int], logprobs: list[float]) -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1),
                     torch.tensor(logprobs, dtype=torch.float32))


def draft_chain(root_token: int, expander, depth: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[DraftTree, Tensor]:
    """Draft `depth` tokens below `root_token`, each drawn from q = process_logits(head, params).

    Returns the chain (a DraftTree: root + drafts, log q of each draft) and q [depth, V]
    (float32), the draft distributions vLLM's rejection sampler needs as draft probabilities.
    Greedy params give argmax tokens and one-hot q. `expander` is a head's draft session
    (heads/tree.py `Expander`), committed up to the root. One request of `draft_chains`.
    """
    return draft_chains([(root_token, expander, params, generator)], depth)[0]


def draft_chains(jobs: Sequence[tuple[int, object, SamplingParams, torch.Generator | None]],
                 depth: int) -> list[tuple[DraftTree, Tensor]]:
    """`draft_chain` for several requests in lockstep, jobs (root_token, expander, params,
    generator): each request draws from its own generator, so the chains are those drafted
    one by one.

    Where the expanders' class offers `draft_logits_many` (EagleSession), a level of ALL chains
    is one packed head forward and one matmul over the head's draft vocabulary, and q is built
    over that vocabulary (the same distribution as over the full one, where the head's logits
    are -inf: temperature, top-k and top-p only ever drop or rescale finite entries), then
    scattered to the target's vocabulary for the returned q; otherwise one `expand` (full
    vocabulary log-probs) per request and level."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if not jobs:
        return []
    expanders = [e for _, e, *_ in jobs]
    many = batched(expanders, "draft_logits_many")
    tokens = [[int(root)] for root, *_ in jobs]
    logprobs: list[list[float]] = [[0.0] for _ in jobs]
    qs: list[list[Tensor]] = [[] for _ in jobs]
    ids, vocab = None, None
    for d in range(depth):
        trees = [GrowingTree(t, list(range(-1, d)), lp, None)
                 for t, lp in zip(tokens, logprobs, strict=True)]
        if many is not None:
            rows, ids, vocab = many([(e, t, [d]) for e, t in zip(expanders, trees, strict=True)])
        else:
            rows = torch.stack([e.expand(t, [d])[0] for e, t in zip(expanders, trees, strict=True)])
        q, j = _draw_level(rows, [(params, generator) for _, _, params, generator in jobs])
        lq = q[torch.arange(len(jobs), device=q.device), j].log().tolist()
        for i, x in enumerate((j if ids is None else ids[j.to(ids.device)]).tolist()):
            tokens[i].append(x)
            logprobs[i].append(lq[i])
            qs[i].append(q[i])
    out = []
    for t, lp, q in zip(tokens, logprobs, qs, strict=True):
        q = torch.stack(q)
        if ids is not None:  # draft vocabulary -> the target's
            q = q.new_zeros(depth, vocab).index_copy_(1, ids.to(q.device), q)
        out.append((_chain(t, lp), q))
    return out


def _draw_level(rows: Tensor, draws: Sequence[tuple[SamplingParams, torch.Generator | None]]
                ) -> tuple[Tensor, Tensor]:
    """One level of `draft_chains`: rows [N, V] of the head's logits, draws (params, generator)
    per row -> (q [N, V] float32, the drawn index [N]). `process_logits` once per distinct
    params (row-wise, so what each row gets alone), argmax for greedy rows, and one `draw_each`
    for all sampled rows (what `draw` one row at a time gives them). Per-row calls cost
    ~0.04 ms more a sampled request and level: at batch 4, T=1, `chain=1` on a 2-core CPU the
    drafting phase takes 4.07 ms a step, 4.24 ms with per-row calls (`treedraft bench
    --profile`)."""
    q = _level_q(rows, [params for params, _ in draws])
    j = q.argmax(dim=-1)  # greedy rows' draft (process_logits' one-hot of the first argmax)
    sampled = [i for i, (params, _) in enumerate(draws) if not params.greedy]
    if sampled:
        at = torch.tensor(sampled, device=rows.device)
        j[at] = draw_each(q[at], [draws[i][1] for i in sampled])
    return q, j


def _level_q(rows: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """q [N, V] float32: `process_logits` of each row of the head's logits `rows` [N, V] under
    its request's params, once per distinct params (row-wise: what each row gets alone)."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)
    if len(groups) == 1:  # (the usual step: every request with the same parameters)
        return process_logits(rows, *groups)
    q = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    for p, idx in groups.items():
        at = torch.tensor(idx, device=rows.device)
        q[at] = process_logits(rows[at], p)
    return q


def gumbel_keys(q: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """log q + Gumbel noise [..., V] float64, one uniform per entry from `generator`: a row's
    entries in decreasing key order are in the order sequential sampling without replacement
    draws them (the first ~ q, each next ~ q without the earlier ones, renormalised: the
    Gumbel-top-k trick); entries where q = 0 get -inf, after every positive one."""
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64, device=q.device)
    u.clamp_(min=torch.finfo(torch.float64).tiny)  # u = 0 would give a positive q key -inf
    return q.double().log() - (-u.log()).log()


def draw_without_replacement(q: Tensor, k: int, generator: torch.Generator | None = None
                             ) -> Tensor:
    """min(k, #positive entries) distinct indices of q [V] (>= 0) in the order sequential
    sampling without replacement draws them (`gumbel_keys`)."""
    if q.dim() != 1:
        raise ValueError(f"draw_without_replacement takes one distribution [V], got "
                         f"{tuple(q.shape)}")
    return gumbel_keys(q, generator).topk(min(k, int((q > 0).sum()))).indices


def draft_sampled_trees(jobs: Sequence[tuple[int, object, SamplingParams, torch.Generator | None]],
                        parents: Sequence[int], device: Device = None
                        ) -> list[tuple[DraftTree, Tensor, list[int], list[int]]]:
    """A fixed tree shape (`parents`: heads.tree's static and paths trees, depth-ordered,
    siblings in rank order) drafted for requests that sample, jobs (root_token, expander, params,
    generator) as in `draft_chains`: the children of every expanded node drawn WITHOUT
    replacement from its q (the head's distribution under the request's params), in sibling
    order. Where q has fewer tokens than the node has children (top-k, top-p), the rest are the
    head's next most likely tokens, one-hot proposals. Level by level, a level of all requests in
    one packed head forward where the expanders offer `draft_logits_many`.

    Per job: (the tree, q [P, V] float32 over the target's vocabulary, one row per expanded
    node, the ids of the drawn nodes, the q row of each): `verify_tree`'s q is
    {node: q[row]}. Exact because the shape is fixed: how many children a node has never
    depends on what they drew (an EAGLE-2 tree, pruned by its own draws' probabilities, would
    not be)."""
    if not jobs:
        return []
    if any(params.greedy for _, _, params, _ in jobs):
        raise ValueError("draft_sampled_trees drafts requests that sample (T > 0); greedy ones "
                         "draft the top-ranked tokens (heads.tree.draft_trees)")
    parents = validate_parents(parents)
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    expanders = [e for _, e, *_ in jobs]
    many = batched(expanders, "draft_logits_many")
    qs: list[list[Tensor]] = [[] for _ in jobs]
    nodes: list[list[int]] = [[] for _ in jobs]
    rows_of: list[list[int]] = [[] for _ in jobs]
    ids, vocab = None, None

    def level_of(live: list[tuple[int, tuple]]) -> list[tuple[list, list]]:
        """One level of every live tree: each expanded node's children drawn from its q."""
        nonlocal ids, vocab
        items = [(expanders[i], tree, level) for i, (tree, level, _) in live]
        if many is not None:
            logits, ids, vocab = many(items)
        else:
            logits = torch.cat([e.expand(t, level) for e, t, level in items])
        q = _level_q(logits, [jobs[i][2] for i, (_, level, _) in live for _ in level])
        answers, lo = [], 0
        for i, (_, level, kmax) in live:
            generator = jobs[i][3]
            hi = lo + len(level)
            block = q[lo:hi]  # this request's expanded nodes: one draw of keys for all of them
            kmax = min(kmax, block.shape[-1])
            pick = gumbel_keys(block, generator).topk(kmax, dim=-1).indices  # [n, kmax]
            support = (block > 0).sum(-1).tolist()
            lq = block.gather(1, pick).log().tolist()
            target_ids = (pick if ids is None else ids[pick.to(ids.device)]).tolist()
            values, tokens = [], []
            for r, node in enumerate(level):
                k = len(children[node])
                drawn = min(k, support[r])
                picked, lp = target_ids[r][:drawn], lq[r][:drawn]
                if drawn < k:  # q's support is used up: the head's next tokens, one-hot
                    rest = logits[lo + r].float().masked_fill(block[r] > 0, float("-inf"))
                    extra = rest.topk(k - drawn).indices
                    lp = lp + torch.log_softmax(logits[lo + r].float(), -1)[extra].tolist()
                    picked = picked + (extra if ids is None else
                                       ids[extra.to(ids.device)]).tolist()
                values.append(lp)
                tokens.append(picked)
                nodes[i] += children[node][:drawn]
                rows_of[i] += [len(qs[i])] * drawn
                qs[i].append(block[r])
            lo = hi
            answers.append((values, tokens))
        return answers

    trees = in_lockstep([fixed_steps(int(root), parents, device) for root, *_ in jobs], level_of)
    result = []
    for tree, rows, drawn, row_of in zip(trees, qs, nodes, rows_of, strict=True):
        q = torch.stack(rows) if rows else torch.zeros(0, vocab or 0)
        if ids is not None:  # draft vocabulary -> the target's
            q = q.new_zeros(q.shape[0], vocab).index_copy_(1, ids.to(q.device), q)
        result.append((tree, q, drawn, row_of))
    return result


def verify_chain(draft_tokens: Sequence[int], draft_probs: Tensor, target_logits: Tensor,
                 params: SamplingParams, generator: torch.Generator | None = None
                 ) -> tuple[int, int]:
    """Speculative sampling of a chain drawn from `draft_probs`: (#accepted, next token).

    draft_tokens [K] with draft_tokens[i] ~ draft_probs[i] ([K, V]); target_logits [K+1, V], row
    i the target's logits after the root and the first i drafts. Draft i is accepted with
    probability min(1, p_i(x)/q_i(x)); at the first rejection the next token is drawn from
    norm(max(0, p_i - q_i)); after K acceptances it is the bonus token sampled from p_K.
    Exactness: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x)
    = min(p, q)(x) + max(0, p - q)(x) = p(x), with r the normalised residual.
    """
    K = len(draft_tokens)
    if draft_probs.shape[0] != K or target_logits.shape[0] != K + 1 or (
            draft_probs.shape[-1] != target_logits.shape[-1]):
        raise ValueError(
            f"need draft_probs [K={K}, V] and target_logits [K+1={K + 1}, V], got "
            f"{tuple(draft_probs.shape)} and {tuple(target_logits.shape)}"
        )
    uniforms = torch.rand(K, generator=generator, device=target_logits.device,
                          dtype=torch.float64).tolist()
    for i, x in enumerate(draft_tokens):
        p = process_logits(target_logits[i], params)  # [V] float32
        q = draft_probs[i].float()
        if q[x] > 0 and uniforms[i] < float(p[x]) / float(q[x]):
            continue
        residual = (p - q).clamp_(min=0)
        if not residual.sum() > 0:  # p <= q everywhere yet x rejected: float rounding only
            return i, _fallback_token(filter_logits(target_logits[i], params) if not params.greedy
                                      else target_logits[i].float(), target_logits[i], [x])
        return i, draw(residual, generator)
    last = target_logits[K]
    return K, int(last.argmax()) if params.greedy else draw(process_logits(last, params),
                                                            generator)
