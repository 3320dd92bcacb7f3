"""Training objectives (training/losses.py, training/features.py) on tiny heads (H=32, V=50).

Proves: EAGLE training-time test == inference: the unrolled step-k output at position t equals
the feature and log-probs that `EagleHead.draft_session()` computes for the depth-k node of a
chain of true tokens drafted from the real pair at t-k (plain, fused layers + draft vocab,
padded batch); the TTT attention mask and label offsets; Medusa head k is trained against the
target's distribution at t+k (index arithmetic and, on a real tiny target, the actual
log-probs); the single-head Medusa logits equal `MedusaHeads.forward`; the KL is zero at the
target and its top-k / draft-vocab forms renormalise; acceptance rates are non-increasing.
"""

from __future__ import annotations

import pytest
import torch

from treedraft.heads.common import TargetSignature
from treedraft.heads.eagle import EagleConfig, EagleHead
from treedraft.heads.medusa import MedusaConfig, MedusaHeads
from treedraft.heads.tree import DraftTree
from treedraft.training.features import Batch, Labels, restrict_topk
from treedraft.training.losses import (
    acceptance_rates,
    eagle_loss,
    eagle_rows,
    eagle_unroll,
    medusa_head_logits,
    medusa_loss,
    medusa_rows,
    soft_kl,
    ttt_mask,
)

H, V, L = 32, 50, 4


def sig() -> TargetSignature:
    return TargetSignature("LlamaForCausalLM", H, V, L)


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def bind(head) -> None:
    g = torch.Generator().manual_seed(1)
    head.bind_target(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))


def make_eagle(**kw) -> EagleHead:
    head = EagleHead(EagleConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, target=sig(), **kw))
    randomize(head)
    bind(head)
    return head.eval()


def make_batch(lengths: list[int], nfeat: int = H, seed: int = 0) -> Batch:
    """Random features/tokens, right padded; every position but the last has a dense label."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(0, V, (B, T), generator=g)
    att = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    ids[~att] = 0
    label_mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None] - 1
    n = int(label_mask.sum())
    lp = torch.log_softmax(torch.randn(n, V, generator=g), -1)
    return Batch(ids, att, label_mask, torch.randn(B, T, nfeat, generator=g), None,
                 Labels(lp, None, lp.argmax(-1)))


def chain_session(head: EagleHead, batch: Batch, b: int, t: int, k: int):
    """Inference view of (step k, position t): commit real pairs at 0..t-k, draft a chain of the
    true tokens x_{t-k+2}..x_{t+1}; returns (feature, log-probs) of the depth-k node."""
    ids, feats = batch.input_ids[b], batch.features[b]
    s = head.draft_session()
    s.commit(feats[: t - k + 1], ids[1: t - k + 2])  # pairs (f_i, x_{i+1}), i = 0..t-k
    tokens = ids[t - k + 1: t + 2]  # root x_{t-k+1}, then the chain
    tree = DraftTree(tokens, torch.arange(-1, k), torch.zeros(k + 1))
    for node in range(k + 1):  # level by level, as draft_tree does
        lp = s.expand(tree, [node])
    return s.feat[k], lp[0]


@pytest.mark.parametrize("variant", ["plain", "fused_draft_vocab"])
def test_ttt_unroll_equals_draft_session(variant):
    kw = {} if variant == "plain" else {"target_layer_ids": (1, 2, -1), "draft_vocab_size": 20}
    head = make_eagle(**kw)
    if variant != "plain":
        head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:20])
    nfeat = H * len(head.config.target_layer_ids)
    batch = make_batch([9, 6], nfeat=nfeat)
    D = 4
    with torch.no_grad():
        outs = [(k, out.clone(), q) for k, out, q, _ in eagle_unroll(head, batch, D)]
    checked = 0
    for k, out, qmask in outs:
        for b, n in enumerate([9, 6]):
            for t in range(k, n - 1):  # every pair (f_t', x_{t+1}) that exists
                assert qmask[b, t] == (t + 1 <= n - 2)  # loss only where x_{t+2} exists
                feat, lp = chain_session(head, batch, b, t, k)
                torch.testing.assert_close(out[b, t], feat, atol=1e-4, rtol=1e-4)
                want = torch.log_softmax(head.logits(out[b, t]).float(), -1)
                fin = torch.isfinite(want)
                assert torch.equal(fin, torch.isfinite(lp))
                torch.testing.assert_close(lp[fin], want[fin], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked == sum(max(n - 1 - k, 0) for k in range(D) for n in (9, 6))


def test_ttt_mask_small():
    m = ttt_mask(4, 2)  # step 2: step-0 keys s <= t-2, step-1 key s = t-1, step-2 key s = t
    assert m.shape == (4, 12)
    assert m[3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert m[2].nonzero().flatten().tolist() == [0, 4 + 1, 8 + 2]
    assert torch.equal(ttt_mask(3, 0), torch.ones(3, 3, dtype=torch.bool).tril())


def test_eagle_label_offsets():
    # label positions p = 1..4 of a length-6 sequence (rows 0..3)
    idx = torch.tensor([[-1, 0, 1, 2, 3, -1]])
    m0, r0 = eagle_rows(idx, 0)  # query t uses label at t+1
    assert m0[0].nonzero().flatten().tolist() == [0, 1, 2, 3] and r0.tolist() == [0, 1, 2, 3]
    m2, r2 = eagle_rows(idx, 2)  # step 2 needs t >= 2
    assert m2[0].nonzero().flatten().tolist() == [2, 3] and r2.tolist() == [2, 3]


def test_medusa_label_offsets():
    idx = torch.tensor([[-1, -1, 0, 1, 2, 3]])  # labels at p = 2..5
    m1, r1 = medusa_rows(idx, 1)  # head 1 at t -> label at t+1
    assert m1[0].nonzero().flatten().tolist() == [1, 2, 3, 4] and r1.tolist() == [0, 1, 2, 3]
    m3, r3 = medusa_rows(idx, 3)  # head 3 at t -> label at t+3
    assert m3[0].nonzero().flatten().tolist() == [0, 1, 2] and r3.tolist() == [1, 2, 3]


def test_medusa_single_head_logits_match_forward():
    for own in (False, True):
        heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3, target=sig(),
                                         own_lm_head=own))
        randomize(heads)
        bind(heads)
        x = torch.randn(5, H)
        full = heads(x)
        for k in range(3):
            torch.testing.assert_close(medusa_head_logits(heads, k, x), full[:, k])


def test_losses_run_and_backprop():
    head = make_eagle()
    head.train()
    batch = make_batch([7, 5])
    loss, m = eagle_loss(head, batch, [1.0, 0.8, 0.64])
    loss.backward()
    assert len(m["kl"]) == 3 and all(0 <= a <= 1 for a in m["top1"])
    assert head.layer.q_proj.weight.grad.abs().sum() > 0
    batch.final_hidden = torch.randn(*batch.input_ids.shape, H)
    with_reg, _ = eagle_loss(head, batch, [1.0, 0.8, 0.64], feature_loss_weight=0.5)
    assert with_reg > loss  # the smooth-L1 regression to f_{t+1} adds to the KL
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, target=sig()))
    randomize(heads)
    bind(heads)
    loss, m = medusa_loss(heads, make_batch([7, 5]), [1.0, 0.8])
    loss.backward()
    assert len(m["kl"]) == 2 and torch.isfinite(loss)


def test_soft_kl_zero_at_target_and_topk_renormalises():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    lp = torch.log_softmax(logits, -1)
    dense = Labels(lp, None, lp.argmax(-1))
    rows = torch.arange(4)
    assert soft_kl(logits, dense, rows).abs().max() < 1e-5
    assert (soft_kl(torch.randn(4, V, generator=g), dense, rows) > 0).all()
    # top-k with k = V is the dense KL
    vals, ids = lp.topk(V, -1)
    torch.testing.assert_close(soft_kl(logits * 0.5, Labels(vals, ids, dense.top1), rows),
                               soft_kl(logits * 0.5, dense, rows), atol=1e-5, rtol=1e-5)
    # restricting to a draft vocab renormalises over the kept ids
    t2d = torch.full((V,), -1)
    keep_ids = torch.arange(0, V, 2)
    t2d[keep_ids] = torch.arange(len(keep_ids))
    sparse, keep = restrict_topk(Labels(vals, ids, dense.top1), t2d)
    assert keep.all()
    torch.testing.assert_close(sparse.logprobs.exp().sum(-1), torch.ones(4))
    want = torch.log_softmax(logits[:, keep_ids], -1)
    for i in range(4):
        kept = sparse.logprobs[i] > float("-inf")
        assert sorted(sparse.ids[i][kept].tolist()) == list(range(len(keep_ids)))
        torch.testing.assert_close(sparse.logprobs[i][kept], want[i][sparse.ids[i][kept]])


def test_acceptance_rates_non_increasing():
    hits = torch.tensor([[5.0, 7.0, 1.0], [2.0, 1.0, 1.0]])
    rates = acceptance_rates(hits, torch.tensor([10.0, 4.0]))
    assert rates == [[0.5, 0.5, 0.1], [0.5, 0.25, 0.25]]


def test_oov_rows_mask_drops_rows_whose_target_argmax_lies_outside_the_draft_vocab():
    # EAGLE-3's recipe: a row whose target argmax the draft vocab cannot produce is left out of
    # the loss; the metrics still count every row (held-out top-1 stays comparable)
    head = make_eagle(draft_vocab_size=20)
    head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:20])
    batch = make_batch([9, 7, 6])
    full = batch.labels.logprobs  # [N, V] -> dense labels over the draft vocab, renormalised
    batch.labels = Labels(torch.log_softmax(full[:, head.d2t], -1), None, full.argmax(-1))
    inside = torch.isin(batch.labels.top1, head.d2t)
    assert 0 < int(inside.sum()) < len(inside)  # both kinds of rows present
    with torch.no_grad():
        (k, out, qmask, rows), = list(eagle_unroll(head, batch, 1))
        per_row = soft_kl(head.draft_logits(out[qmask]), batch.labels, rows)
        keep_loss, keep_m = eagle_loss(head, batch, [1.0])
        mask_loss, mask_m = eagle_loss(head, batch, [1.0], mask_oov=True)
    torch.testing.assert_close(keep_loss, per_row.mean())
    torch.testing.assert_close(mask_loss, per_row[inside[rows]].mean())
    assert not torch.allclose(mask_loss, keep_loss)
    assert keep_m["top1"] == mask_m["top1"]


def test_oov_rows_is_checked_against_the_head():
    from treedraft.training.config import TrainConfig
    from treedraft.training.loop import Objective

    with pytest.raises(ValueError, match="oov_rows='drop'; valid values: keep, mask"):
        TrainConfig(oov_rows="drop").validate()
    with pytest.raises(ValueError, match="oov_rows=mask needs a draft vocabulary"):
        Objective(make_eagle(), TrainConfig(oov_rows="mask", unroll_steps=1))
    medusa = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, target=sig()))
    with pytest.raises(ValueError, match="oov_rows=mask needs a draft vocabulary"):
        Objective(medusa, TrainConfig(oov_rows="mask"))
    assert Objective(make_eagle(draft_vocab_size=20), TrainConfig(oov_rows="mask")).mask_oov
