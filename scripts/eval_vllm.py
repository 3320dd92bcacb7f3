"""`treedraft eval --engine vllm`: the acceptance measurement of `treedraft eval`, run through a
batched vLLM engine with the treedraft plugin instead of the reference decoder.

    treedraft eval --engine vllm --head smollm2-135m-eagle --prompts mtbench --tree chain:5
    treedraft eval --engine vllm --head runs/eagle/final --tree dynamic:60,6,8 --batch-size 16
    treedraft eval --engine vllm --target meta-llama/Llama-3.1-8B-Instruct \
        --head runs/llama-3.1-8b-eagle3/final --tree chain:5 --gpu-memory-utilization 0.5  # GPU

Same prompts (first user turn, chat template), same tree, same sampling settings and the same
report keys as the reference evaluator (training/evaluate.py), read from vLLM's spec-decode
counters: `mean_acceptance_length` (1 + accepted / drafting steps), `per_position_acceptance`
(fraction of drafting steps that accepted >= d drafts), `alpha_implied`, `accepted_by_source`.
For a head's trees every step drafts, so the numbers are the reference's (the engine tests hold
them to it step for step at batch 1); for lookup alone vLLM counts only steps that found a
draft (see `num_drafting_steps` in the reference report). Requests run in waves of
`batch_size` with a token budget large enough that no tree is cut to fit a step.

The engine runs on the device vLLM finds: on a GPU in its serving dtype (bf16, `--dtype auto`
resolved for CUDA) with `--gpu-memory-utilization` of it (vLLM's default 0.9 when not given);
on a CPU in float32, the reference decoder's dtype. A treedraft head folder (an EAGLE-3-layout
head of a real-target recipe included) drafts through the treedraft plugin; a folder in the
speculators format too, with the tree it would be served with.

The reference decoder stays the ground truth for exactness; this path batches requests, which
pays where verification is cheap (GPU); on a 2-core AVX2 CPU it took about as long as the
reference (tree cost per request).
"""

from __future__ import annotations

import time

from treedraft.training.evaluate import EvalConfig, check_tree_head, engine_summary, tree_depth

DEFAULT_BATCH = 16


def speculative_config(head_dir: str | None, tree: str | None) -> dict | None:
    """The --speculative-config that drafts `tree` with the head at `head_dir` (None: no head):
    `treedraft bench`'s `tree=SPEC` configuration (no-spec without a tree)."""
    from .bench import speculative_config as bench_config

    return bench_config("no-spec" if tree is None else f"tree={tree}", head_dir)


def eval_jobs(prompts: list[list[int]], cfg: EvalConfig, batch_size: int | None,
              name: str = "eval") -> list[dict]:
    """One engine job: every prompt, request i seeded with cfg.seed + i when sampling."""
    params = []
    for i in range(len(prompts)):
        p = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
             "max_tokens": cfg.max_new_tokens}
        if cfg.temperature > 0:
            p["seed"] = cfg.seed + i
        params.append(p)
    return [{"name": name, "prompts": prompts, "params": params, "batch_size": batch_size}]


def engine_settings(dtype: str | None, gpu_memory_utilization: float | None,
                    device=None) -> dict:
    """The `vllm.LLM` dtype (and GPU share) of the device the engine runs on (None: a GPU where
    one is visible). dtype None: float32 on a CPU (the reference decoder's), the device's
    serving dtype on a GPU; 'auto': the device's serving dtype (heads/machine.py)."""
    from treedraft.heads.machine import resolve_dtype
    from treedraft.training.config import work_device

    device = work_device(device)
    cuda = device.type == "cuda"
    out = {"dtype": resolve_dtype(dtype or ("auto" if cuda else "float32"), device,
                                  workload="serve")}
    if gpu_memory_utilization is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in "
                             "(0, 1]: the share of the GPU's memory vLLM may take")
        if cuda:
            out["gpu_memory_utilization"] = gpu_memory_utilization
    return out


def machine() -> str:
    """The device the engine runs on, in words."""
    import torch

    from treedraft.heads.machine import describe

    return (f"CUDA: {torch.cuda.get_device_name()}" if torch.cuda.is_available()
            else describe())


def evaluate_vllm(cfg: EvalConfig, *, batch_size: int = DEFAULT_BATCH, dtype: str | None = None,
                  gpu_memory_utilization: float | None = None, progress: bool = True) -> dict:
    """Run `cfg` through a vLLM engine with the plugin; the report of `treedraft eval`.
    `engine_settings` picks the dtype and GPU share."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from treedraft.heads.common import load_head, read_config
    from treedraft.heads.shipped import resolve_head
    from treedraft.heads.speculators import default_tree, is_speculators
    from treedraft.heads.tree import parse_tree_spec
    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.models import resolve_model
    from treedraft.training.target import encode_chat

    from .engine import run_engine

    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be >= 1")
    settings = engine_settings(dtype, gpu_memory_utilization)
    head_dir = None if cfg.head == "none" else str(resolve_head(cfg.head))
    head_cfg = read_config(head_dir) if head_dir else {}
    if is_speculators(head_cfg):  # served as the plugin serves it
        head_cfg = {"default_tree": default_tree(head_cfg)}
    tree = cfg.tree or head_cfg.get("default_tree")
    spec = parse_tree_spec(tree) if tree else None  # bad specs fail before the engine starts
    check_tree_head(spec, tree, head_dir is not None)
    rates = head_cfg.get("acceptance_rates")
    # unmeasured (a checkpoint of ours): the table the plugin shapes by (a speculators head,
    # EAGLE-3 with no depth limit, has none either: not loaded for nothing)
    if rates is None and "head_type" in head_cfg:
        rates = load_head(head_dir).tree_rates()
    gamma = tree_depth(spec, rates) if spec else 0
    ds = load_prompts(cfg.prompts, limit=cfg.limit, stride=cfg.stride)
    target_dir = str(resolve_model(cfg.target))
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [encode_chat(tok, first_turn(m)) for m in ds["messages"]]
    bs = min(batch_size, len(prompts))
    nodes = spec.max_nodes if spec is not None else 0
    # prefill chunks may share a step with trees; no tree is cut to fit the step's budget
    llm = {**settings, "max_num_seqs": bs,
           "max_num_batched_tokens": max(2048, bs * (nodes + 1)),
           "max_model_len": max(len(p) for p in prompts) + cfg.max_new_tokens + nodes + 1}
    total = len(prompts) * cfg.max_new_tokens
    bar = tqdm(total=total, desc=f"eval vllm {tree or 'no-spec'}", unit="tok",
               disable=not progress)

    def on_event(ev: dict) -> None:
        if "ready" in ev:
            bar.set_postfix(engine=f"ready in {ev['ready']:.0f}s")
        elif "tokens" in ev:
            bar.update(ev["tokens"])

    start = time.perf_counter()
    results, _ = run_engine(target_dir, speculative_config(head_dir, tree),
                            eval_jobs(prompts, cfg, bs), llm=llm, timeout=24 * 3600,
                            progress=on_event)
    bar.close()
    res = results["eval"]
    report = engine_summary(res["spec"], res["tokens"], tree, gamma)
    if spec is not None and not spec.lookup and not any(report["accepted_by_source"].values()):
        # vLLM's rejection sampler verifies chains and counts no sources: all are the head's
        report["accepted_by_source"] = {"head": res["spec"]["accepted"], "lookup": 0, "both": 0}
    elapsed = time.perf_counter() - start
    report.update(num_prompts=len(prompts), seconds=elapsed,
                  generate_seconds=sum(res["wave_seconds"]),
                  tokens_per_second=report["tokens_generated"] / max(sum(res["wave_seconds"]),
                                                                     1e-9),
                  engine="vllm", batch_size=bs, dtype=llm["dtype"], machine=machine(),
                  outputs=[{"id": pid, "tokens": t}
                           for pid, t in zip(ds["id"], res["tokens"], strict=True)])
    return report
