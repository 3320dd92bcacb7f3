"""The reference tree decoder reproduces plain decoding with the target.

* Greedy, on the real SmolLM2: token-identical to plain greedy decoding for several MT-bench
  prompts and tree shapes, with a random EAGLE head (almost nothing accepted), a Medusa head, and
  an "oracle" drafter that proposes the target's own top tokens (deep acceptance, so the KV
  compaction after every step is exercised).
* Sampling, on a tiny random Llama: the joint distribution of generated tokens 2 and 3 under
  tree speculation (branching tree) equals plain sampling's (chi-square homogeneity test,
  significance 1e-3), at T=0.8/top-p 0.9 and at T=1/top-k 3.
* Hybrid trees (heads/lookup.py): a random EAGLE head's tree + lookup branches, and lookup
  alone (no head), are token-identical to plain greedy decoding on SmolLM2 and accept lookup
  tokens; sampled (also a chain drawn from the head's q with lookup nodes after it), their
  joint distribution matches plain sampling (tiny Llama, chi-square).
* Per-request seeds make runs reproducible.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from treedraft.heads.reference import plain_generate, speculative_generate
from treedraft.heads.sampling import SamplingParams
from treedraft.heads.tree import DraftTree, parse_tree_spec
from treedraft.training.data import first_turn, load_prompts
from treedraft.training.target import HFTarget, encode_chat, init_head, load_target


class OracleDrafter:
    """Drafts with a causal LM's own distribution (no cache: re-runs the sequence + tree path).
    With the target itself as the model, greedy trees are accepted deeply. `memo`: keep every
    sequence's log-probabilities (a tiny vocabulary's samples revisit the same few sequences
    thousands of times; any q is exact, as long as the one that drew a draft verifies it)."""

    def __init__(self, model, memo: bool = False):
        self.model, self.prompt, self.generated = model, [], None
        self.memo: dict[tuple[int, ...], torch.Tensor] | None = {} if memo else None

    def draft_session(self):
        self.generated = None
        return self

    def commit(self, hidden, tokens):
        if self.generated is None:  # the first commit is prompt[1:] + root
            self.generated = tokens[len(self.prompt) - 1 :].tolist()
        else:
            self.generated += tokens.tolist()

    @torch.inference_mode()
    def expand(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        seqs = []
        for node in nodes:
            path = []
            while node > 0:
                path.append(int(tree.tokens[node]))
                node = int(tree.parents[node])
            seqs.append(tuple(self.prompt + self.generated + path[::-1]))
        if self.memo is None:
            return self._forward(seqs)
        new = list(dict.fromkeys(s for s in seqs if s not in self.memo))
        if new:
            self.memo.update(zip(new, self._forward(new), strict=True))
        return torch.stack([self.memo[s] for s in seqs])

    def _forward(self, seqs: list[tuple[int, ...]]) -> torch.Tensor:
        # one batched forward, right-padded: causal attention leaves real positions untouched
        lens = torch.tensor([len(s) for s in seqs])
        ids = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        logits = self.model(ids).logits[torch.arange(len(seqs)), lens - 1]
        return torch.log_softmax(logits.float(), -1)


@pytest.fixture(scope="module")
def smollm():
    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def mtbench_prompts(smollm):
    ds = load_prompts("mtbench", limit=3)
    return [encode_chat(smollm.tokenizer, first_turn(m)) for m in ds["messages"]]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["chain:3", "[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]", "dynamic:12,4,3"])
def test_greedy_equals_plain_on_smollm2(smollm, mtbench_prompts, spec, torch_threads):
    target = HFTarget(smollm.model)
    eos = [smollm.tokenizer.eos_token_id]
    torch.manual_seed(0)
    eagle = init_head("eagle", smollm.model, smollm.tokenizer)
    oracle = OracleDrafter(smollm.model)
    tree = parse_tree_spec(spec)
    for i, prompt in enumerate(mtbench_prompts[:2]):
        want = plain_generate(target, prompt, 20, eos=eos).tokens
        oracle.prompt = prompt
        for head in (eagle, oracle) if i == 0 else (eagle,):
            got = speculative_generate(target, head, prompt, 20, tree, eos=eos)
            assert got.tokens == want, f"{spec} with {type(head).__name__} diverged"
        if i == 0:  # the oracle proposes the target's argmax: steps accept deep paths
            assert sum(got.accepted) >= 2 * len(got.accepted), got.accepted


@pytest.mark.slow
def test_medusa_greedy_equals_plain(smollm, mtbench_prompts, torch_threads):
    target = HFTarget(smollm.model)
    medusa = init_head("medusa", smollm.model, smollm.tokenizer)
    torch.manual_seed(0)
    torch.nn.init.normal_(medusa.heads[0][0].linear.weight, std=0.05)  # not the zero init
    prompt = mtbench_prompts[2]
    want = plain_generate(target, prompt, 20).tokens
    got = speculative_generate(target, medusa, prompt, 20, parse_tree_spec("static:10"))
    assert got.tokens == want


@pytest.mark.slow
def test_hybrid_and_lookup_greedy_equal_plain_on_smollm2(smollm, mtbench_prompts, torch_threads):
    target = HFTarget(smollm.model)
    eos = [smollm.tokenizer.eos_token_id]
    torch.manual_seed(0)
    eagle = init_head("eagle", smollm.model, smollm.tokenizer)
    from_lookup = 0
    for prompt in mtbench_prompts[:2]:
        want = plain_generate(target, prompt, 40, eos=eos).tokens
        for head, spec in ((eagle, "dynamic:8,3,2+lookup:8"), (None, "lookup:6")):
            got = speculative_generate(target, head, prompt, 40, parse_tree_spec(spec), eos=eos)
            assert got.tokens == want, f"{spec} diverged"
            assert sum(got.by_source.values()) == sum(got.accepted)
            from_lookup += got.by_source["lookup"] + got.by_source["both"]
    assert from_lookup > 0  # lookup branches were accepted: the hybrid path really ran
    with pytest.raises(ValueError, match="without a head"):
        speculative_generate(target, eagle, mtbench_prompts[0], 4, parse_tree_spec("lookup:4"))


def _tiny_llama(seed: int, vocab: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.6,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _pair_counts(generate, n: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab * vocab)
    for seed in range(n):
        toks = generate(torch.Generator().manual_seed(seed)).tokens
        counts[toks[1] * vocab + toks[2]] += 1
    return counts


@torch.no_grad()
def _pair_probs(model, prompt: list[int], params: SamplingParams, vocab: int) -> torch.Tensor:
    """Exact P(2nd, 3rd generated token) [vocab * vocab] under plain sampling with `params`
    (the first generated token summed out): what plain decoding draws from, computed."""
    from treedraft.heads.sampling import process_logits

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        return process_logits(model(torch.tensor(seqs)).logits[:, -1], params).double()

    p0 = probs([prompt])[0]  # [V]
    p1 = probs([prompt + [a] for a in range(vocab)])  # [V(t0), V(t1)]
    p2 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    joint = p0[:, None, None] * p1[:, :, None] * p2.view(vocab, vocab, vocab)
    return joint.sum(0).flatten()


@pytest.mark.parametrize(
    "params, shape",
    [(SamplingParams(temperature=0.8, top_p=0.9), "[[0],[1],[0,0],[0,1],[1,0]]"),  # from q
     (SamplingParams(temperature=1.0, top_k=2), "[[0],[1],[2],[0,0],[0,1],[1,0]]"),  # + filler
     (SamplingParams(temperature=0.8, top_p=0.9), "dynamic:5,2,2"),  # EAGLE-2: one-hot
     (SamplingParams(temperature=0.8, top_p=0.9), "chain:2"),  # drafts sampled from q
     (SamplingParams(temperature=0.8, top_p=0.9), "[[0],[1],[0,0]]+lookup:4"),  # hybrid
     (SamplingParams(temperature=1.0, top_k=3), "chain:2+lookup:4"),  # chain from q + lookup
     (SamplingParams(temperature=1.0, top_k=3), "lookup:4")],  # lookup alone
)
def test_sampling_distribution_matches_plain(params, shape):
    """Speculative samples against the exact distribution of plain sampling (chi-square
    goodness of fit; cells expecting < 5 samples pooled)."""
    vocab, n = 8, 1500
    model = _tiny_llama(0, vocab)
    target = HFTarget(model)
    drafter = OracleDrafter(_tiny_llama(1, vocab), memo=True)  # another model: partial acceptance
    drafter.prompt = prompt = [1, 5, 2]
    drafter = None if shape.startswith("lookup") else drafter
    tree = parse_tree_spec(shape)

    def spec(g):
        return speculative_generate(target, drafter, prompt, 3, tree, params, generator=g)

    counts = _pair_counts(spec, n, vocab).double()
    pvalue = _fit_pvalue(counts, _pair_probs(model, prompt, params, vocab))
    assert pvalue > 1e-3, f"speculative and plain sampling differ (chi-square p={pvalue:.2e})"


def _fit_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` to `probs`; cells expecting < 5 samples pooled.
    A count where probs is 0 fails at once (p = 0)."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum() / probs.sum()
    big = expected >= 5
    assert big.sum() >= 4, expected  # enough cells for the test to have power
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy())[1])


def test_pair_probs_are_what_plain_sampling_draws():
    """The exact reference above agrees with plain sampling itself, and tells another
    temperature apart (the goodness-of-fit test has power)."""
    vocab, n, prompt = 8, 1500, [1, 5, 2]
    model = _tiny_llama(0, vocab)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    counts = _pair_counts(lambda g: plain_generate(HFTarget(model), prompt, 3, params,
                                                   generator=g), n, vocab).double()
    assert _fit_pvalue(counts, _pair_probs(model, prompt, params, vocab)) > 1e-3
    hotter = _pair_probs(model, prompt, SamplingParams(temperature=1.3), vocab)
    assert _fit_pvalue(counts, hotter) < 1e-3


def test_seeded_runs_reproduce():
    model = _tiny_llama(0)
    target = HFTarget(model)
    drafter = OracleDrafter(_tiny_llama(1))
    drafter.prompt = prompt = [1, 2]
    params = SamplingParams(temperature=1.0)
    tree = parse_tree_spec("chain:2")

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return speculative_generate(target, drafter, prompt, 12, tree, params, generator=g).tokens

    assert run(7) == run(7)
    assert any(run(7) != run(s) for s in range(8, 12))


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        plain_generate(HFTarget(_tiny_llama(0)), [], 4)


def test_expected_tau_is_the_mean_acceptance_of_exact_verification():
    """`expected_tau` (1 + sum of reach) against verify_tree's sampled acceptance on the same
    target rows: a branching tree with a repeated sibling token, T=1 and top-k."""
    from treedraft.heads.ceiling import expected_tau, reach_probs
    from treedraft.heads.sampling import process_logits, verify_tree
    from treedraft.heads.tree import tree_buffers

    target = HFTarget(_tiny_llama(0))
    target.forward(torch.tensor([1, 5]), torch.arange(2), torch.ones(2, 2).tril().bool())
    def top(tokens, parents, node, k):  # the target's k likeliest tokens after `node`
        buf = tree_buffers(parents)
        logits, _ = target.forward(torch.tensor(tokens), 2 + buf.depths, buf.ancestor_mask)
        target.keep(2, torch.zeros(0, dtype=torch.long))
        return logits[node].topk(k).indices.tolist()

    a, b = top([2], [-1], 0, 2)
    c, d = top([2, a], [-1, 0], 1, 2)
    e = top([2, a, c], [-1, 0, 1], 2, 1)[0]
    tokens = torch.tensor([2, a, b, a, c, d, e])  # node 3 repeats node 1's token: never taken
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4])
    buf = tree_buffers(parents)
    logits, _ = target.forward(tokens, 2 + buf.depths, buf.ancestor_mask)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)):
        probs = process_logits(logits, params)
        assert reach_probs(tokens, parents, probs)[3] == 0.0
        gen, n = torch.Generator().manual_seed(0), 4000
        got = sum(len(verify_tree(tokens, parents, logits, params, gen)[0]) + 1
                  for _ in range(n)) / n
        want = expected_tau(tokens, parents, probs)
        assert 1.3 < want and abs(got - want) < 0.05, (got, want)
    greedy = process_logits(logits, SamplingParams())
    assert expected_tau(tokens, parents, greedy) == 1 + len(
        verify_tree(tokens, parents, logits, SamplingParams())[0])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=3)])
def test_oracle_tree_is_the_best_tree_of_n_nodes(params):
    """The oracle's N paths are the N most likely to be accepted, found by brute force over
    every path of depth <= N (vocab 8), and it leaves the target's cache as it was."""
    import itertools

    from treedraft.heads.ceiling import oracle_tree
    from treedraft.heads.sampling import process_logits

    vocab, prompt, root, n = 8, [1, 5, 2], 4, 4
    model = _tiny_llama(0, vocab)
    target = HFTarget(model)
    target.forward(torch.tensor(prompt), torch.arange(3), torch.ones(3, 3).tril().bool())
    paths, reach = oracle_tree(target, root, n, params)
    assert target.length == 3
    with torch.no_grad():
        every = [p for d in range(n) for p in itertools.product(range(vocab), repeat=d)]
        probs = {}
        for d in range(n):
            seqs = [p for p in every if len(p) == d]
            logits = model(torch.tensor([prompt + [root, *p] for p in seqs])).logits[:, -1]
            out = process_logits(logits, params).double()
            probs.update(zip(seqs, out, strict=True))
    brute = {}
    for p in every:
        for t in range(vocab):
            brute[p + (t,)] = brute.get(p, 1.0) * float(probs[p][t]) if p else float(probs[()][t])
    best = sorted(brute.values(), reverse=True)[:n]
    torch.testing.assert_close(torch.tensor(reach, dtype=torch.float64),
                               torch.tensor(best, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    for p, r in zip(paths, reach, strict=True):
        assert abs(brute[p] - r) < 1e-5 and (len(p) == 1 or p[:-1] in paths)
    assert oracle_tree(target, root, 3, SamplingParams())[1] == [1.0, 1.0, 1.0]  # greedy chain
