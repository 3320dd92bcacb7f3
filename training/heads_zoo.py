"""Find, load, check and bind draft heads.

A head argument is a checkpoint folder (config.json + model.safetensors, written by
``save_pretrained``) or the short name of a head shipped with treedraft (``SHIPPED_HEADS``;
their files live in the ``treedraft.heads`` package under ``zoo/``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from treedraft.heads.common import DraftHead, TargetSignature, load_head

ZOO = Path(__file__).resolve().parent.parent / "heads" / "zoo"
if not ZOO.is_dir():  # installed as a wheel: the zoo sits inside treedraft/heads
    import treedraft.heads

    ZOO = Path(treedraft.heads.__file__).resolve().parent / "zoo"

# short name -> (target it was trained for, folder under ZOO)
SHIPPED_HEADS: dict[str, tuple[str, str]] = {
    "smollm2-135m-eagle": ("smollm2-135m", "smollm2-135m-eagle"),
    "smollm2-135m-medusa": ("smollm2-135m", "smollm2-135m-medusa"),
    # EAGLE-3 layout (exports to stock vLLM's eagle3); 12 CPU minutes, see its provenance
    "smollm2-135m-eagle3": ("smollm2-135m", "smollm2-135m-eagle3"),
}


def resolve_head(name_or_path: str | Path) -> Path:
    arg = str(name_or_path)
    if arg in SHIPPED_HEADS:
        path = ZOO / SHIPPED_HEADS[arg][1]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"shipped head {arg!r} is not in this install ({path} is missing); "
                "train one with `treedraft train` or pass a checkpoint folder"
            )
        return path
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"unknown head {arg!r}: not a shipped head ({', '.join(SHIPPED_HEADS)}) and not a "
        "checkpoint folder (config.json + model.safetensors)"
    )


def load_head_for(
    name_or_path: str | Path, model: torch.nn.Module, signature: TargetSignature
) -> DraftHead:
    """Load a head, refuse it if it was trained for another target, bind it to ``model``."""
    from .target import bind_head

    head = load_head(resolve_head(name_or_path), target=signature)
    # shipped heads are stored in bf16 to stay small; compute in the target's dtype
    head = head.to(next(model.parameters()).dtype)
    return bind_head(head, model).eval()
