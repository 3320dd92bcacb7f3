"""What a token tree can earn at a position, in expectation, and the best tree of N nodes.

Under the exact verification rule (`sampling.verify_tree`: one-hot proposals, the emitted token
at every node distributed as the target's p), the walk passes from a node to its child c with
probability p(c | node's path), whatever the other children are (a repeated sibling token is
never taken). So the walk reaches node i with probability

    reach(i) = prod over the path root -> i of p(token | parent's path)

and the expected tokens per target pass of a tree is  tau = 1 + sum_i reach(i)  (the bonus token
included). `expected_tau` computes it from the target's rows of a tree: an exact, noise-free
counterpart of the sampled acceptance length.

No tree of N fixed tokens (one-hot proposals: top-ranked tokens, EAGLE-2 trees, lookup nodes)
beats the top-N paths: any exact scheme emits the target's own sample, so a pass accepts node i
only where that sample passes through i, with probability reach(i); a tree of N nodes earns at
most the N largest reach values, and those form a tree (reach(child) <= reach(parent)). Drafts
drawn at random from the head's q and tested against it (chains and static trees at T > 0) are
not bound by it: their tokens move with the target's sample (a q equal to p always passes).
`oracle_tree` finds the top-N paths with the target itself as drafter, so
`1 + oracle reach sum` is the ceiling of tau for N-node trees at that position and temperature
(at T=0 it is N + 1: the target's greedy chain).
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from .sampling import SamplingParams, process_logits
from .tree import tree_buffers


def reach_probs(tree_tokens: Tensor, parents: Tensor, probs: Tensor) -> Tensor:
    """float64 [N+1]: probability that verification reaches each node (root: 1).

    tree_tokens [N+1], parents [N+1] (parents[0] = -1, parents before children), probs [N+1, V]:
    the target's distribution after each node (`process_logits` of its row).
    """
    tokens, par = tree_tokens.tolist(), parents.tolist()
    if probs.dim() != 2 or probs.shape[0] != len(tokens) or len(par) != len(tokens):
        raise ValueError(f"tree_tokens [{len(tokens)}], parents [{len(par)}] and probs "
                         f"{tuple(probs.shape)} must all have N+1 rows")
    step = probs.double()[par[1:], tokens[1:]] if len(tokens) > 1 else probs.new_zeros(0)
    reach = [1.0] + [0.0] * (len(tokens) - 1)
    seen: set[tuple[int, int]] = set()
    for i, (p, t) in enumerate(zip(par[1:], tokens[1:], strict=True), start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: each node's parent must come before it")
        if (p, t) not in seen:  # a repeated sibling token is rejected with p = 0
            seen.add((p, t))
            reach[i] = reach[p] * float(step[i - 1])
    return torch.tensor(reach, dtype=torch.float64)


def expected_tau(tree_tokens: Tensor, parents: Tensor, probs: Tensor) -> float:
    """Expected tokens committed by one verification of the tree: 1 + sum of reach (root out)."""
    return 1.0 + float(reach_probs(tree_tokens, parents, probs)[1:].sum())


def tree_rows(target, tokens: list[int], parents: list[int], params: SamplingParams) -> Tensor:
    """The target's processed distributions [N+1, V] after each node of a tree rooted at the
    token after the target's cache (a `reference.Target`); the cache is left as it was."""
    start = target.length
    par = torch.tensor(parents)
    buf = tree_buffers(par)
    logits, _ = target.forward(torch.tensor(tokens), start + buf.depths, buf.ancestor_mask)
    target.keep(start, torch.zeros(0, dtype=torch.long))
    return process_logits(logits, params)


def oracle_tree(target, root: int, num_nodes: int, params: SamplingParams
                ) -> tuple[list[tuple[int, ...]], list[float]]:
    """The num_nodes paths below `root` most likely to be accepted, with the target's own
    distribution as the drafter: (paths as token tuples, reach of each), by decreasing reach,
    so the first n of them are also the best tree of n nodes.

    Expands in rounds: select the best tree from the rows known so far, run the target once
    over the selected nodes whose rows are missing (with their ancestors), repeat until every
    selected node that could still have a better child has its row.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes} must be >= 1")
    rows: dict[tuple[int, ...], tuple[list[float], list[int]]] = {}
    need: list[tuple[int, ...]] = [()]
    while True:
        nodes = sorted({p[:d] for p in need for d in range(len(p) + 1)}, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(nodes)}
        probs = tree_rows(target, [root] + [p[-1] for p in nodes[1:]],
                          [-1] + [index[p[:-1]] for p in nodes[1:]], params)
        top = probs.double().topk(min(num_nodes, probs.shape[-1]), dim=-1)
        for p, v, t in zip(nodes, top.values.tolist(), top.indices.tolist(), strict=True):
            rows.setdefault(p, (v, t))
        chosen, reach = _best_first(rows, num_nodes)
        last = reach[-1] if len(chosen) == num_nodes else 0.0
        need = [p for p, r in zip(chosen, reach, strict=True) if p not in rows and r > last]
        if not need:
            return chosen, reach


def _best_first(rows, num_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
    heap: list[tuple[float, tuple[int, ...]]] = []

    def push(path: tuple[int, ...], reach: float) -> None:
        for v, t in zip(*rows[path], strict=True):
            if v > 0:
                heapq.heappush(heap, (-reach * v, path + (t,)))

    push((), 1.0)
    chosen, reach = [], []
    while heap and len(chosen) < num_nodes:
        r, path = heapq.heappop(heap)
        chosen.append(path)
        reach.append(-r)
        if path in rows:
            push(path, -r)
    return chosen, reach
