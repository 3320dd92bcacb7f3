"""heads/sampling.py: `process_logits` against an independent float64 implementation of vLLM's
sampler semantics; EXACTNESS of tree verification by enumeration (the distribution of the first
one and two committed tokens under the acceptance rule equals the target's, TV <= 1e-6, on many
random trees, vocabularies and sampling settings); a Monte Carlo check that `verify_tree` follows
that rule; greedy verification on hand-made trees; seed reproducibility; input validation."""

import itertools
import math

import pytest
import torch

from treedraft.heads.sampling import (
    DRAW_BLOCK,
    SamplingParams,
    _fallback_token,
    draft_sampled_trees,
    draw,
    draw_rows,
    draw_without_replacement,
    make_generator,
    process_logits,
    sample,
    verify_chain,
    verify_tree,
)

# ----------------------------------------------------------------------------- process_logits


def softmax(x):
    top = max(x)
    e = [math.exp(v - top) if v != -math.inf else 0.0 for v in x]
    return [v / sum(e) for v in e]


def reference_probs(row, params):
    """Plain-Python float64 vLLM sampler: greedy, temperature, top-k, top-p, softmax."""
    v = len(row)
    if params.temperature < 1e-5:
        best = row.index(max(row))  # first index among ties
        return [float(i == best) for i in range(v)]
    x = [z / params.temperature for z in row]
    if 0 < params.top_k < v:
        kth = sorted(x, reverse=True)[params.top_k - 1]
        x = [z if z >= kth else -math.inf for z in x]
    if params.top_p < 1:
        p = softmax(x)
        keep, mass_above = set(), 0.0
        for i in sorted(range(v), key=lambda i: (-x[i], i)):  # ties: lower token id first
            if mass_above < params.top_p or not keep:  # keep iff mass strictly above < top_p
                keep.add(i)
            mass_above += p[i]
        x = [z if i in keep else -math.inf for i, z in enumerate(x)]
    return softmax(x)


PARAM_GRID = [
    SamplingParams(temperature=t, top_k=k, top_p=p)
    for t, k, p in itertools.product(
        (0.0, 0.7, 1.0, 1.6), (0, -1, 1, 3, 8, 10), (1.0, 0.93, 0.6, 0.35)
    )
]


@pytest.mark.parametrize("ties", [False, True])
def test_process_logits_matches_reference(ties):
    g = torch.Generator().manual_seed(int(ties))
    logits = 2 * torch.randn(2, 3, 8, generator=g)  # batched [..., V]
    if ties:
        logits = torch.randint(-2, 3, (2, 3, 8), generator=g) * 0.5
    for params in PARAM_GRID:
        probs = process_logits(logits, params)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        want = torch.tensor([reference_probs(r, params) for r in logits.reshape(-1, 8).tolist()])
        torch.testing.assert_close(probs.reshape(-1, 8).double(), want.double(), atol=1e-6, rtol=0)


def test_process_logits_leaves_input_alone_and_accepts_half():
    logits = torch.randn(5, 9).half()
    before = logits.clone()
    probs = process_logits(logits, SamplingParams(0.8, top_k=4, top_p=0.9))
    assert torch.equal(logits, before) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_sampling_params_validation():
    assert SamplingParams().greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    for bad, match in [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_sample_greedy_seeded_and_restricted():
    logits = torch.tensor([0.1, 2.0, 2.0, -1.0])
    assert sample(logits, SamplingParams()) == 1  # first index among ties
    params = SamplingParams(temperature=1.0, top_k=2, seed=7)
    draws = [sample(logits, params, make_generator(params)) for _ in range(5)]
    assert len(set(draws)) == 1 and draws[0] in (1, 2)  # same seed, same draw; only top-2
    gen = make_generator(params)
    assert {sample(logits, params, gen) for _ in range(200)} == {1, 2}
    with pytest.raises(ValueError, match=r"one row of logits \[V\]"):
        sample(logits[None], params)


# ----------------------------------------------------------------------------- exactness


def random_tree(g, vocab, depth):
    """Tokens and children of a random tree: root has 2-3 children, others 0-2; distinct siblings."""
    tokens, parents, depths = [int(torch.randint(vocab, (), generator=g))], [-1], [0]
    i = 0
    while i < len(tokens):
        low, high = (2, 4) if i == 0 else (0, 3)
        m = int(torch.randint(low, high, (), generator=g)) if depths[i] < depth else 0
        for t in torch.randperm(vocab, generator=g)[:m].tolist():
            tokens.append(t)
            parents.append(i)
            depths.append(depths[i] + 1)
        i += 1
    children = [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]
    return tokens, parents, children


def emission(p, child_tokens, renormalise=True):
    """The acceptance rule at one node, enumerated: P(child j accepted) for each j in draft order
    (all earlier children rejected, then accept with the renormalised residual p'(c_j)) and
    P(no child accepted and the bonus token is x) for each x."""
    residual, reach, accept = list(p), 1.0, []
    for tok in child_tokens:
        mass = sum(residual)
        q = (residual[tok] / mass if mass > 0 else 0.0) if renormalise else residual[tok]
        accept.append(reach * q)
        reach *= 1 - q
        residual[tok] = 0.0
    mass = sum(residual)
    return accept, [reach * r / mass if mass > 0 else 0.0 for r in residual]


def committed_at(node, probs, tokens, children, renormalise=True):
    """Distribution of the token committed at `node` (an accepted child's token or the bonus)."""
    accept, dist = emission(probs[node], [tokens[c] for c in children[node]], renormalise)
    for a, c in zip(accept, children[node], strict=True):
        dist[tokens[c]] += a
    return dist


def analytic_first_two(probs, off_probs, tokens, children, renormalise=True):
    """P(first committed token), P(first two); after a bonus token the next step is off-tree."""
    v, kids = len(probs[0]), children[0]
    accept, bonus = emission(probs[0], [tokens[c] for c in kids], renormalise)
    first = committed_at(0, probs, tokens, children, renormalise)
    joint = [[bonus[x1] * off_probs[x1][x2] for x2 in range(v)] for x1 in range(v)]
    for a, c in zip(accept, kids, strict=True):
        second = committed_at(c, probs, tokens, children, renormalise)
        for x2 in range(v):
            joint[tokens[c]][x2] += a * second[x2]
    return first, joint


def target_first_two(probs, off_probs, tokens, children):
    child_of = {tokens[c]: c for c in children[0]}
    rows = [probs[child_of[x]] if x in child_of else off_probs[x] for x in range(len(probs[0]))]
    return probs[0], [
        [probs[0][x1] * rows[x1][x2] for x2 in range(len(rows))] for x1 in range(len(rows))
    ]


def tv(a, b):
    return 0.5 * sum(
        abs(x - y) for x, y in zip(itertools.chain(*a), itertools.chain(*b), strict=True)
    )


def normalised(probs: torch.Tensor):
    p = probs.double()
    return (p / p.sum(-1, keepdim=True)).tolist()


EXACT_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=4, top_p=0.7),
    SamplingParams(temperature=0.0),
]


def random_case(g):
    vocab = int(torch.randint(5, 9, (), generator=g))
    tokens, parents, children = random_tree(
        g, vocab, depth=int(torch.randint(2, 4, (), generator=g))
    )
    logits = 1.5 * torch.randn(len(tokens), vocab, generator=g)  # target logits per node
    off_logits = 1.5 * torch.randn(vocab, vocab, generator=g)  # next step after off-tree token x1
    return tokens, parents, children, logits, off_logits


def test_verification_rule_is_exact_by_enumeration():
    g = torch.Generator().manual_seed(0)
    worst, buggy = 0.0, 0.0
    for _, params in itertools.product(range(40), EXACT_PARAMS):
        tokens, _, children, logits, off_logits = random_case(g)
        probs, off = (
            normalised(process_logits(logits, params)),
            normalised(process_logits(off_logits, params)),
        )
        first, joint = analytic_first_two(probs, off, tokens, children)
        want_first, want_joint = target_first_two(probs, off, tokens, children)
        worst = max(worst, tv([first], [want_first]), tv(joint, want_joint))
        # Negative control: without renormalisation after a rejection the rule is biased.
        buggy = max(
            buggy, tv(analytic_first_two(probs, off, tokens, children, False)[1], want_joint)
        )
    assert worst <= 1e-6
    assert buggy > 0.05  # the enumeration does catch a wrong rule


def drawn_emission(p, q, k, one_hot=(), renormalise_q=True):
    """The rule at one node for children drawn without replacement from q (`draft_sampled_trees`),
    enumerated: over every ordered draw of min(k, |support of q|) children (the rest fillers:
    tokens outside q's support, one-hot), then one-hot children `one_hot` (lookup tokens; one
    equal to a drawn token is that node), the distribution of the token the node emits."""
    V, out = len(p), [0.0] * len(p)
    support = [x for x in range(V) if q[x] > 0]
    n = min(k, len(support))
    fillers = [x for x in range(V) if q[x] == 0][: k - n]
    for seq in itertools.permutations(support, n):
        w, left = 1.0, 1.0  # P(this ordered draw)
        for x in seq:
            w, left = w * q[x] / left, left - q[x]
        r, reach = list(p), 1.0
        for i, x in enumerate(seq):
            qi = [0.0 if y in seq[:i] else q[y] for y in range(V)]
            if renormalise_q:
                qi = [v / sum(qi) for v in qi]
            pn = [v / sum(r) for v in r] if sum(r) > 0 else r
            a = min(1.0, pn[x] / qi[x])
            out[x] += w * reach * a
            reach *= 1 - a
            r = [max(0.0, pn[y] - qi[y]) for y in range(V)]
        for t in fillers + [t for t in one_hot if t not in seq]:
            mass = sum(r)
            a = r[t] / mass if mass > 0 else 0.0
            out[t] += w * reach * a
            reach *= 1 - a
            r[t] = 0.0
        mass = sum(r)
        for y in range(V):
            out[y] += w * reach * (r[y] / mass if mass > 0 else 0.0)
    return out


def test_drawn_children_rule_is_exact_by_enumeration():
    """Children drawn without replacement from q, tested recursively (accept x_i with
    min(1, p_i/q_i), p_{i+1} = norm(max(0, p_i - q_i)), q_i without the earlier draws), then
    fillers and lookup tokens one-hot, then the bonus: the node emits exactly p (TV <= 1e-9) for
    1-4 drawn children, q with less support than k, lookup tokens equal to drawn ones or not.
    Negative control: not renormalising q after a draw is biased."""
    g = torch.Generator().manual_seed(0)
    worst, buggy = 0.0, 0.0
    for case in range(150):
        V = int(torch.randint(4, 7, (), generator=g))
        p = normalised(torch.rand(V, generator=g) ** 3)
        q = torch.rand(V, generator=g) * (torch.rand(V, generator=g) > 0.25)
        q[int(torch.randint(V, (), generator=g))] = 0.5  # at least one token
        q = normalised(q)
        k = 1 + case % 4
        lookup = tuple(torch.randperm(V, generator=g)[: case % 3].tolist())
        worst = max(worst, tv([drawn_emission(p, q, k, lookup)], [p]))
        if k > 1:
            buggy = max(buggy, tv([drawn_emission(p, q, k, lookup, renormalise_q=False)], [p]))
    assert worst <= 1e-9
    assert buggy > 0.01  # the enumeration catches a wrong rule


def assert_counts_match(counts: torch.Tensor, want, n: int) -> None:
    """n samples counted in `counts` [V, V] follow the joint distribution `want` [x1][x2]."""
    expected = n * torch.tensor(want)
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    df = int(cells.sum()) - 1
    assert chi2 < df + 4 * math.sqrt(2 * df), (chi2, df)  # ~ p < 1e-4 under the null
    assert tv((counts / n).tolist(), want) < 0.05  # sampling noise here is ~0.02


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """`draw` (the inverse CDF of one uniform): unnormalised weights with zeros at both ends and
    inside; chi-square against w / sum(w); a seeded generator repeats its draws."""
    w = torch.tensor([0.0, 0.3, 0.0, 1e-3, 2.0, 0.7, 0.0, 0.0])
    g = torch.Generator().manual_seed(5)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(w, g) for _ in range(n)]), minlength=len(w))
    assert counts[w == 0].sum() == 0, counts
    want = (w / w.sum()).double()
    assert_counts_match(counts.float()[None], want[None].tolist(), n)
    a = [draw(w, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert a == [draw(w, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert draw(torch.tensor([0.0, 0.0, 1e-30]), g) == 2  # all the mass on the last index
    with pytest.raises(ValueError, match="positive sum"):
        draw(torch.zeros(4), g)
    with pytest.raises(ValueError, match=r"\[V\]"):
        draw(torch.ones(2, 4), g)


def test_draw_rows_of_no_rows_is_empty():
    out = draw_rows(torch.empty(0, 49152), torch.empty(0, dtype=torch.float64))
    assert out.shape == (0,) and out.dtype == torch.long


def test_draw_rows_inverts_the_cdf_exactly_across_blocks():
    """`draw_rows` at a grid of M uniforms (k + 0.5) / M: index i is drawn for the grid points in
    its CDF interval, i.e. M * p_i of them up to one at each end. Weights span several blocks with
    a partial last block (padding), a whole zero block, zeros at block edges, mass 1e-6 and a row
    scale of 1e3; rows of zeros give -1."""
    V = 3 * DRAW_BLOCK + 88
    g = torch.Generator().manual_seed(3)
    w = torch.rand(V, generator=g) ** 8 * 1e3
    w[DRAW_BLOCK : 2 * DRAW_BLOCK] = 0  # a whole zero block
    w[[0, DRAW_BLOCK - 1, 2 * DRAW_BLOCK, V - 1]] = 0  # zeros at block edges and at the end
    w[7] = 1e-6 * w.sum()
    p = (w.double() / w.double().sum())
    M = 60000
    counts = torch.zeros(V, dtype=torch.long)
    for k in range(0, M, 10000):
        u = (torch.arange(k, k + 10000, dtype=torch.float64) + 0.5) / M
        counts += torch.bincount(draw_rows(w.expand(10000, V), u), minlength=V)
    assert counts.sum() == M and counts[w == 0].sum() == 0
    assert (counts - M * p).abs().max() <= 1.01, (counts - M * p).abs().max()
    # rows are independent: row n uses uniforms[n]; a zero row gives -1
    two = torch.stack([w, torch.zeros(V)])
    assert draw_rows(two, torch.tensor([0.0, 0.5], dtype=torch.float64)).tolist() == [
        int((w > 0).nonzero()[0]), -1]
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        draw_rows(w, torch.zeros(1, dtype=torch.float64))


def test_verify_tree_matches_the_rule_monte_carlo():
    # V = 6, root with 3 children, one of them with 2 children: 36 outcomes for (x1, x2).
    tokens = torch.tensor([5, 0, 1, 2, 3, 4, 4])
    parents = [-1, 0, 0, 0, 1, 1, 3]
    children = [[1, 2, 3], [4, 5], [], [6], [], [], []]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 6, generator=g)
    off_logits = torch.randn(6, 6, generator=g)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95)
    probs, off = (
        normalised(process_logits(logits, params)),
        normalised(process_logits(off_logits, params)),
    )
    _, want = target_first_two(probs, off, tokens.tolist(), children)
    n, counts, off_t = 6000, torch.zeros(6, 6), process_logits(off_logits, params)
    for _ in range(n):
        accepted, bonus = verify_tree(tokens, parents, logits, params, g)
        committed = [int(tokens[a]) for a in accepted] + [bonus]
        if len(committed) == 1:  # next step starts off the tree
            committed.append(int(torch.multinomial(off_t[bonus], 1, generator=g)))
        counts[committed[0], committed[1]] += 1
    assert_counts_match(counts, want, n)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=5, top_p=0.95),
                                    SamplingParams(temperature=1.0)])
def test_verify_chain_with_draft_probs_is_exact_monte_carlo(params):
    """Drafts x_i ~ q_i, speculative sampling against q: the first two committed tokens have the
    target's joint distribution p0(x1) p(x2 | x1), whatever q is (q has zeros too)."""
    V, n = 6, 6000
    g = torch.Generator().manual_seed(2)
    logits0, off_logits = torch.randn(V, generator=g), torch.randn(V, V, generator=g)
    q = torch.rand(2, V, generator=g) * torch.tensor([1.0, 1, 0, 1, 1, 0])  # q misses 2 and 5
    q = q / q.sum(-1, keepdim=True)
    p0, off = process_logits(logits0, params), process_logits(off_logits, params)
    want = (p0[:, None] * off).double().tolist()  # [x1][x2]
    counts = torch.zeros(V, V)
    for _ in range(n):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        rows = torch.stack([logits0, off_logits[d[0]], torch.randn(V, generator=g)])
        k, nxt = verify_chain(d, q, rows, params, g)
        committed = d[:k] + [nxt]
        if len(committed) == 1:  # the next step starts after the resampled token
            committed.append(int(torch.multinomial(off[nxt], 1, generator=g)))
        counts[committed[0], committed[1]] += 1
    assert_counts_match(counts, want, n)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=5, top_p=0.95),
                                    SamplingParams(temperature=1.0)])
def test_verify_tree_with_children_drawn_from_q_is_exact_monte_carlo(params):
    """graft_lookup's shape: the root's first child x1 ~ q0 and a lookup child L (merged away
    when L == x1), x1's first child x2 ~ q1 and a lookup child M. The first two committed tokens
    have the target's joint distribution, and x1 is accepted with probability sum min(p0, q0):
    more than the one-hot test of the same draws, sum q0 p0."""
    V, n, L, M = 6, 6000, 2, 4
    g = torch.Generator().manual_seed(3)
    logits0, off_logits = torch.randn(V, generator=g), torch.randn(V, V, generator=g)
    q = torch.rand(2, V, generator=g) * torch.tensor([1.0, 1, 1, 1, 0, 1])  # q misses M
    q = q / q.sum(-1, keepdim=True)
    p0, off = process_logits(logits0, params), process_logits(off_logits, params)
    want = (p0[:, None] * off).double().tolist()  # [x1][x2]
    counts, first, first_one_hot = torch.zeros(V, V), 0, 0
    for _ in range(n):
        x1, x2 = (int(torch.multinomial(q[i], 1, generator=g)) for i in range(2))
        tokens, parents = [0, x1], [-1, 0]  # depth-ordered, the chain's node first
        if L != x1:
            tokens, parents = tokens + [L], parents + [0]
        tokens, parents = tokens + [x2], parents + [1]
        chained = len(tokens) - 1  # x2's node
        if M != x2:
            tokens, parents = tokens + [M], parents + [1]
        rows = torch.stack([logits0] + [  # depth 1: the target after that token
            off_logits[t] if parents[i] == 0 else torch.randn(V, generator=g)
            for i, t in enumerate(tokens) if i])
        accepted, nxt = verify_tree(torch.tensor(tokens), parents, rows, params, g,
                                    q={1: q[0], chained: q[1]})
        committed = [tokens[a] for a in accepted] + [nxt]
        first += bool(accepted) and accepted[0] == 1
        one_hot, _ = verify_tree(torch.tensor(tokens), parents, rows, params, g)
        first_one_hot += bool(one_hot) and one_hot[0] == 1
        if len(committed) == 1:  # the next step starts after the bonus token
            committed.append(int(torch.multinomial(off[nxt], 1, generator=g)))
        counts[committed[0], committed[1]] += 1
    assert_counts_match(counts, want, n)
    assert abs(first / n - float(torch.minimum(p0, q[0]).sum())) < 0.03
    assert abs(first_one_hot / n - float((p0 * q[0]).sum())) < 0.03
    assert first > first_one_hot
    with pytest.raises(ValueError, match="come first"):  # q for a node after a one-hot sibling
        verify_tree(torch.tensor([0, 1, 3]), [-1, 0, 0], torch.randn(3, V), params, g,
                    q={2: q[0]})


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=5, top_p=0.95),
                                    SamplingParams(temperature=1.0)])
def test_verify_tree_with_siblings_drawn_without_replacement_is_exact_monte_carlo(params):
    """draft_sampled_trees' shape: the root's 3 children drawn without replacement from q0, then
    a lookup child L (merged away when drawn); each drawn child x has 2 children drawn without
    replacement from q1[x]. The first two committed tokens have the target's joint distribution,
    and a drawn child is accepted with probability P(the first of them) + ..., more than the
    one-hot test of the same trees. q0 misses a token and q1 rows miss some: a node's later
    draws can run out of mass (fewer children)."""
    V, n, L = 6, 6000, 2
    g = torch.Generator().manual_seed(5)
    logits0, off_logits = torch.randn(V, generator=g), torch.randn(V, V, generator=g)
    q0 = torch.rand(V, generator=g) * torch.tensor([1.0, 1, 1, 1, 0, 1])
    q1 = torch.rand(V, V, generator=g) * (torch.rand(V, V, generator=g) > 0.3)
    q0, q1 = q0 / q0.sum(), q1 / q1.sum(-1, keepdim=True).clamp(min=1e-9)
    p0, off = process_logits(logits0, params), process_logits(off_logits, params)
    want = (p0[:, None] * off).double().tolist()  # [x1][x2]
    counts, drawn_hit, one_hot_hit = torch.zeros(V, V), 0, 0
    for _ in range(n):
        kids = draw_without_replacement(q0, 3, g).tolist()
        tokens, parents, q = [0] + kids, [-1] + [0] * len(kids), {}
        q.update({c: q0 for c in range(1, len(kids) + 1)})
        if L not in kids:
            tokens, parents = tokens + [L], parents + [0]
        for c in range(1, len(kids) + 1):
            grand = draw_without_replacement(q1[tokens[c]], 2, g).tolist()
            q.update({len(tokens) + j: q1[tokens[c]] for j in range(len(grand))})
            tokens, parents = tokens + grand, parents + [c] * len(grand)
        rows = torch.stack([logits0] + [off_logits[t] if parents[i] == 0 else
                                        torch.randn(V, generator=g)
                                        for i, t in enumerate(tokens) if i])
        accepted, nxt = verify_tree(torch.tensor(tokens), parents, rows, params, g, q=q)
        committed = [tokens[a] for a in accepted] + [nxt]
        drawn_hit += bool(accepted) and accepted[0] <= len(kids)
        one_hot, _ = verify_tree(torch.tensor(tokens), parents, rows, params, g)
        one_hot_hit += bool(one_hot) and one_hot[0] <= len(kids)
        if len(committed) == 1:  # the next step starts after the bonus token
            committed.append(int(torch.multinomial(off[nxt], 1, generator=g)))
        counts[committed[0], committed[1]] += 1
    assert_counts_match(counts, want, n)
    assert drawn_hit > one_hot_hit + 0.02 * n
    with pytest.raises(ValueError, match="come first"):  # a drawn node after a one-hot sibling
        verify_tree(torch.tensor([0, 1, 3]), [-1, 0, 0], torch.randn(3, V), params, g,
                    q={2: q0})


def test_draw_without_replacement_is_sequential_sampling_without_replacement():
    """P(first = i) = q_i, P(second = j | first = i) = q_j / (1 - q_i); never a zero of q, and
    no more indices than q has positive entries."""
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g, n = torch.Generator().manual_seed(0), 20000
    pairs = torch.zeros(4, 4)
    for _ in range(n):
        i, j = draw_without_replacement(q, 2, g).tolist()
        pairs[i, j] += 1
    want = torch.tensor([[q[i] * q[j] / (1 - q[i]) if i != j else 0.0 for j in range(4)]
                         for i in range(4)])
    assert (pairs[:, 3] == 0).all() and (pairs[3] == 0).all() and pairs.diagonal().sum() == 0
    assert (pairs / n - want).abs().max() < 0.015
    assert sorted(draw_without_replacement(q, 8, g).tolist()) == [0, 1, 2]


class _TableHead:
    """An expander whose draft log-probs after a node depend on the node's token only."""

    def __init__(self, table):
        self.table = table  # [V, V] log-probs

    def expand(self, tree, nodes):
        return self.table[tree.tokens[nodes]]


def test_draft_sampled_trees_fills_the_shape_and_maps_each_drawn_node_to_its_q():
    """A fixed shape (root: 3 children, its first child: 2) drawn from q under the request's
    params: siblings distinct, each drawn node's q row is its parent's q; top_k=2 leaves the
    root's third child to the head's next most likely token, a one-hot proposal (no q)."""
    V = 8
    g = torch.Generator().manual_seed(0)
    table = torch.log_softmax(torch.randn(V, V, generator=g), -1)
    parents = [-1, 0, 0, 0, 1, 1]
    for params, drawn_at_root in ((SamplingParams(temperature=1.0), 3),
                                  (SamplingParams(temperature=1.0, top_k=2), 2)):
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        out = draft_sampled_trees([(3, _TableHead(table), params, gens[0]),
                                   (5, _TableHead(table), params, gens[1])], parents)
        for (tree, q, nodes, rows), root in zip(out, (3, 5), strict=True):
            t = tree.tokens.tolist()
            assert tree.parents.tolist() == parents and t[0] == root
            assert len(set(t[1:4])) == 3 and len(set(t[4:6])) == 2  # distinct siblings
            assert q.shape == (2, V)  # rows: the root's q, node 1's q
            torch.testing.assert_close(q[0], process_logits(table[root], params))
            torch.testing.assert_close(q[1], process_logits(table[t[1]], params))
            assert nodes == [1, 2, 3][:drawn_at_root] + [4, 5]
            assert rows == [0] * drawn_at_root + [1, 1]
            assert all(q[r][t[c]] > 0 for c, r in zip(nodes, rows, strict=True))
            if drawn_at_root == 2:  # the filler: the likeliest token outside q's support
                rest = table[root].masked_fill(q[0] > 0, float("-inf"))
                assert t[3] == int(rest.argmax())
    again = draft_sampled_trees([(3, _TableHead(table), SamplingParams(temperature=1.0),
                                  torch.Generator().manual_seed(1))], parents)[0][0]
    first = draft_sampled_trees([(3, _TableHead(table), SamplingParams(temperature=1.0),
                                  torch.Generator().manual_seed(1))], parents)[0][0]
    assert torch.equal(again.tokens, first.tokens)  # a seeded request draws the same tree
    with pytest.raises(ValueError, match="greedy"):
        draft_sampled_trees([(3, _TableHead(table), SamplingParams(), None)], parents)


def test_verify_chain_greedy_and_shapes():
    logits = one_hot_logits([3, 4, 7])  # target argmax after root, after d1, after d2
    one_hot = torch.zeros(2, 10)
    one_hot[0, 3] = one_hot[1, 1] = 1
    assert verify_chain([3, 1], one_hot, logits, SamplingParams()) == (1, 4)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain([3, 1], one_hot[:1], logits, SamplingParams())


def test_sampled_verify_reproducible_with_seed():
    g = torch.Generator().manual_seed(3)
    tokens, parents, _, logits, _ = random_case(g)
    params = SamplingParams(temperature=1.0, seed=11)
    tokens = torch.tensor(tokens)

    def run(gen):
        return [verify_tree(tokens, parents, logits, params, gen) for _ in range(30)]

    assert run(make_generator(params)) == run(make_generator(params))
    assert run(make_generator(params)) != run(torch.Generator().manual_seed(12))


# ----------------------------------------------------------------------------- greedy / edges

# root 9 -> node1 (tok 1) -> node3 (tok 3); root -> node2 (tok 2)
TREE_TOKENS, TREE_PARENTS = torch.tensor([9, 1, 2, 3]), [-1, 0, 0, 1]


def one_hot_logits(argmaxes, vocab=10):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[range(len(argmaxes)), argmaxes] = 5.0
    return logits


@pytest.mark.parametrize(
    "argmaxes, expected",
    [
        ([2, 0, 7, 0], ([2], 7)),  # root picks node 2 (a leaf); bonus from node 2's row
        ([1, 3, 0, 4], ([1, 3], 4)),  # full path; bonus at the leaf
        ([1, 8, 0, 0], ([1], 8)),  # node1's target token 8 is not drafted
        ([4, 3, 2, 1], ([], 4)),  # nothing accepted: the root's argmax is the bonus
    ],
)
def test_greedy_verify_hand_made(argmaxes, expected):
    logits = one_hot_logits(argmaxes)
    assert verify_tree(TREE_TOKENS, TREE_PARENTS, logits, SamplingParams()) == expected
    # top_k = 1 sampling is greedy too, through the sampling path
    assert (
        verify_tree(TREE_TOKENS, torch.tensor(TREE_PARENTS), logits, SamplingParams(1.0, top_k=1))
        == expected
    )


def test_root_only_tree_and_input_errors():
    logits = one_hot_logits([3])
    assert verify_tree(torch.tensor([9]), [-1], logits, SamplingParams()) == ([], 3)
    assert verify_tree(torch.tensor([9]), [-1], logits, SamplingParams(0.5, top_k=1)) == ([], 3)
    with pytest.raises(ValueError, match=r"target_logits must be \[N\+1=4, V\]"):
        verify_tree(TREE_TOKENS, TREE_PARENTS, logits, SamplingParams())
    with pytest.raises(ValueError, match="must both be"):
        verify_tree(TREE_TOKENS, [-1, 0], one_hot_logits([0] * 4), SamplingParams())
    with pytest.raises(ValueError, match="topologically ordered"):
        verify_tree(TREE_TOKENS, [-1, 0, 3, 1], one_hot_logits([0] * 4), SamplingParams())


def test_fallback_token_when_no_mass_is_left():
    filtered = torch.tensor([-math.inf, 1.0, 3.0, -math.inf, 2.0])
    raw = torch.tensor([9.0, 1.0, 3.0, 0.0, 2.0])
    assert _fallback_token(filtered, raw, [2]) == 4  # best kept, non-rejected token
    assert _fallback_token(filtered, raw, [1, 2, 4]) == 0  # all kept rejected: raw logits decide
