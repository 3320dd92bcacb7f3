"""EAGLE-3 heads in the speculators format, both ways (pure torch + safetensors, no vLLM).

The speculators format is what vLLM, SGLang and TensorRT-LLM load for EAGLE-3: `config.json`
with `speculators_model_type: "eagle3"`, the draft layer's Llama config under
`transformer_layer_config`, and weights named as vLLM 0.32's `llama_eagle3.py` reads them:

    fc.weight [H, n*H]                  fuse (the n target layers' concat -> H)
    fc_norm.{i}.weight / input_norm.weight   optional norms before fc (fuse_norm / norm_before_fc)
    midlayer.* or layers.0.*            the one decoder layer: input_layernorm (embedding norm),
                                        hidden_norm (feature norm), self_attn.{q,k,v,o}_proj
                                        (q/k/v read 2H), post_attention_layernorm, mlp.*
    norm.weight                         final norm (logits read norm(feature))
    lm_head.weight [Vd, H]              absent: the target's LM head (full vocabulary)
    d2t [Vd] (target id - draft id), t2d [V] bool    absent when Vd == V
    embed_tokens.weight [V, H]          absent: the target's embedding

The flat layout the EAGLE authors and SpecForge publish (`architectures:
["LlamaForCausalLMEagle3"]`, the Llama fields at the top level, `eagle_config` holding the target
layers, the same weight names) loads too, with vLLM's defaults for a plain config (every norm
option off). A draft layer with `model_type: "qwen3"` (speculators format) is vLLM's Qwen3 EAGLE-3
layer: q_norm / k_norm over each head before RoPE (`self_attn.{q,k}_norm.weight [head_dim]`).
Llama-3.1 rope scaling and `norm_output` are computed; every other option vLLM reads from these
configs is refused naming its field: more than one draft layer, a sliding window, another rope
type, biases, another activation, a logit scale, `mask_hidden` (parallel drafting).

`load_speculators(path, target)` builds an `EagleHead(layout="eagle3")` with identical math
(`path`: a folder, or a hub id fetched with huggingface_hub);
`save_speculators(head, out, ...)` writes one that stock vLLM serves with
`{"method": "eagle3", "model": out, "num_speculative_tokens": K}`.

Target layers: vLLM's `eagle_aux_hidden_state_layer_ids` i is the residual stream after i target
layers, i.e. Hugging Face's `hidden_states[i]` for 0 <= i < L (treedraft's `target_layer_ids`);
i = L would be the PRE-norm output where treedraft's L is the post-norm one, so export refuses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .common import CONFIG_NAME, WEIGHTS_NAME, TargetSignature
from .eagle import LLAMA3_ROPE_KEYS, EagleConfig, EagleHead

FORMAT_KEY = "speculators_model_type"
SIGNATURE_KEY = "treedraft_target"  # our exports carry the full target signature
FORMAT_VERSION = "speculators-import-3"  # bump when the conversion changes (plugin cache key)
# the flat layout's architectures (vLLM 0.32's registry maps both to llama_eagle3.py)
FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# draft layer model_type -> vLLM 0.32's EAGLE-3 layer (speculators/algos.py eagle3_arch_map)
LAYER_TYPES = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}


def is_flat(config: dict[str, Any]) -> bool:
    """The flat EAGLE-3 layout (EAGLE authors', SpecForge's): Llama fields at the top level."""
    return FORMAT_KEY not in config and bool(
        set(config.get("architectures") or ()) & set(FLAT_ARCHITECTURES))


def is_speculators(config: dict[str, Any]) -> bool:
    """An EAGLE-3 folder this module imports: the speculators format or the flat layout."""
    return FORMAT_KEY in config or is_flat(config)


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 target layers when a config names none."""
    return (2, num_layers // 2, num_layers - 3)


def resolve(source: str | os.PathLike) -> Path:
    """A local folder as is; anything else as a Hugging Face hub id, downloaded (config and
    weights only) into the hub cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{source}: is a file; give the EAGLE-3 folder holding config.json and "
                         "the weights, or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(source), allow_patterns=[
            "*.json", "*.safetensors", "pytorch_model*.bin"]))
    except (OSError, ValueError) as e:  # not found, offline, gated, malformed id
        raise ValueError(
            f"{source!r} is neither a local folder nor a downloadable hub id ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}); give a folder holding config.json and the weights, or "
            "a hub id such as 'RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3'") from e


def _refuse(path, field: str, value, want, why: str = "") -> None:
    raise ValueError(f"{path}: {field}={value!r} is not supported (supported: {want}); "
                     + (why or "treedraft serves single-layer Llama- or Qwen3-style EAGLE-3 "
                                "heads as vLLM 0.32 runs them"))


def _layer_config(path, cfg: dict) -> tuple[dict, str]:
    """The draft layer's config dict and the prefix its fields are named with in errors."""
    if is_flat(cfg):
        return cfg, ""
    if cfg.get(FORMAT_KEY) != "eagle3":
        _refuse(path, FORMAT_KEY, cfg.get(FORMAT_KEY), "'eagle3'")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{path}: transformer_layer_config is missing or not an object; a "
                         "speculators EAGLE-3 config holds the draft layer's Llama config there")
    return layer, "transformer_layer_config."


def _rope(path, layer: dict, at: str) -> dict | None:
    """The draft layer's rope scaling (None: plain RoPE), from `rope_parameters` (transformers
    5) or `rope_scaling` (older), as vLLM's get_rope reads it; refuses what it cannot compute."""
    field, params = next(((f, layer[f]) for f in ("rope_parameters", "rope_scaling")
                          if layer.get(f)), ("rope_scaling", None))
    partial = (params or {}).get("partial_rotary_factor", layer.get("partial_rotary_factor", 1))
    if partial != 1:
        _refuse(path, f"{at}partial_rotary_factor", partial, "1 (RoPE over the whole head)")
    kind = None if params is None else params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        _refuse(path, f"{at}{field}.rope_type", kind, "'default' or 'llama3'")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise ValueError(f"{path}: {at}{field} of type 'llama3' lacks {missing}; Llama-3.1's "
                         "scaling needs all of " + ", ".join(LLAMA3_ROPE_KEYS))
    return {"rope_type": "llama3", **{k: params[k] for k in LLAMA3_ROPE_KEYS}}


def _sliding_window(layer: dict) -> tuple[str, Any] | None:
    """(field, value) where the draft layer asks for a sliding window, else None."""
    window = layer.get("sliding_window")
    if window is None:  # no window: full attention whatever else the config says
        return None
    types = layer.get("layer_types") or []
    if types and types[0] == "sliding_attention":
        return "layer_types[0]", types[0]
    if layer.get("use_sliding_window"):
        return "use_sliding_window", True
    return None


def _check_layer(path, cfg: dict, layer: dict, at: str) -> None:
    """Refuse, naming the field, every draft-layer option treedraft's layer does not compute."""
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(layer.get(key), int):
            raise ValueError(f"{path}: {at}{key} is missing or not an integer; an EAGLE-3 "
                             "draft layer config needs hidden_size, num_attention_heads, "
                             "intermediate_size and vocab_size")
    n = layer.get("num_hidden_layers", 1)
    if n != 1:
        _refuse(path, f"{at}num_hidden_layers", n, "1",
                "vLLM runs layers after the first as plain pre-norm decoder layers, but "
                "treedraft's draft sessions cache one layer's K/V; serve it with vLLM's own "
                "EAGLE-3 instead (\"method\": \"eagle3\", chains)")
    checks = [(f"{at}model_type", layer.get("model_type", "llama"), tuple(LAYER_TYPES)),
              (f"{at}hidden_act", layer.get("hidden_act", "silu"), ("silu",)),
              (f"{at}attention_bias", layer.get("attention_bias", False), (False,)),
              (f"{at}mlp_bias", layer.get("mlp_bias", False), (False,)),
              (f"{at}logit_scale", layer.get("logit_scale", 1.0), (1, 1.0)),
              (f"{at}is_causal", layer.get("is_causal", True), (True,)),
              (f"{at}dual_chunk_attention_config",
               layer.get("dual_chunk_attention_config"), (None,)),
              (f"{at}eagle_config.use_aux_hidden_state",
               (layer.get("eagle_config") or {}).get("use_aux_hidden_state", True), (True,))]
    for field, value, ok in checks:
        if value not in ok:
            _refuse(path, field, value, " or ".join(repr(v) for v in ok))
    window = _sliding_window(layer)
    if window:
        _refuse(path, f"{at}{window[0]}", window[1], "full attention (no sliding_window)",
                f"the draft layer attends through a sliding window of "
                f"{layer['sliding_window']} tokens, which treedraft's draft sessions do not "
                "apply; it is refused rather than served with full attention")
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is not None and target_hidden != layer["hidden_size"]:
        _refuse(path, "target_hidden_size", target_hidden, f"{layer['hidden_size']} (the draft "
                "layer's hidden_size)", "treedraft's head works in the target's hidden space")


def _options(cfg: dict, layer: dict) -> dict[str, bool]:
    """EagleConfig's norm options as vLLM 0.32 reads them: a speculators config through
    speculators/algos.py update_eagle3 (norm_before_residual defaults to True), a flat one as
    plain config attributes (every option defaults to False); `eagle_config.norm_before_fc`
    wins over the top-level key in both (llama_eagle3.py)."""
    eagle_config = layer.get("eagle_config") or {}
    return {"norm_before_residual": bool(cfg.get("norm_before_residual", not is_flat(cfg))),
            "norm_before_fc": bool(eagle_config.get("norm_before_fc",
                                                    cfg.get("norm_before_fc", False))),
            "fuse_norm": bool(cfg.get("fc_norm", False)),
            "norm_output": bool(cfg.get("norm_output", False))}


def _rope_theta(layer: dict) -> float:
    """RoPE theta from a Llama config dict, old (`rope_theta`) or transformers 5
    (`rope_parameters`) style."""
    default = 1e6 if layer.get("model_type") == "qwen3" else 10000.0  # vLLM's Qwen3 default
    return float((layer.get("rope_parameters") or {}).get(
        "rope_theta", layer.get("rope_theta", default)))


def default_tree(cfg: dict) -> str:
    """The tree a speculators folder is served with when none is given: the one recorded by a
    treedraft export, else a chain of the folder's own `speculative_tokens`."""
    recorded = (cfg.get("treedraft") or {}).get("default_tree")
    if recorded:
        return recorded
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return f"chain:{methods[0].get('speculative_tokens') or 3}"


def _layer_ids(path, cfg: dict, layer: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers in the order vLLM feeds them to fc: ascending (vLLM collects its
    auxiliary hidden states while the target's layers run), wherever the config names them."""
    ids = (cfg.get("eagle_aux_hidden_state_layer_ids")
           or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or layer.get("eagle_aux_hidden_state_layer_ids")
           or (layer.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or default_layer_ids(num_layers))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids={list(ids)} repeats a layer")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids={list(ids)} has {bad} outside "
                         f"0..{num_layers - 1} for a {num_layers}-layer target")
    n = layer.get("num_aux_hidden_states")
    if n is not None and n != len(ids):
        raise ValueError(f"{path}: transformer_layer_config.num_aux_hidden_states={n} but "
                         f"eagle_aux_hidden_state_layer_ids has {len(ids)} layers")
    return tuple(sorted(ids))


def _signature(path, cfg: dict, layer: dict, target: TargetSignature | None) -> TargetSignature:
    if SIGNATURE_KEY in cfg:  # a treedraft export: the full signature
        return TargetSignature.from_dict(cfg[SIGNATURE_KEY])
    if target is None:
        raise ValueError(f"{path}: a speculators config does not record the target's layer count "
                         "or tokenizer; load it with the target (load_head(path, target=...))")
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    archs = verifier.get("architectures") or []
    hidden = cfg.get("target_hidden_size") or layer["hidden_size"]
    # what the head knows of its target; the rest is the target's own (unknowable here)
    return TargetSignature(architecture=archs[0] if archs else None, hidden_size=hidden,
                           vocab_size=layer["vocab_size"],
                           num_hidden_layers=target.num_hidden_layers,
                           tokenizer_fingerprint=None)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
        state = {}
        for b in bins:
            state.update(torch.load(b, map_location="cpu", weights_only=True))
        return state
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def draft_layer(path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The EagleConfig fields an EAGLE-3 config sets (the draft layer's shape, rope, norm
    options), read as vLLM 0.32 reads them, after refusing what treedraft does not compute."""
    layer, at = _layer_config(path, cfg)
    _check_layer(path, cfg, layer, at)
    return dict(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"], rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(layer), rope_scaling=_rope(path, layer, at),
        head_dim=layer.get("head_dim"),
        # vLLM's Qwen3 EAGLE-3 layer (a speculators config only; the flat layout is Llama's)
        qk_norm=not is_flat(cfg) and layer.get("model_type") == "qwen3", **_options(cfg, layer))


def load_speculators(path: str | os.PathLike, target: TargetSignature | None = None
                     ) -> EagleHead:
    """An EAGLE-3 head (a speculators-format or flat folder, or a hub id holding one) as an
    `EagleHead(layout="eagle3")`."""
    path = resolve(path)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    fields = draft_layer(path, cfg)
    layer, _ = _layer_config(path, cfg)
    sig = _signature(path, cfg, layer, target)
    if target is not None:
        from .common import raise_mismatches

        raise_mismatches(sig.mismatches(target))
    ids = _layer_ids(path, cfg, layer, sig.num_hidden_layers)
    state = {k.removeprefix("model."): v for k, v in read_weights(path).items()}
    if "mask_hidden" in state:
        _refuse(path, "mask_hidden (parallel drafting)", "present", "absent")
    V = sig.vocab_size
    vd = cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or V
    if vd != V and "d2t" not in state:
        raise ValueError(f"{path}: draft_vocab_size={vd} < vocab_size={V} but the weights have no "
                         "d2t (draft -> target id offsets); export the head with its vocab map")
    econf = EagleConfig(
        **fields, target=sig, target_layer_ids=tuple(ids),
        draft_vocab_size=None if vd == V and "lm_head.weight" not in state else vd,
        layout="eagle3", own_embedding="embed_tokens.weight" in state,
        default_tree=default_tree(cfg))
    head = EagleHead(econf)
    ours = _from_speculators_names(state, econf, path)
    want = head.state_dict()
    missing, unexpected = sorted(set(want) - set(ours)), sorted(set(ours) - set(want))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
    for k, v in ours.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"{path}: tensor for {k} has shape {list(v.shape)}, the config "
                             f"needs {list(want[k].shape)}")
    head.load_state_dict({k: v.to(want[k].dtype) for k, v in ours.items()})
    return head


# treedraft name -> speculators name (the decoder layer's under `midlayer.`)
_LAYER = {"embed_norm.weight": "midlayer.input_layernorm.weight",
          "feature_norm.weight": "midlayer.hidden_norm.weight",
          "layer.q_proj.weight": "midlayer.self_attn.q_proj.weight",
          "layer.k_proj.weight": "midlayer.self_attn.k_proj.weight",
          "layer.v_proj.weight": "midlayer.self_attn.v_proj.weight",
          "layer.o_proj.weight": "midlayer.self_attn.o_proj.weight",
          "layer.q_norm.weight": "midlayer.self_attn.q_norm.weight",
          "layer.k_norm.weight": "midlayer.self_attn.k_norm.weight",
          "layer.mlp_norm.weight": "midlayer.post_attention_layernorm.weight",
          "layer.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
          "layer.up_proj.weight": "midlayer.mlp.up_proj.weight",
          "layer.down_proj.weight": "midlayer.mlp.down_proj.weight",
          "final_norm.weight": "norm.weight",
          "fuse_input_norm.weight": "input_norm.weight",
          "embed_tokens.weight": "embed_tokens.weight"}


def _from_speculators_names(state: dict, c: EagleConfig, path) -> dict[str, torch.Tensor]:
    src = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
           for k, v in state.items() if k != "t2d"}
    back = {v: k for k, v in _LAYER.items()}
    out = {}
    for k, v in src.items():
        if k in back:
            out[back[k]] = v
        elif k.startswith("fc_norm."):
            out["fuse_norms." + k.removeprefix("fc_norm.")] = v
        elif k == "fc.weight":
            n = len(c.target_layer_ids)
            if n == 1:  # treedraft: no fuse for one layer; accept only the identity
                if not torch.equal(v, torch.eye(c.hidden_size, dtype=v.dtype)):
                    raise ValueError(f"{path}: one target layer with a non-identity fc")
                continue
            out["fuse.weight"] = v
        elif k == "lm_head.weight":
            out["lm_head.weight"] = v
        elif k == "d2t":
            out["d2t"] = v.long() + torch.arange(v.numel())  # offsets -> absolute target ids
        else:
            out[k] = v  # reported as unexpected
    if c.draft_vocab_size is not None and "d2t" not in out:
        out["d2t"] = torch.arange(c.draft_vocab_size)
    return out


def save_speculators(head: EagleHead, out: str | os.PathLike, *, verifier: str,
                     num_speculative_tokens: int = 3, dtype: torch.dtype | None = None) -> Path:
    """Write `head` in the speculators format; stock vLLM serves it as method eagle3."""
    from safetensors.torch import save_file

    c: EagleConfig = head.config
    if head.head_type != "eagle" or c.layout != "eagle3":
        raise ValueError(
            f"this head has the {getattr(c, 'layout', head.head_type)!r} layout; stock vLLM's "
            "EAGLE-3 runs only the eagle3 layout (attention over the 2H concat of embedding and "
            "feature). Train one with `--head.layout=eagle3` (treedraft train) and export that")
    L = c.target.num_hidden_layers
    ids = list(c.target_layer_ids)
    if ids != sorted(set(ids)):
        raise ValueError(
            f"target_layer_ids={ids}: vLLM feeds its auxiliary hidden states to fc in ascending "
            "layer order, once each; train with ascending, distinct ids to export")
    bad = [i for i in c.target_layer_ids if not 0 <= i < L]
    if bad:
        raise ValueError(
            f"target_layer_ids={list(c.target_layer_ids)}: {bad} cannot be exported (vLLM's "
            f"auxiliary layer {L} is the pre-norm output, treedraft's is post-norm); train with "
            f"ids in 0..{L - 1}")
    if c.fuse_norm and c.norm_before_fc:
        raise ValueError("fuse_norm (fc_norm) and norm_before_fc are both on; the speculators "
                         "format allows one of them (its config refuses both)")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
    state = {}
    for k, v in head.state_dict().items():
        if k in _LAYER:
            state[_LAYER[k]] = v
        elif k.startswith("fuse_norms."):
            state["fc_norm." + k.removeprefix("fuse_norms.")] = v
        elif k == "fuse.weight":
            state["fc.weight"] = v
        elif k == "lm_head.weight":
            state["lm_head.weight"] = v
        elif k == "d2t" and v.numel() == c.target.vocab_size:  # full vocabulary, own lm_head
            if not torch.equal(v.long().cpu(), torch.arange(v.numel())):
                raise ValueError("a full-size draft vocabulary in another order than the "
                                 "target's cannot be exported (vLLM maps it only when smaller)")
        elif k == "d2t":
            state["d2t"] = v.long() - torch.arange(v.numel())  # absolute ids -> offsets
            t2d = torch.zeros(c.target.vocab_size, dtype=torch.bool)
            t2d[v.long()] = True
            state["t2d"] = t2d
        else:
            raise ValueError(f"no speculators name for tensor {k!r}")
    if c.lm_head_from_target:  # stock vLLM reads an own LM head: the target's rows at d2t
        head._bound("target_lm_head")
        state["lm_head.weight"] = head.lm_head.weight
    if len(c.target_layer_ids) == 1:
        state["fc.weight"] = torch.eye(c.hidden_size)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    vd = c.draft_vocab_size or c.target.vocab_size
    kind = "qwen3" if c.qk_norm else "llama"  # vLLM picks its EAGLE-3 layer by model_type
    rope = {"rope_type": "default"} if c.rope_scaling is None else dict(c.rope_scaling)
    config = {
        "architectures": ["Eagle3Speculator"],
        FORMAT_KEY: "eagle3",
        "transformer_layer_config": {
            "model_type": kind,
            "architectures": ["Qwen3ForCausalLM" if c.qk_norm else "LlamaForCausalLM"],
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "rope_parameters": {**rope, "rope_theta": c.rope_theta},
            "num_aux_hidden_states": len(c.target_layer_ids),  # vLLM sizes fc from it (else 3)
            "attention_bias": False,
            "mlp_bias": False, "vocab_size": c.target.vocab_size,
            "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "torch_dtype": str(dtype or next(iter(state.values())).dtype).removeprefix("torch."),
        },
        "draft_vocab_size": vd,
        "target_hidden_size": c.hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fuse_norm,
        "norm_output": c.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": [c.target.architecture]},
        },
        SIGNATURE_KEY: c.target.to_dict(),
        "treedraft": {"default_tree": c.default_tree},
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out
