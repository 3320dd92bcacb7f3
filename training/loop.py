"""`train(cfg, resume=None)`: the training loop of `treedraft train`, plain and in one place.

    from treedraft.training.config import load_config
    from treedraft.training.loop import train
    train(load_config("scripts/recipes/tiny-cpu.yaml"))

What happens, in order (every bad input fails before the expensive part):
  1. config, head overrides and --resume config are checked; from the target's config alone
     (no weights) the head is built (a new EAGLE head: EAGLE-3, `target_layer_ids: auto`), the
     architecture checked and the memory estimate printed and checked (preflight.py);
  2. prompts of `data` (MT-bench refused and re-checked), split into training + held-out rows;
     too-long prompts are refused; the target regenerates the replies (cached in out_dir/data)
     with an engine that holds its own copy and frees it; then the target loads (frozen, in
     target_dtype) and the head is bound to its embeddings / LM head (never trained);
  3. with draft_vocab_size the head's vocabulary is the most frequent reply tokens;
  4. steps: target features + soft labels per micro-batch (streamed, or from the optional
     cache), head loss (losses.py), AdamW with warmup + cosine or warmup-stable-decay (the decay ends
     with the run: at its last step or when its time limit runs out; no warmup after init_from),
     grad accumulation and clipping,
     optional bf16 autocast; tqdm shows loss, top-1 agreement and tokens/s (target included);
     every eval_every steps `run_eval` on the held-out prompts logs the mean acceptance length;
     checkpoints every save_every steps (checkpoint.py);
  5. per-depth / per-rank acceptance rates (teacher forced, held-out data) go into
     head.config.acceptance_rates; the head is saved to out_dir/final.
With torchrun (WORLD_SIZE > 1) the same code runs DDP: gloo on CPU, nccl on GPU, each rank
answers its share of the missing replies and trains on all of them (generate.py `Shard`),
micro-batches sharded by rank, only rank 0 logs, evaluates and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt_io
from .config import TrainConfig
from .distributed import Dist, all_sum, barrier, setup_distributed, wrap_ddp
from .features import FeatureCache, TargetFeatures
from .generate import Seq, Shard, build_sequences
from .losses import acceptance_rates, eagle_loss, medusa_loss, rank_hits, soft_kl
from .target import head_overrides

logger = logging.getLogger(__name__)


def check_head_overrides(cfg: TrainConfig) -> None:
    from treedraft.heads import eagle, medusa  # noqa: F401  (register the head types)
    from treedraft.heads.common import HEADS

    fields = {f.name for f in dataclasses.fields(HEADS[cfg.head_type].config_class)}
    unknown = sorted(set(cfg.head) - fields)
    if unknown:
        raise ValueError(f"unknown {cfg.head_type} head keys {unknown} in head: ...; valid: "
                         f"{sorted(fields - {'target'})}")


CONTINUED_KEYS = ("layout", "fuse_norm", "norm_before_fc", "target_layer_ids")


def continued_defaults(name_or_path) -> dict:
    """The layout keys of the head a run continues (init_from, or the checkpoint it resumes):
    its defaults, so a continued head keeps the shape it was trained with."""
    from treedraft.heads import load_head
    from treedraft.heads.shipped import resolve_head

    config = load_head(resolve_head(name_or_path)).config.to_dict()
    return {k: config[k] for k in CONTINUED_KEYS if k in config}


def load_rows(cfg: TrainConfig) -> tuple[list, list]:
    """(training rows, held-out rows) of (id, messages); MT-bench never enters."""
    from .data import assert_no_mtbench, load_prompts

    ds = load_prompts(cfg.data, limit=cfg.prompt_offset + cfg.num_prompts + cfg.eval_prompts,
                      purpose="train")
    assert_no_mtbench(ds)
    rows = list(zip(ds["id"], ds["messages"], strict=True))[cfg.prompt_offset:]
    if len(rows) <= cfg.eval_prompts:
        raise ValueError(
            f"data={cfg.data!r} gave {len(rows)} prompts after prompt_offset="
            f"{cfg.prompt_offset}, but eval_prompts={cfg.eval_prompts} are held out and at least "
            "one is needed for training; add prompts or lower eval_prompts or prompt_offset"
        )
    cut = len(rows) - cfg.eval_prompts
    return rows[:cut], rows[cut:]


def choose_draft_vocab(seqs: list[Seq], vocab_size: int, k: int) -> torch.Tensor:
    """The k most frequent reply tokens (ties and unseen ids: lowest id first)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.input_ids[s.prompt_len:], dtype=torch.long),
                                 minlength=vocab_size)
    return torch.argsort(-counts, stable=True)[:k]


def curriculum_depth(progress: float, full: int, fraction: float) -> int:
    """Unroll depth at `progress` (0..1) of the run: 1 at the start, growing linearly to `full`,
    reached when `fraction` of the run is done (0 = always `full`)."""
    if fraction <= 0:
        return full
    return min(full, 1 + int((full - 1) * progress / fraction))


def run_clock(cfg: TrainConfig, trained, t_run: float):
    """The share of its time budget a run has used, as a function (None: no time budget):
    `budget_minutes` against `trained()` (seconds over all the run's invocations), else
    `time_limit_minutes` against this invocation's time since `t_run`."""
    if cfg.budget_minutes is not None:
        return lambda: trained() / (60 * cfg.budget_minutes)
    if cfg.time_limit_minutes is not None:
        return lambda: (time.perf_counter() - t_run) / (60 * cfg.time_limit_minutes)
    return None


def lr_lambda(warmup: int, total: int, schedule: str = "cosine", decay_fraction: float = 0.2,
              clock=None):
    """Multiplier of lr after s steps: linear warmup to 1, then `cosine` to 0 at `total` steps, or
    `wsd` (warmup-stable-decay: 1 until the last `decay_fraction` of the run, then linearly to 0).

    Progress is the share of the steps after warmup taken, or, when `clock` is given (a run with
    a time limit: the share of its time budget used), whichever is larger, so a run stopped by
    its time limit has finished its decay when it stops."""
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        if clock is not None:
            p = max(p, min(1.0, clock()))
        if schedule == "wsd":
            return 1.0 if p <= 1 - decay_fraction else max(0.0, (1 - p) / decay_fraction)
        return 0.5 * (1 + math.cos(math.pi * p))
    return f


class Objective(nn.Module):
    """head + its loss in one forward, so DDP sees a single forward per backward."""

    def __init__(self, head, cfg: TrainConfig) -> None:
        super().__init__()
        self.head = head
        if head.head_type == "eagle":
            self.weights = cfg.loss_weights(cfg.unroll_steps, "unroll steps")
            self.fw = cfg.feature_loss_weight
            if self.fw and head.config.layout == "eagle3":
                raise ValueError("feature_loss_weight > 0 regresses the head's output onto the "
                                 "target's post-norm feature (EAGLE-1); the eagle3 layout feeds "
                                 "a pre-norm stream forward: set feature_loss_weight=0")
        else:
            self.weights = cfg.loss_weights(head.config.num_heads, "medusa heads")
        self.mask_oov = cfg.oov_rows == "mask"
        if self.mask_oov and getattr(head.config, "draft_vocab_size", None) is None:
            raise ValueError("oov_rows=mask needs a draft vocabulary (an EAGLE head with "
                             "head.draft_vocab_size set): this head drafts over the whole target "
                             "vocabulary, so no row is outside it; use oov_rows=keep")
        # compiled callables only; the head module itself stays eager (drafting in run_eval)
        compile_ = (lambda f: torch.compile(f, dynamic=True)) if cfg.compile else (lambda f: f)
        self.head_forward = compile_(head.forward)
        self.kl = compile_(soft_kl)

    depth: int | None = None  # unroll curriculum: the depth of this step (None = all)

    def forward(self, batch):
        if self.head.head_type == "eagle":
            return eagle_loss(self.head, batch, self.weights[: self.depth], self.fw,
                              self.head_forward, self.kl, self.mask_oov)
        return medusa_loss(self.head, batch, self.weights, self.kl)


class DataOrder:
    """Micro-batch indices: a seeded order per epoch, sharded by rank; resumable.

    With `length_buckets` > 1 (and the sequences' lengths), each window of that many global
    micro-batches of the shuffled order is sorted by length and cut into micro-batches, whose
    order is then shuffled (seeded): sequences batched together have similar lengths, so little
    of a padded [B, T] batch is padding, while every epoch still visits each sequence once."""

    def __init__(self, n: int, cfg: TrainConfig, d: Dist, position: dict | None = None,
                 lengths: list[int] | None = None):
        self.n, self.bs, self.d, self.seed = n, cfg.batch_size, d, cfg.seed
        self.per_epoch = n // (cfg.batch_size * d.world)  # global micro-batches per epoch
        if self.per_epoch == 0:
            raise ValueError(f"{n} training sequences < batch_size={cfg.batch_size} x "
                             f"{d.world} processes; add prompts or lower batch_size")
        self.buckets = cfg.length_buckets if lengths is not None else 1
        self.lengths = lengths
        self.epoch, self.micro = (position["epoch"], position["micro"]) if position else (0, 0)
        self._order: tuple[int, list[int]] | None = None  # (epoch, its order)

    def epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        if self.buckets <= 1:
            return perm
        step = self.bs * self.d.world  # one global micro-batch
        used = self.per_epoch * step
        window = step * self.buckets
        perm = [i for w in range(0, used, window)  # longest first within each window
                for i in sorted(perm[w : min(w + window, used)], key=lambda i: -self.lengths[i])]
        groups = [perm[m * step : (m + 1) * step] for m in range(self.per_epoch)]
        shuffle = torch.randperm(len(groups), generator=g).tolist()
        return [i for m in shuffle for i in groups[m]]

    def next(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        start = (self.micro * self.d.world + self.d.rank) * self.bs
        self.micro += 1
        if self.micro == self.per_epoch:
            self.epoch, self.micro = self.epoch + 1, 0
        return self._order[1][start: start + self.bs]

    def position(self) -> dict:
        return {"epoch": self.epoch, "micro": self.micro}


def fingerprint(seqs: list[Seq]) -> str:
    blob = json.dumps([(s.id, s.input_ids, s.prompt_len) for s in seqs])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train(cfg: TrainConfig, resume: str | os.PathLike | None = None) -> Path | None:
    """Train a head as configured; returns out_dir/final (None on DDP ranks > 0)."""
    from tqdm.auto import tqdm

    from treedraft.heads.machine import describe

    from .preflight import check_architecture, check_memory, estimate_memory
    from .target import bind_head, load_target, new_head, open_target

    cfg.validate()
    check_head_overrides(cfg)
    ckpt = ckpt_io.check_resume(resume, cfg) if resume else None
    d = setup_distributed()
    if cfg.cache_features and d.world > 1:
        raise ValueError("cache_features=true is single-process only; stream features with "
                         "torchrun (the default, cache_features=false)")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out = Path(cfg.out_dir)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # the target's config and tokenizer only: its weights load after the replies are written
    spec = open_target(cfg.target, d.device)
    continued = ckpt or cfg.init_from
    overrides = head_overrides(cfg.head_type, spec.config, {
        **(continued_defaults(continued) if continued else {}), **cfg.head}, new=not continued)
    check_architecture(cfg, spec.config, overrides)
    head = new_head(cfg.head_type, spec.config, spec.tokenizer, **overrides)
    if cfg.init_from and ckpt is None:  # a resume loads its own weights
        init_weights(head, cfg.init_from)  # before the data: a mismatch fails fast
    objective = Objective(head, cfg)  # checks step_weights against the head
    check_memory(cfg, estimate_memory(cfg, spec.config, head, d.device), d.main)
    # a resumed run whose reply generation was cut sees the replies it trained on, no more
    train_seqs, eval_seqs, eval_rows = prepare_data(
        cfg, spec, d, cache_only=cfg.gen_cache_only or (
            ckpt is not None and cfg.gen_time_limit_minutes is not None))
    if cfg.gen_only:
        if d.main:
            print(f"[treedraft] gen_only: {len(train_seqs) + len(eval_seqs)} sequences' replies "
                  "are in the reply cache; run again without --gen-only=true to train", flush=True)
        return None
    loaded = load_target(cfg.target, dtype=cfg.target_torch_dtype(d.device), device=d.device)
    head = bind_head(head.to(d.device), loaded.model)
    vd = getattr(head.config, "draft_vocab_size", None)
    if vd is not None and not cfg.init_from:
        head.set_draft_vocab(choose_draft_vocab(train_seqs, head.config.target.vocab_size, vd))
    dtype = cfg.compute_dtype(d.device)
    if d.main:
        where = (f"CUDA: {torch.cuda.get_device_name(d.device)}" if d.device.type == "cuda"
                 else describe())
        print(f"[treedraft] training in {dtype} (dtype={cfg.dtype}; {where}); lr "
              f"{cfg.schedule} schedule, decay finished at "
              + (f"{cfg.budget_minutes} min of training over all invocations or "
                 if cfg.budget_minutes else
                 f"{cfg.time_limit_minutes} min or " if cfg.time_limit_minutes else "")
              + "the last step", flush=True)
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    batch_fn = make_batches(cfg, loaded.model, head, train_seqs, out, autocast)
    measure_seqs = eval_seqs or train_seqs[: cfg.batch_size]
    measure_fn = make_batches(cfg, loaded.model, head, measure_seqs, None, autocast)

    optimizer = make_optimizer(head, cfg)
    lengths = [len(s.input_ids) for s in train_seqs]
    order = DataOrder(len(train_seqs), cfg, d, lengths=lengths)
    total = (cfg.max_steps if cfg.max_steps is not None
             else math.ceil(cfg.epochs * order.per_epoch / cfg.grad_accum))
    t_run = time.perf_counter()
    state = ckpt_io.load_state(ckpt) if ckpt is not None else {}  # read once: optimizer and all
    before = state.get("trained_seconds", 0.0)

    def trained() -> float:  # seconds of this run over all its invocations
        return before + time.perf_counter() - t_run

    clock = run_clock(cfg, trained, t_run)
    warmup = 0 if cfg.init_from else cfg.warmup_steps  # a trained head does not warm up again
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(warmup, total, cfg.schedule, cfg.decay_fraction, clock))
    data_fp, step = fingerprint(train_seqs), 0
    if ckpt is not None:
        step = resume_from(ckpt, state, head, optimizer, scheduler, data_fp)
        if cfg.budget_minutes is not None and d.main:
            print(f"[treedraft] resuming at step {step}: {before / 60:.2f} of "
                  f"{cfg.budget_minutes} budgeted minutes trained", flush=True)
        order = DataOrder(len(train_seqs), cfg, d, state["position"],
                          lengths=lengths)
    model = objective if d.world == 1 else wrap_ddp(objective)
    log = RunLog(out / "train_log.jsonl", d.main, truncate_after=step)
    prov = {"data": {"source": cfg.data, "train_sequences": len(train_seqs),
                     "train_tokens": sum(len(s.input_ids) for s in train_seqs),
                     "eval_prompts": len(eval_rows), "fingerprint": data_fp}}

    def save(step: int) -> None:
        if d.main:
            ckpt_io.save_checkpoint(out, step, head, cfg, ckpt_io.provenance(cfg, step=step, **prov),
                                    optimizer=optimizer, scheduler=scheduler,
                                    position=order.position(), data_fingerprint=data_fp,
                                    trained_seconds=trained())

    head.train()
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.head_type}",
               disable=not (cfg.progress and d.main))
    train_time, run_tokens, started = 0.0, 0, step
    if cfg.measure_every and cfg.init_from and step == 0 < total and d.main:
        # the head it continues, on the same held-out sequences: the learning curve's start
        log_heldout(cfg, head, measure_fn, measure_seqs, 0, log, bool(eval_seqs))
    def spent() -> bool:  # the run's budget_minutes are used up (a resume may find them so)
        return cfg.budget_minutes is not None and trained() > 60 * cfg.budget_minutes

    while step < total and not spent():
        if cfg.unroll_curriculum and head.head_type == "eagle":
            progress = max(step / total, clock() if clock is not None else 0.0)
            objective.depth = curriculum_depth(progress, cfg.unroll_steps, cfg.unroll_curriculum)
        t0, epoch = time.perf_counter(), order.epoch
        rec = train_step(model, head, batch_fn, order, optimizer, cfg, d, autocast)
        scheduler.step()
        step += 1
        dt = time.perf_counter() - t0
        run_tokens, train_time = run_tokens + rec["tokens"], train_time + dt
        log.write({"step": step, "epoch": epoch, **rec, "lr": scheduler.get_last_lr()[0],
                   "tokens_per_s": rec["tokens"] / dt, **cuda_memory(d.device)})
        # tokens/s of training so far in this run, target forward included, eval excluded
        bar.set_postfix(loss=f"{rec['loss']:.3f}", top1=f"{rec['top1'][0]:.3f}",
                        tok_s=f"{run_tokens / train_time:.0f}")
        bar.update(1)
        stop = (cfg.stop_after_steps is not None and step - started >= cfg.stop_after_steps) or (
            cfg.time_limit_minutes is not None
            and time.perf_counter() - t_run > 60 * cfg.time_limit_minutes) or spent()
        if stop:
            break
        if cfg.measure_every and step % cfg.measure_every == 0 and step < total and d.main:
            log_heldout(cfg, head, measure_fn, measure_seqs, step, log, bool(eval_seqs))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            evaluate(cfg, loaded, head, eval_rows, step, log, d)
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            save(step)
    bar.close()
    head.config.acceptance_rates = log_heldout(cfg, head, measure_fn, measure_seqs, step, log,
                                               bool(eval_seqs), d.main)
    result = evaluate(cfg, loaded, head, eval_rows, step, log, d)
    save(step)  # the last checkpoint also carries the measured acceptance rates
    if not d.main:
        return None
    final = ckpt_io.provenance(cfg, step=step, total_steps=total, eval=result,
                               tokens_per_s=run_tokens / max(train_time, 1e-9), **prov)
    return ckpt_io.save_head_dir(out / "final", head, cfg, final)


def cuda_memory(device: torch.device) -> dict:
    """Peak memory and the caching allocator's retries so far (a retry frees cached blocks and
    synchronises: the suspect for the first GPU run's slow steps); {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"cuda_peak_gib": round(stats.get("allocated_bytes.all.peak", 0) / 2**30, 2),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0)}


def init_weights(head, name_or_path: str) -> None:
    """Copy the weights (draft vocabulary included) of a saved head into `head`."""
    from treedraft.heads import load_head
    from treedraft.heads.shipped import resolve_head

    src = load_head(resolve_head(name_or_path), target=head.target_signature)
    mine, theirs = head.config.to_dict(), src.config.to_dict()
    ignore = {"acceptance_rates", "default_tree"}
    problems = [f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here"
                for k in sorted((set(mine) | set(theirs)) - ignore) if mine.get(k) != theirs.get(k)]
    if src.head_type != head.head_type or problems:
        raise ValueError(
            f"init_from={name_or_path!r} is a {src.head_type} head shaped differently from the "
            f"{head.head_type} head this config builds ({'; '.join(problems) or 'head_type'}); "
            "set head_type and head: {...} to match it")
    head.load_state_dict(src.state_dict(), strict=True)


def train_step(model, head, batch_fn, order: DataOrder, optimizer, cfg: TrainConfig, d: Dist,
               autocast) -> dict:
    """One optimizer step over grad_accum micro-batches; returns the step's log record."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum, tokens, positions, top1, kl = 0.0, 0, 0, [], []
    for micro in range(cfg.grad_accum):
        batch = batch_fn(order.next()).to(d.device)
        last = micro == cfg.grad_accum - 1
        # DDP: all-reduce gradients on the last micro-batch only
        with model.no_sync() if d.world > 1 and not last else contextlib.nullcontext():
            with torch.autocast(d.device.type, dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                loss, metrics = model(batch)
            (loss / cfg.grad_accum).backward()
        loss_sum += float(loss.detach()) / cfg.grad_accum
        tokens += batch.num_tokens
        positions += batch.attention.numel()
        top1.append(metrics["top1"])
        kl.append(metrics["kl"])
    grad_norm = nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip or float("inf"))
    optimizer.step()
    mean = lambda rows: [sum(v) / len(v) for v in zip(*rows, strict=True)]  # noqa: E731
    return {"loss": all_sum(d, loss_sum) / d.world, "top1": mean(top1), "kl": mean(kl),
            "grad_norm": float(grad_norm), "tokens": int(all_sum(d, tokens)),
            "padding": 1 - tokens / max(positions, 1)}  # share of padded [B, T] positions


def prepare_data(cfg: TrainConfig, loaded, d: Dist, cache_only: bool = False
                 ) -> tuple[list[Seq], list[Seq], list]:
    """(training sequences, held-out sequences, held-out rows); each rank generates its share
    of the missing replies (none with cache_only) and every rank gets all of them."""
    train_rows, eval_rows = load_rows(cfg)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else Path(cfg.out_dir) / "data"
    eval_ids = frozenset(rid for rid, _ in eval_rows)
    seqs = build_sequences(loaded, train_rows + eval_rows, cfg, data_dir, first=eval_ids,
                           generate_missing=not cache_only, held_out=eval_ids,
                           shard=Shard(d.rank, d.world, barrier))
    train_seqs = [s for s in seqs if s.id not in eval_ids]
    if not train_seqs:
        hint = (f": gen_cache_only=true and the reply cache in {data_dir} answers none of these "
                "prompts (same target, gen_* settings and seed?)" if cfg.gen_cache_only else "")
        raise ValueError(f"no training sequences left from data={cfg.data!r}{hint}")
    return train_seqs, [s for s in seqs if s.id in eval_ids], eval_rows


def make_optimizer(head, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the head's own parameters; no weight decay on norms and biases."""
    decay = [p for p in head.parameters() if p.ndim >= 2]
    no_decay = [p for p in head.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=tuple(cfg.betas))


def make_batches(cfg: TrainConfig, model, head, seqs: list[Seq], out: Path | None, autocast):
    """indices -> Batch: the target run on the fly, or the feature cache (cache_features)."""
    layer_ids = head.config.target_layer_ids
    need_final = head.head_type == "eagle" and cfg.feature_loss_weight > 0
    d2t = getattr(head, "d2t", None)
    if cfg.cache_features and out is not None:
        t2d = None
        if d2t is not None:
            t2d = torch.full((head.config.target.vocab_size,), -1, dtype=torch.long)
            t2d[d2t.cpu()] = torch.arange(len(d2t))
        source = TargetFeatures(model, layer_ids, need_final=need_final, topk=cfg.cache_topk,
                                autocast_dtype=autocast, compile=cfg.compile)
        fp = {"target": cfg.target, "layers": list(layer_ids), "topk": cfg.cache_topk,
              "final": need_final, "dtype": cfg.cache_dtype}
        weights = str(next(model.parameters()).dtype).removeprefix("torch.")
        if weights != "float32":  # caches of float32 targets keep their fingerprint
            fp["target_dtype"] = weights
        return FeatureCache(out / "features", seqs, source, batch_size=cfg.batch_size,
                            dtype=getattr(torch, cfg.cache_dtype), fingerprint=fp, t2d=t2d,
                            progress=cfg.progress)
    source = TargetFeatures(model, layer_ids, need_final=need_final, label_ids=d2t,
                            autocast_dtype=autocast, compile=cfg.compile and out is not None)
    return lambda idx: source([seqs[i] for i in idx])


def resume_from(ckpt: Path, state: dict, head, optimizer, scheduler, data_fp: str) -> int:
    """Load head weights (from `ckpt`), optimizer, scheduler and RNG states (from its `state`,
    `ckpt_io.load_state`); return the step."""
    from treedraft.heads.common import load_head

    if state["data_fingerprint"] != data_fp:
        raise ValueError(
            f"--resume {ckpt}: the training data differs from the checkpoint's (fingerprint "
            f"{state['data_fingerprint']} vs {data_fp}); was out_dir/data removed and the "
            "replies regenerated differently? Resume with the original out_dir")
    saved = load_head(ckpt)
    head.load_state_dict(saved.state_dict())  # target_* buffers are not saved: kept as bound
    head.config.acceptance_rates = saved.config.acceptance_rates
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    ckpt_io.set_rng_state(state["rng"])
    return state["step"]


@torch.no_grad()
def measure(cfg: TrainConfig, head, batch_fn, seqs: list[Seq]) -> list[list[float]]:
    """Acceptance rates [depth][rank] from teacher-forced rank hits on `seqs`."""
    depth = cfg.acceptance_depth if head.head_type == "eagle" else head.config.num_heads
    was_training = head.training
    head.eval()
    hits, counts = torch.zeros(depth, cfg.acceptance_topk), torch.zeros(depth)
    for i in range(0, len(seqs), cfg.batch_size):
        h, c = rank_hits(head, batch_fn(list(range(i, min(i + cfg.batch_size, len(seqs))))),
                         depth, cfg.acceptance_topk)
        hits, counts = hits + h, counts + c
    head.train(was_training)
    return acceptance_rates(hits, counts)


def log_heldout(cfg: TrainConfig, head, batch_fn, seqs: list[Seq], step: int, log,
                held_out: bool = True, main: bool = True) -> list[list[float]]:
    """`measure` on the held-out sequences (target + head forward over them, no backward),
    logged as {"heldout": {"top1": [per depth], "topk": [per depth]}}: the training-time signal
    of the learning curve. held_out=False: no held-out prompts, measured on training ones."""
    rates = measure(cfg, head, batch_fn, seqs)
    top1, topk = [r[0] for r in rates], [sum(r) for r in rates]
    log.write({"step": step, "heldout": {"top1": top1, "topk": topk, "k": cfg.acceptance_topk,
                                         "sequences": "held-out" if held_out else "training"}})
    if cfg.progress and main:
        from tqdm.auto import tqdm

        tqdm.write(f"step {step}: held-out teacher-forced top-1 per depth "
                   + " ".join(f"{x:.3f}" for x in top1))
    return rates


def evaluate(cfg: TrainConfig, loaded, head, rows, step: int, log, d: Dist) -> dict | None:
    """run_eval on the held-out prompts (rank 0); logs the mean acceptance length."""
    from treedraft.heads.sampling import SamplingParams

    from .evaluate import run_eval

    result = None
    if d.main and rows and d.device.type != "cpu":
        logger.warning("skipping run_eval: the reference decoder (HFTarget) runs on CPU only")
    elif d.main and rows and cfg.eval_max_new_tokens > 0:
        was_training = head.training
        head.eval()
        report = run_eval(loaded, head, rows, tree=cfg.eval_tree,
                          params=SamplingParams(temperature=cfg.eval_temperature),
                          max_new_tokens=cfg.eval_max_new_tokens, seed=cfg.seed, progress=False)
        head.train(was_training)
        result = {k: v for k, v in report.items() if k != "outputs"}
        log.write({"step": step, "eval": result})
        if cfg.progress:
            from tqdm.auto import tqdm

            tqdm.write(f"step {step}: held-out mean acceptance length "
                       f"{result['mean_acceptance_length']:.3f} ({result['tree']})")
    if d.world > 1:
        barrier()
    return result


class RunLog:
    """out_dir/train_log.jsonl; on resume, lines after the resumed step are dropped."""

    def __init__(self, path: Path, enabled: bool, truncate_after: int = 0) -> None:
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.is_file() else []
        keep = [ln for ln in lines if json.loads(ln)["step"] <= truncate_after]
        path.write_text("".join(ln + "\n" for ln in keep) if truncate_after else "")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
