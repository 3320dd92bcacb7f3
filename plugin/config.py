"""`--speculative-config` → treedraft: recognise a treedraft head and rewrite the config (frontend).

vLLM's `SpeculativeConfig` forbids unknown keys and never infers a method from a treedraft head
folder, so `EngineArgs.create_speculative_config` is wrapped (it runs in the frontend, after
plugins load). When ``model`` is a treedraft head (a folder whose config.json has ``head_type``,
or a shipped head's short name), an EAGLE-3 head in the speculators format (config.json with
``speculators_model_type``) or the flat layout (``architectures: ["LlamaForCausalLMEagle3"]``,
SpecForge's and the EAGLE authors'), unless ``method`` is ``"eagle3"`` (then vLLM serves it as
its own), or ``method`` is ``"treedraft"``; any of these may be a Hugging Face hub id
(``org/name``), downloaded into the hub cache at start-up:

- the treedraft keys (``tree``) are popped and validated; bad specs fail here, at startup;
- the head is loaded on CPU and checked against the target (architecture, hidden size, vocab,
  layers, tokenizer fingerprint); a mismatch names both sides;
- an EAGLE-3 folder is converted once into a treedraft folder (cache: $TREEDRAFT_CACHE or
  ~/.cache/treedraft/imported/), which the workers load;
- the dict becomes ``method="custom_class"``, ``model=PROPOSER``,
  ``num_speculative_tokens = the tree's node budget``;
- ``additional_config["treedraft"]`` carries head dir, head type and tree to every process.

Tree shape: ``tree`` if given, else ``chain:num_speculative_tokens`` if that is given, else the
head's ``default_tree`` under ``"auto"``. ``"auto"`` drafts at most that tree with
``AUTO_LOOKUP`` prompt-lookup nodes grafted (``"auto:SPEC"``: at most SPEC, lookup only if SPEC
has ``+lookup:N``) and lets the proposer choose each step's spec among a few fixed ones, from
nothing drafted to that tree, by the tokens per second per request each realized in the engine
(heads/policy.py); it is what a config naming only the head gets. Chains are verified by vLLM's
own rejection sampler; branching trees by
treedraft's tree verifier. Prompt lookup needs no head: ``{"method": "treedraft", "tree":
"lookup:N"}`` drafts from each request's own history alone, and ``"+lookup:N"`` after a head's
tree grafts lookup branches into it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .attention_cuda import CONFIG_PATCHES as CUDA_CONFIG_PATCHES
from .patching import Patch

PROPOSER = "treedraft.plugin.proposer.TreeDraftProposer"
KEY = "treedraft"  # additional_config key
TREEDRAFT_KEYS = ("tree", "scratch_blocks")  # popped from --speculative-config (vLLM's own keys stay)
# --speculative-config keys and the --spec-* shorthand attributes of EngineArgs they merge with
FLAGS = {"method": "spec_method", "model": "spec_model", "num_speculative_tokens": "spec_tokens"}


def tree_mode(vllm_config) -> bool:
    """Whether this engine verifies branching trees (tree attention, scratch KV blocks); read in
    every process that builds an engine part, so it imports nothing of vLLM's."""
    from treedraft.heads.tree import parse_tree_spec

    td = (vllm_config.additional_config or {}).get(KEY)
    return bool(td) and not parse_tree_spec(td["tree"]).is_chain


def _head_dir(model: Any, method: Any = None) -> Path | None:
    """The head folder if `model` names a treedraft head or an EAGLE-3 folder (speculators or
    flat layout), else None (leave the config to vLLM). A hub id (`org/name`, with `method`
    absent or "treedraft") is downloaded into the hub cache first; one that cannot be fails
    here, at start-up, saying why."""
    if not isinstance(model, str) or not model:
        return None
    from treedraft.heads.common import is_hub_id
    from treedraft.heads.shipped import SHIPPED_HEADS, resolve_head

    if model in SHIPPED_HEADS:
        return resolve_head(model)
    folder = Path(model).expanduser()
    if method in (None, KEY) and is_hub_id(model):
        folder = _hub_head(model)
        if folder is None:
            return None
    raw = _read_json(folder / "config.json")
    return folder.resolve() if raw is not None and _is_head(raw) else None


def _is_head(raw: dict) -> bool:
    from treedraft.heads.speculators import is_speculators

    return "head_type" in raw or is_speculators(raw)


def _read_json(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def _hub_head(model: str) -> Path | None:
    """The hub repository `model` downloaded (config and weights) when it holds a head; None
    when its config.json says it holds something else (e.g. a draft model for vLLM: its
    weights are left to vLLM). Not found, offline without it cached, gated: resolve()'s error
    (what was wrong, what to give instead)."""
    from huggingface_hub import hf_hub_download

    from treedraft.heads.speculators import resolve

    try:
        raw = _read_json(Path(hf_hub_download(model, "config.json")))
    except (OSError, ValueError):  # resolve() below names the failure
        raw = None
    if raw is not None and not _is_head(raw):
        return None
    return resolve(model)


def imported_dir(head, source: Path) -> Path:
    """A speculators-format head saved as a treedraft folder (what the workers load), cached
    per source folder, target signature and the folder's files' modification times."""
    import hashlib

    from treedraft.heads.shipped import cache_dir
    from treedraft.heads.speculators import FORMAT_VERSION

    stamp = [FORMAT_VERSION, str(source), json.dumps(head.config.target.to_dict(),
                                                     sort_keys=True)] + [
        f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(source.iterdir()) if p.is_file()]
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
    out = cache_dir() / "imported" / key
    if not (out / "config.json").is_file():
        head.save_pretrained(out, provenance={"imported_from": str(source),
                                              "format": "speculators eagle3"})
    return out


def target_signature(model_config) -> Any:
    """TargetSignature of vLLM's target ModelConfig (loads its tokenizer for the fingerprint)."""
    from transformers import AutoTokenizer

    from treedraft.heads.common import TargetSignature, tokenizer_fingerprint

    hf = model_config.hf_text_config
    tok = AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code,
        revision=model_config.tokenizer_revision)
    return TargetSignature(
        architecture=(model_config.hf_config.architectures or [""])[0],
        hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size,
        num_hidden_layers=hf.num_hidden_layers,
        tokenizer_fingerprint=tokenizer_fingerprint(tok.get_vocab()),
    )


AUTO = "auto"  # "tree": "auto" or "auto:SPEC": each step's spec chosen (heads/policy.py)
# lookup nodes plain "auto" may graft: its greedy chains graft 4 or 16 (heads.policy.grafts).
# Paired at batch 1, T=0 on a 2-core EPYC (scripts/BENCHMARKS.md, "How many lookup nodes"):
# Qwen2.5-Coder-0.5B on HumanEval, chain:2+lookup:16 3.2x no-spec, chain:3+lookup:8 2.8x;
# SmolLM2-135M on MT-bench and HumanEval, lookup:4 to 16 within 1.33-1.49x
AUTO_LOOKUP = 16


def asks_auto(tree, sc: dict) -> bool:
    """Whether the `tree` key's value (None if absent) and the rest of a --speculative-config
    `sc` ask for "auto": "auto" / "auto:SPEC", or only the head named (no tree, no
    num_speculative_tokens, no num_speculative_tokens_per_batch_size)."""
    if isinstance(tree, str):
        return tree.strip().startswith(AUTO)
    return (tree is None and sc.get("num_speculative_tokens") is None
            and not sc.get("num_speculative_tokens_per_batch_size"))


def resolve_tree(sc: dict, head_config: dict) -> tuple[Any, bool]:
    """(TreeSpec, auto) asked for by the popped `tree` key / num_speculative_tokens / head
    default. "auto" drafts at most the head's default tree + lookup:AUTO_LOOKUP (or
    chain:num_speculative_tokens), "auto:SPEC" at most SPEC, each step's budget chosen from
    measured cost. Naming only the head
    (no tree, no num_speculative_tokens, no num_speculative_tokens_per_batch_size) means "auto";
    a tree or a token count given explicitly is drafted as given."""
    from treedraft.heads.tree import parse_tree_spec

    tree = sc.pop("tree", None)
    k = sc.get("num_speculative_tokens")
    if isinstance(tree, list):  # JSON paths given inline
        tree = json.dumps(tree)
    auto = asks_auto(tree, sc)  # only the head named: its default tree, each step's budget chosen
    if auto and tree is not None:
        rest = tree.strip()[len(AUTO):].strip()
        if rest and not rest.startswith(":"):
            raise ValueError(f"--speculative-config: tree {tree!r}: write 'auto' or 'auto:SPEC'")
        tree = rest[1:].strip() or None
    if tree is None:
        tree = f"chain:{k}" if k is not None else head_config.get("default_tree", "chain:5")
        if auto and k is None and "lookup" not in tree:
            tree = f"{tree}+lookup:{AUTO_LOOKUP}"
    spec = parse_tree_spec(tree)
    if k is not None and spec.max_nodes != k:
        raise ValueError(
            f"--speculative-config: num_speculative_tokens={k} disagrees with tree "
            f"{spec.to_string()!r}, which has {spec.max_nodes} nodes; drop num_speculative_tokens "
            f"(the tree sets it) or set it to {spec.max_nodes}"
        )
    if auto and not spec.has_head:
        raise ValueError(f"--speculative-config: 'auto' chooses the head's tree size; "
                         f"{spec.to_string()!r} has no head part")
    return spec, auto


def rewrite(engine_args, target_model_config, parallel_config=None) -> None:
    """Rewrite engine_args.speculative_config in place when it names a treedraft head."""
    sc = dict(engine_args.speculative_config or {})
    for key, attr in FLAGS.items():  # the --spec-* shorthands, merged as vLLM would
        if getattr(engine_args, attr, None) is not None and key not in sc:
            sc[key] = getattr(engine_args, attr)
    sc = {k.replace("-", "_"): v for k, v in sc.items()}
    head_dir = _head_dir(sc.get("model"), sc.get("method"))
    if head_dir is None:
        if sc.get("method") == KEY and not sc.get("model"):
            return _rewrite_lookup_only(engine_args, sc, target_model_config, parallel_config)
        if sc.get("method") == KEY:
            raise ValueError(
                f"--speculative-config: method 'treedraft' needs 'model' to be a treedraft head "
                f"folder (config.json with head_type), an EAGLE-3 folder or hub id "
                f"(speculators or LlamaForCausalLMEagle3 config.json) or a shipped head name, "
                f"got {sc.get('model')!r}"
            )
        return
    from treedraft.heads.common import load_head
    from treedraft.heads.speculators import default_tree, is_speculators

    head_config = json.loads((head_dir / "config.json").read_text())
    speculators = is_speculators(head_config)
    if speculators and sc.get("method") == "eagle3":
        return  # a speculators EAGLE-3 folder asked for by vLLM's own method: vLLM serves it
    if sc.get("method") not in (None, KEY, "custom_class"):
        raise ValueError(
            f"--speculative-config: {head_dir} is a treedraft head, but method={sc['method']!r}; "
            "drop 'method' (or set it to 'treedraft')"
        )
    if speculators:  # default tree: ours if we exported it, else the folder's own chain length
        head_config = {"default_tree": default_tree(head_config)}
    spec, auto = resolve_tree(sc, head_config)
    if not spec.has_head:
        raise ValueError(
            f"--speculative-config: tree {spec.to_string()!r} drafts by prompt lookup alone, "
            f"without a head, but 'model' names the head {head_dir}; drop 'model' and set "
            f"'method': 'treedraft', or add a head tree (e.g. 'chain:2+{spec.to_string()}')")
    target_sig = target_signature(target_model_config)
    # CPU, small; refuses a corrupt or unknown head (a speculators folder: checked on load)
    try:
        head = load_head(head_dir, target=target_sig if speculators else None)
        head.check_target(target_sig)
    except ValueError as e:
        if speculators:  # vLLM's own EAGLE-3 may still serve it as a chain
            raise ValueError(f"{e}. To serve this folder with vLLM's own EAGLE-3 instead (chains, "
                             "no trees), add \"method\": \"eagle3\" to --speculative-config"
                             ) from e
        raise
    if speculators:  # the workers load a treedraft folder converted once here
        head_dir = imported_dir(head, head_dir)
    if spec.max_nodes > 1 and head.head_type == "medusa":
        depth = max(len(p) for p in spec.paths) if spec.kind == "paths" else None
        if depth is not None and depth > head.config.num_heads:
            raise ValueError(
                f"tree {spec.to_string()!r} is {depth} deep, but the Medusa head {head_dir} has "
                f"{head.config.num_heads} heads; use a tree at most {head.config.num_heads} deep"
            )
    _check_platform(spec)
    _check_parallel(spec, auto, parallel_config)
    _check_target(spec, target_model_config)
    _finish(engine_args, sc, spec, {"head_dir": str(head_dir), "head_type": head.head_type,
                                    "auto": auto})


def _rewrite_lookup_only(engine_args, sc: dict, target_model_config, parallel_config=None
                         ) -> None:
    """{"method": "treedraft", "tree": "lookup:N"}: prompt lookup verified as trees, no head."""
    from treedraft.heads.tree import parse_tree_spec

    tree = sc.pop("tree", None)
    spec = parse_tree_spec(tree) if tree is not None else None
    if spec is None or spec.has_head:
        raise ValueError(
            f"--speculative-config: method 'treedraft' without 'model' drafts by prompt lookup "
            f"alone and needs 'tree': 'lookup:N', got tree={tree!r}; or set 'model' to a "
            "treedraft head folder or shipped head name")
    k = sc.get("num_speculative_tokens")
    if k is not None and k != spec.max_nodes:
        raise ValueError(f"--speculative-config: num_speculative_tokens={k} disagrees with tree "
                         f"{spec.to_string()!r} ({spec.max_nodes} nodes); drop it")
    _check_platform(spec)
    _check_parallel(spec, False, parallel_config)
    _check_target(spec, target_model_config)
    _finish(engine_args, sc, spec, {"head_dir": None, "head_type": None})


def _check_platform(spec) -> None:
    """Branching trees run on vLLM's CPU backend and on CUDA (plugin/attention_cuda.py: the
    Triton tree kernel; the engine-level CUDA refusals and PIECEWISE graphs are applied to the
    VllmConfig by attention_cuda.CONFIG_PATCHES, the per-layer ones when the layers are built)."""
    import importlib.util

    from vllm.platforms import current_platform

    if spec.is_chain or current_platform.is_cpu():
        return
    if not current_platform.is_cuda():
        raise NotImplementedError(
            f"tree {spec.to_string()!r}: treedraft verifies branching trees on vLLM's CPU and "
            "CUDA backends only; use 'chain:K' on this platform")
    if importlib.util.find_spec("triton") is None:
        raise NotImplementedError(
            f"tree {spec.to_string()!r}: tree attention on CUDA is a Triton kernel, but triton "
            "is not installed; install vLLM's triton (pip install triton) or use 'chain:K'")


def _check_parallel(spec, auto: bool, parallel_config) -> None:
    """Refuse, at startup, what treedraft cannot serve exactly across parallel ranks.

    Pipeline parallel: vLLM builds the drafter on the last stage only, so only that stage would
    install tree attention and compact the accepted path's K/V; earlier stages would compute
    tree rows as one causal sequence and keep rejected nodes' K/V. Tensor parallel: every rank
    runs its own proposer while the scheduler takes rank 0's drafts, so the ranks must draft
    identically. `auto` decides from each rank's own wall-clock timings (ranks draft different
    trees) and tree attention depends on each rank's stored tree matching the scheduled drafts:
    both are refused. A fixed chain drafts the same tokens on every rank (the same head on
    the same all-reduced hidden states) and vLLM verifies it on every rank, as its own EAGLE."""
    if parallel_config is None:
        return
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    tp = getattr(parallel_config, "tensor_parallel_size", 1)
    if pp > 1:
        raise NotImplementedError(
            f"pipeline_parallel_size={pp}: treedraft does not support pipeline parallelism (vLLM "
            "runs the drafter on the last stage only, so earlier stages would verify drafts "
            "without tree attention or KV compaction); serve with pipeline_parallel_size=1, "
            "or drop --speculative-config")
    if tp > 1 and (auto or not spec.is_chain):
        what = "'auto' (each rank would choose its own tree size from its own timings)" if auto \
            else f"the branching tree {spec.to_string()!r}"
        k = spec.max_nodes if spec.is_chain else 3
        raise NotImplementedError(
            f"tensor_parallel_size={tp}: treedraft cannot serve {what} exactly across "
            f"tensor-parallel ranks; draft a fixed chain instead (\"num_speculative_tokens\": "
            f"{k} without 'tree', or \"tree\": \"chain:{k}\"), or use tensor_parallel_size=1")


SINK_MODEL_TYPES = ("gpt_oss",)  # attention with learned sinks


def tree_unsupported_target(model_config) -> list[str]:
    """What in the target's attention the tree path cannot serve (empty: nothing).

    Tree rows get positions root + depth and an ancestor mask (plugin/attention_cpu.py); that
    holds for plain causal softmax attention with RoPE (or no position encoding) and a KV cache."""
    hf = model_config.hf_text_config
    window = model_config.get_sliding_window()
    chunk = getattr(model_config, "attention_chunk_size", None)
    rswa = getattr(model_config, "rswa_window", None)
    checks = {
        "MLA attention (its backend is not overridden: siblings would see each other)":
            model_config.use_mla,
        "M-RoPE positions (read from mrope_positions, not the tree's depths)":
            model_config.uses_mrope,
        "Mamba / linear-attention layers (recurrent state has no tree form)":
            model_config.is_hybrid or model_config.is_attention_free,
        f"sliding-window attention (window {window})":
            window is not None and getattr(hf, "use_sliding_window", True) is not False,
        "attention logit soft-capping": bool(getattr(hf, "attn_logit_softcapping", None)),
        "ALiBi position biases": model_config.uses_alibi,
        "attention sinks": getattr(hf, "model_type", None) in SINK_MODEL_TYPES,
        # vLLM rewrites these layers' block tables and windows in its own metadata builders
        f"chunked local attention (chunks of {chunk})": bool(chunk),
        f"R-SWA attention (window {rswa})": rswa is not None,
    }
    return [k for k, v in checks.items() if v]


def _check_target(spec, model_config) -> None:
    """Refuse, at startup, a branching tree for a target whose attention trees cannot serve."""
    bad = [] if spec.is_chain else tree_unsupported_target(model_config)
    if bad:
        k = spec.max_nodes
        raise NotImplementedError(
            f"tree {spec.to_string()!r}: the target {model_config.model} uses {'; '.join(bad)}, "
            f"which treedraft's tree verification does not support; use a chain ('chain:{k}' or "
            f"num_speculative_tokens={k} without 'tree'), verified by vLLM's own sampler")


def _finish(engine_args, sc: dict, spec, head: dict) -> None:
    """The rewritten config: vLLM's custom_class proposer with the tree's node budget."""
    scratch = sc.pop("scratch_blocks", None)  # KV blocks kept for tree attention (scratch.py)
    if scratch is not None:
        if isinstance(scratch, bool) or not isinstance(scratch, int) or scratch < 0:
            raise ValueError(f"--speculative-config: scratch_blocks must be an integer >= 0, got "
                             f"{scratch!r} (0: tree rows recomputed in torch, no scratch)")
        head = {**head, "scratch_blocks": scratch}
    sc.update(method="custom_class", model=PROPOSER, num_speculative_tokens=spec.max_nodes)
    for attr in FLAGS.values():  # merged into sc above
        setattr(engine_args, attr, None)
    engine_args.speculative_config = sc
    engine_args.additional_config = {
        **(engine_args.additional_config or {}), KEY: {**head, "tree": spec.to_string()},
    }


def _wrap_create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        rewrite(self, target_model_config, target_parallel_config)
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config


FRONTEND_PATCHES = [
    Patch(
        "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
        _wrap_create_speculative_config,
        "treedraft heads in --speculative-config become a custom_class proposer",
    ),
] + CUDA_CONFIG_PATCHES  # CUDA tree mode: PIECEWISE graphs, start-up refusals
