"""Reference tree speculative decoding, in plain torch: the ground truth for the vLLM plugin.

One loop, batch 1, no tricks (like gpt-fast's ``speculative_decode``):
  1. the head drafts a token tree rooted at the last committed token (``draft_tree``);
  2. the target runs ONCE over the tree's nodes: node i at position ``prefix + depth[i]``,
     seeing the committed prefix and its own tree ancestors only (``ancestor_mask``);
  3. ``verify_tree`` walks the tree with the exact rule (greedy, or rejection sampling)
     and returns the accepted path plus one token from the target;
  4. the accepted nodes' KV moves into the first slots after the prefix (``Target.keep``), the
     head gets the target's hidden states on the accepted path, and the loop repeats.

The output equals plain decoding with the target: token for token at temperature 0, in
distribution at temperature > 0 (tests/test_reference.py checks both).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .lookup import LookupIndex, accepted_by_source, draft_hybrid, graft_lookup
from .sampling import (
    SamplingParams,
    draft_chain,
    draft_sampled_trees,
    sample,
    verify_chain,
    verify_tree,
)
from .tree import TreeSpec, fixed_parents

GREEDY = SamplingParams()


class Target(Protocol):
    """The target model with a KV cache of the committed sequence (batch 1)."""

    length: int  # tokens in the cache

    def reset(self) -> None: ...

    def forward(self, tokens: Tensor, positions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Append tokens [T] at positions [T]; mask [T, T] bool among the new tokens (the cached
        prefix is always visible). Returns (logits [T, V] float32, hidden [T, H_in])."""
        ...

    def keep(self, start: int, nodes: Tensor) -> None:
        """Keep cache entries start + nodes right after the first ``start``; drop the rest."""
        ...


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded), at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes per verify step (root excluded)
    # accepted draft tokens by the source that proposed them (hybrid trees): head/lookup/both
    by_source: dict[str, int] = field(default_factory=lambda: accepted_by_source([], []))

    @property
    def num_verify_steps(self) -> int:
        return len(self.accepted)


def causal(n: int) -> Tensor:
    """The [n, n] causal mask of n new rows over themselves."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def prefill(target: Target, prompt: list[int]) -> tuple[Tensor, Tensor]:
    """Reset the target and run the prompt: (logits, hidden) of every prompt position."""
    if not prompt:
        raise ValueError("empty prompt: the decoder needs at least one prompt token")
    target.reset()
    n = len(prompt)
    return target.forward(torch.tensor(prompt), torch.arange(n), causal(n))


def _done(tokens: list[int], max_new_tokens: int, eos: Collection[int]) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in eos)


def _finish(tokens: list[int], max_new_tokens: int, eos: Collection[int]) -> list[int]:
    """Cut at the first EOS (kept) and at max_new_tokens, as plain decoding would stop."""
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def plain_generate(
    target: Target,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
    eos: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """One target pass per token: the baseline the speculative decoder must reproduce."""
    logits, _ = prefill(target, prompt)
    out = [sample(logits[-1], params, generator)]
    while not _done(out, max_new_tokens, eos):
        pos = torch.tensor([target.length])
        logits, _ = target.forward(torch.tensor(out[-1:]), pos, causal(1))
        out.append(sample(logits[-1], params, generator))
    return DecodeResult(_finish(out, max_new_tokens, eos))


def speculative_generate(
    target: Target,
    head,  # a treedraft head: has draft_session() -> (commit, expand); None for 'lookup:N'
    prompt: list[int],
    max_new_tokens: int,
    spec: TreeSpec,
    params: SamplingParams = GREEDY,
    eos: Collection[int] = (),
    generator: torch.Generator | None = None,
    acceptance_rates=None,
) -> DecodeResult:
    """Tree speculative decoding; same output distribution as ``plain_generate``.

    Chains at T > 0 (any spec whose head part is a chain: `TreeSpec.chain_nodes` of its
    `head_spec`) draw each draft from the head's distribution q (under the request's
    temperature/top-k/top-p) and verify with speculative sampling against q, as the vLLM plugin
    does, lookup nodes grafted after the chain as one-hot proposals (`graft_lookup`); fixed-shape
    trees at T > 0 (static, paths) draw each node's children without replacement from its q
    (`draft_sampled_trees`) and `verify_tree` tests them against it; EAGLE-2 (dynamic) trees
    (and greedy chains and trees) draft the top-ranked tokens, one-hot proposals. A spec
    with lookup nodes ('+lookup:N', or 'lookup:N' with head=None) grafts prompt-lookup branches
    over prompt + output so far into the tree (heads/lookup.py).
    """
    if spec.has_head == (head is None):
        raise ValueError(f"tree {spec.to_string()!r} " + (
            "needs a draft head" if head is None else "drafts without a head: pass head=None"))
    sampled_chain = (spec.has_head and spec.head_spec.chain_nodes is not None
                     and not params.greedy)
    shape = (fixed_parents(spec.head_spec, acceptance_rates) if spec.has_head and not
             params.greedy and not sampled_chain and spec.head_spec.is_fixed else None)
    logits, hidden = prefill(target, prompt)
    root = sample(logits[-1], params, generator)  # first generated token = root of the first tree
    session = head.draft_session() if head is not None else None
    if session is not None:  # pairs (f_t, x_{t+1}) for t = 0..n-1; the last ends with the root
        session.commit(hidden, torch.tensor(prompt[1:] + [root]))
    index = LookupIndex()
    if spec.lookup:
        index.extend(prompt + [root])
    result = DecodeResult([root])
    while not _done(result.tokens, max_new_tokens, eos):
        sources, q_of = None, None
        if sampled_chain:  # drafts drawn from q, speculative sampling with q (as vLLM does)
            tree, q = draft_chain(root, session, spec.head_spec.chain_nodes, params, generator)
            if spec.lookup:  # one-hot lookup nodes after the chain's (drawn from q)
                hybrid, nodes = graft_lookup(tree, index, spec.lookup)
                tree, sources, q_of = hybrid.tree, hybrid.sources, dict(zip(nodes, q, strict=True))
        elif shape is not None:  # a fixed shape, each node's children drawn from its q
            tree, q, drawn, rows = draft_sampled_trees([(root, session, params, generator)],
                                                       shape)[0]
            hybrid, ids = graft_lookup(tree, index if spec.lookup else None, spec.lookup)
            tree, sources = hybrid.tree, hybrid.sources
            q_of = {ids[node - 1]: q[row] for node, row in zip(drawn, rows, strict=True)}
        else:
            hybrid = draft_hybrid(root, session, spec, index, acceptance_rates)
            tree, sources = hybrid.tree, hybrid.sources
        buf = tree.buffers()
        start = target.length  # the root's position: it is not in the cache yet
        logits, hidden = target.forward(tree.tokens, start + buf.depths, buf.ancestor_mask)
        if sampled_chain and q_of is None:
            n, root = verify_chain(tree.tokens[1:].tolist(), q, logits, params, generator)
            accepted = list(range(1, n + 1))
        else:
            accepted, root = verify_tree(tree.tokens, tree.parents, logits, params, generator,
                                         q_of)
        path = torch.tensor([0, *accepted])  # node ids of root + accepted nodes, in order
        target.keep(start, path)  # accepted KV -> contiguous slots after the prefix
        new = tree.tokens[path[1:]].tolist() + [root]
        if session is not None:
            session.commit(hidden[path], torch.tensor(new))
        if spec.lookup:
            index.extend(new)
        if sources is not None:
            for k, v in accepted_by_source(sources, accepted).items():
                result.by_source[k] += v
        result.tokens += new
        result.accepted.append(len(accepted))
        result.tree_sizes.append(tree.tokens.numel() - 1)
        if any(t in eos for t in new[:-1]):
            break  # EOS inside the accepted path: plain decoding would have stopped there
    result.tokens = _finish(result.tokens, max_new_tokens, eos)
    return result
