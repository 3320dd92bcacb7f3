"""Prompt lookup as a tree source, and hybrid trees (the head's tree + lookup branches).

Features:
- `LookupIndex`: an incremental n-gram index over one request's token history (prompt + output
  so far). `extend` indexes only the new tokens (min_n..max_n keys per token), so a step costs
  O(new tokens * n) to index and O(n) dict look-ups to propose, whatever the history length.
- `LookupIndex.propose`: continuation chains after the history's longest suffix matches: for
  n = max_n down to min_n, each of the last MAX_OCCURRENCES earlier occurrences of the last n
  tokens gives the tokens that followed it. Distinct continuations are ranked by (match length n, occurrences, recency) and
  merged into a trie within a node budget (a shared prefix costs its nodes once).
- `merge_trees`: one tree from the head's `DraftTree` and lookup chains: a lookup token equal
  to an existing child reuses that node, new nodes are appended; the result is re-ordered by
  depth (stable), so it is topologically ordered with every node's siblings in draft order
  (head children first, by the head's rank; then lookup children, by lookup rank) and its
  depth-sorted prefixes are trees (what a node budget cut keeps). `sources` marks each node
  HEAD, LOOKUP or both (bit flags), so metrics can tell which source produced an accepted path.
- `lookup_tree`: lookup alone, as a DraftTree (no head).

Verification does not care where a node came from: greedy follows the target's argmax, sampled
verification tries children in draft order as one-hot proposals (heads/sampling.py), exact for
any tree. Lookup proposals carry log-prob 0 (a deterministic proposal). At T > 0 a head chain
or fixed-shape tree is drawn from the head's q and the lookup nodes grafted after it
(`graft_lookup`): each head node is tested against the q it was drawn from, the lookup nodes as
one-hot proposals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import MAX_TREE_DEPTH, Device, DraftTree, validate_parents

HEAD, LOOKUP = 1, 2  # node source bits; HEAD | LOOKUP = both proposed it
SOURCE_NAMES = {HEAD: "head", LOOKUP: "lookup", HEAD | LOOKUP: "both"}
SOURCES = tuple(SOURCE_NAMES.values())  # labels of accepted-by-source counts
DEFAULT_MIN_N, DEFAULT_MAX_N = 1, 4  # n-gram lengths matched (longest first)
MAX_OCCURRENCES = 32  # most recent occurrences read per n-gram: bounds a step's cost


class LookupIndex:
    """n-gram -> end positions over one token history; append-only, rewound on preemption."""

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup n-gram lengths need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # (n-gram) -> positions p where tokens[p-n:p] == n-gram, ascending (p = continuation start)
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._match = 0  # match_length of the history as it is (noted by `extend`)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the history and index the n-grams that end at each of them (and
        note the last one's match length on the way: `match_length` is then O(1))."""
        toks, ends, match = self.tokens, self._ends, self._match
        for t in tokens:
            toks.append(int(t))
            end = len(toks)
            match = 0
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(toks[end - n:end])
                seen = ends.get(key)
                if seen is None:
                    ends[key] = [end]
                else:  # occurred before, ending earlier: a continuation follows it
                    match = n if n < end else match
                    seen.append(end)
        self._match = match

    def sync(self, history: Sequence[int]) -> None:
        """Make the indexed history equal `history` (new tokens appended; a history that is not
        an extension of ours, e.g. after preemption, is re-indexed from scratch)."""
        n = len(self.tokens)
        if len(history) < n or (n and (history[n - 1] != self.tokens[-1]
                                       or history[0] != self.tokens[0])):
            self.tokens, self._ends, self._match = [], {}, 0
            n = 0
        new = history[n:]
        self.extend(new.tolist() if hasattr(new, "tolist") else new)  # numpy: ints at once

    def match_length(self) -> int:
        """The longest n (min_n..max_n) whose last n tokens occurred earlier in the history with
        a continuation: what `propose`'s best chain is matched on; 0 when it has none."""
        return self._match

    def propose(self, budget: int, max_depth: int = MAX_TREE_DEPTH,
                max_candidates: int = 8) -> list[list[int]]:
        """Up to `max_candidates` distinct continuation chains (each <= max_depth tokens),
        best first, whose trie has at most `budget` nodes."""
        toks, L = self.tokens, len(self.tokens)
        found: dict[tuple[int, ...], tuple[int, set[int]]] = {}  # cont -> (n, start positions)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            for p in self._ends.get(tuple(toks[L - n:]), ())[-MAX_OCCURRENCES:]:
                if p >= L:  # the suffix itself: its continuation is what we want to know
                    continue
                cont = tuple(toks[p:p + max_depth])
                found.setdefault(cont, (n, set()))[1].add(p)  # n: its longest match
            if len(found) >= max_candidates:
                break
        ranked = sorted(found, key=lambda c: (-found[c][0], -len(found[c][1]), -max(found[c][1])))
        return trie_limit(ranked[:max_candidates], budget)


def trie_limit(chains: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Chains in order, each cut so that their trie (shared prefixes once) has <= budget nodes."""
    trie: set[tuple[int, ...]] = set()
    out = []
    for chain in chains:
        kept = []
        for t in chain:
            key = (*kept, t)
            if key not in trie:
                if len(trie) == budget:
                    break
                trie.add(key)
            kept.append(t)
        if kept:
            out.append(kept)
    return out


@dataclass
class HybridTree:
    tree: DraftTree
    sources: torch.Tensor  # [N+1] int8 HEAD/LOOKUP bits (root: 0)

    @classmethod
    def of_head(cls, tree: DraftTree) -> HybridTree:
        """A tree the head drafted alone: every node but the root from the head."""
        sources = torch.full_like(tree.tokens, HEAD, dtype=torch.int8)
        sources[0] = 0
        return cls(tree, sources)


def merge_trees(head_tree: DraftTree | None, root_token: int, chains: Sequence[Sequence[int]],
                device: Device = None) -> HybridTree:
    """The head's tree (or just the root) plus lookup `chains` below the root, as one tree.

    Node ids are re-ordered by depth (stable): parents before children, siblings in draft order
    (head nodes first, then lookup nodes in chain order), depth-sorted prefixes are trees."""
    if head_tree is not None:
        tokens = head_tree.tokens.tolist()
        parents = head_tree.parents.tolist()
        logprobs = head_tree.logprobs.tolist()
        if tokens[0] != root_token:
            raise ValueError(f"head tree root {tokens[0]} != root token {root_token}")
    else:
        tokens, parents, logprobs = [int(root_token)], [-1], [0.0]
    sources = [0] + [HEAD] * (len(tokens) - 1)
    child: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in
                                         enumerate(zip(parents, tokens, strict=True)) if i}
    for chain in chains:
        node = 0
        for t in chain:
            t = int(t)
            nxt = child.get((node, t))
            if nxt is None:
                nxt = child[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
                logprobs.append(0.0)
                sources.append(0)
            sources[nxt] |= LOOKUP
            node = nxt
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    if max(depth) > MAX_TREE_DEPTH:
        raise ValueError(f"merged tree is {max(depth)} deep > MAX_TREE_DEPTH={MAX_TREE_DEPTH}")
    order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
    new_id = {old: new for new, old in enumerate(order)}

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return HybridTree(
        tree=DraftTree(tokens=t([tokens[i] for i in order], torch.long),
                       parents=t([-1] + [new_id[parents[i]] for i in order[1:]], torch.long),
                       logprobs=t([logprobs[i] for i in order], torch.float32)),
        sources=t([sources[i] for i in order], torch.int8),
    )


def graft_lookup(tree: DraftTree, index: LookupIndex | None, n: int,
                 device: Device = None) -> tuple[HybridTree, list[int]]:
    """A depth-ordered tree the head drew from its q (heads.sampling.draft_chains, T > 0: a
    chain; `draft_sampled_trees`: a fixed shape) with up to `n` lookup nodes from `index` merged
    in (`merge_trees`): the hybrid tree and the ids in it of the head's nodes 1..N, in their
    order (node i of `tree` is node ids[i - 1] of the hybrid). Head nodes stay first among their
    siblings, in their order, which `verify_tree`'s q needs; a lookup token equal to a head
    node's merges into it."""
    root, parents = int(tree.tokens[0]), validate_parents(tree.parents)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    if depth != sorted(depth):
        raise ValueError(f"graft_lookup takes a depth-ordered tree (depths non-decreasing in "
                         f"node order), got parents {parents}")
    _check_history(index, root)
    hybrid = merge_trees(tree, root, index.propose(n) if index is not None and n else [],
                         device)
    # merge_trees orders by (depth, id), stable: a depth-ordered head tree keeps its order
    return hybrid, [i for i, s in enumerate(hybrid.sources.tolist()) if s & HEAD]


def _check_history(index: LookupIndex | None, root: int) -> None:
    """A lookup index proposes what follows its history, which must end with the tree's root."""
    if index is not None and index.tokens and index.tokens[-1] != root:
        raise ValueError(f"lookup history ends with {index.tokens[-1]}, not the root {root}")


def accepted_by_source(sources: torch.Tensor | Sequence[int], accepted: Sequence[int]) -> dict:
    """Accepted draft tokens of one step counted by source: {'head': a, 'lookup': b, 'both': c}."""
    src = sources.tolist() if isinstance(sources, torch.Tensor) else list(sources)
    out = dict.fromkeys(SOURCES, 0)
    for node in accepted:
        out[SOURCE_NAMES[src[node]]] += 1
    return out


def draft_hybrid(root_token: int, expander, spec, index: LookupIndex | None,
                 acceptance_rates=None, device: Device = None) -> HybridTree:
    """The tree `spec` asks for: the head's tree (if any) plus up to spec.lookup lookup nodes
    proposed from `index` (whose history must end with `root_token`; None without lookup)."""
    return draft_hybrids([(root_token, expander, index)], spec, acceptance_rates, device)[0]


def draft_hybrids(jobs, spec, acceptance_rates=None, device: Device = None) -> list[HybridTree]:
    """`draft_hybrid` for several (root_token, expander, index) jobs (one per request): the
    head's trees drafted together (heads.tree.draft_trees: a tree level of every request in one
    head forward), the lookup chains grafted per request (none for a job whose index is None)."""
    from .tree import draft_trees

    if spec.lookup:
        for root, _, index in jobs:
            _check_history(index, int(root))
    head_trees = (draft_trees([(root, e) for root, e, _ in jobs], spec.head_spec,
                              acceptance_rates, device)
                  if spec.has_head else [None] * len(jobs))
    out = []
    for (root, _, index), head_tree in zip(jobs, head_trees, strict=True):
        if not spec.lookup or index is None:  # the head's tree as drafted (depth-ordered)
            out.append(HybridTree.of_head(head_tree) if head_tree is not None
                       else merge_trees(None, root, [], device))
        else:
            out.append(merge_trees(head_tree, root, index.propose(spec.lookup), device))
    return out
