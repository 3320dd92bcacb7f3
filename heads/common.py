"""Shared machinery of the draft heads: target signatures, configs, registry, checkpoints.

Features
- `TargetSignature`: what a head was trained against (architecture, hidden size, vocab size,
  layer count, tokenizer fingerprint); `check_compatible` names every mismatch with both sides.
- `ConfigMixin`: `to_dict()/from_dict()` for dataclass configs; unknown keys are rejected with the
  list of valid keys; a nested `target` dict becomes a `TargetSignature`.
- `HEADS` registry filled by `@register_head("name")`; `load_head(path)` dispatches on the
  `head_type` stored in config.json (`path`: a folder, or a hub id `org/name` fetched first).
- `DraftHead`: base `nn.Module` with `bind_target` (frozen references to the target's input
  embeddings and LM head, never saved) and `save_pretrained/from_pretrained`
  (config.json + model.safetensors [+ provenance.json], written atomically file by file).

Pure torch + safetensors: no vllm, transformers or numpy here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PROVENANCE_NAME = "provenance.json"


class ConfigMixin:
    """`to_dict()/from_dict()` for dataclass configs; `from_dict` rejects unknown keys."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # nested dataclasses become dicts, tuples stay tuples

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} keys {unknown}; valid keys: {sorted(fields)}"
            )
        required = [
            n for n, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"{cls.__name__} is missing required keys {missing}")
        return cls(**d)


@dataclass
class TargetSignature(ConfigMixin):
    """Identity of the target model a head was trained for."""

    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    hidden_size: int
    vocab_size: int  # rows of the target's embedding / LM head
    num_hidden_layers: int
    tokenizer_fingerprint: str | None = None  # tokenizer_fingerprint(vocab); None = unknown

    def mismatches(self, other: TargetSignature) -> list[str]:
        """Differences, as seen from a head trained for `self` loaded onto target `other`.

        Architecture and tokenizer fingerprint are compared only when both sides know them.
        """
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("architecture", "tokenizer_fingerprint") and not (mine and theirs):
                continue
            if mine != theirs:
                out.append(f"head was trained for {f.name}={mine!r}, target has {theirs!r}")
        return out


def check_compatible(head_sig: TargetSignature, target_sig: TargetSignature) -> None:
    """Raise ValueError naming every mismatch (both sides) between a head and a target."""
    raise_mismatches(head_sig.mismatches(target_sig))


def raise_mismatches(problems: Sequence[str]) -> None:
    if problems:
        raise ValueError(
            "draft head does not fit this target: " + "; ".join(problems)
            + "; train a head for this target or pick the matching head"
        )


def tokenizer_fingerprint(vocab: Mapping[str, int]) -> str:
    """Short sha256 over the sorted (token, id) pairs: equal vocabularies give equal prints."""
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def node_depth(parents: Sequence[int], node: int) -> int:
    """Depth of `node` in a tree given by `parents` (parents[0] = -1 for the root)."""
    depth = 0
    while node != 0:
        node = parents[node]
        depth += 1
        if node < 0 or depth > len(parents):
            raise ValueError(f"parents {list(parents)} do not form a tree rooted at node 0")
    return depth


HEADS: dict[str, type[DraftHead]] = {}


def batched(objects: Sequence, name: str) -> Callable | None:
    """The batched method `name` (e.g. EagleSession.commit_many) of the objects' class, when they
    are all of that one class and it has it; else None (the caller goes one by one)."""
    cls = type(objects[0]) if len(objects) else None
    many = getattr(cls, name, None)
    return many if many is not None and all(type(o) is cls for o in objects) else None


def commit_sessions(items: Sequence) -> None:
    """Commit (session, target_hidden, tokens) items, one per request: together where the
    sessions' class offers `commit_many` (EagleSession: one packed head forward), else one by
    one."""
    if not items:
        return
    many = batched([s for s, *_ in items], "commit_many")
    if many is not None:
        many(items)
        return
    for session, target_hidden, tokens in items:
        session.commit(target_hidden, tokens)


def register_head(name: str) -> Callable[[type[DraftHead]], type[DraftHead]]:
    """Class decorator: `@register_head("eagle")` makes `load_head` find the class by name."""

    def deco(cls: type[DraftHead]) -> type[DraftHead]:
        if HEADS.get(name, cls) is not cls:
            raise ValueError(f"head type {name!r} is already registered by {HEADS[name]}")
        cls.head_type = name
        HEADS[name] = cls
        return cls

    return deco


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A head folder's config.json (head_type + config), with a clear error when it is missing."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"head directory {path} does not exist; expected a directory written by "
            f"save_pretrained with {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{cfg_path} is missing; a head directory holds {CONFIG_NAME} (head_type + config) "
            f"and {WEIGHTS_NAME}, as written by save_pretrained"
        )
    return json.loads(cfg_path.read_text())


# a Hugging Face hub id: `org/name`, each part of word characters, '.' or '-'
HUB_ID = re.compile(r"[\w-][\w.-]*/[\w.-]+")


def is_hub_id(source: str | os.PathLike) -> bool:
    """Whether `source` names a hub repository (`org/name`) rather than a local path: it does
    not exist here and reads as an id (an absolute or ./ path never does)."""
    return not Path(source).expanduser().exists() and HUB_ID.fullmatch(str(source)) is not None


def load_head(path: str | os.PathLike, target: TargetSignature | None = None,
              map_location: str | torch.device = "cpu") -> DraftHead:
    """Load any registered head from `path`, dispatching on config.json's `head_type`; a
    speculators-format or flat EAGLE-3 folder (vLLM/SGLang's, SpecForge's) loads as an
    eagle3-layout EagleHead. `path` may be a hub id (`org/name`), fetched into the hub cache."""
    from . import eagle, medusa  # noqa: F401  (registers the built-in heads)
    from .speculators import is_speculators, load_speculators, resolve

    # a hub id is downloaded (config and weights); a missing local folder stays read_config's
    # FileNotFoundError
    path = resolve(path) if is_hub_id(path) else Path(path)
    raw = read_config(path)
    if is_speculators(raw):  # an EAGLE-3 head in the speculators format
        head = load_speculators(path, target).to(map_location)
        head.provenance = None
        return head
    head_type = raw.get("head_type")
    if head_type not in HEADS:
        raise ValueError(
            f"{path / CONFIG_NAME} has head_type={head_type!r}; known head types: {sorted(HEADS)}"
        )
    return HEADS[head_type].from_pretrained(path, target=target, map_location=map_location)


class DraftHead(nn.Module):
    """Base of all draft heads: config, target binding, checkpoint I/O.

    Subclasses set `config_class` and are decorated with `@register_head(name)`.
    """

    head_type: ClassVar[str]
    config_class: ClassVar[type]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.provenance: dict | None = None
        # Frozen references to the target's weights; non-persistent, so never saved.
        self.register_buffer("target_embed", None, persistent=False)  # [V, H]
        self.register_buffer("target_lm_head", None, persistent=False)  # [V, H]

    @property
    def target_signature(self) -> TargetSignature:
        return self.config.target

    def bind_target(self, embed_weight: Tensor | None, lm_head_weight: Tensor | None) -> None:
        """Use the target's input embeddings and LM head ([V, H] each); they stay frozen."""
        sig = self.config.target
        want = (sig.vocab_size, sig.hidden_size)
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if w is not None and tuple(w.shape) != want:
                raise ValueError(
                    f"bind_target: {name} has shape {tuple(w.shape)}, the head was built for "
                    f"[vocab_size, hidden_size] = {list(want)}"
                )
        if embed_weight is not None:
            self.target_embed = embed_weight.detach()
        if lm_head_weight is not None:
            self.target_lm_head = lm_head_weight.detach()

    def _bound(self, name: str) -> Tensor:
        w = getattr(self, name)
        if w is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the target's {name.removeprefix('target_')} "
                "weights: call head.bind_target(embed_weight, lm_head_weight) with the target's "
                "input embeddings and LM head before drafting"
            )
        return w

    @property
    def max_draft_depth(self) -> int | None:
        """How deep below the root this head can draft (None: as deep as a tree goes)."""
        return None

    def tree_rates(self) -> tuple[tuple[float, ...], ...] | list | None:
        """The acceptance table static trees are shaped from: the measured
        `config.acceptance_rates`, else (a checkpoint saved before they were measured) None for
        the default table, cut to `max_draft_depth` where the head has one (a static tree from
        the full default table would reach past a Medusa head's last head)."""
        from .tree import DEFAULT_ACCEPTANCE_RATES

        rates = getattr(self.config, "acceptance_rates", None)
        if rates is None and self.max_draft_depth is not None:
            return DEFAULT_ACCEPTANCE_RATES[: self.max_draft_depth]
        return rates

    def check_target(self, target: TargetSignature) -> None:
        """Raise ValueError if this head cannot run on `target`."""
        raise_mismatches(self.target_problems(self.config, target))

    @classmethod
    def target_problems(cls, config, target: TargetSignature) -> list[str]:
        return config.target.mismatches(target)

    def save_pretrained(self, path: str | os.PathLike, provenance: dict | None = None) -> None:
        """Write config.json, model.safetensors (head weights only) and provenance.json.

        Each file is written to a temporary name and then os.replace'd; config.json goes last,
        so a reader never sees a new config next to old weights. Without `provenance`, a stale
        provenance.json from an earlier save is removed.
        """
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = {"head_type": self.head_type, **self.config.to_dict()}
        writers = [(WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))]
        if provenance is not None:
            writers.append((PROVENANCE_NAME, lambda p: _write_json(p, provenance)))
        elif (path / PROVENANCE_NAME).exists():
            (path / PROVENANCE_NAME).unlink()
        writers.append((CONFIG_NAME, lambda p: _write_json(p, config)))
        tmps = []
        try:
            for name, write in writers:
                tmp = path / f".{name}.tmp-{os.getpid()}"
                tmps.append((tmp, path / name))
                write(tmp)
            for tmp, final in tmps:
                os.replace(tmp, final)
        finally:
            for tmp, _ in tmps:
                tmp.unlink(missing_ok=True)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: TargetSignature | None = None,
                        map_location: str | torch.device = "cpu"):
        """Load a head saved by save_pretrained; with `target`, refuse an incompatible one."""
        from safetensors.torch import load_file

        path = Path(path)
        raw = read_config(path)
        head_type = raw.pop("head_type", None)
        if head_type != cls.head_type:
            raise ValueError(
                f"{path / CONFIG_NAME} has head_type={head_type!r} but {cls.__name__} loads "
                f"{cls.head_type!r}; use load_head(path) to dispatch on head_type"
            )
        config = cls.config_class.from_dict(raw)
        if target is not None:
            raise_mismatches(cls.target_problems(config, target))
        weights = path / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(
                f"{weights} is missing; save_pretrained writes the head's weights there"
            )
        state = load_file(str(weights))
        head = cls(config)
        want = set(head.state_dict())
        missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match {cls.__name__}({config}): missing tensors {missing}, "
                f"unexpected tensors {unexpected}"
            )
        head.load_state_dict(state, assign=True)
        prov = path / PROVENANCE_NAME
        head.provenance = json.loads(prov.read_text()) if prov.is_file() else None
        return head.to(map_location)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
