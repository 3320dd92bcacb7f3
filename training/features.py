"""Target features and soft labels for training, streamed (default) or from a disk cache.

Features
- `pad_batch`: right-padded [B, T] ids; positions are 0..T-1 in every row, as in drafting.
- `TargetFeatures(model, ...)(seqs) -> Batch`: ONE no-grad forward of the frozen target's base
  model with output_hidden_states. Head inputs = HF hidden_states[k] for k in target_layer_ids,
  concatenated; soft labels = the target's next-token log-probs, computed only at positions whose
  next token is a reply token (the LM head runs there only). Nothing touches the disk.
- Draft vocabulary: with `label_ids` (the head's d2t) the labels are the target's distribution
  restricted to those ids and renormalised (log_softmax over the subset); `top1` stays the full-
  vocab argmax, so top-1 agreement is measured honestly.
- `FeatureCache`: optional, for several epochs over the same data: sharded safetensors holding
  bf16 features and the top-k of the target distribution per label position; a cached batch is
  a `Batch` with sparse labels (ids + log-probs, renormalised over the draft vocab if any).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .generate import Seq


@dataclass
class Labels:
    """Soft labels, one row per label position (row-major over the batch)."""

    logprobs: Tensor  # [N, V'] dense over the label vocab, or [N, k] top-k (then ids is set)
    ids: Tensor | None  # [N, k] label-vocab ids of the top-k columns; None = dense
    top1: Tensor  # [N] the target's argmax, TARGET vocab ids


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] right padded with 0
    attention: Tensor  # [B, T] bool, True = real token
    label_mask: Tensor  # [B, T] bool: position p has a label (token p+1 is a reply token)
    features: Tensor  # [B, T, n*H] head inputs (target layers of target_layer_ids)
    final_hidden: Tensor | None  # [B, T, H] target final post-norm hidden (feature regression)
    labels: Labels

    def to(self, device) -> Batch:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        lab = self.labels
        return Batch(*(move(t) for t in (self.input_ids, self.attention, self.label_mask,
                                          self.features, self.final_hidden)),
                     Labels(move(lab.logprobs), move(lab.ids), move(lab.top1)))

    @property
    def num_tokens(self) -> int:
        return int(self.attention.sum())

    def label_index(self) -> Tensor:
        """[B, T] long: row of `labels` for each label position, -1 elsewhere."""
        idx = torch.full(self.label_mask.shape, -1, dtype=torch.long, device=self.label_mask.device)
        idx[self.label_mask] = torch.arange(int(self.label_mask.sum()), device=idx.device)
        return idx


def label_span(s: Seq) -> tuple[int, int]:
    """Positions [lo, hi) of `s` that carry a label: the next token is a reply token."""
    return max(s.prompt_len - 1, 0), len(s.input_ids) - 1


def pad_batch(seqs: list[Seq]) -> tuple[Tensor, Tensor, Tensor]:
    """ids [B, T] (0-padded on the right), attention [B, T], label_mask [B, T]."""
    T = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attention = torch.zeros(len(seqs), T, dtype=torch.bool)
    label_mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attention[b, :n] = True
        lo, hi = label_span(s)
        label_mask[b, lo:hi] = True
    return ids, attention, label_mask


class TargetFeatures:
    """Runs the frozen target over a batch of sequences and returns a `Batch`."""

    def __init__(self, model, layer_ids: tuple[int, ...], *, need_final: bool = False,
                 label_ids: Tensor | None = None, autocast_dtype: torch.dtype | None = None,
                 topk: int | None = None, compile: bool = False) -> None:
        self.model = model
        self.base = torch.compile(model.model.forward, dynamic=True) if compile else model.model
        self.layer_ids = tuple(layer_ids)
        self.need_final = need_final
        self.label_ids = label_ids  # [Vd] target ids of the label vocab; None = full vocab
        self.autocast_dtype = autocast_dtype
        self.topk = topk  # keep only the top-k of the labels (used to fill the cache)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, seqs: list[Seq]) -> Batch:
        ids, attention, label_mask = (t.to(self.device) for t in pad_batch(seqs))
        dev = self.device.type
        with torch.autocast(dev, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            out = self.base(input_ids=ids, attention_mask=attention.long(),
                            output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # L+1 tensors [B, T, H]; hs[L] = final post-norm output
        features = torch.cat([hs[k] for k in self.layer_ids], dim=-1).float()
        # Soft labels in float32 even under bf16 autocast: bf16 logits (~3 digits) would
        # blur the target distribution. The LM head runs at label positions only.
        final = hs[-1][label_mask].float()  # [N, H]
        lm = self.model.get_output_embeddings().weight  # [V, H]
        logits = F.linear(final, lm.float())  # [N, V]
        top1 = logits.argmax(-1)
        if self.topk is not None:  # sparse labels over the full target vocab
            lp = torch.log_softmax(logits, -1)
            vals, idx = lp.topk(self.topk, dim=-1)
            labels = Labels(vals, idx, top1)
        else:
            if self.label_ids is not None:  # restrict to the draft vocab and renormalise
                logits = logits[:, self.label_ids.to(logits.device)]
            labels = Labels(torch.log_softmax(logits, -1), None, top1)
        return Batch(ids, attention, label_mask, features,
                     hs[-1].float() if self.need_final else None, labels)


def restrict_topk(labels: Labels, t2d: Tensor | None) -> tuple[Labels, Tensor]:
    """Top-k labels (target ids) -> draft-vocab ids, renormalised over the ids kept.

    Returns the labels and a [N] bool of rows that kept at least one id (others are dropped).
    """
    if t2d is None:
        return labels, torch.ones(labels.top1.shape, dtype=torch.bool, device=labels.top1.device)
    ids = t2d[labels.ids]  # [N, k], -1 outside the draft vocab
    lp = labels.logprobs.float().masked_fill(ids < 0, float("-inf"))
    keep = (ids >= 0).any(-1)
    lp = lp[keep] - torch.logsumexp(lp[keep], -1, keepdim=True)
    return Labels(lp, ids[keep].clamp(min=0), labels.top1[keep]), keep


HEADER_BYTES = 100  # safetensors header bytes per stored tensor (name, dtype, shape, offsets)


def cache_bytes(seqs: list[Seq], source: TargetFeatures, dtype: torch.dtype) -> int:
    """Disk bytes of a `FeatureCache` of `seqs` filled by `source` (features and the optional
    final hidden state in `dtype`; per label row: top-k fp16 log-probs, int32 ids, int64 top-1)."""
    cfg = source.model.config
    width = cfg.hidden_size * (len(source.layer_ids) + source.need_final)
    k = min(source.topk or cfg.vocab_size, cfg.vocab_size)
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for s in seqs:
        lo, hi = label_span(s)
        total += (len(s.input_ids) * width * elem + max(0, hi - lo) * (k * 6 + 8)
                  + HEADER_BYTES * (4 + source.need_final))
    return total


TARGET_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
FINGERPRINT_NAMES = {"ids": "token ids of the training sequences (another tokenizer, data, "
                            "max_seq_len or replies)",
                     "target_shape": "target (" + ", ".join(TARGET_SHAPE) + ")"}


def check_same(root: Path, cached: dict, wanted: dict) -> None:
    """Refuse a cache built with other settings, naming each setting that differs."""
    diffs = [f"{FINGERPRINT_NAMES.get(k, k)}: " + ("differ" if k == "ids" else
                                                    f"{cached.get(k)!r} in the cache, "
                                                    f"{wanted.get(k)!r} here")
             for k in sorted(set(cached) | set(wanted)) if cached.get(k) != wanted.get(k)]
    if diffs:
        raise ValueError(f"{root} holds a feature cache built with other settings ("
                         + "; ".join(diffs) + "); it is not reused: delete that folder to "
                         "build one for these settings, or give this run another out_dir")


def check_disk(root: Path, need: int, n: int) -> None:
    """Print the cache's estimated size; refuse it if the disk holding `root` has less free."""
    where = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(where).free
    print(f"[treedraft] feature cache: {n} sequences, about {need / 1e6:,.0f} MB in {root} "
          f"({free / 1e6:,.0f} MB free)", flush=True)
    if need > free:
        raise ValueError(f"the feature cache of {n} sequences needs about {need / 1e6:,.0f} MB "
                         f"but {where} has {free / 1e6:,.0f} MB free: put out_dir on a larger "
                         "disk, lower cache_topk or num_prompts, or stream the features "
                         "(cache_features=false)")


class FeatureCache:
    """Sharded safetensors cache of per-sequence features and top-k labels (see module doc).

    A cache is reused only if it was built with the same settings (`fingerprint`, the target's
    shape, the sequences' token ids); another one is refused with the settings that differ. Its
    size is estimated and checked against the free disk before the target runs."""

    SEQS_PER_SHARD = 256

    def __init__(self, root: Path, seqs: list[Seq], source: TargetFeatures, *, batch_size: int,
                 dtype: torch.dtype, fingerprint: dict, t2d: Tensor | None = None,
                 progress: bool = True) -> None:
        self.root, self.seqs, self.t2d = Path(root), seqs, t2d
        self.need_final = source.need_final
        mc = source.model.config
        fp = {**fingerprint,
              "target_shape": [getattr(mc, k, None) for k in TARGET_SHAPE],
              "ids": hashlib.sha256(json.dumps([s.input_ids for s in seqs]).encode()).hexdigest()}
        meta = self.root / "meta.json"
        if meta.is_file():
            check_same(self.root, json.loads(meta.read_text()), fp)
        else:  # new, or a build that was killed (no meta.json): (re)build it all
            check_disk(self.root, cache_bytes(seqs, source, dtype), len(seqs))
            self._build(source, batch_size, dtype, progress)
            meta.write_text(json.dumps(fp))
        self._files: dict[int, object] = {}

    def _build(self, source: TargetFeatures, batch_size: int, dtype, progress: bool) -> None:
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        self.root.mkdir(parents=True, exist_ok=True)
        n, per = len(self.seqs), self.SEQS_PER_SHARD
        bar = tqdm(total=n, desc="feature cache", unit="seq", disable=not progress)
        for first in range(0, n, per):
            # one shard's sequences, shortest first: batched with similar lengths (little padding)
            members = sorted(range(first, min(first + per, n)),
                             key=lambda i: len(self.seqs[i].input_ids))
            shard: dict[str, Tensor] = {}
            for start in range(0, len(members), batch_size):
                idx = members[start: start + batch_size]
                b = source([self.seqs[i] for i in idx])
                rows = b.label_mask.sum(1).tolist()
                lo = 0
                for j, i in enumerate(idx):
                    t, hi = len(self.seqs[i].input_ids), lo + rows[j]
                    shard[f"{i}.features"] = b.features[j, :t].to(dtype).cpu()
                    if self.need_final:
                        shard[f"{i}.final"] = b.final_hidden[j, :t].to(dtype).cpu()
                    shard[f"{i}.lp"] = b.labels.logprobs[lo:hi].half().cpu()
                    shard[f"{i}.ids"] = b.labels.ids[lo:hi].int().cpu()
                    shard[f"{i}.top1"] = b.labels.top1[lo:hi].cpu()
                    lo = hi
                bar.update(len(idx))
            save_file(shard, str(self.root / f"shard-{first // per:05d}.safetensors"))
        bar.close()

    def _get(self, i: int, name: str) -> Tensor:
        from safetensors import safe_open

        k = i // self.SEQS_PER_SHARD
        if k not in self._files:
            self._files[k] = safe_open(str(self.root / f"shard-{k:05d}.safetensors"), "pt")
        return self._files[k].get_tensor(f"{i}.{name}")

    def __call__(self, indices: list[int]) -> Batch:
        seqs = [self.seqs[i] for i in indices]
        ids, attention, label_mask = pad_batch(seqs)
        B, T = ids.shape
        feats = [self._get(i, "features").float() for i in indices]
        features = torch.zeros(B, T, feats[0].shape[-1])
        final = torch.zeros(B, T, self._get(indices[0], "final").shape[-1]) \
            if self.need_final else None
        for b, (i, f) in enumerate(zip(indices, feats, strict=True)):
            features[b, : len(f)] = f
            if final is not None:
                final[b, : len(f)] = self._get(i, "final").float()
        labels = Labels(torch.cat([self._get(i, "lp").float() for i in indices]),
                        torch.cat([self._get(i, "ids").long() for i in indices]),
                        torch.cat([self._get(i, "top1") for i in indices]))
        labels, keep = restrict_topk(labels, self.t2d)
        label_mask[label_mask.clone()] = keep
        return Batch(ids, attention, label_mask, features, final, labels)
