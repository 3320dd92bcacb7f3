"""Checkpoints of a training run: atomic directories that `--resume` continues exactly.

Layout of out_dir:
    checkpoints/step-0000100/   config.json + model.safetensors + provenance.json (the head, via
                                save_pretrained), train_config.json, trainer_state.pt
    final/                      the trained head (load_head-able) + train_config.json
    train_log.jsonl             one line per optimizer step / evaluation
Each directory is written under a temporary name and renamed into place (os.replace), so a
killed run leaves either the old checkpoint or the new one, never half of one.
trainer_state.pt holds optimizer, scheduler, RNG states (torch, python), step, data position
and a fingerprint of the training data.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .config import (
    CONFIG_FILE,
    PER_RUN_KEYS,
    RESUMABLE_KEYS,
    TrainConfig,
    diff,
    from_dict,
    read_file,
)

STATE_FILE = "trainer_state.pt"


def provenance(cfg: TrainConfig, **extra) -> dict:
    """Git revision, command line, package versions, data, config (written with every head)."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("treedraft", "torch", "transformers", "datasets", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"git_revision": git_revision(), "command": sys.argv, "python": sys.version.split()[0],
            "packages": versions, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "train_config": cfg.to_dict(), **extra}


def git_revision() -> str | None:
    """`git rev-parse HEAD` of the source tree (+ '-dirty' with local changes), None if unknown."""
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move directory tmp to final; an existing final is swapped out first, then removed."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_head_dir(path: Path, head, cfg: TrainConfig, prov: dict, state: dict | None = None
                  ) -> Path:
    """Atomically write a head directory (+ train_config.json, + trainer_state.pt if given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    head.save_pretrained(tmp, provenance=prov)
    cfg.save(tmp / CONFIG_FILE)
    if state is not None:
        torch.save(state, tmp / STATE_FILE)
    _replace_dir(tmp, path)
    return path


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, head, cfg: TrainConfig, prov: dict, *,
                    optimizer, scheduler, position: dict, data_fingerprint: str,
                    trained_seconds: float = 0.0) -> Path:
    """`trained_seconds`: the run's wall time so far over all its invocations (budget_minutes)."""
    state = {"step": step, "position": position, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng_state(),
             "data_fingerprint": data_fingerprint, "trained_seconds": trained_seconds}
    path = save_head_dir(Path(out_dir) / "checkpoints" / f"step-{step:07d}", head, cfg, prov,
                         state)
    prune(Path(out_dir) / "checkpoints", cfg.keep_checkpoints)
    return path


def prune(ckpt_dir: Path, keep: int) -> None:
    if keep > 0:
        for old in sorted(ckpt_dir.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest one under a run directory's checkpoints/."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = sorted((path / "checkpoints").glob("step-*/" + STATE_FILE))
    if found:
        return found[-1].parent
    raise FileNotFoundError(
        f"--resume {path}: no checkpoint there (expected {STATE_FILE} in it, or a run directory "
        "with checkpoints/step-*/)"
    )


def checkpoint_config(path: str | Path) -> TrainConfig:
    """The config a checkpoint was trained with, less the per-invocation stop keys."""
    d = read_file(find_checkpoint(path) / CONFIG_FILE)
    return from_dict({k: v for k, v in d.items() if k not in PER_RUN_KEYS})


def check_resume(path: str | Path, cfg: TrainConfig) -> Path:
    """The checkpoint to resume from; ValueError naming the keys if its config differs."""
    ckpt = find_checkpoint(path)
    changed = diff(checkpoint_config(ckpt), cfg)
    if changed:
        raise ValueError(
            f"--resume {ckpt} was trained with a different config: {'; '.join(changed)}. "
            f"Resume with the same config (only {', '.join(sorted(RESUMABLE_KEYS))} may change) "
            "or start a new run"
        )
    return ckpt


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
