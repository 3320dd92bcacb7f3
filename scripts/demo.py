"""The main job on the embedded default target, as it stands today.

    scripts/venv.sh treedraft demo                  # SmolLM2-135M, 4 MT-bench questions
    scripts/venv.sh treedraft demo --num-prompts 1 --max-new-tokens 32   # quicker

1. materializes the target (once) and answers MT-bench first turns with vLLM (greedy);
2. runs treedraft's reference tree decoder with the shipped EAGLE head (if this install has
   it) on the same prompts, reports tokens per target pass, and checks that its greedy output
   equals plain decoding token for token.
"""

from __future__ import annotations

import os
import time


def _vllm_answers(folder: str, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(folder, enforce_eager=True, max_model_len=2048, dtype="float32")
    start = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"vLLM: {n} tokens in {time.perf_counter() - start:.1f}s (batch of {len(prompts)})")
    return [o.outputs[0].text for o in outs]


def run_demo(target: str, num_prompts: int = 4, max_new_tokens: int = 64) -> None:
    from treedraft.heads.shipped import resolve_head
    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.evaluate import run_eval
    from treedraft.training.models import resolve_model
    from treedraft.training.target import load_head_for, load_target, target_signature

    folder = resolve_model(target)
    print(f"target {target}: {folder}")
    ds = load_prompts("mtbench", limit=num_prompts)
    prompts = [first_turn(m) for m in ds["messages"]]
    for p, text in zip(prompts, _vllm_answers(folder, prompts, max_new_tokens), strict=True):
        print(f"\n> {p[-1]['content'][:100]}\n{text.strip()[:300]}")

    loaded = load_target(target)
    rows = list(zip(ds["id"], ds["messages"], strict=True))
    plain = run_eval(loaded, None, rows, max_new_tokens=max_new_tokens, progress=False)
    head_name = f"{target}-eagle"
    try:
        resolve_head(head_name)
    except (FileNotFoundError, ValueError) as e:
        print(f"\nreference decoder: plain decoding only ({e})")
        return
    head = load_head_for(head_name, loaded.model, target_signature(loaded.model, loaded.tokenizer))
    spec = run_eval(loaded, head, rows, max_new_tokens=max_new_tokens, progress=False)
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(plain["outputs"], spec["outputs"], strict=True))
    print(f"\nreference tree decoder with {head_name} ({spec['tree']}): "
          f"{spec['mean_acceptance_length']:.2f} tokens per target pass; "
          f"greedy output equal to plain decoding for {same}/{len(rows)} prompts")
