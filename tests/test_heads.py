"""Draft heads (heads/common.py, eagle.py, medusa.py) on tiny configs (H=32, V=50).

Proves: checkpoints round-trip and hold only the head's own weights; configs reject unknown keys;
mismatched targets are refused with both sides named; EAGLE fusion and draft-vocab mapping;
EAGLE full-sequence forward == KV-cached incremental forward; tree expansion with the ancestor
mask == running each root->node path as its own chain (tree mask and positions are right);
Medusa head shapes and depth limit; unbound target weights give a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from treedraft.heads.common import (
    HEADS,
    TargetSignature,
    check_compatible,
    load_head,
    tokenizer_fingerprint,
)
from treedraft.heads.eagle import (
    GROUPED_MAX_QUERIES,
    EagleConfig,
    EagleHead,
    KVCache,
    KVPool,
    Segment,
    grouped_attention,
    pooled_attention,
)
from treedraft.heads.medusa import MedusaConfig, MedusaHeads
from treedraft.heads.tree import draft_tree, parse_tree_spec

H, V, L = 32, 50, 4


@dataclass
class Tree:  # stand-in for heads/tree.py's DraftTree: only tokens/parents are read
    tokens: torch.Tensor
    parents: torch.Tensor


def sig(**kw) -> TargetSignature:
    base = dict(architecture="LlamaForCausalLM", hidden_size=H, vocab_size=V,
                num_hidden_layers=L, tokenizer_fingerprint="abc123")
    return TargetSignature(**{**base, **kw})


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def target_weights(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)


def make_eagle(**kw) -> EagleHead:
    cfg = EagleConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, target=sig(), **kw)
    head = EagleHead(cfg)
    randomize(head)
    head.bind_target(*target_weights())
    return head.eval()


def make_medusa(**kw) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3, target=sig(), **kw))
    randomize(heads)
    heads.bind_target(*target_weights())
    return heads


@pytest.mark.parametrize("kind", ["eagle", "eagle_fused_dv", "eagle3_normed", "medusa",
                                  "medusa_own"])
def test_save_load_round_trip(tmp_path, kind):
    head = {
        "eagle": lambda: make_eagle(),
        "eagle_fused_dv": lambda: make_eagle(target_layer_ids=(1, 2, -2), draft_vocab_size=20),
        "eagle3_normed": lambda: make_eagle(layout="eagle3", target_layer_ids=(1, 2, -2),
                                            draft_vocab_size=20, fuse_norm=True,
                                            norm_before_fc=True, norm_before_residual=True),
        "medusa": lambda: make_medusa(),
        "medusa_own": lambda: make_medusa(own_lm_head=True, num_layers=2),
    }[kind]()
    head.save_pretrained(tmp_path, provenance={"git": "deadbeef"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model.safetensors", "provenance.json"]
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert set(stored) == set(dict(head.named_parameters())) | set(dict(head.named_buffers())) - {
        "target_embed", "target_lm_head"}
    if kind in ("eagle", "medusa"):  # nothing shaped like the target's embedding / LM head
        assert all(tuple(t.shape) != (V, H) for t in stored.values())

    loaded = load_head(tmp_path, target=sig())
    assert type(loaded) is type(head) and loaded.config == head.config
    assert loaded.provenance == {"git": "deadbeef"}
    loaded.bind_target(*target_weights())
    if isinstance(head, EagleHead):
        n = len(head.config.target_layer_ids)
        x = torch.randn(2, 5, n * H)
        ids, pos = torch.randint(0, V, (2, 5)), torch.arange(5).expand(2, 5)
        a, b = head(head.project(x), ids, pos)[0], loaded(loaded.project(x), ids, pos)[0]
        torch.testing.assert_close(head.logits(a), loaded.logits(b), rtol=0, atol=0)
    else:
        x = torch.randn(2, 5, H)
        torch.testing.assert_close(head(x), loaded(x), rtol=0, atol=0)

    head.save_pretrained(tmp_path)  # re-save without provenance drops the stale one
    assert not (tmp_path / "provenance.json").exists()


def test_config_rejects_unknown_keys(tmp_path):
    d = make_eagle().config.to_dict()
    with pytest.raises(ValueError, match=r"unknown EagleConfig keys \['hiden_size'\].*valid keys"):
        EagleConfig.from_dict({**d, "hiden_size": 3})
    with pytest.raises(ValueError, match="unknown TargetSignature keys"):
        EagleConfig.from_dict({**d, "target": {**d["target"], "layers": 3}})
    assert EagleConfig.from_dict(json.loads(json.dumps(d))) == make_eagle().config
    make_medusa().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_head(tmp_path)


def test_mismatched_target_refused(tmp_path):
    make_eagle(target_layer_ids=(1, 2, 3)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_size=32, target has 896") as e:
        load_head(tmp_path, target=sig(hidden_size=896, tokenizer_fingerprint="zzz"))
    assert "tokenizer_fingerprint='abc123', target has 'zzz'" in str(e.value)
    with pytest.raises(ValueError, match=r"layers \(1, 2, 3\), target has only 2 layers"):
        EagleHead.from_pretrained(tmp_path, target=sig(num_hidden_layers=2))
    check_compatible(sig(), sig(tokenizer_fingerprint=None))  # unknown fingerprint: not compared
    with pytest.raises(ValueError, match="head_type='eagle' but MedusaHeads"):
        MedusaHeads.from_pretrained(tmp_path)


def test_missing_files_and_unknown_head_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.*config.json"):
        load_head(tmp_path / "nope")
    make_medusa().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"head_type": "hydra"}))
    with pytest.raises(ValueError, match=r"head_type='hydra'.*known head types"):
        load_head(tmp_path)
    assert {"eagle", "medusa"} <= set(HEADS)


def test_tokenizer_fingerprint():
    a = tokenizer_fingerprint({"a": 0, "b": 1})
    assert a == tokenizer_fingerprint({"b": 1, "a": 0}) != tokenizer_fingerprint({"a": 1, "b": 0})


def test_eagle_fusion_and_layer_ids():
    assert make_eagle().config.target_layer_ids == (L,)
    head = make_eagle(target_layer_ids=(1, 2, -1))
    assert head.config.target_layer_ids == (1, 2, L)
    assert head.project(torch.randn(2, 7, 3 * H)).shape == (2, 7, H)
    with pytest.raises(ValueError, match="expected 96"):
        head.project(torch.randn(7, H))
    with pytest.raises(ValueError, match="out of range"):
        make_eagle(target_layer_ids=(L + 1,))


def test_eagle_draft_vocab_mapping():
    head = make_eagle(draft_vocab_size=10)
    d2t = torch.randperm(V)[:10]
    head.set_draft_vocab(d2t)
    f = torch.randn(3, H)
    lg = head.logits(f)
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t] = False
    assert lg.shape == (3, V) and torch.isinf(lg[:, outside]).all() and (lg[:, outside] < 0).all()
    expect = f @ head.target_lm_head[d2t].T  # lm_head was initialised from the target's rows
    torch.testing.assert_close(lg[:, d2t], expect)


def test_lm_head_from_target_is_the_targets_rows_bound_frozen_and_never_saved(tmp_path):
    """`lm_head_from_target`: the draft vocabulary's LM head is the target's rows at d2t, at
    every bind and every new d2t; it is no parameter (nothing trains it), it is not saved, and
    a head that was never bound refuses to draft instead of drafting from zeros."""
    head = make_eagle(target_layer_ids=(1, 2, -2), draft_vocab_size=10, lm_head_from_target=True)
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:10]
    head.set_draft_vocab(d2t)
    f = torch.randn(3, H)
    torch.testing.assert_close(head.logits(f)[:, d2t], f @ head.target_lm_head[d2t].T)
    assert "lm_head.weight" not in dict(head.named_parameters())
    assert "lm_head.weight" not in head.state_dict()
    head.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_head(tmp_path, target=sig())
    assert torch.equal(loaded.d2t, d2t)
    with pytest.raises(RuntimeError, match="needs the target's lm_head"):
        loaded.logits(f)
    loaded.bind_target(*target_weights())
    torch.testing.assert_close(loaded.logits(f), head.logits(f), rtol=0, atol=0)
    # a bound head that loads another d2t (a resumed run) drafts from that d2t's rows
    other = make_eagle(target_layer_ids=(1, 2, -2), draft_vocab_size=10, lm_head_from_target=True)
    other.set_draft_vocab(torch.arange(10, 20))
    loaded.load_state_dict(other.state_dict())
    torch.testing.assert_close(loaded.logits(f), other.logits(f), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lm_head_from_target needs a draft vocabulary"):
        make_eagle(lm_head_from_target=True)


@pytest.mark.parametrize("draft_vocab", [None, 10])
def test_eagle_expand_topk_equals_topk_of_expand(draft_vocab):
    """The fast path draft_tree takes (top-k over the draft vocab only) changes no draft."""
    head = make_eagle(draft_vocab_size=draft_vocab)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(5))[:10])
    g = torch.Generator().manual_seed(4)
    h, tok = torch.randn(5, H, generator=g), torch.randint(0, V, (5,), generator=g)
    sess = head.draft_session()
    sess.commit(h, tok)
    tree = Tree(torch.tensor([int(tok[-1]), 3, 7]), torch.tensor([-1, 0, 0]))
    for nodes in ([0], [1, 2]):
        values, ids = sess.expand_topk(tree, nodes, 4)
        ref_values, ref_ids = sess.expand(tree, nodes).topk(4, dim=-1)
        torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-6)
        assert torch.equal(ids, ref_ids)

    class Slow:  # the same session without the fast path
        def __init__(self, s):
            self.expand = s.expand

    for spec in ("chain:3", "static:6", "dynamic:6,3,2"):
        fast = draft_tree(int(tok[-1]), sess, parse_tree_spec(spec))
        slow = draft_tree(int(tok[-1]), Slow(sess), parse_tree_spec(spec))
        assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.parents, slow.parents)
        torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("draft_vocab", [None, 10])
def test_sampled_chains_drafted_together_equal_one_by_one_and_the_full_vocab_q(draft_vocab):
    """draft_chains (one head forward per level for all requests, q over the draft vocabulary):
    each request draws what it draws alone from its seeded generator, and q at every depth is
    the full-vocabulary q of that chain (process_logits of `expand`), scattered to the target's
    vocabulary, with log q of each draft in the chain. Requests with the same parameters are
    processed together within a level (`_draw_level`), the others apart: both are checked."""
    from treedraft.heads.sampling import SamplingParams, draft_chains, process_logits

    head = make_eagle(draft_vocab_size=draft_vocab)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(5))[:10])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(),  # greedy
              SamplingParams(temperature=1.0)]  # the first's parameters again
    g = torch.Generator().manual_seed(4)
    hidden = [torch.randn(3 + i, H, generator=g) for i in range(len(params))]
    toks = [torch.randint(0, V, (3 + i,), generator=g) for i in range(len(params))]

    def sessions():
        out = []
        for h, t in zip(hidden, toks, strict=True):
            s = head.draft_session()
            s.commit(h, t)
            out.append(s)
        return out

    def jobs(ss):
        return [(int(t[-1]), s, p, torch.Generator().manual_seed(10 + i))
                for i, (t, s, p) in enumerate(zip(toks, ss, params, strict=True))]

    ss = sessions()
    together = draft_chains(jobs(ss), 3)
    alone = [draft_chains([job], 3)[0] for job in jobs(sessions())]
    for (chain, q), (ref_chain, ref_q), p, s in zip(together, alone, params, ss, strict=True):
        assert chain.tokens.tolist() == ref_chain.tokens.tolist()
        torch.testing.assert_close(q, ref_q, rtol=0, atol=1e-6)
        assert q.shape == (3, V)
        full = torch.stack([process_logits(s.expand(chain, [d])[0], p) for d in range(3)])
        torch.testing.assert_close(q, full, rtol=0, atol=1e-6)
        drafts = chain.tokens[1:]
        torch.testing.assert_close(chain.logprobs[1:], q[torch.arange(3), drafts].log(),
                                   rtol=0, atol=1e-5)
        if draft_vocab:
            assert set(drafts.tolist()) <= set(head.d2t.tolist())
        if p.greedy:
            assert torch.equal(q.argmax(-1), drafts)
    assert len({tuple(c.tokens.tolist()) for c, _ in together}) == 5  # the requests differ


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_eagle_incremental_equals_full_sequence(layout):
    head = make_eagle(layout=layout)
    T = 9
    feats, ids = torch.randn(2, T, H), torch.randint(0, V, (2, T))
    pos = torch.arange(T).expand(2, T)
    full, _ = head(feats, ids, pos)
    kv, steps = None, []
    for s, e in [(0, 4), (4, 5), (5, 6), (6, 9)]:  # a prefill chunk, single steps, a chunk
        out, (k, v) = head(feats[:, s:e], ids[:, s:e], pos[:, s:e], past_kv=kv)
        kv = (k, v) if kv is None else (torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2))
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    assert kv[0].shape == (2, 2, T, 8)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_fused_projections_compute_what_the_separate_layers_compute(layout, qk_norm):
    """Serving fuses q/k/v and gate/up into one linear layer each: the same features and K/V,
    and the same trees drafted from the same sessions; the separate layers are gone."""
    head = make_eagle(layout=layout, qk_norm=qk_norm)
    feats, ids = torch.randn(2, 7, H), torch.randint(0, V, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    want, (wk, wv) = head(feats, ids, pos)
    s = head.draft_session()
    s.commit(torch.randn(6, H, generator=torch.Generator().manual_seed(2)), ids[0, :6])
    spec = parse_tree_spec("dynamic:8,3,3")
    tree = draft_tree(s.last_token, s, spec)
    head.fuse_projections()
    names = {n for n, _ in head.named_modules()}
    assert {"layer.qkv_proj", "layer.gate_up_proj"} <= names and "layer.q_proj" not in names
    got, (k, v) = head(feats, ids, pos)
    for a, b in ((got, want), (k, wk), (v, wv)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    s.rewind(5)
    s.commit(torch.randn(6, H, generator=torch.Generator().manual_seed(2))[5:], ids[0, 5:6])
    again = draft_tree(s.last_token, s, spec)
    assert again.tokens.tolist() == tree.tokens.tolist()
    assert again.parents.tolist() == tree.parents.tolist()


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_eagle_tree_expansion_equals_chains(layout, shape):
    """Every node's draft distribution equals the one its path gives when committed as if the
    target had accepted it: a branching tree (masked levels) and a chain (levels of one node
    that see every earlier slot run without a mask)."""
    head = make_eagle(layout=layout)
    g = torch.Generator().manual_seed(3)
    prefix_h, prefix_tok = torch.randn(6, H, generator=g), torch.randint(0, V, (6,), generator=g)
    if shape == "tree":
        parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7])
        levels = [[0], [1, 2, 3], [4, 5, 6], [7, 8], [9]]
    else:
        parents = torch.tensor([-1, 0, 1, 2, 3])
        levels = [[0], [1], [2], [3], [4]]
    tokens = torch.randint(0, V, (len(parents) - 1,), generator=g)
    tree = Tree(torch.cat([prefix_tok[-1:], tokens]), parents)

    sess = head.draft_session()
    sess.commit(prefix_h[:4], prefix_tok[:4])  # two commits: positions continue
    sess.commit(prefix_h[4:], prefix_tok[4:])
    got = {n: lp for lvl in levels for n, lp in zip(lvl, sess.expand(tree, lvl), strict=True)}

    for node in range(len(parents)):
        path = []
        a = node
        while a > 0:
            path.insert(0, a)
            a = int(parents[a])
        chain = head.draft_session()  # the path committed as if the target had accepted it
        chain.commit(prefix_h, prefix_tok)
        for n in path:
            chain.commit(chain.root_feature[None], tree.tokens[n : n + 1])
        ref = chain.expand(Tree(tree.tokens[node : node + 1], torch.tensor([-1])), [0])[0]
        torch.testing.assert_close(got[node], ref, rtol=0, atol=1e-5)
    assert got[0].shape == (V,) and torch.allclose(got[0].exp().sum(), torch.tensor(1.0))

    sess.commit(prefix_h[:1], prefix_tok[:1])  # a new commit discards the tree's KVs
    assert sess.tree_nodes == [] and sess.length == 7
    with pytest.raises(ValueError, match="root token"):
        sess.expand(Tree(torch.tensor([(int(prefix_tok[0]) + 1) % V]), torch.tensor([-1])), [0])


def _committed(seed: int):
    """A tiny EAGLE head, 8 random pairs (features, tokens) and a session that committed them."""
    head = make_eagle()
    g = torch.Generator().manual_seed(seed)
    h, tok = torch.randn(8, H, generator=g), torch.randint(0, V, (8,), generator=g)
    full = head.draft_session()
    full.commit(h, tok)
    return head, h, tok, full


def test_eagle_rewind_rolls_back_and_skips_gaps():
    head, h, tok, full = _committed(5)
    again = head.draft_session()
    again.commit(h, tok)
    again.commit(h[:3], tok[:3])
    again.rewind(5)  # roll back into the committed prefix, then re-commit the rest
    again.commit(h[5:], tok[5:])
    torch.testing.assert_close(again.root_feature, full.root_feature, rtol=0, atol=1e-5)
    root = Tree(tok[-1:], torch.tensor([-1]))
    torch.testing.assert_close(again.expand(root, [0]), full.expand(root, [0]), rtol=0, atol=1e-5)
    gap = head.draft_session()  # a prefix-cache hit: the head never saw positions 0..19
    gap.commit(h[:2], tok[:2])
    gap.rewind(20)
    gap.commit(h[2:], tok[2:])
    assert gap.length == 26 and gap.length - gap.start == 6  # 6 pairs held
    tree = Tree(torch.cat([tok[-1:], tok[:3]]), torch.tensor([-1, 0, 0, 1]))
    assert gap.expand(tree, [0]).shape == (1, V) and gap.expand(tree, [1, 2]).shape == (2, V)
    gap.rewind(20)  # back to the first kept pair: no context left
    assert gap.start == gap.length == 20


def test_eagle_session_seeded_with_another_sessions_pairs_drafts_as_if_it_had_committed_them():
    """A prefix-cache hit in serving: the request's first 5 pairs come from a session that
    committed them for the same tokens (`cached_prefix` -> `seed`), the rest it commits itself.
    It drafts what a session that committed all 8 pairs drafts; a shorter export, an export
    of a session that does not start at 0 and a seed into a used session are refused."""
    head, h, tok, full = _committed(6)
    donor = head.draft_session()
    donor.commit(h[:6], tok[:6])
    seeded = head.draft_session()
    seeded.seed(*donor.cached_prefix(5))
    assert (seeded.start, seeded.length) == (0, 5)
    seeded.commit(h[5:], tok[5:])
    torch.testing.assert_close(seeded.root_feature, full.root_feature, rtol=0, atol=1e-5)
    tree = Tree(torch.cat([tok[-1:], tok[:3]]), torch.tensor([-1, 0, 0, 1]))
    torch.testing.assert_close(seeded.expand(tree, [0, 1, 2, 3]), full.expand(tree, [0, 1, 2, 3]),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="exports pairs"):
        donor.cached_prefix(7)
    gap = head.draft_session()
    gap.rewind(3)
    gap.commit(h[3:], tok[3:])
    with pytest.raises(ValueError, match="exports pairs"):
        gap.cached_prefix(2)
    with pytest.raises(ValueError, match="new session"):
        full.seed(*donor.cached_prefix(5))


def test_prefix_store_finds_pairs_by_tokens_and_keeps_the_most_recent():
    from treedraft.heads.prefix import PrefixStore

    def kv(n, fill):
        return torch.full((2, n, 4), float(fill)), torch.full((2, n, 4), -float(fill))

    store = PrefixStore(max_tokens=10)
    store.put([1, 2, 3, 4, 5], *kv(4, 1))  # pairs 0..3 of tokens 1 2 3 4 5
    assert store.find([1, 2, 3]) is not None and store.find([1, 2, 3])[0].shape == (2, 2, 4)
    assert store.find([1, 2, 9]) is None  # token 2 differs: pair 1 would not be the same
    assert store.find([1, 2, 3, 4, 5, 6]) is None  # needs 5 pairs, it holds 4
    store.put([1, 2, 3, 4, 5, 6, 7], *kv(6, 2))  # extends the first: replaces it
    assert len(store) == 1 and store.tokens == 6
    assert float(store.find([1, 2, 3, 4, 5, 6])[0][0, 0, 0]) == 2.0
    store.put([7, 8, 9, 10, 11], *kv(4, 3))  # 10 pairs held: at the limit
    store.find([1, 2, 3])  # the first one used last: the second goes out next
    store.put([20, 21, 22], *kv(2, 4))
    assert store.find([7, 8, 9]) is None and store.find([1, 2, 3]) is not None
    assert store.find([20, 21, 22]) is not None and store.tokens <= 10
    store.put(list(range(30)), *kv(20, 5))  # more than the store holds: not kept
    assert store.find([0, 1, 2]) is None


def commit_alone_and_together(alone, together, news) -> None:
    """Commit news[i] (target_hidden, tokens) to alone[i] one by one and to together[i] in one
    packed forward (`EagleSession.commit_many`); both lists of sessions end alike."""
    from treedraft.heads.eagle import EagleSession

    for s, (hh, tt) in zip(alone, news, strict=True):
        s.commit(hh, tt)
    EagleSession.commit_many([(s, hh, tt) for s, (hh, tt) in zip(together, news, strict=True)])
    for a, b in zip(alone, together, strict=True):
        assert a.length == b.length and a.last_token == b.last_token
        torch.testing.assert_close(a.root_feature, b.root_feature, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_sessions_draft_together_as_one_by_one(layout):
    """Batched drafting (serving: one packed head forward per tree level for all requests)
    makes the trees and features that sessions make one by one: different context lengths,
    commit sizes, a rewound and a gapped session, chain, static and dynamic trees."""
    from treedraft.heads.eagle import EagleSession
    from treedraft.heads.tree import draft_trees

    head = make_eagle(layout=layout)
    g = torch.Generator().manual_seed(11)
    h, tok = torch.randn(40, H, generator=g), torch.randint(0, V, (40,), generator=g)
    cuts = [(0, 3), (0, 17), (5, 9), (2, 40)]

    def sessions():
        out = []
        for lo, hi in cuts:
            s = head.draft_session()
            s.commit(h[lo:hi], tok[lo:hi])
            out.append(s)
        out[2].rewind(2)  # a rollback
        out[3].rewind(60)  # a gap: no context
        return out

    alone, together = sessions(), sessions()
    news = [(h[30:31], tok[30:31]), (h[20:24], tok[20:24]), (h[9:12], tok[9:12]),
            (h[1:3], tok[1:3])]
    commit_alone_and_together(alone, together, news)
    for spec in ("chain:4", "static:9", "dynamic:12,3,4", "dynamic:6,2,5"):
        spec = parse_tree_spec(spec)
        one = [draft_tree(s.last_token, s, spec) for s in alone]
        many = draft_trees([(s.last_token, s) for s in together], spec)
        for x, y in zip(one, many, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist() and x.parents.tolist() == y.parents.tolist()
            torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="same head"):
        EagleSession.commit_many([(alone[0], h[:1], tok[:1]),
                                  (make_eagle(layout=layout).draft_session(), h[:1], tok[:1])])


def test_a_prompt_commit_among_decode_commits_ends_as_one_by_one():
    """A serving step's packed commit where one request commits its prompt (more pairs than the
    batched attention takes) between requests committing a few pairs: the short segments attend
    in one call over the pool (`pooled_attention` over some of the row's tokens), the prompt
    alone, and every session ends where committing alone ends."""
    head = make_eagle()
    g = torch.Generator().manual_seed(5)
    h, tok = torch.randn(40, H, generator=g), torch.randint(0, V, (40,), generator=g)

    def sessions():
        a, b, c = (head.draft_session() for _ in range(3))
        a.commit(h[:5], tok[:5])
        c.commit(h[3:12], tok[3:12])
        return [a, b, c]

    together, alone = sessions(), sessions()  # together in the pool's first rows
    news = [(h[5:7], tok[5:7]), (h[:GROUPED_MAX_QUERIES + 9], tok[:GROUPED_MAX_QUERIES + 9]),
            (h[12:13], tok[12:13])]
    commit_alone_and_together(alone, together, news)
    spec = parse_tree_spec("chain:3")
    for a, b in zip(alone, together, strict=True):
        assert (draft_tree(a.last_token, a, spec).tokens.tolist()
                == draft_tree(b.last_token, b, spec).tokens.tolist())
    # the pooled call over the short segments alone: their tokens' attention, in segment order
    nh, nkv, d = 4, 2, H // 4
    sizes = (2, GROUPED_MAX_QUERIES + 9, 1)
    q = torch.randn(1, nh, sum(sizes), d, generator=g)
    k, v = torch.randn(1, nkv, sum(sizes), d, generator=g), torch.randn(1, nkv, sum(sizes), d,
                                                                        generator=g)
    short = [Segment(0, 2, together[0].cache, together[0].length - 2, None, causal=True),
             Segment(sum(sizes) - 1, sum(sizes), together[2].cache, together[2].length - 1,
                     None, causal=True)]
    got = pooled_attention(q, k, v, short)
    want = [grouped_attention(q[:, :, seg.lo : seg.hi], *seg.cache.write(seg.at, k[:, :, seg.lo :
                              seg.hi], v[:, :, seg.lo : seg.hi]),
                              None if seg.hi - seg.lo == 1 else torch.ones(
                                  2, seg.at + 2, dtype=torch.bool).tril(seg.at))
            for seg in short]
    assert got is not None and got.shape == (1, nh, 3, d)
    torch.testing.assert_close(got, torch.cat(want, 2), rtol=0, atol=1e-5)


def test_medusa_shapes_and_depth_limit():
    heads = make_medusa()
    hidden = torch.randn(2, 5, H)
    logits = heads(hidden)
    assert logits.shape == (2, 5, 3, V)
    sess = heads.draft_session()
    sess.commit(hidden[0], torch.randint(0, V, (5,)))
    tree = Tree(torch.tensor([7, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 3]))
    lp = sess.expand(tree, [0, 1, 2, 3])  # depths 0, 1, 1, 2 -> heads 1, 2, 2, 3
    torch.testing.assert_close(lp, torch.log_softmax(logits[0, -1], -1)[[0, 1, 1, 2]])
    with pytest.raises(ValueError, match="medusa head has 3 heads; tree depth must be <= 3"):
        sess.expand(tree, [4])


def test_unmeasured_medusa_static_tree_stays_within_its_heads():
    """A Medusa checkpoint saved before its acceptance was measured has no acceptance_rates: a
    static tree shaped from the default table (MAX_TREE_DEPTH deep) would reach past its last
    head and kill the engine at the first draft (`static:64`).
    tree_rates() cuts the default table to the heads it has; measured rates are kept."""
    from treedraft.heads.tree import DEFAULT_ACCEPTANCE_RATES, draft_tree, parse_tree_spec

    heads, eagle = make_medusa(), make_eagle()
    assert heads.config.acceptance_rates is None and heads.max_draft_depth == 3
    assert heads.tree_rates() == DEFAULT_ACCEPTANCE_RATES[:3] and eagle.tree_rates() is None
    sess = heads.draft_session()
    sess.commit(torch.randn(5, H), torch.randint(0, V, (5,)))
    spec = parse_tree_spec("static:64")
    with pytest.raises(ValueError, match="medusa head has 3 heads"):
        draft_tree(7, sess, spec, None)  # the full default table: too deep
    tree = draft_tree(7, sess, spec, heads.tree_rates())
    assert len(tree.tokens) == 65 and int(tree.buffers().depths.max()) == 3
    heads.config.acceptance_rates = [[0.5, 0.2], [0.4, 0.1]]
    assert heads.tree_rates() == [[0.5, 0.2], [0.4, 0.1]]


def test_unbound_target_weights():
    cfg = EagleConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, target=sig())
    with pytest.raises(RuntimeError, match="bind_target"):
        EagleHead(cfg)(torch.randn(1, 2, H), torch.zeros(1, 2, dtype=torch.long),
                       torch.arange(2)[None])
    with pytest.raises(RuntimeError, match="bind_target"):
        MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, target=sig()))(
            torch.randn(H))
    with pytest.raises(ValueError, match=r"shape \(50, 16\)"):
        EagleHead(cfg).bind_target(torch.randn(V, 16), None)


def test_pending_pairs_commit_lazily_what_eager_commits_make():
    """Serving defers a request's commits until it drafts (plugin/pairs.py PendingPairs): the
    session then ends exactly where eager commits end, through steps, rollbacks inside and
    before what is pending, a gap and flushes in between; `full` tells the caller to flush."""
    from treedraft.heads.common import commit_sessions
    from treedraft.plugin.pairs import PendingPairs

    head = make_eagle()
    g = torch.Generator().manual_seed(5)
    h, tok = torch.randn(64, H, generator=g), torch.randint(0, V, (64,), generator=g)
    # (position c, pairs from c to hi): what a serving step hands over, in order
    steps = [(0, 9), (9, 10), (10, 13), (13, 14), (11, 15), (15, 16), (3, 8), (8, 12),
             (20, 23), (23, 30)]

    def check(flush_after: set[int]) -> None:
        eager, lazy = head.draft_session(), head.draft_session()
        pending = PendingPairs(max_rows=12)
        for k, (c, hi) in enumerate(steps):
            eager.rewind(c)
            eager.commit(h[c:hi], tok[c:hi])
            pending.add(c, h[c:hi], tok[c:hi])
            assert pending.full == (len(pending) >= 12)
            if k in flush_after or k == len(steps) - 1:
                commit_sessions([pending.flush(lazy)])
                assert len(pending) == 0 and pending.flush(lazy) is None
                assert (lazy.start, lazy.length) == (eager.start, eager.length)
                assert lazy.last_token == eager.last_token
                torch.testing.assert_close(lazy.root_feature, eager.root_feature,
                                           rtol=0, atol=1e-5)
                spec = parse_tree_spec("dynamic:6,3,2")
                x = draft_tree(eager.last_token, eager, spec)
                y = draft_tree(lazy.last_token, lazy, spec)
                assert x.tokens.tolist() == y.tokens.tolist()
                torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)

    check(set())  # everything in one flush at the end
    check({0, 3, 5})  # flushed now and then (rollbacks cross a flush)
    check({4, 7})  # flushed right after rollbacks inside what was pending
    check({6})
    full = PendingPairs(max_rows=12)
    full.add(0, h[:9], tok[:9])
    assert not full.full
    full.add(9, h[9:14], tok[9:14])
    assert full.full and len(full) == 14  # nothing dropped: the caller flushes it


@pytest.mark.parametrize("parts", [False, True])
def test_pair_log_drains_into_pending_pairs_what_adding_each_step_makes(parts):
    """Plain decode steps are logged whole (plugin/pairs.py PairLog) and replayed into the
    requests' PendingPairs when read: the same pairs at the same positions as adding each step
    at once, through a rollback (a preempted request recomputed from position 2), a request
    that joins late, and one that finished (its pairs dropped, no PendingPairs made for it).
    parts: a step logs its features as parts (the target layers a head reads, joined when
    drained) and its tokens as a numpy array, as serving does."""
    from treedraft.plugin.pairs import PairLog, PendingPairs

    g = torch.Generator().manual_seed(3)
    # steps: (request ids, positions) of one pair each
    steps = [(["a", "b"], [5, 0]), (["a", "b"], [6, 1]), (["a", "b", "c"], [7, 2, 9]),
             (["a", "b", "c"], [8, 3, 10]), (["b", "a", "c"], [4, 2, 11]),
             (["a", "b", "c"], [3, 5, 12])]
    eager: dict[str, PendingPairs] = {}
    log, lazy = PairLog(max_steps=3), {"a": PendingPairs()}
    lazy["a"].add(0, torch.randn(5, H, generator=g), torch.arange(5))  # a's prefill, direct
    eager["a"] = PendingPairs()
    eager["a"].add(0, lazy["a"].feats[0], lazy["a"].tokens[0])
    for k, (req_ids, positions) in enumerate(steps):
        feats = torch.randn(len(req_ids), H, generator=g)
        tokens = torch.randint(0, V, (len(req_ids),), generator=g)
        for j, (r, pos) in enumerate(zip(req_ids, positions, strict=True)):
            eager.setdefault(r, PendingPairs()).add(pos, feats[j : j + 1], tokens[j : j + 1])
        if parts:  # three parts of the features, numpy int32 tokens
            log.add(req_ids, positions, (feats[:, :5], feats[:, 5:9], feats[:, 9:]),
                    tokens.numpy().astype("int32"))
        else:
            log.add(req_ids, positions, feats, tokens)
        assert len(log) == k % 3 + 1 and log.full == (len(log) == 3)
        if log.full:
            log.drain(lazy)
            assert len(log) == 0
    log.drain(lazy)
    assert lazy.keys() == eager.keys() == {"a", "b", "c"}
    for r in eager:
        want, got = eager[r], lazy[r]
        assert (got.start, len(got)) == (want.start, len(want)), r
        torch.testing.assert_close(torch.cat(got.feats), torch.cat(want.feats), rtol=0, atol=0)
        assert torch.cat(got.tokens).tolist() == torch.cat(want.tokens).tolist()
    assert (lazy["a"].start, len(lazy["a"])) == (0, 4)  # rolled back to 2, then 3
    # a finished request: its logged pairs are dropped, nothing is made for it
    log.add(["a", "d"], [4, 0], torch.randn(2, H, generator=g), torch.tensor([1, 2]))
    log.drain(lazy, live={"a"})
    assert "d" not in lazy and len(lazy["a"]) == 5 and lazy["a"].tokens[-1].tolist() == [1]


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_attention_equals_sdpa_with_repeated_kv_heads(masked, queries):
    """The sessions' attention (grouped matmuls over a float32 cache) computes what SDPA over
    repeated K/V heads computes: head h reads kv head h // groups, the mask [T, S] drops the
    keys it says for each query, and bf16 queries come back in bf16."""
    g = torch.Generator().manual_seed(0)
    T, S = queries, 11
    q = torch.randn(1, 6, T, 16, generator=g)
    k, v = torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16, generator=g)
    mask = (torch.rand(T, S, generator=g) > 0.4) if masked else None
    if masked:
        mask[:, -1] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
        attn_mask=None if mask is None else mask[None, None])
    got = grouped_attention(q, k, v, mask)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    # a kv head read by the wrong query heads would differ: swap the kv heads to see it
    assert not torch.allclose(grouped_attention(q, k.flip(1), v.flip(1), mask), want, atol=1e-3)
    if masked and T > 1:  # each query reads its own mask row, not the last one's
        assert not torch.allclose(grouped_attention(q, k, v, mask[[T - 1] * T]), want, atol=1e-3)
    low = grouped_attention(q.bfloat16(), k, v, mask)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), want, atol=3e-2)


def test_pooled_attention_equals_one_call_per_session():
    """Many sessions' segments attend in one batched call over their pool (`pooled_attention`)
    and get what one call per session gets: different context lengths, causal commits of 1-3
    pairs, a tree level under its own ancestor mask, rows not in order and a row without a
    segment between them, stale values past a row's length; each segment's K/V land in its
    own row. Rows go back to the pool with their session and are handed out again."""
    g = torch.Generator().manual_seed(3)
    nh, nkv, d = 6, 2, 8
    pool = KVPool()
    caches = [KVCache(pool) for _ in range(4)]
    assert [c.row for c in caches] == [0, 1, 2, 3]
    for c, n in zip(caches, (5, 9, 3, 7), strict=True):  # committed context, then stale slots
        c.write(0, torch.randn(1, nkv, n + 4, d, generator=g), torch.randn(1, nkv, n + 4, d,
                                                                          generator=g))
    tree_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 1]],
                             dtype=torch.bool)  # 7 committed + 1 tree node, then 2 new nodes
    # (cache, at, queries, mask, causal): rows 3, 0, 2; row 1 has no segment
    plan = [(caches[3], 8, 2, tree_mask, False), (caches[0], 5, 1, None, True),
            (caches[2], 3, 3, torch.ones(3, 6, dtype=torch.bool).tril(3), True)]
    N = sum(t for _, _, t, _, _ in plan)
    q = torch.randn(1, nh, N, d, generator=g, dtype=torch.bfloat16)
    k, v = torch.randn(1, nkv, N, d, generator=g), torch.randn(1, nkv, N, d, generator=g)
    segs, lo = [], 0
    for c, at, t, m, causal in plan:
        segs.append(Segment(lo, lo + t, c, at, m, causal))
        lo += t
    before = pool.k.clone(), pool.v.clone()
    got = pooled_attention(q, k, v, segs)
    assert got is not None and got.shape == q.shape and got.dtype == q.dtype
    want = []
    for seg in segs:
        r, end = seg.cache.row, seg.at + seg.hi - seg.lo
        kk, vv = before[0][r : r + 1, :, :end].clone(), before[1][r : r + 1, :, :end].clone()
        kk[:, :, seg.at :], vv[:, :, seg.at :] = k[:, :, seg.lo : seg.hi], v[:, :, seg.lo : seg.hi]
        torch.testing.assert_close(pool.k[r : r + 1, :, :end], kk, rtol=0, atol=0)
        torch.testing.assert_close(pool.v[r : r + 1, :, :end], vv, rtol=0, atol=0)
        want.append(grouped_attention(q[:, :, seg.lo : seg.hi], kk, vv, seg.mask))
    torch.testing.assert_close(got.float(), torch.cat(want, 2).float(), rtol=0, atol=1e-2)
    # the masks matter: the tree segment under a causal mask reads its sibling's slot
    segs[0].causal = True
    assert not torch.allclose(pooled_attention(q, k, v, segs)[:, :, :2].float(),
                              want[0].float(), atol=1e-2)
    torch.testing.assert_close(pool.k[1], before[0][1], rtol=0, atol=0)  # row 1 untouched
    assert pooled_attention(q, k, v, segs[:1]) is None  # one segment: the per-session call
    long = Segment(0, 17, caches[1], 9, None, True)  # a prompt's commit: SDPA per session
    assert pooled_attention(torch.zeros(1, nh, 18, d), torch.zeros(1, nkv, 18, d),
                            torch.zeros(1, nkv, 18, d), [long, Segment(17, 18, caches[0], 6,
                                                                       None, True)]) is None
    del caches[1], long  # its session dropped: its row is handed out again, the lowest first
    again, new = KVCache(pool), KVCache(pool)
    assert (again.row, new.row) == (1, 4)
    assert not pool.k[1].any() and not pool.v[1].any()  # a reused row starts from zeros
    # a segment without a mask sees every slot up to its last token; one long context among
    # short ones (reading every row that far would cost more) attends per segment
    segs = [Segment(0, 2, caches[0], 3, None), Segment(2, 3, caches[2], 2, None, True)]
    q3, k3, v3 = (torch.randn(1, h, 3, d, generator=g) for h in (nh, nkv, nkv))
    got = pooled_attention(q3, k3, v3, segs)
    ref = grouped_attention(q3[:, :, :2], pool.k[0:1, :, :5], pool.v[0:1, :, :5], None)
    torch.testing.assert_close(got[:, :, :2], ref, rtol=0, atol=1e-5)
    far = Segment(2, 3, caches[2], 60, None, True)
    assert pooled_attention(q3, k3, v3, [segs[0], far]) is None
