"""The plugin's one patch mechanism: declared targets, applied from one place, logged, never twice.

A `Patch` names its target as ``"module:Attr.attr"`` and gives a factory that receives the
original and returns the replacement. `apply` resolves the target, refuses a target that is
already patched (our marker on the current value) unless this process patched it itself
(register() runs more than once per process), logs one line per patch and remembers the
original, so tests and `original()` can reach it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MARKER = "__treedraft_patch__"


@dataclass(frozen=True)
class Patch:
    target: str  # "package.module:Class.method" or "package.module:function"
    make: Callable[[Any], Any]  # original -> replacement
    why: str  # one line for the log


_applied: dict[str, Any] = {}  # target -> original


def _resolve(target: str) -> tuple[Any, str]:
    module_name, _, qual = target.partition(":")
    if not qual:
        raise ValueError(f"patch target {target!r} must look like 'package.module:Class.attr'")
    owner: Any = importlib.import_module(module_name)
    *path, attr = qual.split(".")
    for name in path:
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise AttributeError(
            f"patch target {target} does not exist in this vLLM; the plugin supports only the "
            "vLLM version named in treedraft.plugin.SUPPORTED_VLLM"
        )
    return owner, attr


def apply(patches: Sequence[Patch]) -> None:
    from vllm.logger import init_logger

    log = init_logger("vllm.treedraft")
    for p in patches:
        if p.target in _applied:
            continue  # this process already applied it (register() is called repeatedly)
        owner, attr = _resolve(p.target)
        current = getattr(owner, attr)
        # staticmethod / classmethod descriptors must be read from the class dict
        raw = owner.__dict__.get(attr, current) if isinstance(owner, type) else current
        if getattr(current, MARKER, None) or getattr(raw, MARKER, None):
            raise RuntimeError(f"{p.target} is already patched by treedraft; refusing to patch twice")
        new = p.make(current)
        setattr(new, MARKER, p.target)
        setattr(owner, attr, new)
        _applied[p.target] = current
        log.info("treedraft patched %s: %s", p.target, p.why)


def original(target: str) -> Any:
    """The value `target` had before treedraft patched it (KeyError if it was not patched)."""
    return _applied[target]


def applied() -> list[str]:
    return sorted(_applied)
