"""Cost of prompt lookup per drafting step (heads/lookup.py), against a 2k-token history.

    python -m treedraft.scripts.bench_lookup                  # MT-bench-like chat text
    python -m treedraft.scripts.bench_lookup --history 8192 --budget 16

Builds a history from SmolLM2's tokenizer over ShareGPT conversations, indexes it once, then
times what one decoding step of one request costs: `sync` with 1-4 new tokens (what verification
accepted) and `propose(budget)`. Prints per-step microseconds (median of many steps) with the
machine's CPU flags; the goal is well under 1 ms per request per step at 2k tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from treedraft.heads.lookup import LookupIndex
    from treedraft.heads.machine import describe
    from treedraft.training.data import load_prompts
    from treedraft.training.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    ids: list[int] = []
    for messages in load_prompts("sharegpt", limit=200)["messages"]:
        ids += tok(" ".join(m["content"] for m in messages))["input_ids"]
        if len(ids) >= a.history + 4 * a.steps:
            break
    t = time.perf_counter()
    idx = LookupIndex()
    idx.sync(ids[: a.history])
    build = time.perf_counter() - t
    sync_us, prop_us, found = [], [], 0
    n = a.history
    for step in range(a.steps):
        new = 1 + step % 4  # tokens committed by one verify step
        t0 = time.perf_counter()
        idx.sync(ids[: n + new])
        t1 = time.perf_counter()
        chains = idx.propose(a.budget)
        t2 = time.perf_counter()
        n += new
        sync_us.append((t1 - t0) * 1e6)
        prop_us.append((t2 - t1) * 1e6)
        found += bool(chains)
    print(describe())
    print(f"history {a.history} -> {n} tokens, budget {a.budget}: index build "
          f"{build * 1e3:.1f} ms once; per step: sync {statistics.median(sync_us):.1f} us, "
          f"propose {statistics.median(prop_us):.1f} us (median; p99 "
          f"{sorted(prop_us)[int(0.99 * len(prop_us))]:.1f} us); proposals in "
          f"{found / a.steps:.0%} of steps")


if __name__ == "__main__":
    main()
