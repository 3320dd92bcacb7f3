"""Old training recipe against the new one, side by side on this machine at equal wall time.

    python -m treedraft.scripts.bench_recipes --minutes 20 --num-prompts 300
    # a recipe change A/B'd at equal compute (the new recipe with and without it):
    python -m treedraft.scripts.bench_recipes --recipes new fuse-norm --minutes 12 \
        --variant fuse-norm='--head.fuse_norm=true'
    # the same A/B reading a cache already built for these prompts (each trains 12 minutes):
    python -m treedraft.scripts.bench_recipes --recipes new fuse-norm --minutes 12 \
        --variant fuse-norm='--head.fuse_norm=true' --cache-from runs/bench_recipes/new/features

Every recipe trains the same head from scratch (`--config`, the shipped EAGLE recipe by
default) on the same ShareGPT conversations (their own replies, no generation) with
`treedraft train`, one after the other, each in its own process with the whole machine (its
progress bar goes to OUT/NAME.log):

- `old`: the streamed baseline: random batches (`length_buckets=1`), the target run for
  every batch of every epoch, bf16 autocast whatever the CPU, a cosine schedule;
- `old-dtype-auto`: the baseline with the machine's dtype, to tell that gain from the rest;
- `new`: the shipped recipe: a feature cache (the target runs once per sequence; later epochs
  cost only the head), length-bucketed batches, `dtype=auto` (training: float32 on CPUs
  without AMX), warmup-stable-decay;
- `--variant NAME=OVERRIDES`: the new recipe plus overrides.

Every schedule ends with the run (`time_limit_minutes`). A cached recipe's cache is built first
(a one-step run; a cache already in OUT/NAME/features with the same settings is reused) and that
run's time, model loading included, is taken off its training minutes, so every recipe gets the
same wall time. With `--cache-from DIR` (a cache built for the same prompts and settings, e.g.
an earlier run's `features/`) every cached recipe hard-links it instead and trains its full
minutes: an A/B at equal training compute (a cache of other settings is refused by the run,
naming them). Printed per recipe: useful (non-padding) training tokens per hour overall and
per epoch (the target's forward included where it runs), the padded share of positions, and
teacher-forced top-1 per unroll depth on held-out conversations at the end; ratios against the
first recipe. A benchmark, not a test: numbers depend on the machine (its CPU flags are
printed) and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

OLD = ["--cache_features=false", "--length_buckets=1", "--schedule=cosine",
       "--unroll_curriculum=0"]
RECIPES = {
    "old": [*OLD, "--dtype=bfloat16"],
    "old-dtype-auto": [*OLD, "--dtype=auto"],  # the baseline with only the dtype changed
    "new": ["--cache_features=true", "--length_buckets=16", "--dtype=auto", "--schedule=wsd",
            "--decay_fraction=0.4"],
}


def summarize(records: list[dict], extra_seconds: float = 0.0) -> dict:
    """A run's train_log.jsonl records -> its throughput and final held-out top-1.

    `extra_seconds`: wall time spent outside the logged steps that the run must be charged for
    (the new recipe's cache build). Step time is tokens / tokens_per_s of each step record."""
    steps = [r for r in records if "tokens" in r and "tokens_per_s" in r]
    if not steps:
        raise ValueError("no training steps in the log: did the run fail before its first step?")
    epochs: dict[int, dict] = {}
    for r in steps:
        e = epochs.setdefault(r.get("epoch", 0), {"tokens": 0, "seconds": 0.0, "positions": 0.0})
        e["tokens"] += r["tokens"]
        e["seconds"] += r["tokens"] / r["tokens_per_s"]
        e["positions"] += r["tokens"] / max(1e-9, 1 - r["padding"])
    tokens = sum(e["tokens"] for e in epochs.values())
    seconds = sum(e["seconds"] for e in epochs.values())
    later = [e for k, e in epochs.items() if k > 0]

    def rate(es: list[dict]) -> float:
        return 3600 * sum(e["tokens"] for e in es) / sum(e["seconds"] for e in es)

    heldout = [r["heldout"]["top1"] for r in records if "heldout" in r]
    return {"steps": len(steps), "tokens": tokens, "train_minutes": seconds / 60,
            "wall_minutes": (seconds + extra_seconds) / 60,
            "tokens_per_hour": 3600 * tokens / (seconds + extra_seconds),
            "per_epoch": {k: {"tokens": e["tokens"], "tokens_per_hour": rate([e]),
                              "padding": 1 - e["tokens"] / e["positions"]}
                          for k, e in sorted(epochs.items())},
            "later_epochs_tokens_per_hour": rate(later) if later else None,
            "padding": 1 - tokens / sum(e["positions"] for e in epochs.values()),
            "heldout_top1": heldout[-1] if heldout else None}


def link_cache(src: Path, dst: Path) -> None:
    """Hard-link the built feature cache `src` into a run's `dst` (no copy; read-only use)."""
    import os
    import shutil

    if not (src / "meta.json").is_file():
        raise SystemExit(f"--cache-from {src}: no meta.json there, so no finished feature cache "
                         "(give a run's features/ folder, built with the same prompts)")
    if not dst.exists():
        shutil.copytree(src, dst, copy_function=os.link)


def train(args: list[str], log: Path) -> float:
    """`treedraft train ARGS` in a fresh process; its wall seconds (fails loudly)."""
    cmd = [sys.executable, "-m", "treedraft.scripts.cli", "train", *args]
    print("$ treedraft train " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"treedraft train failed ({done.returncode}); its output: {log}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="scripts/recipes/smollm2-135m-eagle.yaml")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall minutes per recipe")
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--prompt-offset", type=int, default=12608,
                    help="first ShareGPT prompt (default: after every shipped head's data)")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), metavar="NAME",
                    help=f"recipes in this order ({', '.join(RECIPES)}, or one from --variant); "
                    "ratios are printed against the first")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="a recipe change to A/B: the new recipe plus space-separated "
                    "overrides, e.g. fuse-norm='--head.fuse_norm=true' (repeatable)")
    ap.add_argument("--cache-from", type=Path, default=None, metavar="DIR",
                    help="a finished feature cache for these prompts (a run's features/ folder): "
                    "hard-linked into every cached recipe, not built and not charged")
    ap.add_argument("--out", default="runs/bench_recipes")
    ap.add_argument("overrides", nargs="*", help="--key=value TrainConfig overrides for both "
                    "recipes (after --)")
    a = ap.parse_args()
    from treedraft.heads.machine import describe

    recipes = dict(RECIPES)
    for v in a.variant:
        name, sep, extra = v.partition("=")
        if not sep or not name:
            ap.error(f"--variant {v!r}: expected NAME=OVERRIDES, "
                     "e.g. fuse-norm='--head.fuse_norm=true'")
        recipes[name] = [*RECIPES["new"], *shlex.split(extra)]
    unknown = [n for n in a.recipes if n not in recipes]
    if unknown:
        ap.error(f"unknown recipe(s) {unknown}: choose from {', '.join(recipes)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--config", a.config, "--regenerate=false", "--long_prompts=skip",
              f"--prompt_offset={a.prompt_offset}", f"--num_prompts={a.num_prompts}",
              f"--eval_prompts={a.eval_prompts}", "--eval_max_new_tokens=0", "--save_every=0",
              "--measure_every=0", "--compile=false", "--epochs=1000",
              f"--num_threads={a.threads}", f"--data_dir={out / 'data'}", *a.overrides]
    print(f"[bench_recipes] {describe()}; {a.minutes:g} wall minutes per recipe", flush=True)
    results = {}
    for name in a.recipes:
        run_dir, log = out / name, out / f"{name}.log"
        log.write_text("")
        args = [*common, *recipes[name], f"--out_dir={run_dir}"]
        extra = 0.0
        print(f"[bench_recipes] recipe {name} (output: {log})", flush=True)
        cached = "--cache_features=true" in recipes[name]
        if cached and a.cache_from:  # built before: not charged
            link_cache(a.cache_from, run_dir / "features")
        elif cached:  # the cache is built in the wall time
            extra = train([*args, "--max_steps=1"], log)
            print(f"[bench_recipes] feature cache + one step: {extra / 60:.1f} min", flush=True)
        minutes = a.minutes - extra / 60
        if minutes <= 0:
            raise SystemExit(f"the cache took {extra / 60:.1f} min, more than --minutes "
                             f"{a.minutes:g}: give the recipes more time or fewer prompts")
        train([*args, f"--time_limit_minutes={minutes:.2f}"], log)
        records = [json.loads(ln) for ln in (run_dir / "train_log.jsonl").read_text().splitlines()]
        results[name] = summarize(records, extra)
        print(f"[bench_recipes] {name}: " + json.dumps(results[name]), flush=True)
    (out / "results.json").write_text(json.dumps({"machine": describe(), "minutes": a.minutes,
                                                  "args": common, "results": results}, indent=1))
    print(f"\n{describe()}\n")
    print("| recipe | steps | useful tokens | tokens/h (wall) | tokens/h epoch 1 | tokens/h later "
          "epochs | padding | held-out top-1 per depth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in results.items():
        later = r["later_epochs_tokens_per_hour"]
        print(f"| {name} | {r['steps']} | {r['tokens']:,} | {r['tokens_per_hour']:,.0f} | "
              f"{r['per_epoch'][min(r['per_epoch'])]['tokens_per_hour']:,.0f} | "
              f"{'-' if later is None else f'{later:,.0f}'} | {100 * r['padding']:.0f} % | "
              + " ".join(f"{x:.3f}" for x in r["heldout_top1"] or []) + " |")
    print()
    base, o = next(iter(results.items()))
    for name, n in list(results.items())[1:]:
        print(f"{name} / {base}, useful tokens per wall hour: "
              f"{n['tokens_per_hour'] / o['tokens_per_hour']:.2f}x"
              + ("" if n["later_epochs_tokens_per_hour"] is None else
                 f"; {name}'s later epochs / {base} overall: "
                 f"{n['later_epochs_tokens_per_hour'] / o['tokens_per_hour']:.2f}x"))


if __name__ == "__main__":
    main()
