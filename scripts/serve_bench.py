"""The main job's configurations through `vllm serve` and vLLM's own `vllm bench serve` client:
the check that `treedraft bench` (offline engines) measures what a server delivers.

    python -m treedraft.scripts.serve_bench                      # no-spec, chain=3, auto
    python -m treedraft.scripts.serve_bench --config no-spec --config 'tree=chain:2+lookup:4' \
        --concurrency 1,8 --temperatures 0 --rounds 2 --out runs/serve_bench

Every configuration gets its own `vllm serve` (one port each, all up at once, the same engine
arguments as `treedraft bench`: eager, the machine's dtype, max-num-seqs = the largest
concurrency), then for each (T, concurrency) `vllm bench serve` runs the same prompts against
every server in turn, `--rounds` times, the order alternating (`bench.run_order`). The prompts
are the main job's (8 MT-bench first turns, `--stride 10`, as text in vLLM's `custom` dataset
format: the client applies the chat template), `--ignore-eos` at `--max-new-tokens`, 4
requests per concurrency slot (at least the 8 prompts, cycled), after `--num-warmups` of one
request per slot. A run's output tokens/s is its rate at full concurrency, as `treedraft
bench` measures a queue (`engine.full_batch_window`, from vLLM's detailed result: start
times, latencies, output lengths); `wall_tokens_per_s` is vLLM's
output throughput over the whole run, the drain at its end included. The speedup of a run is
its tokens/s over the baseline's (the first configuration's) in the same round; rows hold the
median and range, as `treedraft bench`'s do. Every server gets the run's `--seed` (by default
a new one per run, as `treedraft bench` draws: at T > 0 a run's replies are a draw of their own).
Writes OUT/serve_bench.json (every run's `vllm bench serve` result) and OUT/serve_bench.md; each
server's log is OUT/serve-N.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def summarize(runs: list[dict], baseline: str) -> list[dict]:
    """runs: {config, temperature, concurrency, round, tokens_per_s} -> one row per (config,
    T, concurrency): the median tokens/s, the median and range of per-round speedups against
    the baseline's run of the same round."""
    base = {(r["temperature"], r["concurrency"], r["round"]): r["tokens_per_s"]
            for r in runs if r["config"] == baseline}
    rows: dict[tuple, dict] = {}
    for r in runs:
        k = (r["config"], r["temperature"], r["concurrency"])
        row = rows.setdefault(k, {"config": k[0], "temperature": k[1], "concurrency": k[2],
                                  "round_tokens_per_s": [], "round_speedups": []})
        row["round_tokens_per_s"].append(r["tokens_per_s"])
        row["round_speedups"].append(r["tokens_per_s"] / base[(k[1], k[2], r["round"])])
    for row in rows.values():
        s = row["round_speedups"]
        row.update(tokens_per_s=statistics.median(row["round_tokens_per_s"]),
                   speedup=statistics.median(s), speedup_range=[min(s), max(s)])
    return list(rows.values())


def markdown(rows: list[dict]) -> str:
    out = ["| config | T | concurrency | output tok/s | speedup (rounds) |", "|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["speedup_range"]
        out.append(f"| {r['config']} | {r['temperature']:g} | {r['concurrency']} | "
                   f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log: Path, timeout: float = 900,
            env: dict[str, str] | None = None):
    """Run `vllm serve ...` (`cmd`, without `--port`) listening on `port`, with its output in
    `log`; yields the process once /health answers on that port, terminates it (then kills it
    after 60 s) on the way out. A server that exits or is not up within `timeout` seconds raises
    RuntimeError with its log's end."""
    from .engine import engine_env

    if "--port" in cmd:
        raise ValueError(f"serving: give the port as `port`, not in the command: {cmd}")
    with log.open("w") as f:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=f, stderr=subprocess.STDOUT,
                                env=env or engine_env())
    try:
        end = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve on port {port} exited ({proc.returncode}); "
                                   f"its log {log}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"vllm serve on port {port} not ready after {timeout:.0f} s; "
                                   f"its log {log}:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> list[dict]:
    from treedraft.heads.machine import describe, resolve_dtype
    from treedraft.heads.shipped import resolve_head
    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.models import resolve_model

    from .bench import PRESETS, run_order, run_seed, speculative_config
    from .engine import full_batch_window

    q = PRESETS["quick"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", default="smollm2-135m-eagle")
    p.add_argument("--config", action="append", default=None,
                   help="as treedraft bench's; the first is the baseline "
                        "(default: no-spec chain=3 auto)")
    p.add_argument("--concurrency", default="1,8", help="vllm bench serve --max-concurrency")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--limit", type=int, default=q["limit"])
    p.add_argument("--stride", type=int, default=q["stride"])
    p.add_argument("--max-new-tokens", type=int, default=q["max_new_tokens"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=8100, help="the first server's; then +1 each")
    p.add_argument("--out", default="runs/serve_bench")
    p.add_argument("--seed", type=int, default=None,
                   help="every server's vllm serve --seed (default: a new one each run)")
    a = p.parse_args(argv)
    seed = run_seed(a.seed)
    configs = tuple(a.config or ("no-spec", "chain=3", "auto"))
    conc = [int(c) for c in a.concurrency.split(",")]
    temps = [float(t) for t in a.temperatures.split(",")]
    vllm = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"
    target = str(resolve_model(a.target))
    specs = {c: speculative_config(c, str(resolve_head(a.head))) for c in configs}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "prompts.jsonl"  # vLLM's custom dataset: the client applies the chat template
    ds = load_prompts("mtbench", limit=a.limit, stride=a.stride)
    data.write_text("".join(json.dumps({"prompt": first_turn(m)[-1]["content"]}) + "\n"
                            for m in ds["messages"]))
    dtype = resolve_dtype(a.dtype)
    print(f"[serve_bench] {describe()}; vLLM dtype {dtype}, eager; {len(ds)} MT-bench prompts x "
          f"{a.max_new_tokens} tokens; concurrency {conc}, T {temps}; {a.rounds} rounds; "
          f"configurations: {', '.join(configs)}; seed {seed}", flush=True)
    ports: dict[str, int] = {}
    runs: list[dict] = []
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as servers:
        for i, c in enumerate(configs):
            ports[c] = a.port + i
            cmd = [vllm, "serve", target, "--dtype", dtype, "--enforce-eager",
                   "--max-num-seqs", str(max(conc)), "--max-model-len", "2048", "--seed", str(seed)]
            if specs[c] is not None:
                cmd += ["--speculative-config", json.dumps(specs[c])]
            # one at a time: start-ups do not overlap
            procs.append(servers.enter_context(serving(cmd, ports[c], out / f"serve-{i}.log")))
            print(f"[serve_bench] {c}: vllm serve up on port {ports[c]}", flush=True)
        # on the way out every server is asked to stop first, then each is waited for
        servers.callback(lambda: [p.terminate() for p in procs if p.poll() is None])
        jobs = [(t, cc) for t in temps for cc in conc]
        for rnd, (t, cc), c in run_order(configs, jobs, a.rounds):
            name = f"{c}-T{t:g}-c{cc}-r{rnd}".replace("=", "_").replace(":", "_")
            n = max(len(ds), 4 * cc)
            cmd = [vllm, "bench", "serve", "--backend", "vllm",
                   "--base-url", f"http://127.0.0.1:{ports[c]}", "--model", target,
                   "--dataset-name", "custom", "--dataset-path", str(data), "--disable-shuffle",
                   "--custom-output-len", str(a.max_new_tokens), "--ignore-eos",
                   "--num-prompts", str(n), "--max-concurrency", str(cc),
                   "--temperature", str(t), "--num-warmups", str(cc), "--disable-tqdm",
                   "--save-result", "--save-detailed", "--result-dir", str(out),
                   "--result-filename", f"{name}.json"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed for {c}:\n{r.stdout[-3000:]}"
                                   f"{r.stderr[-3000:]}")
            res = json.loads((out / f"{name}.json").read_text())
            window = full_batch_window(
                res["start_times"], [s + t for s, t in zip(res["start_times"], res["latencies"],
                                                           strict=True)], res["output_lens"], cc)
            rate = sum(window[0]) / window[1] if window else None
            runs.append({"config": c, "temperature": t, "concurrency": cc, "round": rnd,
                         "tokens_per_s": rate or res["output_throughput"],
                         "wall_tokens_per_s": res["output_throughput"],
                         "completed": res["completed"]})
            print(f"[serve_bench] round {rnd + 1} T={t:g} concurrency {cc} {c}: "
                  f"{runs[-1]['tokens_per_s']:.1f} output tok/s at full concurrency "
                  f"({res['output_throughput']:.1f} over the whole run)", flush=True)
    rows = summarize(runs, configs[0])
    result = {"seed": seed, "runs": runs, "rows": rows}
    (out / "serve_bench.json").write_text(json.dumps(result, indent=1))
    table = markdown(rows)
    (out / "serve_bench.md").write_text(table)
    print(table)
    return rows


if __name__ == "__main__":
    main()
