"""Training objectives of the draft heads on a `features.Batch`.

Features
- `soft_kl`: forward KL(p_target || q_draft) per row, dense or top-k labels. Its gradient is
  that of the soft cross-entropy; KL reads better (0 = the draft matches the target).
- EAGLE with multi-step unrolling, EAGLE-3's "training-time test" (`eagle_unroll`, `ttt_mask`):
  the head is trained on its own predicted features D steps deep, exactly as it drafts.
- Medusa: head k against the target's distribution k positions further (`medusa_rows`).
- Optional EAGLE-1 feature regression (smooth L1 to the target's final hidden state).
- Metrics: top-1 agreement with the target per step / head, and top-k rank hits, from which
  `acceptance_rates` (per depth, per rank) are estimated (`measure_acceptance`).

Offsets (positions are 0-based; x_i = token i, f_i = target feature at position i):
  EAGLE step 0 at position t runs the pair (f_t, x_{t+1}) and outputs fhat_{t+1}, whose logits
  predict x_{t+2}; the label is the target's distribution at position t+1.
  EAGLE step k >= 1 at position t runs (out_{k-1}[t-1], x_{t+1}): at inference this is the
  depth-k chain node with token x_{t+1} drafted from the last REAL pair at position t-k (root
  x_{t-k+1}, chain tokens x_{t-k+2}..x_{t+1} at positions t-k+1..t). It predicts x_{t+2}, so its
  label is again the target's distribution at position t+1; it is valid for t >= k. Its query
  attends to the real step-0 keys at positions <= t-k and to the step-j key at position t-k+j
  for j = 1..k (its chain ancestors and itself).
  Medusa head k (1..K) at position t reads f_t and predicts x_{t+1+k}: label = the target's
  distribution at position t+k.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .features import Batch, Labels


def soft_kl(logits: Tensor, labels: Labels, rows: Tensor) -> Tensor:
    """KL(p || softmax(logits)) per row; logits [N, V'] over the label vocab, rows [N] of labels."""
    logq = torch.log_softmax(logits.float(), -1)
    logp = labels.logprobs[rows]
    p = logp.exp()
    if labels.ids is None:  # dense: logp is finite everywhere
        return (p * (logp - logq)).sum(-1)
    # top-k labels: q at the listed ids only; ids dropped by a draft vocab have logp = -inf
    logq = logq.gather(-1, labels.ids[rows])
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def ttt_mask(T: int, k: int, device=None) -> Tensor:
    """Attention of unroll step k over the keys of steps 0..k: bool [T, (k+1)*T].

    Query t sees step-0 keys s <= t-k (real features) and, for j = 1..k, the step-j key at
    s = t-k+j (its own chain); j = k is the query itself.
    """
    t = torch.arange(T, device=device)[:, None]
    s = torch.arange(T, device=device)[None]
    return torch.cat([s <= t - k] + [s == t - k + j for j in range(1, k + 1)], dim=1)


def eagle_rows(label_index: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Queries of step k: mask [B, T-1] over positions t, and their label rows [N].

    Valid iff t >= k and position t+1 has a label (x_{t+2} is a reply token).
    """
    lab = label_index[:, 1:]  # label of query t = target distribution at position t+1
    t = torch.arange(lab.shape[1], device=lab.device)[None]
    mask = (lab >= 0) & (t >= k)
    return mask, lab[mask]


def eagle_unroll(head, batch: Batch, steps: int, forward=None
                 ) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """Yield (k, out [B, T-1, H], query mask [B, T-1], label rows [N]) for k = 0..steps-1.

    `forward`: head.forward, or a compiled version of it (TrainConfig.compile)."""
    forward = forward or head
    B, T = batch.input_ids.shape
    feats = head.project(batch.features[:, : T - 1])  # [B, T-1, H]: f_t for t = 0..T-2
    x_next = batch.input_ids[:, 1:]  # [B, T-1]: x_{t+1}
    pos = torch.arange(T - 1, device=x_next.device).expand(B, -1)
    label_index = batch.label_index()
    ks, vs, out = [], [], None
    for k in range(steps):
        if k == 0:
            out, (kk, vv) = forward(feats, x_next, pos)  # causal
        else:
            # step k at t takes step k-1's output at t-1 (position 0 has no input: masked out)
            inp = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
            past = (torch.cat(ks, 2), torch.cat(vs, 2))  # [B, Hkv, k*(T-1), D]
            mask = ttt_mask(T - 1, k, x_next.device).expand(B, -1, -1)
            out, (kk, vv) = forward(inp, x_next, pos, past_kv=past, attn_mask=mask)
        ks.append(kk)
        vs.append(vv)
        qmask, rows = eagle_rows(label_index, k)
        yield k, out, qmask, rows


def eagle_loss(head, batch: Batch, weights: list[float], feature_loss_weight: float = 0.0,
               forward=None, kl=soft_kl, mask_oov: bool = False) -> tuple[Tensor, dict]:
    """Weighted sum over unroll steps of mean KL (+ feature regression); metrics per step.

    `forward` / `kl`: head.forward and soft_kl, or compiled versions of them. `mask_oov`
    (EAGLE-3's recipe): rows whose target argmax lies outside the head's draft vocabulary are
    left out of the loss (the head cannot produce that token); the metrics count every row."""
    total = batch.features.new_zeros(())
    kls, top1 = [], []
    # [N_labels] the target's argmax is draftable: per label row, the same at every unroll step
    inside = torch.isin(batch.labels.top1, head.d2t) if mask_oov else None
    for k, out, qmask, rows in eagle_unroll(head, batch, len(weights), forward):
        sel = out[qmask]  # [N, H]
        logits = head.draft_logits(sel)  # [N, Vd]
        if not len(rows):
            loss_k = sel.sum() * 0
        elif inside is not None:
            w = inside[rows].to(logits.dtype)
            loss_k = (kl(logits, batch.labels, rows) * w).sum() / w.sum().clamp(min=1)
        else:
            loss_k = kl(logits, batch.labels, rows).mean()
        if feature_loss_weight and batch.final_hidden is not None and len(rows):
            target = batch.final_hidden[:, 1:][qmask]  # f_{t+1}
            loss_k = loss_k + feature_loss_weight * F.smooth_l1_loss(sel.float(), target)
        total = total + weights[k] * loss_k
        kls.append(float(loss_k.detach()))
        top1.append(_agreement(head, logits, batch.labels.top1[rows]))
    return total, {"kl": kls, "top1": top1}


def _draft_ids(head, logits: Tensor, k: int) -> Tensor:
    """Top-k draft tokens [N, k] in TARGET vocab ids."""
    idx = logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
    d2t = getattr(head, "d2t", None)
    return d2t[idx] if d2t is not None else idx


def _agreement(head, logits: Tensor, top1: Tensor) -> float:
    if not len(top1):
        return float("nan")
    return float((_draft_ids(head, logits.detach(), 1)[:, 0] == top1).float().mean())


def medusa_rows(label_index: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Queries of head k (1-based): mask [B, T] over positions t, and label rows [N].

    Valid iff position t+k exists and has a label (x_{t+1+k} is a reply token).
    """
    lab = torch.full_like(label_index, -1)
    lab[:, : label_index.shape[1] - k] = label_index[:, k:]
    mask = lab >= 0
    return mask, lab[mask]


def medusa_head_logits(heads, k: int, x: Tensor) -> Tensor:
    """Logits of head k (0-based) alone: MedusaHeads.forward restricted to one head, so the
    loss runs the big LM head only at the positions that head is trained on."""
    h = heads.heads[k](x)
    if heads.config.own_lm_head:
        return heads.lm_heads[k](h)
    return F.linear(h, heads._bound("target_lm_head").to(h.dtype))


def medusa_loss(heads, batch: Batch, weights: list[float], kl=soft_kl) -> tuple[Tensor, dict]:
    """Weighted sum over heads of mean KL; head k reads the target's FINAL hidden state."""
    hidden = batch.final_hidden if batch.final_hidden is not None else batch.features
    label_index = batch.label_index()
    total = hidden.new_zeros(())
    kls, top1 = [], []
    for k in range(heads.config.num_heads):
        qmask, rows = medusa_rows(label_index, k + 1)
        logits = medusa_head_logits(heads, k, hidden[qmask])
        loss_k = kl(logits, batch.labels, rows).mean() if len(rows) else logits.sum() * 0
        total = total + weights[k] * loss_k
        kls.append(float(loss_k.detach()))
        top1.append(_agreement(heads, logits, batch.labels.top1[rows]))
    return total, {"kl": kls, "top1": top1}


@torch.no_grad()
def rank_hits(head, batch: Batch, depth: int, topk: int) -> tuple[Tensor, Tensor]:
    """Teacher-forced hits [depth, topk] (draft rank-r token == target argmax) and counts [depth].

    Depth d+1 is unroll step d (EAGLE) or head d+1 (Medusa), with the true tokens as parents.
    """
    hits = torch.zeros(depth, topk)
    counts = torch.zeros(depth)
    if head.head_type == "eagle":
        steps = ((k, out[q], rows) for k, out, q, rows in eagle_unroll(head, batch, depth))
        outs = ((k, head.draft_logits(sel), rows) for k, sel, rows in steps)
    else:
        hidden = batch.final_hidden if batch.final_hidden is not None else batch.features
        label_index = batch.label_index()

        def medusa_outs():
            for k in range(depth):
                q, rows = medusa_rows(label_index, k + 1)
                yield k, medusa_head_logits(head, k, hidden[q]), rows

        outs = medusa_outs()
    for k, logits, rows in outs:
        r = min(topk, logits.shape[-1])
        match = _draft_ids(head, logits, r) == batch.labels.top1[rows][:, None]  # [N, r]
        hits[k, :r] += match.float().sum(0).cpu()
        counts[k] += len(rows)
    return hits, counts


def acceptance_rates(hits: Tensor, counts: Tensor) -> list[list[float]]:
    """rates[d][r] = P(rank-r draft token == target's greedy token at depth d+1), teacher forced.

    Clamped to be non-increasing along ranks, so `build_static_paths` stays optimal (tree.py).
    """
    rates = (hits / counts.clamp(min=1)[:, None]).tolist()
    for row in rates:
        for r in range(1, len(row)):
            row[r] = min(row[r], row[r - 1])
    return [[round(v, 5) for v in row] for row in rates]
