"""Run a real vLLM engine (offline ``LLM``) in its own process and print the results as JSON.

Tests call ``run_vllm(...)`` below; vLLM is kept out of the pytest process. The script's
stdout ends with one line ``TREEDRAFT_RESULT {...}``; vLLM logs to both streams.
"""

from __future__ import annotations

import json
import subprocess
import sys

from treedraft.scripts.engine import engine_env

INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # vLLM's engine core and worker in-process


def run_vllm(model: str, prompts: list[list[dict]], *, max_tokens: int = 24, timeout: int = 600,
             **llm_kwargs) -> tuple[list[str], str]:
    """Greedy chat completions of ``prompts`` with vLLM; returns (texts, vLLM's log).

    vLLM's engine core and worker run inside the child (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    it starts in about half the time of three processes."""
    request = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "llm": llm_kwargs}
    proc = subprocess.run([sys.executable, __file__, json.dumps(request)], capture_output=True,
                          text=True, timeout=timeout,
                          env={**engine_env(), **INPROC})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TREEDRAFT_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1]), proc.stdout + proc.stderr


def _main(request: dict) -> None:
    from vllm import LLM, SamplingParams

    llm_kwargs = {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32", **request["llm"]}
    llm = LLM(request["model"], **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    outs = llm.chat(request["prompts"], params, use_tqdm=False)
    print("TREEDRAFT_RESULT " + json.dumps([o.outputs[0].text for o in outs]), flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
