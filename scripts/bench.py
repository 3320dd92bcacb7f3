"""`treedraft bench`: vLLM without speculation, vLLM ngram, our head as a chain (vLLM's own
rejection sampler) and treedraft trees (static and dynamic), side by side in one invocation.

    treedraft bench                                  # embedded default: SmolLM2 + shipped EAGLE head
    treedraft bench --limit 2 --max-new-tokens 32 --batch-sizes 1,4 --temperatures 0   # quick look
    treedraft bench --limit 80 --max-new-tokens 256                 # full MT-bench (hours on CPU)
    treedraft bench --stride 10 --limit 8 --batch-sizes 1 --config no-spec --config chain=1
                                                     # one question per MT-bench category
    treedraft bench --target HF_FOLDER --head HEAD_DIR --config 'tree=dynamic:16,4,4'

Each configuration runs in its own engine process (scripts/engine.py) over MT-bench first turns,
for every batch size (requests submitted in waves of that many, prompts cycled to fill a wave)
and temperature. Writes OUT/bench.json (tokens/s, TPOT, mean acceptance length, per-depth
acceptance, speedup vs no-spec per row), OUT/bench.md (the table) and two PNG plots (speedup vs
batch size; acceptance per depth). TPOT here is wave wall time / the wave's longest output,
i.e. the time per output token a stream of that wave saw. Engines run as `vllm serve` would by
default (dtype auto, i.e. bfloat16 on a CPU that has it; torch.compile on); `--dtype float32
--enforce-eager` is what the exactness tests use.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DEFAULT_CONFIGS = (  # small trees: on a CPU every verified token costs compute
    "no-spec",
    "ngram=4",
    "chain=3",
    "tree=static:10",
    "tree=dynamic:10,3,3",
)


def speculative_config(config: str, head: str) -> dict | None:
    """'no-spec' | 'ngram=K' | 'chain=K' | 'tree=SPEC' | 'spec=JSON' -> vLLM's speculative_config.

    spec=JSON is any --speculative-config dict ("model" defaults to the benchmarked head), e.g.
    'spec={"tree": "chain:3", "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 0]]}'.
    """
    kind, _, arg = config.partition("=")
    if kind == "no-spec":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(arg or 4),
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if kind == "chain":
        return {"model": head, "num_speculative_tokens": int(arg or 4)}
    if kind == "tree":
        return {"model": head, "tree": arg}
    if kind == "spec":
        try:
            sc = json.loads(arg)
        except json.JSONDecodeError as e:
            raise ValueError(f"bench config {config!r}: spec= needs a JSON object ({e})") from e
        if not isinstance(sc, dict):
            raise ValueError(f"bench config {config!r}: spec= needs a JSON object")
        return {"model": head, **sc}
    raise ValueError(f"bench config {config!r}: use no-spec, ngram=K, chain=K, tree=SPEC or "
                     "spec=JSON")


def _jobs(prompts: list[list[int]], batch_sizes, temperatures, max_new_tokens: int) -> list[dict]:
    jobs = []
    for t in temperatures:
        for bs in batch_sizes:
            n = max(len(prompts), bs)
            wave = [prompts[i % len(prompts)] for i in range(n)]
            jobs.append({"name": f"T{t}-bs{bs}", "prompts": wave, "batch_size": bs,
                         "params": {"temperature": t, "max_tokens": max_new_tokens,
                                    "ignore_eos": True}})
    return jobs


def _row(config: str, job: dict, res: dict) -> dict:
    total = sum(len(t) for t in res["tokens"])
    seconds = sum(res["wave_seconds"])
    bs = job["batch_size"]
    longest = [max(len(t) for t in res["tokens"][i : i + bs]) for i in range(0, len(res["tokens"]), bs)]
    spec = res["spec"]
    steps = spec["drafts"]
    return {
        "config": config, "batch_size": bs, "temperature": job["params"]["temperature"],
        "tokens": total, "seconds": seconds, "tokens_per_s": total / seconds,
        "tpot_ms": 1000 * sum(w / n for w, n in zip(res["wave_seconds"], longest, strict=True))
        / len(longest),
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "acceptance_per_depth": [a / steps for a in spec["accepted_per_pos"]] if steps else [],
        "mean_tree_size": spec["draft_tokens"] / steps if steps else None,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| config | T | batch | tok/s | TPOT ms | speedup | mean acc. len | tree size |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        size = f"{r['mean_tree_size']:.1f}" if r["mean_tree_size"] else "-"
        lines.append(f"| {r['config']} | {r['temperature']:g} | {r['batch_size']} | "
                     f"{r['tokens_per_s']:.1f} | {r['tpot_ms']:.1f} | {r['speedup']:.2f}x | "
                     f"{tau} | {size} |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG plots (pip install 'treedraft[bench]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for c in configs:
            pts = sorted((r["batch_size"], r["speedup"]) for r in rows
                         if r["config"] == c and r["temperature"] == t)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="batch size", ylabel="speedup vs no-spec", title=f"T={t:g}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    speed = out / "speedup_vs_batch.png"
    fig.savefig(speed, dpi=100)
    fig, ax = plt.subplots(figsize=(6, 4))
    bs1 = [r for r in rows if r["acceptance_per_depth"] and r["batch_size"] == min(
        x["batch_size"] for x in rows) and r["temperature"] == temps[0]]
    for r in bs1:
        d = r["acceptance_per_depth"]
        ax.plot(range(1, len(d) + 1), d, marker="o", label=r["config"])
    ax.set(xlabel="depth", ylabel="P(accepted depth >= d)", title=f"acceptance per depth, T={temps[0]:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    acc = out / "acceptance_per_depth.png"
    fig.savefig(acc, dpi=100)
    return [speed, acc]


def bench(target: str = "smollm2-135m", head: str = "smollm2-135m-eagle",
          prompts: str = "mtbench", limit: int = 4, max_new_tokens: int = 64,
          batch_sizes=(1, 4, 16, 32), temperatures=(0.0, 1.0), configs=DEFAULT_CONFIGS,
          out: str | Path = "runs/bench", dtype: str = "auto",
          enforce_eager: bool = False, stride: int = 1) -> list[dict]:
    from transformers import AutoTokenizer

    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.heads_zoo import resolve_head
    from treedraft.training.models import resolve_model
    from treedraft.training.target import encode_chat

    from .engine import run_engine

    specs = {c: speculative_config(c, str(resolve_head(head))) for c in configs}  # fail early
    target_dir = str(resolve_model(target))
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = [encode_chat(tok, first_turn(m)) for m in load_prompts(prompts, limit=limit, stride=stride)["messages"]]
    jobs = _jobs(ids, batch_sizes, temperatures, max_new_tokens)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in configs:
        t = time.perf_counter()
        llm = {"max_num_seqs": max(batch_sizes), "dtype": dtype, "enforce_eager": enforce_eager}
        results, _ = run_engine(target_dir, specs[c], jobs, llm=llm, timeout=7200)
        rows += [_row(c, j, results[j["name"]]) for j in jobs]
        print(f"{c}: done in {time.perf_counter() - t:.0f} s", flush=True)
    base = {(r["batch_size"], r["temperature"]): r["tokens_per_s"] for r in rows
            if r["config"] == configs[0]}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[(r["batch_size"], r["temperature"])]
    meta = {"target": target, "head": head, "prompts": prompts, "limit": limit,
            "stride": stride, "max_new_tokens": max_new_tokens, "baseline": configs[0], "dtype": dtype,
            "enforce_eager": enforce_eager}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    (out / "bench.md").write_text(table)
    print(table)
    for p in plots(rows, out):
        print(f"wrote {p}")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return rows
