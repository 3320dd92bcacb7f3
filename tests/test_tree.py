"""heads/tree.py: tree buffers on hand-made trees, refusal of bad paths/specs with helpful messages,
spec round trips, the static builder against a brute-force optimum, and `draft_tree` with a fake
deterministic expander (shape invariants, draft order, batched level-by-level expansion, EAGLE-2
selection against a brute-force re-implementation)."""

import itertools

import pytest
import torch

from treedraft.heads.tree import (
    DEFAULT_ACCEPTANCE_RATES,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    DraftTree,
    TreeSpec,
    build_static_paths,
    draft_tree,
    expected_acceptance_length,
    parse_tree_spec,
    paths_to_parents,
    tree_buffers,
)

T, F = True, False

# (paths, parents, ranks, depths, ancestor_mask, retrieve_indices)
HAND_MADE = {
    "chain3": (
        [[0], [0, 0], [0, 0, 0]],
        [-1, 0, 1, 2],
        [0, 0, 0, 0],
        [0, 1, 2, 3],
        [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]],
        [[0, 1, 2, 3]],
    ),
    "contract": (
        [[0], [1], [0, 0]],
        [-1, 0, 0, 1],
        [0, 0, 1, 0],
        [0, 1, 1, 2],
        [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, T, F, T]],
        [[0, 2, -1], [0, 1, 3]],
    ),
    "two_branches": (  # given out of order on purpose: node order is (len, path)
        [[0, 0, 0], [1, 0], [0], [0, 0], [1]],
        [-1, 0, 0, 1, 2, 3],
        [0, 0, 1, 0, 0, 0],
        [0, 1, 1, 2, 2, 3],
        [
            [T, F, F, F, F, F],
            [T, T, F, F, F, F],
            [T, F, T, F, F, F],
            [T, T, F, T, F, F],
            [T, F, T, F, T, F],
            [T, T, F, T, F, T],
        ],
        [[0, 2, 4, -1], [0, 1, 3, 5]],
    ),
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_hand_made_buffers(name):
    paths, parents, ranks, depths, mask, retrieve = HAND_MADE[name]
    assert paths_to_parents(paths) == (parents, ranks)
    b = tree_buffers(torch.tensor(parents), device=torch.device("cpu"))
    assert b.parents.tolist() == parents and b.ranks.tolist() == ranks
    assert b.depths.tolist() == depths
    assert b.ancestor_mask.dtype == torch.bool and b.ancestor_mask.tolist() == mask
    assert b.retrieve_indices.tolist() == retrieve


def test_root_only_buffers():
    b = tree_buffers([-1])
    assert b.ancestor_mask.tolist() == [[True]] and b.retrieve_indices.tolist() == [[0]]


@pytest.mark.parametrize(
    "parents, match",
    [
        ([], "at least its root"),
        ([0, 0], r"parents\[0\] must be -1"),
        ([-1, 1], r"parents\[1\] = 1 must be in \[0, 1\)"),
        ([-1, 0, 3, 0], "topologically ordered"),
        ([-1, -1], r"parents\[1\] = -1"),
        (torch.tensor([-1.0, 0.0]), "integer tensor"),
        ([-1, "a"], "must be integers"),
    ],
)
def test_bad_parents_refused(parents, match):
    with pytest.raises(ValueError, match=match):
        tree_buffers(parents)


@pytest.mark.parametrize(
    "paths, match",
    [
        ([], r"empty.*\[\[0\]\]"),
        ("[[0]]", "must be a list of lists"),
        ([[0], 1], r"path 1 must be a non-empty list"),
        ([[0], []], r"path \[\] must be a non-empty list"),
        ([[0], [-1]], r"path \[-1\]: ranks must be integers >= 0"),
        ([[0], [0.5]], "ranks must be integers"),
        ([[0, 0]], r"path \[0, 0\] has no parent: add \[0\]"),
        ([[1]], r"path \[1\] skips a sibling: add \[0\]"),
        ([[0], [0, 0], [0, 2], [0, 1, 0]], r"path \[0, 2\] skips a sibling: add \[0, 1\]"),
        ([[0], [1], [0]], r"path \[0\] appears twice"),
        (
            [[0] * d for d in range(1, MAX_TREE_DEPTH + 2)],
            r"17 deep > MAX_TREE_DEPTH=16; shorten it",
        ),
        ([[k] for k in range(MAX_TREE_NODES + 1)], "257 nodes > MAX_TREE_NODES = 256"),
    ],
)
def test_bad_paths_refused(paths, match):
    with pytest.raises(ValueError, match=match):
        paths_to_parents(paths)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("chain:5", TreeSpec("paths", paths=tuple((0,) * d for d in range(1, 6)))),
        ("[[0],[1],[0,0]]", TreeSpec("paths", paths=((0,), (1,), (0, 0)))),
        (" [[1], [0,0], [0]] ", TreeSpec("paths", paths=((0,), (1,), (0, 0)))),
        ("static:32", TreeSpec("static", num_nodes=32)),
        ("dynamic:60,6", TreeSpec("dynamic", num_nodes=60, depth=6)),
        ("dynamic:60,6,10", TreeSpec("dynamic", num_nodes=60, depth=6, topk=10)),
    ],
)
def test_parse_and_round_trip(text, expected):
    spec = parse_tree_spec(text)
    assert spec == expected
    assert parse_tree_spec(spec.to_string()) == spec


@pytest.mark.parametrize("text, nodes", [
    ("chain:3", 3), ("[[0]]", 1), ("dynamic:3,3,1", 3), ("dynamic:1,1,1", 1), ("static:1", 1),
    ("dynamic:1,1", 1), ("static:4", None), ("dynamic:10,3,3", None), ("[[0],[1]]", None),
    ("chain:3+lookup:2", None), ("lookup:4", None)])
def test_chain_nodes_names_the_specs_that_only_draft_chains(text, nodes):
    # these draw their drafts from the head's q at T > 0 (reference decoder and plugin)
    assert parse_tree_spec(text).chain_nodes == nodes


def test_to_string_canonical_forms():
    assert parse_tree_spec("[[0],[0,0]]").to_string() == "chain:2"
    assert parse_tree_spec("[[1],[0]]").to_string() == "[[0],[1]]"
    assert parse_tree_spec("dynamic:60,6,8").to_string() == "dynamic:60,6"


@pytest.mark.parametrize(
    "text, match",
    [
        ("chain:0", "K = 0 is out of range"),
        ("chain:17", "K = 17 is out of range"),
        ("dynamic:", "not a comma-separated list"),
        ("dynamic:60", "takes 2 or 3 integers, got 1"),
        ("foo:3", "unknown tree kind 'foo'"),
        ("chain", "not a known form"),
        ("static:-1", "NODES = -1 is out of range"),
        ("static:257", "NODES = 257 is out of range"),
        ("[[0],", "malformed JSON"),
        ("[[0,0]]", "has no parent"),
        ("dynamic:10,40", "DEPTH = 40 is out of range"),
        ("dynamic:4,6", "DEPTH = 6 > NODES = 4"),
        ("dynamic:200,3,4", r"NODES = 200 > 36 candidates"),
    ],
)
def test_bad_specs_refused(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_tree_spec(text)
    assert "accepted forms: 'chain:K'" in str(info.value)


def test_tree_spec_constructor_validates():
    with pytest.raises(ValueError, match="kind 'beam' unknown"):
        TreeSpec("beam")
    with pytest.raises(ValueError, match="takes `num_nodes` only"):
        TreeSpec("static", num_nodes=4, paths=((0,),))


# ----------------------------------------------------------------------------- static builder


def all_trees(num_nodes, depth, width):
    """Every valid tree (prefix-closed, contiguous sibling ranks) of exactly num_nodes nodes."""
    trees = {frozenset()}
    for _ in range(num_nodes):
        grown = set()
        for tree in trees:
            for parent in [(), *tree]:
                k = sum(1 for p in tree if p[:-1] == parent)
                if len(parent) < depth and k < width:
                    grown.add(tree | {parent + (k,)})
        trees = grown
    return trees


def rate_tables():
    yield [list(row[:3]) for row in DEFAULT_ACCEPTANCE_RATES[:3]]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # random tables, non-increasing in rank
        yield torch.rand(3, 3, generator=g).sort(dim=1, descending=True).values.tolist()


@pytest.mark.parametrize("table", list(rate_tables()))
def test_static_greedy_equals_brute_force_optimum(table):
    for n in range(1, 6):
        greedy = build_static_paths(table, n)
        assert len(greedy) == n and paths_to_parents(greedy)
        best = max(expected_acceptance_length(sorted(t), table) for t in all_trees(n, 3, 3))
        assert expected_acceptance_length(greedy, table) == pytest.approx(best, abs=1e-12)


def test_static_trees_are_nested_and_valid():
    trees = [build_static_paths(DEFAULT_ACCEPTANCE_RATES, n) for n in (1, 8, 64, 256)]
    assert trees[0] == [[0]]
    for small, big in itertools.pairwise(trees):
        assert {tuple(p) for p in small} <= {tuple(p) for p in big}
    assert len(paths_to_parents(trees[-1])[0]) == 257


def test_expected_acceptance_length_and_rate_errors():
    assert expected_acceptance_length([[0], [0, 0]], [[0.5], [0.5]]) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="beyond the rate table"):
        expected_acceptance_length([[0], [1]], [[0.5]])
    with pytest.raises(ValueError, match="allows only 1 nodes"):
        build_static_paths([[0.5]], 2)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        build_static_paths([[1.5]], 1)


# ----------------------------------------------------------------------------- drafting

VOCAB = 12


class TableExpander:
    """Deterministic draft: log p(child token | node) = table[depth(node), token(node)] ([V] row).

    Records every call and checks the Expander contract: each listed node is new, its ancestors
    were all expanded before, and the tree holds valid tokens for every node created so far."""

    def __init__(self, seed=0, max_depth=8):
        g = torch.Generator().manual_seed(seed)
        self.table = (2 * torch.randn(max_depth, VOCAB, VOCAB, generator=g)).log_softmax(-1)
        self.calls, self.expanded = [], set()

    def expand(self, tree: DraftTree, nodes):
        parents = tree.parents.tolist()
        assert len(tree.tokens) == len(parents) == len(tree.logprobs)
        assert (tree.tokens >= 0).all() and nodes
        depths = []
        for node in nodes:
            assert node not in self.expanded
            depth, a = 0, parents[node]
            while a != -1:
                assert a in self.expanded
                depth, a = depth + 1, parents[a]
            depths.append(depth)
        self.calls.append(list(nodes))
        self.expanded.update(nodes)
        return self.table[depths, tree.tokens[nodes]]  # [len(nodes), V]


def node_depths(tree):
    depths = [0]
    for p in tree.parents.tolist()[1:]:
        depths.append(depths[p] + 1)
    return depths


def check_tree(tree, expander, max_children=None, exact_topk=True):
    """Shape invariants, topological order, draft order, logprobs taken from the table."""
    n = len(tree.tokens)
    assert tree.tokens.shape == tree.parents.shape == tree.logprobs.shape == (n,)
    assert tree.tokens.dtype == tree.parents.dtype == torch.long
    b = tree.buffers()  # validates topological order
    depths = node_depths(tree)
    assert b.depths.tolist() == depths and tree.logprobs[0] == 0
    tokens = tree.tokens.tolist()
    for i in range(n):
        kids = tree.children(i)
        if not kids:
            continue
        row = expander.table[depths[i], tokens[i]]
        kid_tokens = [tokens[c] for c in kids]
        assert len(set(kid_tokens)) == len(kids)
        assert torch.equal(tree.logprobs[kids], row[kid_tokens])
        assert tree.logprobs[kids].tolist() == sorted(tree.logprobs[kids].tolist(), reverse=True)
        if exact_topk:
            assert kid_tokens == row.topk(len(kids)).indices.tolist()
        if max_children is not None:
            assert len(kids) <= max_children


def test_chain_draft_is_greedy_and_expands_each_non_leaf_once():
    for k in (1, 4):
        ex = TableExpander()
        tree = draft_tree(3, ex, parse_tree_spec(f"chain:{k}"))
        assert tree.parents.tolist() == list(range(-1, k))
        assert ex.calls == [[i] for i in range(k)]  # root + chain nodes except the leaf
        tok = 3
        for d, t in enumerate(tree.tokens.tolist()[1:]):
            tok = int(ex.table[d, tok].argmax())
            assert t == tok
        check_tree(tree, ex)


@pytest.mark.parametrize(
    "text", ["[[0],[1],[0,0]]", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]", "static:20"]
)
def test_fixed_shape_draft(text):
    spec = parse_tree_spec(text)
    ex = TableExpander(seed=1)
    tree = draft_tree(5, ex, spec, device=torch.device("cpu"))
    expected_paths = (
        build_static_paths(DEFAULT_ACCEPTANCE_RATES, 20) if spec.kind == "static" else spec.paths
    )
    parents, _ = paths_to_parents([list(p) for p in expected_paths])
    assert tree.parents.tolist() == parents and tree.tokens[0] == 5
    check_tree(tree, ex)
    # one call per level, listing exactly that level's non-leaf nodes
    depths, has_kids = node_depths(tree), {p for p in parents[1:]}
    levels = [
        [i for i in range(len(parents)) if depths[i] == d and i in has_kids]
        for d in range(max(depths))
    ]
    assert ex.calls == levels


def test_static_uses_given_rates():
    ex = TableExpander()
    wide = [[0.9, 0.8, 0.7, 0.6], [0.1]]
    tree = draft_tree(0, ex, TreeSpec("static", num_nodes=4), acceptance_rates=wide)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 0]


def brute_force_eagle2(table, root, num_nodes, depth, k):
    """Independent EAGLE-2: all explored candidates, then the top num_nodes by cumulative score."""
    pool, frontier = [], [((root,), 0.0)]
    for _ in range(depth):
        new = []
        for path, score in frontier:
            values, tokens = table[len(path) - 1, path[-1]].topk(k)
            new += [
                (path + (t,), score + v)
                for v, t in zip(values.tolist(), tokens.tolist(), strict=True)
            ]
        pool += new
        frontier = sorted(new, key=lambda e: -e[1])[:k]  # stable: ties keep creation order
    return {path for path, _ in sorted(pool, key=lambda e: -e[1])[:num_nodes]}


def token_paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [(tokens[0],)]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return set(paths[1:])


@pytest.mark.parametrize(
    "num_nodes, depth, topk, seed", [(60, 6, 8, 0), (10, 4, 3, 1), (3, 3, 4, 2), (15, 5, 2, 3)]
)
def test_dynamic_draft_matches_brute_force(num_nodes, depth, topk, seed):
    ex = TableExpander(seed=seed)
    tree = draft_tree(7, ex, TreeSpec("dynamic", num_nodes=num_nodes, depth=depth, topk=topk))
    assert len(tree.tokens) == num_nodes + 1 and max(node_depths(tree)) <= depth
    check_tree(tree, ex, max_children=topk, exact_topk=False)
    assert token_paths(tree) == brute_force_eagle2(ex.table, 7, num_nodes, depth, topk)
    assert ex.calls[0] == [0] and len(ex.calls) <= depth
    assert all(len(c) <= topk for c in ex.calls)
    # node order is canonical: (len, path) over sibling ranks, as for user-given paths
    assert paths_to_parents([list(p) for p in canonical(tree)])[0] == tree.parents.tolist()


def canonical(tree):
    ranks, parents, paths = tree.buffers().ranks.tolist(), tree.parents.tolist(), [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (ranks[i],))
    return paths[1:]


def test_dynamic_stops_expanding_when_selection_is_final():
    # Root 7 -> tokens 0, 1, 2 with prob ~1/3 each, then near-certain chains t -> t+1. The best 6
    # nodes (3 children + their chain successors) are known after 2 levels: depth 6 never explored.
    ex = TableExpander()
    probs = torch.ones_like(ex.table)
    for t in range(VOCAB):
        probs[:, t, (t + 1) % VOCAB] = 1e6
    probs[0, 7, 8], probs[0, 7, :3] = 1.0, 1e6
    ex.table = (probs / probs.sum(-1, keepdim=True)).log()
    tree = draft_tree(7, ex, TreeSpec("dynamic", num_nodes=6, depth=6, topk=4))
    assert len(ex.calls) == 2
    assert token_paths(tree) == {(7, a) for a in range(3)} | {(7, a, a + 1) for a in range(3)}
    assert token_paths(tree) == brute_force_eagle2(ex.table, 7, 6, 6, 4)


def test_expander_errors_are_reported():
    class Bad:
        def expand(self, tree, nodes):
            return torch.zeros(len(nodes) + 1, VOCAB)

    with pytest.raises(ValueError, match=r"expected \[1, V\]"):
        draft_tree(0, Bad(), parse_tree_spec("chain:2"))

    class Tiny:
        def expand(self, tree, nodes):
            return torch.zeros(len(nodes), 2).log_softmax(-1)

    with pytest.raises(ValueError, match="3 distinct children from a vocabulary of 2"):
        draft_tree(0, Tiny(), parse_tree_spec("[[0],[1],[2]]"))
