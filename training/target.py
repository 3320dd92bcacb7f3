"""A transformers causal LM behind the small `Target` interface of the reference decoder.

The reference decoder (``treedraft.heads.reference``) is pure torch; this adapter is where
transformers comes in. It keeps a KV cache of the committed sequence and runs new tokens with an
arbitrary mask among themselves (a token tree's ancestor mask) and explicit positions
(prefix length + depth). After verification, ``keep`` moves the accepted nodes' KV into the
first contiguous slots after the prefix and drops the rest: the same bookkeeping the vLLM
plugin does on the paged cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from treedraft.heads.common import DraftHead, TargetSignature, load_head, tokenizer_fingerprint
from treedraft.heads.shipped import resolve_head


@dataclass
class LoadedTarget:
    model: torch.nn.Module | None  # None: weights not loaded (`open_target`)
    tokenizer: object
    path: str
    name: str = ""  # what the user named (an embedded model's short name, a folder, a hub id)
    config: object = None  # the transformers config (the model's when loaded)
    device: torch.device | None = None  # where the work on this target runs (model's if loaded)

    def __post_init__(self) -> None:
        if self.model is not None:
            self.config = self.model.config
            self.device = next(self.model.parameters()).device
        self.device = torch.device(self.device or "cpu")


def open_target(name_or_path: str, device: torch.device | str | None = None) -> LoadedTarget:
    """A target's tokenizer and config without its weights: what the run checks, sizes and
    generates replies from before any copy of the target is resident."""
    from transformers import AutoConfig, AutoTokenizer

    from .models import resolve_model

    path = resolve_model(name_or_path)
    return LoadedTarget(None, AutoTokenizer.from_pretrained(path), path, str(name_or_path),
                        config=AutoConfig.from_pretrained(path), device=device)


def load_target(name_or_path: str, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> LoadedTarget:
    """Load a causal LM (frozen, in `dtype`, onto `device`) and its tokenizer from a short name,
    HF folder or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model

    path = resolve_model(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    if device is not None:
        model.to(device)
    model.eval().requires_grad_(False)
    return LoadedTarget(model, tokenizer, path, str(name_or_path))


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype a target's weights are stored in, from its transformers config (None where the
    config names none)."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name).removeprefix("torch."), None) if name else None


def read_lm_head(target: LoadedTarget) -> torch.Tensor:
    """The target's LM head [V, H] read from its safetensors files alone (the input embeddings
    where the two are tied), for an export that shares it: one tensor, not the model."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # parameter names only: nothing is allocated
        model = AutoModelForCausalLM.from_config(target.config)
    names = {id(p): n for n, p in model.named_parameters()}
    wanted = [names[id(m.weight)] for m in (model.get_output_embeddings(),
                                             model.get_input_embeddings()) if id(m.weight) in names]
    for name in dict.fromkeys(wanted):
        if (file := _weights_file(target.path, name)) is not None:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name)
    raise FileNotFoundError(
        f"{target.path} holds none of {sorted(set(wanted))} in its safetensors files; this "
        "export writes the target's LM head, so pass --target the full Hugging Face folder "
        "(config.json, tokenizer and *.safetensors weights)")


def _weights_file(path: str, name: str) -> str | None:
    """The safetensors file of `path` (a folder or a hub id) that holds tensor `name`."""
    import json
    from pathlib import Path

    def fetch(filename: str) -> str | None:
        if Path(path).is_dir():
            f = Path(path) / filename
            return str(f) if f.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(path, filename)
        except EntryNotFoundError:
            return None

    if (index := fetch("model.safetensors.index.json")) is not None:
        shard = json.loads(Path(index).read_text())["weight_map"].get(name)
        return fetch(shard) if shard else None
    if (single := fetch("model.safetensors")) is not None:
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return single if name in f.keys() else None
    return None


def target_signature(model, tokenizer) -> TargetSignature:
    """The signature of a target given as a model or its transformers config."""
    cfg = getattr(model, "config", model)
    return TargetSignature(
        architecture=(cfg.architectures or [type(model).__name__])[0],
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        num_hidden_layers=cfg.num_hidden_layers,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer.get_vocab()) if tokenizer else None,
    )


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` with the chat template (and the assistant prompt appended)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class HFTarget:
    """Implements ``treedraft.heads.reference.Target`` for a transformers causal LM (batch 1)."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...] | None = None):
        from transformers import DynamicCache

        self.model = model
        self.num_layers = model.config.num_hidden_layers
        # HF hidden_states[k] = output after k layers; hidden_states[L] = final post-norm output.
        self.layer_ids = tuple(layer_ids) if layer_ids else (self.num_layers,)
        self._cache_cls = DynamicCache
        self.reset()

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """Append ``tokens`` [T] at ``positions`` [T]; ``mask`` [T, T] bool says which new tokens
        each new token sees (the cached prefix is always visible).
        Returns (logits [T, V] float32, hidden [T, len(layer_ids) * H])."""
        prefix = self.length
        T = tokens.numel()
        dtype = self.model.dtype
        visible = torch.cat([torch.ones(T, prefix, dtype=torch.bool), mask.cpu()], dim=1)
        # additive float mask [1, 1, T, prefix + T]: works for the sdpa and eager paths alike
        attn = torch.zeros(1, 1, T, prefix + T, dtype=dtype)
        attn.masked_fill_(~visible, torch.finfo(dtype).min)
        out = self.model(
            input_ids=tokens.view(1, T),
            position_ids=positions.view(1, T),
            attention_mask=attn,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        hidden = torch.cat([out.hidden_states[k][0] for k in self.layer_ids], dim=-1)
        return out.logits[0].float(), hidden

    def keep(self, start: int, nodes: torch.Tensor) -> None:
        """Keep cache entries ``start + nodes`` (in that order) right after the first ``start``
        entries and drop every later entry."""
        idx = torch.cat([torch.arange(start), start + nodes.cpu().long()])
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def auto_layer_ids(num_layers: int) -> tuple[int, ...]:
    """`target_layer_ids: auto`: vLLM's default EAGLE-3 auxiliary layers (2, L//2, L-3), clamped
    into 0..L-1 and deduplicated for targets too shallow for three distinct ones (L < 7)."""
    from treedraft.heads.speculators import default_layer_ids

    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in default_layer_ids(num_layers)}))


# A new EAGLE head's defaults where `head:` names none: EAGLE-3, exportable to stock vLLM.
NEW_EAGLE_DEFAULTS = {"layout": "eagle3", "fuse_norm": True, "target_layer_ids": "auto"}


def head_overrides(kind: str, hf_config, head: dict, new: bool) -> dict:
    """The head-config overrides a run builds its head with: `head` with `target_layer_ids:
    auto` resolved, over NEW_EAGLE_DEFAULTS for a new EAGLE head (`new`: no init_from, no
    resume; a continued head keeps the config defaults it was trained with)."""
    out = {**(NEW_EAGLE_DEFAULTS if kind == "eagle" and new else {}), **head}
    if out.get("target_layer_ids") == "auto":
        out["target_layer_ids"] = list(auto_layer_ids(hf_config.num_hidden_layers))
    return out


def init_head(kind: str, model: torch.nn.Module, tokenizer, **overrides):
    """A new (untrained) head of ``kind`` ('eagle' | 'medusa') shaped for ``model`` and bound to
    its embeddings and LM head. ``overrides`` set config fields (e.g. target_layer_ids)."""
    return bind_head(new_head(kind, model.config, tokenizer, **overrides), model)


def new_head(kind: str, hf_config, tokenizer, **overrides):
    """A new head of ``kind`` shaped for a target with transformers config ``hf_config``, not
    bound to its weights yet (`bind_head` once the target is loaded)."""
    from treedraft.heads.common import HEADS, load_head  # noqa: F401  (fills the registry)
    from treedraft.heads.eagle import EagleConfig, EagleHead
    from treedraft.heads.medusa import MedusaConfig, MedusaHeads

    cfg, sig = hf_config, target_signature(hf_config, tokenizer)
    if kind == "eagle":
        config = EagleConfig(**{
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": _rope_theta(cfg),
            "head_dim": getattr(cfg, "head_dim", None),
            "target": sig,
            **overrides,
        })
        head = EagleHead(config)
    elif kind == "medusa":
        config = MedusaConfig(**{"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                                 "num_heads": 4, "target": sig, **overrides})
        head = MedusaHeads(config)
    else:
        raise ValueError(f"unknown head kind {kind!r}; use 'eagle' or 'medusa'")
    return head


def bind_head(head, model: torch.nn.Module):
    """Give ``head`` the target's (frozen) input embeddings and LM head."""
    head.bind_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return head


def load_head_for(name_or_path: str | os.PathLike, model: torch.nn.Module,
                  signature: TargetSignature) -> DraftHead:
    """Load a head (folder or shipped name), refuse it if it was trained for another target,
    bind it to ``model``."""
    head = load_head(resolve_head(name_or_path), target=signature)
    # shipped heads are stored in bf16 to stay small; compute in the target's dtype
    head = head.to(next(model.parameters()).dtype)
    return bind_head(head, model).eval()
