"""`treedraft load`: drive a running `vllm serve` with a mix of request shapes; JSON report.

    vllm serve TARGET --port 8000 --speculative-config '{"model": "smollm2-135m-eagle", "tree": "dynamic:16,4,4"}' &
    treedraft load --url http://127.0.0.1:8000 --clients 8 --requests 48 --out tree.json
    treedraft load --url http://127.0.0.1:8001 --clients 8 --requests 48 --out plain.json \
        --compare tree.json                    # T=0 answers must be identical

Loopback only (the tool refuses other hosts), bounded in count and time. Every client runs its
share of a fixed, seeded workload: streaming and non-streaming, chat and completions, T=0 and
T>0 with top-k/top-p, stop strings, short max_tokens, logprobs, seeds, n=2, prompts near the
server's max_model_len, and clients that disconnect mid-stream. The report holds: requests,
errors by kind, latency percentiles, completion tokens/s, mean acceptance length from /metrics
(the change during the load), the server's memory before/after (`--server-pid`), its gauges
once the load has drained (requests running / waiting, KV cache usage, live draft sessions:
after a probe request, at most the probe's own), and each T=0 answer (for `--compare`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

KINDS = ("chat", "chat_stream", "completion", "completion_stream", "logprobs", "stop",
         "short", "seeded", "n2", "near_max_len", "disconnect")
WORDS = ("the sea river code list prime number function return value city capital France "
         "Paris write explain why how small model token tree draft verify").split()
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
        "vllm:num_preemptions")  # counters: their change during the load is reported


NEAR_MAX_ROOM = 96  # tokens left for the chat template and the reply of near_max_len requests


def workload(n: int, seed: int, max_model_len: int, max_tokens: int = 32,
             near_max_room: int = NEAR_MAX_ROOM) -> list[dict]:
    """n request descriptions, the same for a given seed (so two servers get the same load)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        words = rng.choices(WORDS, k=rng.randint(4, 24))
        prompt = f"Question {i}: " + " ".join(words) + ". Answer briefly."
        sampled = rng.random() < 0.5 and kind not in ("near_max_len",)
        req = {"id": i, "kind": kind, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0.8 if sampled else 0.0}
        if sampled:
            req.update(top_p=0.9, top_k=20)
        if kind == "stop":
            req["stop"] = ["."]
        elif kind == "short":
            req["max_tokens"] = 2
        elif kind == "seeded":
            req.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        elif kind == "logprobs":
            req["logprobs"] = 2
        elif kind == "n2":
            req.update(n=2, temperature=0.8, top_k=20)
        elif kind == "near_max_len":  # all but ~96 tokens of the context in the prompt (chat,
            # no max_tokens: the reply may run to the end of the context, the OpenAI default)
            req["prompt"] = " ".join(rng.choices(WORDS, k=max(16, max_model_len - near_max_room)))
            req["max_tokens"] = None
        out.append(req)
    return out


def _body(req: dict, model: str) -> tuple[str, dict]:
    keys = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n")
    body = {"model": model, **{k: req[k] for k in keys if req.get(k) is not None}}
    stream = req["kind"] in ("chat_stream", "completion_stream", "disconnect")
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}  # the last chunk counts the tokens
    if req["kind"].startswith("chat") or req["kind"] == "near_max_len":
        body["messages"] = [{"role": "user", "content": req["prompt"]}]
        if "logprobs" in req:
            body.update(logprobs=True, top_logprobs=req["logprobs"])
        return "/v1/chat/completions", body
    body["prompt"] = req["prompt"]
    if "logprobs" in req:
        body["logprobs"] = req["logprobs"]
    return "/v1/completions", body


async def _one(client, url: str, model: str, req: dict) -> dict:
    path, body = _body(req, model)
    t = time.perf_counter()
    res = {"id": req["id"], "kind": req["kind"]}
    try:
        if body["stream"]:
            text, chunks, tokens = [], 0, 0
            async with client.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    res["error"] = f"HTTP {r.status_code}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunks += 1
                    data = json.loads(line[6:])
                    usage = data.get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
                    choice = data["choices"]
                    if choice:
                        c = choice[0]
                        text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                    if req["kind"] == "disconnect" and chunks >= 2:
                        break  # leave mid-stream: the server must clean up
            res["text"], res["tokens"] = "".join(text), tokens
        else:
            r = await client.post(url + path, json=body)
            if r.status_code != 200:
                res["error"] = f"HTTP {r.status_code}"
                res["detail"] = r.text[:300]
                return res
            data = r.json()
            c = data["choices"][0]
            res["text"] = c.get("text") if "text" in c else c["message"]["content"]
            res["tokens"] = data.get("usage", {}).get("completion_tokens", 0)
            if "logprobs" in req:
                lp = c.get("logprobs") or {}
                n_lp = len(lp.get("tokens") or lp.get("content") or [])
                if n_lp != res["tokens"] // body.get("n", 1):
                    res["error"] = f"logprobs: {n_lp} entries for {res['tokens']} tokens"
    except Exception as e:  # noqa: BLE001 (every failure is counted by kind, none stops the load)
        res["error"] = type(e).__name__
    res["latency"] = time.perf_counter() - t
    return res


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:treedraft_live_draft_sessions")


def _scrape(url: str, names: tuple[str, ...], suffix: str = "") -> dict[str, float | None]:
    """Each metric's value summed over its label sets (None where /metrics lacks it)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float | None] = dict.fromkeys(names)
    for name in names:
        pattern = rf"^{re.escape(name + suffix)}\{{[^}}]*\}} ([0-9.e+-]+)$"
        for m in re.finditer(pattern, text, re.M):
            out[name] = (out[name] or 0.0) + float(m.group(1))
    return out


def _metrics(url: str) -> dict[str, float]:
    """The spec-decode counters (0 where the server has none)."""
    return {k: v or 0.0 for k, v in _scrape(url, SPEC, "_total").items()}


def _gauges(url: str) -> dict[str, float | None]:
    return _scrape(url, GAUGES)


def drained(url: str, model: str, timeout: float = 60.0) -> dict[str, float | None]:
    """The server's gauges once no request runs or waits, after one short probe request (vLLM
    and the draft proposer release a finished request's state at the next step: the probe is
    that step, so afterwards only the probe's own state may remain)."""
    import httpx

    def idle() -> dict:
        deadline = time.time() + timeout
        while True:
            g = _gauges(url)
            busy = (g[GAUGES[0]] or 0) + (g[GAUGES[1]] or 0)
            if not busy or time.time() > deadline:
                return g
            time.sleep(0.5)

    idle()
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The sea is",
                                              "max_tokens": 4, "temperature": 0},
               timeout=timeout).raise_for_status()
    return idle()


def _rss_mib(pid: int | None) -> float | None:
    """Resident memory of the server and its children (engine core, worker), MiB."""
    if pid is None:
        return None
    import subprocess

    ps = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)],
                        capture_output=True, text=True).stdout.split()
    return sum(int(x) for x in ps) / 1024


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _run(args, reqs: list[dict]) -> list[dict]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    results: list[dict] = []
    deadline = time.perf_counter() + args.time_limit

    from tqdm.auto import tqdm

    bar = tqdm(total=len(reqs), desc=f"load {args.url}", unit="req", file=sys.stderr,
               disable=None)  # off where stderr is not a terminal and CI logs would fill

    async def client_loop(client):
        while not queue.empty() and time.perf_counter() < deadline:
            results.append(await _one(client, args.url, args.model, queue.get_nowait()))
            bar.update(1)
            bar.set_postfix(errors=sum("error" in r for r in results), refresh=False)

    timeout = httpx.Timeout(args.time_limit)
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    bar.close()
    return sorted(results, key=lambda r: r["id"])


def report(args, results: list[dict], wall: float, before: dict, after: dict,
           rss: tuple) -> dict:
    errors = dict(Counter(f"{r['kind']}: {r['error']}" for r in results if "error" in r))
    lat = [r["latency"] for r in results if "latency" in r]
    drafts = after[SPEC[0]] - before[SPEC[0]]
    accepted = after[SPEC[1]] - before[SPEC[1]]
    return {"url": args.url, "clients": args.clients, "requests": len(results),
            "errors": errors, "num_errors": sum(errors.values()), "wall_seconds": wall,
            "latency_s": {q: percentile(lat, p) for q, p in (("p50", .5), ("p90", .9),
                                                               ("p99", .99))},
            "completion_tokens_per_s": sum(r.get("tokens", 0) for r in results) / wall,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "preemptions": after[SPEC[2]] - before[SPEC[2]],
            "server_rss_mib": {"before": rss[0], "after": rss[1]},
            "greedy": {str(r["id"]): r.get("text") for r in results
                       if r.get("greedy") and "error" not in r}}


def compare(a: dict, b: dict) -> list[str]:
    """Request ids whose T=0 answers differ between two reports (both answered)."""
    return sorted((k for k in a["greedy"].keys() & b["greedy"].keys()
                   if a["greedy"][k] != b["greedy"][k]), key=int)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32, help="of most requests")
    p.add_argument("--near-max-room", type=int, default=NEAR_MAX_ROOM,
                   help="tokens of context left by the prompts of near-max_model_len requests")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the server's max_model_len (default: read from /v1/models)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole load")
    p.add_argument("--server-pid", type=int, default=None, help="for memory before/after")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--compare", type=Path, default=None, help="a report of the same load")


def run(args: argparse.Namespace) -> int:
    """Run the load; print the report; 1 if any request failed or a T=0 answer differs."""
    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--url {args.url}: treedraft load drives loopback servers only")
    import httpx

    models = httpx.get(args.url + "/v1/models", timeout=30).json()["data"]
    args.model = args.model or models[0]["id"]
    max_len = args.max_model_len or models[0].get("max_model_len") or 2048
    reqs = workload(args.requests, args.seed, max_len, args.max_tokens, args.near_max_room)
    greedy = {r["id"] for r in reqs if r["temperature"] == 0 and r["kind"] != "disconnect"}
    before, rss0 = _metrics(args.url), _rss_mib(args.server_pid)
    t = time.perf_counter()
    results = asyncio.run(_run(args, reqs))
    wall = time.perf_counter() - t
    for r in results:
        r["greedy"] = r["id"] in greedy
    httpx.get(args.url + "/health", timeout=30).raise_for_status()  # the server is still up
    after = _metrics(args.url)
    rep = report(args, results, wall, before, after, (rss0, _rss_mib(args.server_pid)))
    rep["planned"] = len(reqs)  # fewer answered: the time limit cut the load short
    rep["after_drain"] = drained(args.url, args.model)
    if args.compare is not None:
        rep["differs_from_compare"] = compare(rep, json.loads(args.compare.read_text()))
    text = json.dumps(rep, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in rep.items() if k != "greedy"}, indent=1))
    if rep["requests"] < rep["planned"]:
        print(f"treedraft load: only {rep['requests']} of {rep['planned']} requests ran within "
              f"--time-limit {args.time_limit:g} s; raise it", file=sys.stderr)
    bad = rep["num_errors"] or rep.get("differs_from_compare") or rep["requests"] < rep["planned"]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="treedraft load", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
