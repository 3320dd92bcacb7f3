"""Prompt lookup as a tree source (heads/lookup.py) and hybrid tree specs.

* `LookupIndex` proposes the continuations of the history's longest suffix matches, ranked by
  match length, count and recency; incremental indexing gives the same proposals as indexing the
  whole history at once; a history that is not an extension (preemption) is re-indexed.
* `trie_limit` keeps the node budget counting shared prefixes once.
* `merge_trees` reuses head nodes for equal lookup tokens, marks sources, and returns a
  depth-ordered tree whose buffers verification accepts.
* Spec grammar: '+lookup:N' and 'lookup:N' round-trip; bad budgets and suffixes are refused
  with the accepted forms in the message.
* Exactness of hybrid trees in the reference decoder is in tests/test_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from treedraft.heads.lookup import (
    HEAD,
    LOOKUP,
    LookupIndex,
    accepted_by_source,
    graft_lookup,
    merge_trees,
    trie_limit,
)
from treedraft.heads.tree import DraftTree, parse_tree_spec, tree_buffers


def test_longest_match_first_then_count_then_recency():
    idx = LookupIndex(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    idx.extend([7, 1, 2, 3, 9, 1, 2, 4, 5, 2, 4, 1, 2])
    # suffix [1, 2]: '1 2' ends at 3 and 7 (not counting the suffix itself at 13);
    # '7 1 2'/'9 1 2' do not match '4 1 2' -> n=2 continuations [3 9 1 2], [4 5 2 4 1 2]
    # n=1 ('2'): ends at 3, 7, 10 -> [4 1 2] is new
    props = idx.propose(budget=100, max_depth=4, max_candidates=8)
    assert props == [[4, 5, 2, 4], [3, 9, 1, 2], [4, 1, 2]]  # n=2 by recency, then n=1
    idx2 = LookupIndex(min_n=1, max_n=3)
    idx2.extend([5, 6, 9, 5, 6, 9, 5, 6, 8, 1, 5, 6])  # '5 6' -> 9 twice, 8 once
    assert idx2.propose(budget=100, max_depth=1) == [[9], [8]]  # count beats recency
    # the match length of the best proposal (what "auto" prices lookup by), 0 without one
    assert idx.match_length() == 2 and idx2.match_length() == 2
    idx3 = LookupIndex(min_n=1, max_n=4)
    idx3.extend([1, 2, 3, 4, 5, 1, 2, 3, 4])
    assert idx3.match_length() == 4 and idx3.propose(8)[0] == [5, 1, 2, 3, 4]
    idx3.extend([6])  # '6' never occurred before
    assert idx3.match_length() == 0 and idx3.propose(8) == []
    assert LookupIndex().match_length() == 0


def test_match_length_noted_by_extend_is_the_longest_earlier_suffix_match():
    """`extend` notes the match length as it indexes; it must equal the definition (the longest
    n in min_n..max_n whose last n tokens occurred earlier), after every token, across syncs
    and a re-index, for min_n > 1 too."""
    def longest(hist, lo, hi):
        return max((n for n in range(lo, min(hi, len(hist) - 1) + 1)
                    if any(hist[p - n:p] == hist[-n:] for p in range(n, len(hist)))), default=0)

    hist = torch.randint(0, 4, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    for lo, hi in ((1, 4), (2, 3)):
        idx = LookupIndex(min_n=lo, max_n=hi)
        seen = set()
        for i in range(1, len(hist) + 1):
            idx.sync(hist[:i])
            assert idx.match_length() == longest(hist[:i], lo, hi), (lo, hi, i)
            seen.add(idx.match_length())
        assert seen == {0, *range(lo, hi + 1)}  # every answer occurred: the test can fail
        idx.sync([3, 3, 1])  # not an extension: re-indexed from scratch
        assert idx.match_length() == longest([3, 3, 1], lo, hi)


def test_incremental_index_equals_whole_history_and_resyncs():
    hist = torch.randint(0, 6, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = LookupIndex()
    whole.extend(hist)
    inc = LookupIndex()
    for i in range(0, len(hist), 7):
        inc.sync(hist[: i + 7])
    assert inc.tokens == hist and inc._ends == whole._ends
    assert inc.propose(16) == whole.propose(16) != []
    other = hist[:50] + [5, 5, 5]  # not an extension of what is indexed: start over
    inc.sync(other)
    fresh = LookupIndex()
    fresh.extend(other)
    assert inc.tokens == other and inc._ends == fresh._ends
    assert LookupIndex().propose(8) == []  # empty history: nothing to propose
    with pytest.raises(ValueError, match="min_n <= max_n"):
        LookupIndex(min_n=3, max_n=2)


def test_trie_limit_counts_shared_prefixes_once():
    chains = [[1, 2, 3], [1, 2, 4], [5, 6]]
    assert trie_limit(chains, 100) == chains
    assert trie_limit(chains, 4) == [[1, 2, 3], [1, 2, 4]]  # 1,2,3 + 4: [5] does not fit
    assert trie_limit(chains, 2) == [[1, 2], [1, 2]]
    assert trie_limit(chains, 0) == []


def _tree(tokens, parents):
    return DraftTree(torch.tensor(tokens), torch.tensor(parents),
                     torch.linspace(0, -1, len(tokens)))


def test_merge_reuses_head_nodes_marks_sources_and_orders_by_depth():
    #           root  a   b   a.c
    head = _tree([10, 11, 12, 13], [-1, 0, 0, 1])
    merged = merge_trees(head, 10, [[11, 13, 14], [15]])
    t, p = merged.tree.tokens.tolist(), merged.tree.parents.tolist()
    # depth 1: 11 (head+lookup), 12 (head), 15 (lookup); depth 2: 13 (both); depth 3: 14
    assert t == [10, 11, 12, 15, 13, 14]
    assert p == [-1, 0, 0, 0, 1, 4]
    assert merged.sources.tolist() == [0, HEAD | LOOKUP, HEAD, LOOKUP, HEAD | LOOKUP, LOOKUP]
    assert merged.tree.logprobs[3] == 0 and merged.tree.logprobs[1] == head.logprobs[1]
    buf = tree_buffers(merged.tree.parents)  # valid, topologically ordered
    assert buf.depths.tolist() == [0, 1, 1, 1, 2, 3]
    assert accepted_by_source(merged.sources, [1, 4, 5]) == {"head": 0, "lookup": 1, "both": 2}
    alone = merge_trees(None, 10, [[1, 2], [1, 3]])
    assert alone.tree.tokens.tolist() == [10, 1, 2, 3] and alone.tree.parents.tolist() == [-1, 0, 1, 1]
    assert alone.sources.tolist() == [0, LOOKUP, LOOKUP, LOOKUP]
    with pytest.raises(ValueError, match="root"):
        merge_trees(head, 99, [])


def test_graft_lookup_keeps_each_chain_node_first_among_its_siblings():
    """A chain drawn from q (10 -> 11 -> 12) with the history's continuations after "7 10"
    grafted (11 15 16 7 10, the most recent, then 17): the chain's nodes (tested against q)
    come first among their siblings, in depth order; the lookup token 11 merges into the
    chain's node."""
    index = LookupIndex()
    index.extend([7, 10, 17, 9, 7, 10, 11, 15, 16, 7, 10])
    assert index.propose(6) == [[11, 15, 16, 7, 10], [17]]
    hybrid, nodes = graft_lookup(_tree([10, 11, 12], [-1, 0, 1]), index, 6)
    t, p = hybrid.tree.tokens.tolist(), hybrid.tree.parents.tolist()
    assert t == [10, 11, 17, 12, 15, 16, 7, 10] and p == [-1, 0, 0, 1, 1, 4, 5, 6]
    assert nodes == [1, 3]  # 11 (head and lookup), 12 (head, before the lookup sibling 15)
    assert hybrid.sources[1] == HEAD | LOOKUP and hybrid.sources[3] == HEAD
    assert graft_lookup(_tree([10, 11], [-1, 0]), None, 4)[1] == [1]  # no index: the chain
    with pytest.raises(ValueError, match="root"):
        graft_lookup(_tree([5, 11], [-1, 0]), index, 4)
    # a sampled fixed-shape tree (10 -> 11, 12; 11 -> 13): its nodes keep their order, first
    # among their siblings; the lookup chain's 11 merges into node 1, 15 follows 11's child 13
    hybrid, nodes = graft_lookup(_tree([10, 11, 12, 13], [-1, 0, 0, 1]), index, 6)
    t, p = hybrid.tree.tokens.tolist(), hybrid.tree.parents.tolist()
    assert t == [10, 11, 12, 17, 13, 15, 16, 7, 10] and p == [-1, 0, 0, 0, 1, 1, 5, 6, 7]
    assert nodes == [1, 2, 4]
    with pytest.raises(ValueError, match="depth-ordered"):  # node 3 (depth 1) after depth 2
        graft_lookup(_tree([10, 11, 12, 13], [-1, 0, 1, 0]), index, 4)


@pytest.mark.parametrize("spec, nodes", [("dynamic:48,8+lookup:16", 64), ("lookup:16", 16),
                                         ("chain:4+lookup:8", 12), ("[[0],[1]]+lookup:3", 5)])
def test_hybrid_specs_round_trip(spec, nodes):
    s = parse_tree_spec(spec)
    assert s.to_string() == spec and parse_tree_spec(s.to_string()) == s
    assert s.max_nodes == nodes and not s.is_chain
    assert s.has_head == (not spec.startswith("lookup"))
    if s.has_head:
        assert s.head_spec.lookup == 0 and s.head_spec.max_nodes == nodes - s.lookup


@pytest.mark.parametrize("bad, why", [
    ("lookup:0", "lookup N = 0"), ("chain:3+lookup:-1", "lookup N = -1"),
    ("chain:3+lookup:1.5", "'1.5' is not"), ("chain:3+foo:2", "unknown suffix 'foo:2'"),
    ("dynamic:250,6+lookup:16", "= 266 > MAX_TREE_NODES"), ("lookup:3+lookup:2", "alone"),
    ("chain:2+lookup:2+lookup:1", "at most one"), ("lookup:", "integers"),
])
def test_bad_lookup_specs_are_refused_with_the_grammar(bad, why):
    with pytest.raises(ValueError, match="lookup:N") as e:
        parse_tree_spec(bad)
    assert why in str(e.value)
