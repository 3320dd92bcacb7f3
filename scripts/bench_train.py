"""Training throughput on this machine: tokens/s of full training steps, target forward included.

    python -m treedraft.scripts.bench_train --steps 4 --draft-vocab 0 8192 --dtype float32 bfloat16

For each (draft vocab, dtype) it runs `--steps` optimizer steps of the real loop pieces
(target features + head loss (EAGLE TTT or Medusa) + backward + AdamW) on ShareGPT prompts with their own replies
(no generation), after warm-up steps, and prints tokens/s split into target and head time.
A benchmark, not a test: numbers depend on the machine and on what else runs on it.
Whole recipes side by side (feature cache, batching, schedule): `scripts/bench_recipes.py`.
"""

from __future__ import annotations

import argparse
import time

import torch


def bench(loaded, seqs, cfg, draft_vocab: int | None, dtype: str, steps: int) -> dict:
    from treedraft.training.features import TargetFeatures
    from treedraft.training.loop import Objective, choose_draft_vocab
    from treedraft.training.target import init_head

    torch.manual_seed(0)
    over = dict(cfg.head, **({"draft_vocab_size": draft_vocab} if draft_vocab else {}))
    head = init_head(cfg.head_type, loaded.model, loaded.tokenizer, **over)
    if draft_vocab:
        head.set_draft_vocab(choose_draft_vocab(seqs, head.config.target.vocab_size, draft_vocab))
    ac = torch.bfloat16 if dtype == "bfloat16" else None
    source = TargetFeatures(loaded.model, head.config.target_layer_ids,
                            label_ids=getattr(head, "d2t", None), autocast_dtype=ac,
                            compile=cfg.compile)
    objective = Objective(head, cfg)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    t_target = t_head = tokens = 0.0
    warmup = 2 if cfg.compile else 1  # compiled code: first calls compile
    for i in range(steps + warmup):
        part = seqs[(i * cfg.batch_size) % len(seqs):][: cfg.batch_size]
        t0 = time.perf_counter()
        batch = source(part)
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
            loss, _ = objective(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= warmup:
            t_target, t_head, tokens = t_target + t1 - t0, t_head + t2 - t1, tokens + batch.num_tokens
    return {"draft_vocab": draft_vocab or "full", "dtype": dtype,
            "tokens_per_s": tokens / (t_target + t_head), "target_tok_s": tokens / t_target,
            "head_tok_s": tokens / t_head, "tokens_per_hour_M": 3.6e-3 * tokens / (t_target + t_head)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="recipe for the head/unroll/batch settings")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0, 8192])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="--key=value TrainConfig overrides (after --)")
    a = ap.parse_args()
    from treedraft.heads.machine import describe
    from treedraft.training.config import load_config
    from treedraft.training.generate import build_sequences
    from treedraft.training.loop import load_rows
    from treedraft.training.target import load_target

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(a.config, ["--regenerate=false", "--eval_prompts=0", "--long_prompts=skip",
                                 *a.overrides])
    cfg.num_prompts = max(cfg.num_prompts, cfg.batch_size * (a.steps + 2))
    loaded = load_target(cfg.target)
    rows, _ = load_rows(cfg)
    seqs = build_sequences(loaded, rows, cfg, None)
    print(describe())
    print(f"{cfg.head_type}: threads={torch.get_num_threads()} batch={cfg.batch_size}x<="
          f"{cfg.max_seq_len} unroll={cfg.unroll_steps} compile={cfg.compile} head={cfg.head}")
    for dv in a.draft_vocab:
        for dt in a.dtype:
            r = bench(loaded, seqs, cfg, dv, dt, a.steps)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
