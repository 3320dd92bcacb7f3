"""EAGLE draft head: one Llama decoder layer that autoregresses on target features.

Features
- Input pair (feature f_t, token x_{t+1}): RMSNorm(embed(x_{t+1})) and RMSNorm(f_t) concatenated,
  mixed by Linear(2H -> H) (EAGLE-1 style), then ONE Llama decoder layer (pre-norm RMSNorm, GQA
  attention with standard rotate_half RoPE, SiLU-gated MLP) and a final RMSNorm. The output
  predicts the target's final post-norm hidden state f_{t+1}; logits come from the target's LM
  head (bound, never saved).
- EAGLE-3 style feature fusion: `target_layer_ids` picks several target hidden states (HF
  `hidden_states` indices, e.g. (2, L//2, L-3)); `fuse` = Linear(n*H -> H) projects their concat.
  Default (L,) = the final post-norm output, with `fuse` = identity.
- Optional reduced draft vocabulary: own `lm_head` [Vd, H] plus a saved `d2t` buffer [Vd] holding
  the TARGET id of each draft id (absolute ids, not EAGLE-3's offsets); `logits` scatters into
  the target vocab with -inf elsewhere. `lm_head_from_target`: the draft vocabulary's LM head
  is the target's rows at d2t (EAGLE-1's shared LM head over EAGLE-3's reduced vocabulary),
  gathered at `bind_target`, frozen and never saved: a smaller checkpoint and fewer weights to
  train (the speculators export writes the rows, as stock vLLM reads an own LM head).
- `forward` runs [B, T] sequences causally (training, multi-step unrolling) or with a KV cache
  and an explicit bool mask (tree drafting).
- `draft_session()`: KV-cached Expander for heads/tree.py's `draft_tree` (see EagleSession).
- `fuse_projections()` (serving): q/k/v and gate/up as one linear layer each, the same output;
  a fused head drafts, it is not trained or saved.
- `layout="eagle3"` (a config field): EAGLE-3's own layer, exactly vLLM 0.32's
  `llama_eagle3.py`: q/k/v read the 2H concat [embed_norm(embedding), feature_norm(feature)]
  (no `combine`, no attention pre-norm), the residual stream starts at the feature (its normed
  value with `norm_before_residual`), and the output feature fed to the next step is the
  PRE-norm residual stream; logits read final_norm(feature). It is the layout the speculators
  format stores (treedraft.heads.speculators converts both ways).
- `norm_output` (eagle3, speculators' `norm_output`): the output feature fed to the next step is
  final_norm(stream) instead of the pre-norm stream; logits read it directly.
- `qk_norm` (Qwen3 draft layers): an RMSNorm over head_dim on each query and key head before
  RoPE, as vLLM's `Qwen3Attention`. `rope_scaling` {"rope_type": "llama3", ...}: Llama-3.1's
  frequency scaling, as vLLM's `Llama3RotaryEmbedding`.
- `fuse_norm` (vLLM/speculators `fc_norm`): an RMSNorm per target layer before `fuse`, so
  SmolLM2's deep layer (token RMS ~20 against ~3 at layer 2) does not drown the others;
  `norm_before_fc`: one RMSNorm over the n*H concat (imported heads only).

Position convention (training and drafting agree): the pair (f_t, x_{t+1}) sits at position t
and its output is fhat_{t+1}.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import ConfigMixin, DraftHead, TargetSignature, register_head

LAYOUTS = ("eagle1", "eagle3")


@dataclass
class EagleConfig(ConfigMixin):
    hidden_size: int  # must equal target.hidden_size (embeddings / LM head are the target's)
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target: TargetSignature
    rms_norm_eps: float = 1e-6  # mirror the target's
    rope_theta: float = 10000.0  # mirror the target's
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    target_layer_ids: tuple[int, ...] | None = None  # None -> (num_hidden_layers,) = final output
    draft_vocab_size: int | None = None  # None -> draft over the full target vocab
    default_tree: str = "dynamic:60,6,8"
    acceptance_rates: list[list[float]] | None = None  # [depth][rank], measured after training
    layout: str = "eagle1"  # eagle1 (combine 2H -> H, then a decoder layer) | eagle3 (see above)
    fuse_norm: bool = False  # RMSNorm per target layer before fuse (speculators `fc_norm`)
    norm_before_fc: bool = False  # one RMSNorm over the n*H concat before fuse
    norm_before_residual: bool = False  # eagle3: the residual starts at the NORMED feature
    lm_head_from_target: bool = False  # with a draft vocab: lm_head = target rows at d2t,
    #   bound and frozen, never saved
    own_embedding: bool = False  # own token embedding [V, H] (imported heads that ship one
    #   different from the target's); default: the target's, bound and never saved
    norm_output: bool = False  # eagle3: the output feature is final_norm(stream)
    qk_norm: bool = False  # RMSNorm(head_dim) on q and k heads before RoPE (Qwen3 layers)
    rope_scaling: dict | None = None  # None, or {"rope_type": "llama3", LLAMA3_ROPE_KEYS...}

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            self.target = TargetSignature.from_dict(self.target)
        if self.hidden_size != self.target.hidden_size:
            raise ValueError(
                f"EagleConfig.hidden_size={self.hidden_size} != target hidden_size="
                f"{self.target.hidden_size}; the head works in the target's hidden space"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        num_layers = self.target.num_hidden_layers
        ids = (num_layers,) if self.target_layer_ids is None else tuple(self.target_layer_ids)
        if not ids or any(not -num_layers - 1 <= i <= num_layers for i in ids):
            raise ValueError(
                f"target_layer_ids={ids} out of range for a {num_layers}-layer target "
                f"(valid: 0..{num_layers}, or negative HF hidden_states indices)"
            )
        self.target_layer_ids = tuple(i % (num_layers + 1) for i in ids)  # -1 -> num_layers
        if self.layout not in LAYOUTS:
            raise ValueError(f"EagleConfig.layout={self.layout!r}; valid: {', '.join(LAYOUTS)}")
        if self.norm_before_residual and self.layout != "eagle3":
            raise ValueError("norm_before_residual is an eagle3-layout option (layout='eagle3')")
        if self.norm_output and self.layout != "eagle3":
            raise ValueError("norm_output is an eagle3-layout option (layout='eagle3')")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        vd = self.draft_vocab_size
        if vd is not None and not 0 < vd <= self.target.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in 1..{self.target.vocab_size}"
            )
        if self.lm_head_from_target and vd is None:
            raise ValueError("lm_head_from_target needs a draft vocabulary (draft_vocab_size): "
                             "a full-vocabulary head drafts with the target's LM head already")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Llama: normalise in float32 (x * rsqrt(mean(x^2) + eps)), cast back, then scale.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def check_rope_scaling(scaling: dict) -> None:
    """Refuse a rope_scaling this module does not compute exactly (only Llama-3.1's)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported (supported: "
                         "'llama3', or no rope_scaling)")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, device) -> Tensor:
    """[head_dim / 2] float32 RoPE frequencies; with Llama-3.1 scaling, vLLM's
    `Llama3RotaryEmbedding`: wavelengths above original_max / low_freq_factor are slowed by
    `factor`, those below original_max / high_freq_factor kept, those between interpolated."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    if scaling is None:
        return inv_freq
    factor, low, high, orig = (float(scaling[k]) for k in LLAMA3_ROPE_KEYS)
    wave_len = 2 * math.pi / inv_freq
    smooth = (orig / wave_len - low) / (high - low) if low != high else 0
    return torch.where(wave_len < orig / high, inv_freq,
                       torch.where(wave_len > orig / low, inv_freq / factor,
                                   (1 - smooth) * inv_freq / factor + smooth * inv_freq))


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions [B, T], `rope_inv_freq` [head_dim / 2] -> cos, sin [B, 1, T, head_dim]
    (float32)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half
    return (x.float() * cos + rotated * sin).to(x.dtype)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of a few queries per head, q [1, nh, T, D], over k, v [1, nkv, S, D] (grouped
    query heads: head h reads kv head h // (nh / nkv)), mask bool [T, S] or [1, S] (True =
    attend) or None: the serving sessions' calls (a decode commit, a tree level). Two grouped
    matmuls in float32 against the session cache's float32 K/V: nothing is repeated or converted
    but the queries. On a 2-core CPU (bf16 head, 9 query / 3 kv heads) per call at 400 keys:
    77 us for one query and 86 for two, where SDPA over repeated bf16 K/V takes 289 and 149 and
    converting a bf16 cache to float32 first 144 and 152."""
    _, nh, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    groups = nh // nkv
    qf = q.reshape(nkv, groups * T, d).to(k.dtype)  # [nkv, groups*T, D]: (group, query) rows
    scores = torch.bmm(qf, k[0].transpose(1, 2)) * d ** -0.5  # [nkv, groups*T, S]
    if mask is not None:
        scores = scores.view(nkv, groups, T, S).masked_fill(~mask.reshape(-1, S), float("-inf"))
    out = torch.bmm(scores.view(nkv, groups * T, S).softmax(-1), v[0])  # [nkv, groups*T, D]
    return out.reshape(1, nh, T, d).to(q.dtype)


# packed segments with more queries than this run SDPA (a prompt's commit); fewer, the grouped
# matmuls (`grouped_attention`: ~2x faster at 1-4 queries on the 2-core CPU), and
# several such segments of one pool attend together (`pooled_attention`)
GROUPED_MAX_QUERIES = 16


def pooled_attention(q: Tensor, k: Tensor, v: Tensor, segs: Sequence[Segment]) -> Tensor | None:
    """The attention of the given segments of a packed row in ONE batched call: q [1, nh, N, D],
    this row's k, v [1, nkv, N, D] (the segments' tokens written into each segment's row of the
    sessions' `KVPool` first), grouped query heads as in `grouped_attention`; returns
    [1, nh, n, D] for the segments' n tokens, in segment order (all N when the segments cover
    the row). Queries are laid out by pool row ([R, Tmax] padded), keys read straight from a
    view of the pool's first R rows and Smax slots (no copy), each row under its causal mask
    (query t of a segment at `at` sees slots 0..at+t) or the segment's own mask; padded queries
    and rows without a segment compute something finite and are dropped. None where it does not
    apply: one segment, a segment with more than GROUPED_MAX_QUERIES queries (a prompt's commit:
    `DecoderLayer.attention` pools the others), caches of different pools, or rows so sparse (a
    few sessions of many) or one context so much longer than the others that reading every row
    that far would cost more than one call per segment."""
    if len(segs) < 2:
        return None
    pool = segs[0].cache.pool
    rows, lens, ats = [], [], []
    for seg in segs:
        if seg.hi - seg.lo > GROUPED_MAX_QUERIES or seg.cache.pool is not pool:
            return None
        rows.append(seg.cache.row)
        lens.append(seg.hi - seg.lo)
        ats.append(seg.at)
    R, Tm = max(rows) + 1, max(lens)
    ends = [a + t for a, t in zip(ats, lens, strict=True)]
    S = max(ends)
    if R > 2 * len(segs) + 2 or R * S > 3 * sum(ends):  # sparse rows, or one long context
        return None  # among short ones: reading R x S slots would cost more than per segment
    dev = q.device
    if sum(lens) != q.shape[2]:  # some of the row's tokens: theirs, in segment order
        sel = torch.tensor([i for seg in segs for i in range(seg.lo, seg.hi)], device=dev)
        q, k, v = q[:, :, sel], k[:, :, sel], v[:, :, sel]
    _, nh, N, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    pool.reserve(R - 1, S, k)
    # token i of segment j: pool row rows[j], slot ats[j] + i, padded query position i
    tok_row = torch.tensor([r for r, t in zip(rows, lens, strict=True) for _ in range(t)],
                           device=dev)
    tok_t = torch.tensor([i for t in lens for i in range(t)], device=dev)
    tok_slot = torch.tensor([a + i for a, t in zip(ats, lens, strict=True) for i in range(t)],
                            device=dev)
    pool.k[tok_row, :, tok_slot] = k[0].transpose(0, 1).to(pool.DTYPE)  # [N, nkv, D]
    pool.v[tok_row, :, tok_slot] = v[0].transpose(0, 1).to(pool.DTYPE)
    qp = q.new_zeros((R, Tm, nh, d), dtype=pool.DTYPE)
    qp[tok_row, tok_t] = q[0].transpose(0, 1).to(pool.DTYPE)
    qp = qp.view(R, Tm, nkv, g, d).permute(0, 2, 3, 1, 4).reshape(R * nkv, g * Tm, d)
    keys = pool.k[:R, :, :S].reshape(R * nkv, S, d)  # views: the pool is [rows, nkv, cap, D]
    values = pool.v[:R, :, :S].reshape(R * nkv, S, d)
    at = torch.zeros(R, dtype=torch.long, device=dev)  # rows without a segment: slot 0 only
    at[rows] = torch.tensor(ats, device=dev)
    mask = (torch.arange(S, device=dev)[None, None]
            <= (at[:, None] + torch.arange(Tm, device=dev)[None])[..., None])  # [R, Tm, S]
    for seg, r, t, a in zip(segs, rows, lens, ats, strict=True):
        if seg.causal or t == 1 and seg.mask is None:
            continue
        # a tree level: its own ancestor mask; no mask: every slot up to its last token
        mask[r, :t, : a + t] = True if seg.mask is None else seg.mask
    scores = torch.bmm(qp, keys.transpose(1, 2)) * d ** -0.5  # [R*nkv, g*Tm, S]
    scores = scores.view(R, nkv, g, Tm, S).masked_fill(~mask[:, None, None], float("-inf"))
    out = torch.bmm(scores.view(R * nkv, g * Tm, S).softmax(-1), values)  # [R*nkv, g*Tm, D]
    out = out.view(R, nkv, g, Tm, d).permute(0, 3, 1, 2, 4).reshape(R, Tm, nh, d)
    return out[tok_row, tok_t].transpose(0, 1)[None].to(q.dtype)  # [1, nh, N, D]


class DecoderLayer(nn.Module):
    """One Llama decoder layer: x + attn(norm(x)), then + mlp(norm(.)).

    eagle3 layout: no attention pre-norm; q/k/v read a 2H input and the caller passes the
    residual (`forward_from`)."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.c = c
        h, d, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        eagle3 = c.layout == "eagle3"
        self.attn_norm = None if eagle3 else RMSNorm(h, c.rms_norm_eps)
        qkv_in = 2 * h if eagle3 else h
        self.q_proj = nn.Linear(qkv_in, nh * d, bias=False)
        self.k_proj = nn.Linear(qkv_in, nkv * d, bias=False)
        self.v_proj = nn.Linear(qkv_in, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(d, c.rms_norm_eps) if c.qk_norm else None
        self.mlp_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.qkv_proj: nn.Linear | None = None  # `fuse_projections` (serving)
        self.gate_up_proj: nn.Linear | None = None
        self._inv_freq: Tensor | None = None  # RoPE frequencies (float32), on the input's device

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """For serving: q/k/v as one linear layer and gate/up as one, their weights stacked by
        rows (one GEMM each instead of three and two, as vLLM's QKVParallelLinear and
        MergedColumnParallelLinear; about 0.03 ms less per head forward on a 2-core CPU at 1-16
        rows, and five fewer kernel launches on a GPU). The separate layers are dropped: a fused
        layer's state_dict has the fused names, so fuse a loaded head, never one to train or to
        save."""
        if self.qkv_proj is not None:
            return

        def stacked(*layers: nn.Linear) -> nn.Linear:
            w = torch.cat([m.weight for m in layers])
            out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            out.weight.copy_(w)
            return out

        self.qkv_proj = stacked(self.q_proj, self.k_proj, self.v_proj)
        self.gate_up_proj = stacked(self.gate_proj, self.up_proj)
        del self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj

    def attention(self, x: Tensor, positions: Tensor, past_kv, attn_mask, packed=None):
        c = self.c
        B, T, _ = x.shape
        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([nh * d, nkv * d, nkv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(B, T, nh, d), k.view(B, T, nkv, d)
        if self.q_norm is not None:  # Qwen3: per-head norms before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, nkv, d).transpose(1, 2)
        if self._inv_freq is None or self._inv_freq.device != x.device:  # computed once
            self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, x.device)
        cos, sin = rope_cos_sin(positions, self._inv_freq)
        q, k = apply_rope(torch.cat([q, k], dim=1), cos, sin).split(  # [B, nh|nkv, T, D]
            [c.num_attention_heads, c.num_key_value_heads], dim=1)
        new_kv = (k, v)  # cached post-RoPE, for these T tokens only
        if packed is not None:  # several sessions' tokens in one row
            o = self._packed(q, k, v, packed)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        S = k.shape[2]  # S_past + T
        if attn_mask is None:
            # causal over past + current: query i (position S-T+i) sees keys 0..S-T+i
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        else:
            if tuple(attn_mask.shape) != (B, T, S) or attn_mask.dtype != torch.bool:
                raise ValueError(
                    f"attn_mask must be bool [B, T, S_past+T] = [{B}, {T}, {S}], "
                    f"got {attn_mask.dtype} {list(attn_mask.shape)}"
                )
            mask = attn_mask[:, None]  # [B, 1, T, S]
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # GQA
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nh, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), new_kv

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, packed: Sequence[Segment]) -> Tensor:
        """Attention of a packed row's segments: the short ones (decode commits, tree levels) in
        one batched call over the sessions' pool (`pooled_attention`), each longer one (a
        prompt's commit, which joins a serving step's commit whenever a request starts drafting)
        alone; every segment alone where the batched call does not apply."""
        short = [seg for seg in packed if seg.hi - seg.lo <= GROUPED_MAX_QUERIES]
        pooled = pooled_attention(q, k, v, short)
        if pooled is None:
            return torch.cat([self._segment(q, k, v, seg) for seg in packed], dim=2)
        if len(short) == len(packed):
            return pooled
        parts, at = [], 0  # in row order; `pooled` holds the short segments' rows in order
        for seg in packed:
            n = seg.hi - seg.lo
            if n > GROUPED_MAX_QUERIES:
                parts.append(self._segment(q, k, v, seg))
            else:
                parts.append(pooled[:, :, at : at + n])
                at += n
        return torch.cat(parts, dim=2)

    def _segment(self, q: Tensor, k: Tensor, v: Tensor, seg: Segment) -> Tensor:
        """One session's queries [1, nh, T, D] of a packed row: its K/V written into its cache at
        `seg.at`, attention over the cache's first at+T slots under `seg.mask` [T, at+T]."""
        lo, hi, at = seg.lo, seg.hi, seg.at
        keys, values = seg.cache.write(at, k[:, :, lo:hi], v[:, :, lo:hi])
        mask = seg.mask
        if seg.causal:  # query i sees slots 0..at+i (one query: every slot)
            mask = None if hi - lo == 1 else (torch.arange(at + hi - lo, device=q.device)[None]
                                              <= torch.arange(at, at + hi - lo,
                                                              device=q.device)[:, None])
        if hi - lo <= GROUPED_MAX_QUERIES:  # a decode commit, a tree level: grouped matmuls
            return grouped_attention(q[:, :, lo:hi], keys, values, mask)
        groups = self.c.num_attention_heads // self.c.num_key_value_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        mask = None if mask is None else mask[None, None]
        return F.scaled_dot_product_attention(q[:, :, lo:hi].to(keys.dtype), keys, values,
                                              attn_mask=mask).to(q.dtype)

    def forward(self, x: Tensor, positions: Tensor, past_kv=None, attn_mask=None, packed=None):
        return self.forward_from(self.attn_norm(x), x, positions, past_kv, attn_mask, packed)

    def forward_from(self, attn_in: Tensor, residual: Tensor, positions: Tensor, past_kv=None,
                     attn_mask=None, packed=None):
        """residual + attn(attn_in), then + mlp(norm(.)); returns (x, this step's kv)."""
        a, new_kv = self.attention(attn_in, positions, past_kv, attn_mask, packed)
        x = residual + a
        h = self.mlp_norm(x)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        x = x + self.down_proj(F.silu(gate) * up)
        return x, new_kv


def _retie_lm_head(head: EagleHead, incompatible_keys) -> None:
    """After load_state_dict (a new d2t): a bound lm_head_from_target head takes its rows."""
    if head.target_lm_head is not None:
        head._tie_lm_head()


@register_head("eagle")
class EagleHead(DraftHead):
    config_class = EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__(config)
        h, n = config.hidden_size, len(config.target_layer_ids)
        eps = config.rms_norm_eps
        self.fuse_input_norm = RMSNorm(n * h, eps) if config.norm_before_fc else None
        self.fuse_norms = (nn.ModuleList(RMSNorm(h, eps) for _ in range(n))
                           if config.fuse_norm else None)
        self.fuse = nn.Linear(n * h, h, bias=False) if n > 1 else nn.Identity()
        self.embed_norm = RMSNorm(h, eps)
        self.feature_norm = RMSNorm(h, eps)
        self.eagle3 = config.layout == "eagle3"
        self.combine = None if self.eagle3 else nn.Linear(2 * h, h, bias=False)
        self.embed_tokens = (nn.Embedding(config.target.vocab_size, h)
                             if config.own_embedding else None)
        self.layer = DecoderLayer(config)
        self.final_norm = RMSNorm(h, config.rms_norm_eps)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)  # [Vd, H]
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size))  # draft -> target id
            if config.lm_head_from_target:  # the target's rows (`_tie_lm_head`): not a weight
                del self.lm_head.weight
                self.lm_head.register_buffer("weight", torch.zeros(config.draft_vocab_size, h),
                                             persistent=False)
                self.register_load_state_dict_post_hook(_retie_lm_head)  # a loaded d2t

    def fuse_projections(self) -> None:
        """Serving: the layer's q/k/v and gate/up as one linear layer each
        (`DecoderLayer.fuse_projections`: a fused head is for drafting, not training or
        saving)."""
        self.layer.fuse_projections()

    def bind_target(self, embed_weight: Tensor | None, lm_head_weight: Tensor | None) -> None:
        super().bind_target(embed_weight, lm_head_weight)
        if lm_head_weight is not None and self.config.lm_head_from_target:
            self._tie_lm_head()

    def _tie_lm_head(self) -> None:
        """lm_head = the bound target LM head's rows at d2t (lm_head_from_target)."""
        rows = self._bound("target_lm_head")
        w = self.lm_head.weight
        self.lm_head.weight = rows[self.d2t.to(rows.device)].to(device=w.device, dtype=w.dtype)

    def set_draft_vocab(self, target_ids: Tensor, init_from_target: bool = True) -> None:
        """Set the target id of each draft id; optionally copy those rows of the target LM head."""
        vd, v = self.config.draft_vocab_size, self.config.target.vocab_size
        if vd is None:
            raise ValueError("this head drafts over the full target vocab (draft_vocab_size=None)")
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        if ids.shape != (vd,) or ids.unique().numel() != vd or ids.min() < 0 or ids.max() >= v:
            raise ValueError(f"target_ids must be {vd} distinct ids in 0..{v - 1}")
        self.d2t.copy_(ids)
        if self.config.lm_head_from_target:
            if self.target_lm_head is not None:
                self._tie_lm_head()
        elif init_from_target:
            with torch.no_grad():
                self.lm_head.weight.copy_(self._bound("target_lm_head")[ids.to(self.d2t.device)])

    def project(self, target_hidden: Tensor) -> Tensor:
        """target_hidden [..., T, n*H] (layers of target_layer_ids, concatenated) -> [..., T, H]."""
        want = len(self.config.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != want:
            raise ValueError(
                f"target hidden has last dim {target_hidden.shape[-1]}, expected {want} = "
                f"{len(self.config.target_layer_ids)} layers {self.config.target_layer_ids} x "
                f"hidden {self.config.hidden_size}"
            )
        x = target_hidden
        if self.fuse_input_norm is not None:
            x = self.fuse_input_norm(x)
        if self.fuse_norms is not None:
            chunks = x.chunk(len(self.fuse_norms), dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fuse_norms, chunks, strict=True)], -1)
        return self.fuse(x)

    def forward(self, features: Tensor, input_ids: Tensor, positions: Tensor,
                past_kv: tuple[Tensor, Tensor] | None = None, attn_mask: Tensor | None = None,
                packed: list[Segment] | None = None):
        """Run pairs (features[b, t], input_ids[b, t]) at positions[b, t].

        features [B, T, H] (projected), input_ids/positions [B, T]; past_kv (k, v) [B, Hkv, S, D];
        attn_mask bool [B, T, S+T] (True = attend), None = causal over past + current.
        Returns out_features [B, T, H] (predicted next features; eagle3: the pre-norm residual
        stream) and (k, v) [B, Hkv, T, D] of these T tokens.
        packed: B == 1 holds several sessions' tokens, one `Segment` each; attention runs per
        segment against that session's cache (written in place); returns (out_features, None).
        """
        embed = (self.embed_tokens.weight if self.embed_tokens is not None
                 else self._bound("target_embed"))
        e = F.embedding(input_ids, embed).to(features.dtype)  # [B, T, H]
        f = self.feature_norm(features)
        if self.eagle3:  # vLLM llama_eagle3.py: attention reads the 2H concat
            residual = f if self.config.norm_before_residual else features
            x, new_kv = self.layer.forward_from(torch.cat([self.embed_norm(e), f], dim=-1),
                                                residual, positions, past_kv, attn_mask, packed)
            return (self.final_norm(x) if self.config.norm_output else x), new_kv
        x = self.combine(torch.cat([self.embed_norm(e), f], dim=-1))
        x, new_kv = self.layer(x, positions, past_kv, attn_mask, packed)
        return self.final_norm(x), new_kv

    def draft_logits(self, feature: Tensor) -> Tensor:
        """[..., H] -> [..., Vd] over the draft vocab (or [..., V] without one)."""
        if self.eagle3 and not self.config.norm_output:  # else the feature is normed already
            feature = self.final_norm(feature)
        if self.config.draft_vocab_size is None:
            return F.linear(feature, self._bound("target_lm_head").to(feature.dtype))
        if self.config.lm_head_from_target:
            self._bound("target_lm_head")  # its rows are the LM head: unbound, it is zeros
        return self.lm_head(feature)

    def logits(self, feature: Tensor) -> Tensor:
        """[..., H] -> [..., V_target]; with a draft vocab, -inf outside it."""
        lg = self.draft_logits(feature)
        if self.config.draft_vocab_size is None:
            return lg
        full = lg.new_full((*lg.shape[:-1], self.config.target.vocab_size), float("-inf"))
        return full.index_copy(-1, self.d2t, lg)

    def draft_session(self) -> EagleSession:
        return EagleSession(self)

    @property
    def kv_pool(self) -> KVPool:
        """The K/V of this head's draft sessions (created with the first session; not a
        buffer: never saved, never moved by `.to()`, reallocated on the device a write asks)."""
        pool = self.__dict__.get("_kv_pool")
        if pool is None:
            pool = self.__dict__["_kv_pool"] = KVPool()
        return pool

    @classmethod
    def target_problems(cls, config: EagleConfig, target: TargetSignature) -> list[str]:
        out = config.target.mismatches(target)
        L = target.num_hidden_layers
        if any(i > L for i in config.target_layer_ids):
            out.append(
                f"head reads target layers {config.target_layer_ids}, target has only {L} "
                f"layers (valid ids 0..{L})"
            )
        return out


@dataclass
class Segment:
    """One session's tokens lo..hi of a packed row (see `EagleHead.forward(packed=...)`)."""

    lo: int
    hi: int
    cache: KVCache  # the session's K/V; these tokens are written at slots at..at+T-1
    at: int
    mask: Tensor | None  # bool [T, at+T] over the cache slots (True = attend); None = all
    causal: bool = False  # instead of mask: query i sees slots 0..at+i


class KVPool:
    """The K/V of every draft session of one head, [rows, Hkv, capacity, D] each, in float32
    whatever the head's dtype (a bf16 head's K/V are stored exactly; attention reads them
    without converting). A session holds one row (`KVCache`), released when the session is
    dropped and handed to the next; the decode commits and tree levels of many sessions attend
    in one batched call over a view of the pool (`pooled_attention`). Grows by doubling its rows
    or its capacity (copying what it holds); the capacity follows the longest session, so it
    holds rows x capacity x Hkv x D x 8 bytes. Slots nobody wrote are zeros: a batched call
    reads past a row's length (masked), and masked garbage could be NaN."""

    DTYPE = torch.float32

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._free: list[int] = []  # released rows, a heap: the lowest is reused first
        self._rows = 0  # rows ever handed out

    def acquire(self) -> int:
        """A free row; a reused one is zeroed (a batched call reads past the new session's
        length, masked: a non-finite value left there would still reach its output)."""
        if self._free:
            row = heapq.heappop(self._free)
            if self.k is not None and row < self.k.shape[0]:
                self.k[row].zero_()
                self.v[row].zero_()
            return row
        self._rows += 1
        return self._rows - 1

    def release(self, row: int) -> None:
        heapq.heappush(self._free, row)

    def reserve(self, row: int, end: int, like: Tensor) -> None:
        """Make rows 0..row hold slots 0..end-1 (like: a [1, Hkv, T, D] tensor of the head)."""
        k = self.k
        if (k is not None and row < k.shape[0] and end <= k.shape[2]
                and k.device == like.device):
            return
        rows = cap = 0
        if k is not None:
            rows, cap = k.shape[0], k.shape[2]
        shape = (rows if row < rows else max(row + 1, 2 * rows, 4), like.shape[1],
                 cap if end <= cap else max(end, 2 * cap, 64), like.shape[3])
        nk = torch.zeros(shape, dtype=self.DTYPE, device=like.device)
        nv = torch.zeros(shape, dtype=self.DTYPE, device=like.device)
        if k is not None:
            nk[:rows, :, :cap] = k
            nv[:rows, :, :cap] = self.v
        self.k, self.v = nk, nv


class KVCache:
    """One session's head K/V: a row of its head's `KVPool` (slot i = the session's i-th cached
    pair or tree node), written in place; the row goes back to the pool with the session."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.row = pool.acquire()
        weakref.finalize(self, pool.release, self.row)

    def write(self, at: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [1, Hkv, T, D] at slots at..at+T-1; views [1, Hkv, at+T, D] of slots
        0..at+T-1."""
        end, r, pool = at + k.shape[2], self.row, self.pool
        pool.reserve(r, end, k)
        pool.k[r, :, at:end] = k[0]
        pool.v[r, :, at:end] = v[0]
        return pool.k[r : r + 1, :, :end], pool.v[r : r + 1, :, :end]


class EagleSession:
    """Stateful drafting with an EagleHead (one request); implements heads/tree.py's Expander.

    Positions, with n = number of committed pairs so far (the root token x_n is the bonus token):
    - commit: pair (f_t, x_{t+1}) sits at position t; the root pair (f_{n-1}, x_n) at n-1.
      Its output fhat_n is the ROOT feature; expand([0]) = log_softmax(logits(fhat_n)).
    - a tree node at depth d >= 1 with token y (a candidate for x_{n+d}) runs the pair
      (fhat of its PARENT, y) at position n-1+d and attends to every committed pair, the pairs
      of its depth>=1 ancestors, and itself. Its output is the feature whose logits give its
      children. This is exactly what a chain commit of the path would compute.
    The K/V cache holds the committed pairs (slots 0..C-1, C = length - start), then the current
    tree's nodes in the order they ran; the next commit or new tree overwrites the node slots.

    Sessions of one head batch across requests: `commit_many` and `topk_lists_many` run every
    session's tokens of a step (or of a tree level) in ONE packed head forward and one LM-head
    matmul, attention per session against its own cache (heads/tree.py `draft_trees` uses
    them). One session alone takes the same path: the math lives once.
    """

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.length = 0  # committed pairs = next pair position
        self.start = 0  # position of the first pair in the cache (> 0 after a rewind past a gap)
        self.cache = KVCache(head.kv_pool)
        self.last_token: int | None = None
        self.root_feature: Tensor | None = None  # [H] output of the last committed pair
        self._reset_tree()

    def _reset_tree(self) -> None:
        self.feat: dict[int, Tensor] = {0: self.root_feature}  # node -> output feature [H]
        self.depth: dict[int, int] = {0: 0}
        self.tree_nodes: list[int] = []  # node id of each tree slot (after the committed ones)

    # ---------------------------------------------------------------- one session
    def commit(self, target_hidden: Tensor, tokens: Tensor) -> None:
        """Append pairs (target_hidden[i], tokens[i]); target_hidden [T, n*H], tokens [T]."""
        self.commit_many([(self, target_hidden, tokens)])

    def rewind(self, length: int) -> None:
        """Make `length` the next pair position before a commit.

        length < self.length: drop the later pairs (a rollback, e.g. a recomputed request).
        length > self.length: the target skipped positions the head never saw (a prefix-cache
        hit); restart with no draft context at that position. Drafts stay valid, only weaker.
        """
        if length == self.length:
            return
        if length < 0:
            raise ValueError(f"rewind position must be >= 0, got {length}")
        if not self.start < length < self.length:
            # back to (or before) the first kept pair, or forward past a gap: no context
            self.start = length
        self.length = length  # cache slots past length - start are overwritten by the commit
        self.last_token, self.root_feature = None, None
        self._reset_tree()

    def cached_prefix(self, n: int | None = None) -> tuple[Tensor, Tensor]:
        """K, V [Hkv, n, D] (float32 copies) of committed pairs 0..n-1, n <= length (all of
        them by default): what `seed` takes. Only a session whose cache starts at position 0."""
        n = self.length if n is None else n
        if self.start != 0 or not 0 < n <= self.length:
            raise ValueError(f"cached_prefix({n}): this session holds pairs {self.start}.."
                             f"{self.length - 1}; it exports pairs 0..n-1 of a session that "
                             "starts at 0")
        pool, r = self.cache.pool, self.cache.row
        return pool.k[r, :, :n].clone(), pool.v[r, :, :n].clone()

    def seed(self, k: Tensor, v: Tensor) -> None:
        """Start a new session at position n with K, V [Hkv, n, D] of pairs 0..n-1 that a
        session of this head committed for the same n + 1 tokens (`cached_prefix`): pair p's K/V
        depend only on tokens 0..p+1 (through the target's features), so the session holds what
        committing those pairs would have given it. The next commit is pair n. Serving uses it
        for a request whose first tokens the target took from its prefix cache (it computes no
        features there for the head to commit)."""
        if self.length:
            raise ValueError("seed starts a new session: this one has committed pairs")
        if k.ndim != 3 or k.shape != v.shape or not k.shape[1]:
            raise ValueError(f"seed expects K, V [Hkv, n, D] with n >= 1, got "
                             f"{list(k.shape)} and {list(v.shape)}")
        p = next(self.head.parameters())
        self.cache.write(0, k[None].to(p.device), v[None].to(p.device))
        self.start, self.length = 0, k.shape[1]

    @torch.no_grad()
    def expand(self, tree, nodes: list[int]) -> Tensor:
        """Log-probs [len(nodes), V_target] of each node's CHILD token (float32)."""
        feats = self._features_many([(self, tree, nodes)])[0]
        return torch.log_softmax(self.head.logits(feats).float(), dim=-1)

    def expand_topk(self, tree, nodes: list[int], k: int) -> tuple[Tensor, Tensor]:
        """Top-k (log-probs [N, k] float32, target token ids [N, k]) of each node's child.

        Same values as `expand(...).topk(k)`, computed over the draft vocabulary only: with a
        reduced draft vocab this skips the scatter into, softmax over and top-k of the full one.
        """
        values, idx = self._topk_many([(self, tree, nodes, k)])
        return values[:, :k], idx[:, :k]

    # ---------------------------------------------------------------- many sessions, one forward
    @staticmethod
    @torch.no_grad()
    def commit_many(items) -> None:
        """`commit` for several sessions of one head: items (session, target_hidden [T, n*H],
        tokens [T]); all pairs in one packed forward."""
        head = items[0][0].head
        p = next(head.parameters())
        hidden, ids, pos, segs, lo = [], [], [], [], 0
        for s, target_hidden, tokens in items:
            if s.head is not head:
                raise ValueError("commit_many: every session must belong to the same head")
            T = target_hidden.shape[0] if target_hidden.ndim == 2 else 0
            if target_hidden.ndim != 2 or tokens.shape != (T,) or not T:
                raise ValueError(
                    f"commit expects target_hidden [T, n*H] and tokens [T] with T >= 1, got "
                    f"{list(target_hidden.shape)} and {list(tokens.shape)}"
                )
            C = s.length - s.start
            hidden.append(target_hidden)
            ids.append(tokens)
            pos += range(s.length, s.length + T)
            # causal: pair i sees the committed pairs and pairs 0..i of this commit (the mask is
            # built only where the session attends alone: `DecoderLayer._segment`)
            segs.append(Segment(lo, lo + T, s.cache, C, None, causal=True))
            lo += T
        feats = head.project(torch.cat(hidden).to(p.device, p.dtype))[None]  # [1, N, H]
        out, _ = head(feats, torch.cat(ids).to(p.device)[None],
                      torch.tensor(pos, device=p.device)[None], packed=segs)
        for (s, _, tokens), seg in zip(items, segs, strict=True):
            s.length += seg.hi - seg.lo
            s.last_token = int(tokens[-1])
            s.root_feature = out[0, seg.hi - 1]
            s._reset_tree()

    @staticmethod
    @torch.no_grad()
    def topk_lists_many(items) -> list[tuple[list, list]]:
        """`expand_topk` for several sessions of one head, as Python lists (heads/tree.py
        drafting reads lists): items (session, tree, nodes, k); the missing nodes of all trees
        run in one packed forward, the logits in one matmul, converted in two calls."""
        values, idx = EagleSession._topk_many(items)
        values, idx = values.tolist(), idx.tolist()
        out, lo = [], 0
        for _, _, nodes, k in items:
            hi = lo + len(nodes)
            out.append(([v[:k] for v in values[lo:hi]], [t[:k] for t in idx[lo:hi]]))
            lo = hi
        return out

    @staticmethod
    @torch.no_grad()
    def _topk_many(items) -> tuple[Tensor, Tensor]:
        """Top-max(k) log-probs and target ids [sum of len(nodes), kmax] of items (session, tree,
        nodes, k)."""
        lg, d2t, _ = EagleSession.draft_logits_many([(s, t, nodes) for s, t, nodes, _ in items])
        kmax = max(k for *_, k in items)
        if kmax > lg.shape[-1]:
            raise ValueError(f"cannot draft {kmax} distinct children from a vocabulary of "
                             f"{lg.shape[-1]}")
        values, idx = torch.log_softmax(lg, dim=-1).topk(kmax, dim=-1)
        return values, (idx if d2t is None else d2t[idx])

    @staticmethod
    @torch.no_grad()
    def draft_logits_many(items) -> tuple[Tensor, Tensor | None, int]:
        """Items (session, tree, nodes): the nodes' logits [sum of len(nodes), Vd] (float32)
        over the head's draft vocabulary, all items' missing nodes in one packed forward and
        one matmul; the draft -> target id map (None: the full vocabulary); the target's
        vocabulary size (heads.sampling.draft_chains)."""
        feats = EagleSession._features_many(items)
        head = items[0][0].head
        return (head.draft_logits(torch.cat(feats)).float(), getattr(head, "d2t", None),
                head.config.target.vocab_size)

    @staticmethod
    def _features_many(items) -> list[Tensor]:
        """Per item (session, tree, nodes): the nodes' output features [len(nodes), H], after
        running the missing ones of all sessions together (one packed forward per wave; one wave
        when callers expand level by level)."""
        pending = []
        for s, tree, nodes in items:
            if s.head is not items[0][0].head:
                raise ValueError("sessions drafted together must belong to the same head")
            pending.append((s, tree, s._todo(tree, nodes)))
        while True:
            jobs = []
            for s, tree, todo in pending:
                if not todo:
                    continue
                parents = _parent_list(tree)
                ready = [n for n in todo if parents[n] in s.feat]
                if not ready:
                    raise ValueError(f"cannot expand nodes {todo}: their parents were never "
                                     "expanded")
                jobs.append((s, tree, parents, ready))
            if not jobs:
                break
            EagleSession._run_nodes(jobs)
            pending = [(s, tree, [n for n in todo if n not in s.feat]) for s, tree, todo in pending]
        return [torch.stack([s.feat[n] for n in nodes]) for s, _, nodes in items]

    def _todo(self, tree, nodes: list[int]) -> list[int]:
        """The listed nodes without features yet (a request for the root starts a new tree)."""
        if self.length == 0:
            raise RuntimeError("commit target hidden states before drafting (nothing committed)")
        if 0 in nodes:
            root = _token_list(tree)[0]
            if root != self.last_token:
                raise ValueError(
                    f"tree root token {root} != last committed token {self.last_token}; "
                    "the root must be the bonus token passed last to commit"
                )
            self._reset_tree()
        return [n for n in dict.fromkeys(nodes) if n not in self.feat]

    @staticmethod
    def _run_nodes(jobs) -> None:
        """One packed forward over jobs (session, tree, parents, nodes); parents have features.

        A node attends to its session's committed pairs, the earlier tree slots that are its
        ancestors, and itself. A level of one node whose ancestors fill every earlier tree slot
        (a chain's, or any tree's first level) sees every slot: it runs without a mask."""
        head = jobs[0][0].head
        dev = next(head.parameters()).device
        feats, ids, pos, segs, lo = [], [], [], [], 0
        for s, tree, parents, nodes in jobs:
            depth, M, T = s.depth, len(s.tree_nodes), len(nodes)
            for n in nodes:
                depth[n] = depth[parents[n]] + 1  # parents ran before their children
            feats += [s.feat[parents[n]] for n in nodes]
            tokens = _token_list(tree)
            ids += [tokens[n] for n in nodes]
            pos += [s.length - 1 + depth[n] for n in nodes]
            C = s.length - s.start  # committed pairs held in the cache
            mask = None
            if T > 1 or depth[nodes[0]] - 1 != M:
                slot = {node: j for j, node in enumerate(s.tree_nodes)}
                rows = []
                for i, n in enumerate(nodes):
                    row = [False] * (M + T)
                    a = parents[n]
                    while a > 0:
                        row[slot[a]] = True
                        a = parents[a]
                    row[M + i] = True
                    rows.append(row)
                mask = torch.cat([torch.ones(T, C, dtype=torch.bool),
                                  torch.tensor(rows, dtype=torch.bool)], dim=1).to(dev)
            segs.append(Segment(lo, lo + T, s.cache, C + M, mask))
            lo += T
        out, _ = head(torch.stack(feats)[None], torch.tensor(ids, device=dev)[None],
                      torch.tensor(pos, device=dev)[None], packed=segs)
        for (s, _, _, nodes), seg in zip(jobs, segs, strict=True):
            s.tree_nodes += nodes
            for i, n in enumerate(nodes):
                s.feat[n] = out[0, seg.lo + i]


def _parent_list(tree) -> list[int]:
    """A tree's parents as a list (a GrowingTree holds one; a DraftTree's tensor converted)."""
    return getattr(tree, "parent_list", None) or tree.parents.tolist()


def _token_list(tree) -> list[int]:
    return getattr(tree, "token_list", None) or tree.tokens.tolist()
