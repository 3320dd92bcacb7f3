"""Run one streaming-input session (vLLM's AsyncLLM, `StreamingInput` chunks) in its own process.

A session is one request id whose prompt grows chunk by chunk, each chunk with its own
SamplingParams; vLLM keeps the request (and treedraft its draft state) between chunks and
replaces its SamplingParams. Tests call ``run_session(...)``; the child prints one line
``TREEDRAFT_RESULT [token ids of the whole session's output]``. AsyncLLM always runs its engine
core in a separate process, hence the ``__main__`` guard. One session per process: in vLLM 0.32
a second AsyncLLM with speculative decoding, built in the same process after a first one shut
down, returns a streaming session that differs from no speculation's (tokens of its first steps
missing; vLLM's own ngram method too, with treedraft's plugin not loaded, whatever the first
engine was).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from treedraft.scripts.engine import engine_env

RESULT = "TREEDRAFT_RESULT "


def run_session(target: str, speculative_config: dict | None, chunks: list[dict], *,
                timeout: int = 600) -> tuple[list[int], str]:
    """chunks: [{"prompt": [token ids], "params": SamplingParams kwargs}, ...] -> (the session's
    output token ids, the child's log)."""
    request = {"target": target, "speculative_config": speculative_config, "chunks": chunks}
    proc = subprocess.run([sys.executable, __file__, json.dumps(request)], capture_output=True,
                          text=True, timeout=timeout, env=engine_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"streaming session failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(lines[-1][len(RESULT):]), proc.stdout + proc.stderr


async def _session(request: dict) -> list[int]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=request["target"], speculative_config=request["speculative_config"],
        enforce_eager=True, dtype="float32", max_model_len=1024, seed=0))
    chunks = [(TokensPrompt(prompt_token_ids=c["prompt"]), SamplingParams(**c["params"]))
              for c in request["chunks"]]

    async def inputs():
        for prompt, params in chunks:
            yield StreamingInput(prompt=prompt, sampling_params=params)

    tokens: list[int] = []
    try:
        async for out in engine.generate(prompt=inputs(), sampling_params=chunks[0][1],
                                         request_id="session"):
            tokens = list(out.outputs[0].token_ids)  # cumulative over the session's chunks
    finally:
        engine.shutdown()
    return tokens


if __name__ == "__main__":
    print(RESULT + json.dumps(asyncio.run(_session(json.loads(sys.argv[1])))), flush=True)
