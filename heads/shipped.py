"""Where a head argument points: a head shipped with treedraft, or a checkpoint folder.

A head argument is a checkpoint folder (config.json + model.safetensors, written by
``save_pretrained``) or the short name of a head shipped with treedraft (``SHIPPED_HEADS``;
their files live next to this module under ``zoo/``). Used by training/ (``init_from``,
evaluation) and by the vLLM plugin (``--speculative-config '{"model": NAME}'``).

``cache_dir()`` is treedraft's cache folder (``$TREEDRAFT_CACHE``, default
``~/.cache/treedraft``): models materialized from embedded GGUF files, heads imported from
other formats.

Pure python: no torch, vllm or transformers here.
"""

from __future__ import annotations

import os
from pathlib import Path

ZOO = Path(__file__).resolve().parent / "zoo"

# short name -> (target it was trained for, folder under ZOO)
SHIPPED_HEADS: dict[str, tuple[str, str]] = {
    "smollm2-135m-eagle": ("smollm2-135m", "smollm2-135m-eagle"),
    "smollm2-135m-medusa": ("smollm2-135m", "smollm2-135m-medusa"),
    # EAGLE-3 layout (exports to stock vLLM's eagle3); 12 CPU minutes, see its provenance
    "smollm2-135m-eagle3": ("smollm2-135m", "smollm2-135m-eagle3"),
    # Qwen2.5-Coder-0.5B-Instruct, EAGLE-3 layout, MLP 1024 wide; trained on a 2-core CPU
    # (scripts/recipes/qwen2.5-coder-0.5b-eagle3.yaml, its provenance)
    "qwen2.5-coder-0.5b-eagle3": ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-eagle3"),
}


def resolve_head(name_or_path: str | os.PathLike) -> Path:
    """The folder of a shipped head's short name, or `name_or_path` if it is a folder."""
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


def cache_dir() -> Path:
    return Path(os.environ.get("TREEDRAFT_CACHE", Path.home() / ".cache" / "treedraft"))
