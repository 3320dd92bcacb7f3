"""Offline acceptance evaluator: the reference tree decoder over a prompt set.

    treedraft eval --target smollm2-135m --head PATH --prompts mtbench --tree dynamic:60,6 \\
        --temperature 0 --max-new-tokens 256 --json out.json

For every prompt (chat template applied, first user turn) it runs
``treedraft.heads.reference.speculative_generate`` (or plain decoding with ``--head none``) and
reports:
  mean_acceptance_length   tokens committed per target verify pass, bonus token included
  per_position_acceptance  [d-1] = fraction of verify steps that accepted >= d draft tokens
  alpha_implied            the per-token acceptance a that gives the same tau for a chain of
                           gamma = tree depth: tau = (1 - a^(gamma+1)) / (1 - a)
plus step counts, tree sizes and the generated token ids (to compare with ``--head none``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from treedraft.heads.reference import DecodeResult, plain_generate, speculative_generate
from treedraft.heads.sampling import SamplingParams
from treedraft.heads.tree import (
    DEFAULT_ACCEPTANCE_RATES,
    MAX_TREE_DEPTH,
    TreeSpec,
    build_static_paths,
    parse_tree_spec,
)


@dataclass
class EvalConfig:
    target: str = "smollm2-135m"
    head: str = "none"  # checkpoint folder, shipped head name, or "none" (plain decoding)
    prompts: str = "mtbench"  # mtbench | humaneval | sharegpt | FILE.jsonl
    tree: str | None = None  # default: the head's default_tree
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    limit: int | None = None  # first N prompts (after the stride)
    stride: int = 1  # every stride-th prompt: MT-bench with stride 5 is 2 per category
    seed: int = 0  # request i uses seed + i


def tree_depth(spec: TreeSpec, rates=None) -> int:
    """Deepest node gamma a spec can draft (static trees are built from ``rates``; lookup
    chains reach min(N, MAX_TREE_DEPTH) below the root)."""
    lookup = min(spec.lookup, MAX_TREE_DEPTH)
    if spec.kind == "lookup":
        return lookup
    if spec.kind == "paths":
        head = max(len(p) for p in spec.paths)
    elif spec.kind == "dynamic":
        head = spec.depth
    else:
        head = max(len(p) for p in build_static_paths(rates or DEFAULT_ACCEPTANCE_RATES,
                                                        spec.num_nodes))
    return max(head, lookup)


def check_tree_head(spec: TreeSpec | None, spec_str: str | None, has_head: bool) -> None:
    """A tree that needs a head gets one, and lookup alone gets none."""
    if spec is not None and spec.has_head != has_head:
        raise ValueError(f"tree {spec_str!r} " + ("needs a head (--head)" if spec.has_head else
                                                  "drafts without a head: use --head none"))


def implied_alpha(tau: float, gamma: int) -> float:
    """Solve tau = (1 - a^(gamma+1)) / (1 - a) for a in [0, 1] (bisection; tau is increasing)."""
    tau = min(max(tau, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(gamma + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _acceptance_report(steps: int, accepted: int, per_depth: list[int], nodes: int,
                       by_source: dict, tokens: int, spec: str | None, gamma: int) -> dict:
    """The report keys from counts: `steps` verify steps that accepted `accepted` drafts in all,
    `per_depth[d-1]` of them at least d, `nodes` drafted nodes in all."""
    tau = (accepted + steps) / steps if steps else 1.0
    per_depth = list(per_depth) + [0] * gamma
    return {
        "mean_acceptance_length": tau,
        "per_position_acceptance": [per_depth[d] / max(steps, 1) for d in range(gamma)],
        "alpha_implied": implied_alpha(tau, gamma) if gamma else 0.0,
        "tokens_generated": tokens,
        "mean_tree_size": nodes / max(steps, 1),
        # accepted draft tokens by the source that proposed them (head / lookup / both)
        "accepted_by_source": dict(by_source),
        "tree": spec,
        "tree_depth": gamma,
    }


def summarize(results: list[DecodeResult], spec: str | None, gamma: int) -> dict:
    accepted = [a for r in results for a in r.accepted]
    report = _acceptance_report(
        len(accepted), sum(accepted), [sum(a >= d for a in accepted) for d in range(1, gamma + 1)],
        sum(s for r in results for s in r.tree_sizes),
        {k: sum(r.by_source[k] for r in results) for k in (results[0].by_source if results else {})},
        sum(len(r.tokens) for r in results), spec, gamma)
    # steps that drafted at least one node (prompt lookup may find nothing to propose); vLLM
    # counts only these as drafts, so its mean acceptance length is 1 + accepted /
    # num_drafting_steps, higher than ours for lookup, equal for a head's trees
    report.update(num_verify_steps=len(accepted),
                  num_drafting_steps=sum(s > 0 for r in results for s in r.tree_sizes))
    return report


def engine_summary(counts: dict, tokens: list[list[int]], spec: str | None, gamma: int) -> dict:
    """`summarize`'s keys from a vLLM engine's spec-decode counters (scripts/engine.py
    `counter_delta`) and its outputs. vLLM counts only steps that drafted: for a head's trees
    that is every step, so tau and per-depth acceptance equal the reference decoder's."""
    report = _acceptance_report(
        counts["drafts"], counts["accepted"], counts["accepted_per_pos"], counts["draft_tokens"],
        counts.get("accepted_by_source") or {}, sum(len(t) for t in tokens), spec, gamma)
    # vLLM does not count steps that drafted nothing
    report.update(num_verify_steps=None, num_drafting_steps=counts["drafts"])
    return report


def run_eval(
    loaded,
    head,
    rows: list[tuple[str, list[dict]]],
    *,
    tree: str | None = None,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Reference decoding of ``rows`` ((id, messages) pairs; first user turn used) with an
    in-memory target (``target.LoadedTarget``) and head (None = plain decoding, or lookup alone
    when ``tree`` is 'lookup:N')."""
    from tqdm.auto import tqdm

    from .data import first_turn
    from .target import HFTarget, encode_chat

    spec_str = tree or (head.config.default_tree if head is not None else None)
    spec = parse_tree_spec(spec_str) if spec_str else None
    check_tree_head(spec, spec_str, head is not None)
    rates = head.tree_rates() if head is not None else None
    gamma = tree_depth(spec, rates) if spec else 0
    eos = {loaded.tokenizer.eos_token_id}
    target = HFTarget(loaded.model, head.config.target_layer_ids if head is not None else None)
    results, outputs = [], []
    start = time.perf_counter()
    bar = tqdm(rows, desc="eval", disable=not progress)
    for i, (pid, messages) in enumerate(bar):
        prompt = encode_chat(loaded.tokenizer, first_turn(messages))
        gen = torch.Generator().manual_seed(seed + i)
        if spec is None:
            r = plain_generate(target, prompt, max_new_tokens, params, eos, gen)
        else:
            r = speculative_generate(target, head, prompt, max_new_tokens, spec, params, eos,
                                     gen, acceptance_rates=rates)
            bar.set_postfix(tau=f"{summarize(results + [r], spec_str, gamma)['mean_acceptance_length']:.2f}")
        results.append(r)
        outputs.append({"id": pid, "tokens": r.tokens, "mean_acceptance_length":
                        (sum(r.accepted) + len(r.accepted)) / max(len(r.accepted), 1)
                        if spec is not None else 1.0, "accepted_by_source": r.by_source})
    elapsed = time.perf_counter() - start
    report = summarize(results, spec_str, gamma)
    if spec is None:  # plain decoding: one token per target pass
        report.update(mean_acceptance_length=1.0, num_verify_steps=report["tokens_generated"])
    report.update(num_prompts=len(results), seconds=elapsed,
                  tokens_per_second=report["tokens_generated"] / max(elapsed, 1e-9),
                  outputs=outputs)
    return report


def evaluate(cfg: EvalConfig, *, progress: bool = True) -> dict:
    """``treedraft eval``: load target, head and prompts named in ``cfg``; run ``run_eval``."""
    from .data import load_prompts
    from .target import load_head_for, load_target, target_signature

    if cfg.tree is not None:
        parse_tree_spec(cfg.tree)  # bad specs fail before anything is loaded
    ds = load_prompts(cfg.prompts, limit=cfg.limit, stride=cfg.stride)  # bad input fails early
    loaded = load_target(cfg.target)
    head = None
    if cfg.head != "none":
        head = load_head_for(cfg.head, loaded.model, target_signature(loaded.model, loaded.tokenizer))
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    report = run_eval(loaded, head, list(zip(ds["id"], ds["messages"], strict=True)), tree=cfg.tree,
                      params=params, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                      progress=progress)
    report["config"] = asdict(cfg)
    return report


def write_report(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
