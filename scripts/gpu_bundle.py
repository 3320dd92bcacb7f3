"""`treedraft bundle`: train a head on a GPU machine that has nothing installed.

Such a machine (see ../.library/device/README.md) has an NVIDIA GPU, Python 3.12, torch,
transformers, safetensors, tokenizers, accelerate, pyyaml, tqdm, numpy and pyarrow, but no
package index, no model hub and no treedraft; files reach it only as a working tree of at most
64 MiB per transfer, and results come back as at most 8 files of at most 16 MiB. The bundle is
everything else, cut into parts that each fit one transfer:

    treedraft bundle runs/bundle --config scripts/recipes/smollm2-135m-eagle.yaml --max-steps=3000
    # then, one transfer per part (the machine keeps its disk while it stays busy):
    python runs/bundle/part-1/stage.py                         # copies part 1 to /tmp/treedraft-bundle
    python runs/bundle/part-2/stage.py --run --out "$OUT"      # last part: install, train, send back
    # back here: cat head.tar.gz.* | tar xz     -> final/ (a head folder), train_log.jsonl

Contents: treedraft's code (heads/, training/, scripts/, plugin/; a tarball), the wheels training
needs that such a machine lacks (`datasets`, `gguf` and what they need, for CPython 3.12 on
manylinux x86_64), the target (an embedded GGUF, or a local Hugging Face folder), the MT-bench
questions (the contamination check reads them; the run reads packaged files from the bundle
only, TREEDRAFT_FILES_ONLY=1), the training
prompts exactly as this config selects them (MT-bench rows already dropped) as gzipped JSONL, and the
config. Files larger than a part are split into chunks; `manifest.json` holds every file's size
and sha256. On the GPU, `stage.py` (standalone: it imports nothing of treedraft) reassembles and
checks the files, names any missing part or missing preinstalled package, installs the bundled
wheels that are not installed yet into the stage folder, runs the same `treedraft train` with the
same config (data, target and out_dir pointed at the stage folder), and writes the trained head
and its log back as pieces of at most 15 MiB.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from .gpu_stage import SAME_DATA as STAGE_SAME_DATA
from .gpu_stage import sha256_of  # the stage script checks what this writes, with this helper

MiB = 1 << 20
# distributions such a GPU machine has (seen there); their wheels are not bundled
GPU_HAS = {"torch", "transformers", "safetensors", "tokenizers", "accelerate", "pyyaml", "tqdm",
           "numpy", "pyarrow", "huggingface-hub", "filelock", "fsspec", "packaging", "jinja2",
           "markupsafe", "networkx", "sympy", "mpmath", "typing-extensions", "regex", "psutil",
           "setuptools", "triton", "hf-xet", "httpx", "httpcore", "anyio", "h11", "sniffio",
           "certifi", "idna", "typer", "click", "shellingham", "rich", "markdown-it-py", "mdurl",
           "pygments", "annotated-doc", "pandas", "requests", "urllib3", "charset-normalizer",
           "python-dateutil", "six", "xxhash", "aiohttp", "aiosignal", "aiohappyeyeballs", "attrs",
           "frozenlist", "multidict", "yarl", "propcache"}
NEEDED = ("datasets", "gguf")  # what training imports beyond GPU_HAS
CODE_PACKAGES = ("heads", "training", "scripts", "plugin")  # treedraft.<name>


def _code_tarball(dest: Path) -> None:
    """treedraft's importable code as treedraft/<pkg>/..., without caches and without the head
    zoo's weights (~40 MB; a zoo head named by init_from travels on its own)."""
    import importlib

    def keep(t: tarfile.TarInfo) -> tarfile.TarInfo | None:
        zoo_weights = "/zoo/" in t.name and t.name.endswith(".safetensors")
        return None if "__pycache__" in t.name or zoo_weights else t

    with tarfile.open(dest, "w:gz") as tar:
        for name in CODE_PACKAGES:
            root = Path(importlib.import_module(f"treedraft.{name}").__file__).parent
            tar.add(root, arcname=f"treedraft/{name}", filter=keep)


def _wheels(dest: Path) -> None:
    """Wheels of NEEDED and their dependencies for CPython 3.12 manylinux, minus GPU_HAS."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           *[a for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
                         "manylinux_2_24_x86_64") for a in ("--platform", p)], *NEEDED]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(NEEDED)} failed (a package index is needed "
                           f"to build a bundle):\n{proc.stderr[-2000:]}")
    for whl in dest.glob("*.whl"):
        dist = whl.name.split("-")[0].lower().replace("_", "-")
        if dist in GPU_HAS:
            whl.unlink()


def _packaged_files(dest: Path) -> None:
    """Packaged files every training run reads whatever its data: the MT-bench questions (the
    contamination check drops them from any prompt set)."""
    from treedraft.training.embedded import MTBENCH_QUESTIONS

    out = dest / "files" / MTBENCH_QUESTIONS.path
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MTBENCH_QUESTIONS.locate(), out)


def _expected_installed(wheels: Path) -> list[str]:
    """Distributions the bundled wheels require that the bundle does not carry (the GPU machine
    must have them; stage.py checks before it installs anything)."""
    import re
    import zipfile

    from packaging.requirements import Requirement

    # the GPU machine: CPython 3.12 on x86_64 Linux; no extras
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "extra": ""}
    bundled, needs = set(), set()
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    for whl in wheels.glob("*.whl"):
        bundled.add(norm(whl.name.split("-")[0]))
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:"):
                    req = Requirement(line.split(":", 1)[1].strip())
                    if req.marker is None or req.marker.evaluate(env):
                        needs.add(norm(req.name))
    return sorted(needs - bundled)


def _target_files(target: str, dest: Path) -> str:
    """Copy what the GPU needs to load `target`; returns the target argument to use there
    ({files} = the staged files folder, {stage} = the stage folder)."""
    from treedraft.training.models import EMBEDDED_MODELS

    if target in EMBEDDED_MODELS:  # the GGUF parts, laid out like the installed packages
        for part in EMBEDDED_MODELS[target].parts:
            src = part.locate()
            out = dest / "files" / part.path
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
        return target
    folder = Path(target).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"target={target!r}: a bundle carries an embedded target or a local "
                         "Hugging Face folder (no hub on the GPU machine)")
    shutil.copytree(folder, dest / "target")
    return "{stage}/target"


def _prompts(cfg, dest: Path) -> None:
    """The rows this config trains and evaluates on, in order, as gzipped JSONL (ids kept); with
    regenerate only their first turn (the prompt: the target writes the reply)."""
    from treedraft.training.data import first_turn
    from treedraft.training.loop import load_rows

    train_rows, eval_rows = load_rows(cfg)
    with gzip.open(dest, "wt", encoding="utf-8") as f:
        for rid, messages in [*train_rows, *eval_rows]:
            messages = first_turn(messages) if cfg.regenerate else messages
            f.write(json.dumps({"id": rid, "messages": messages}) + "\n")


def _split(payload: Path, part_bytes: int) -> dict:
    """Cut files larger than a part into chunks; returns the manifest."""
    files = {}
    for path in sorted(p for p in payload.rglob("*") if p.is_file()):
        rel = path.relative_to(payload).as_posix()
        size = path.stat().st_size
        entry = {"size": size, "sha256": sha256_of(path), "chunks": [rel]}
        if size > part_bytes:
            entry["chunks"] = []
            with path.open("rb") as f:
                i = 0
                while chunk := f.read(part_bytes):
                    name = f"{rel}.chunk{i:03d}"
                    (payload / name).write_bytes(chunk)
                    entry["chunks"].append(name)
                    i += 1
            path.unlink()
        files[rel] = entry
    return files


def stream_on_gpu(cfg, overrides: list[str]) -> None:
    """The GPU run streams the target's features unless the command line asks for the cache:
    the shipped CPU recipes cache them (there the target is most of a step), while on a GPU the
    target's forward is cheap and a cache of ~10^8 training tokens' sequences would fill disk."""
    from treedraft.training.config import parse_overrides

    asked = "cache_features" in parse_overrides(overrides)[0]
    if cfg.cache_features and not asked:
        print("[bundle] cache_features=false for the GPU run (the recipe's feature cache is for "
              "CPUs; pass --cache-features=true to keep it)", flush=True)
        cfg.cache_features = False


def _check_replies(files: list[Path]) -> None:
    for f in files:
        if not (f.is_file() and f.name.startswith("gen-") and f.suffix == ".jsonl"):
            raise ValueError(f"--replies {f}: not a reply cache (a gen-<hash>.jsonl file that "
                             "a run with regenerate=true wrote in its data_dir)")


def _replies(files: list[Path], dest: Path) -> None:
    """Reply caches (gen-*.jsonl, e.g. what an earlier GPU run sent back) into the run's data
    folder, where `treedraft train` finds them when their settings match this run's."""
    for f in files:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest / f.name)


# what must agree between a bundle's runs: the target and the data they train on, and the
# settings that key the reply cache the later runs read (they write no replies)
SAME_DATA = tuple(k for k in STAGE_SAME_DATA if k not in (
    "gen_temperature", "gen_temperatures", "data_dir", "out_dir")) + ("reply_temperatures",)


def _data_value(cfg, key: str):
    """A SAME_DATA entry of `cfg` (reply_temperatures: the temperatures replies are written at,
    however gen_temperature / gen_temperatures spell them)."""
    return cfg.reply_temperatures() if key == "reply_temperatures" else getattr(cfg, key)


def _then_configs(cfg, then: list[str]) -> list:
    """The configs trained after the first on the same machine (`--then`), checked against it:
    they train on its prompts and read the replies it wrote (gen_cache_only)."""
    from treedraft.training.config import load_config

    out = []
    for path in then:
        other = load_config(path, [])
        other.validate()
        if diff := [k for k in SAME_DATA if _data_value(other, k) != _data_value(cfg, k)]:
            theirs = ", ".join(f"{k}={_data_value(other, k)!r}" for k in diff)
            ours = ", ".join(f"{k}={_data_value(cfg, k)!r}" for k in diff)
            raise ValueError(f"--then {path}: {theirs} differ from the first run's ({ours}); a "
                             "later run trains on the first run's prompts and replies, so these "
                             "must match (put them in its file)")
        stream_on_gpu(other, [])
        other.gen_cache_only = True
        out.append(other)
    return out


def build(out: Path, config: str | None, overrides: list[str], part_mib: int = 60,
          replies: list[Path] = (), then: list[str] = ()) -> list[Path]:
    """Write the bundle's parts (folders part-1, part-2, ...) under `out`; returns them."""
    from treedraft.training.config import load_config

    cfg = load_config(config, overrides)
    cfg.validate()
    _check_replies(list(replies))
    stream_on_gpu(cfg, overrides)
    later = _then_configs(cfg, list(then))
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give a new folder for the bundle")
    payload = out / "payload"
    payload.mkdir(parents=True)
    _code_tarball(payload / "code.tar.gz")
    _wheels(payload / "wheels")
    target = _target_files(cfg.target, payload)
    _packaged_files(payload)
    _replies(list(replies), payload / "run" / "data")  # out_dir {stage}/run, data_dir its data/
    _prompts(cfg, payload / "prompts.jsonl.gz")
    # the prompts file starts at prompt_offset already: each run reads it from its first row
    runs = []
    for i, c in enumerate([cfg, *later], start=1):
        suffix = "" if i == 1 else f"-{i}"
        run_cfg = {**c.to_dict(), "target": target, "data": "{stage}/prompts.jsonl.gz",
                   "prompt_offset": 0, "out_dir": "{stage}/run" + suffix,
                   "data_dir": None if i == 1 else "{stage}/run/data"}  # the first run's replies
        if c.init_from:  # a head folder or a zoo name: ship the head (the code carries no weights)
            from treedraft.heads.shipped import resolve_head

            shutil.copytree(resolve_head(c.init_from), payload / f"init_from{suffix}")
            run_cfg["init_from"] = "{stage}/init_from" + suffix
        (payload / f"config{suffix}.json").write_text(json.dumps(run_cfg, indent=1))
        runs.append(f"config{suffix}.json")
    installed = _expected_installed(payload / "wheels")
    part_bytes = part_mib * MiB - MiB  # room for stage.py and the manifest
    files = _split(payload, part_bytes)
    chunks = sorted(((c, (payload / c).stat().st_size) for e in files.values()
                     for c in e["chunks"]), key=lambda x: -x[1])
    parts: list[list[str]] = []
    sizes: list[int] = []
    for name, size in chunks:  # first fit, largest first
        k = next((i for i, s in enumerate(sizes) if s + size <= part_bytes), None)
        if k is None:
            parts.append([])
            sizes.append(0)
            k = len(parts) - 1
        parts[k].append(name)
        sizes[k] += size
    manifest = {"parts": len(parts), "files": files, "installed": installed, "runs": runs}
    out_parts = []
    for i, names in enumerate(parts, start=1):
        d = out / f"part-{i}"
        for name in names:
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(payload / name, d / name)
        (d / "manifest.json").write_text(json.dumps({**manifest, "part": i}, indent=1))
        shutil.copyfile(Path(__file__).with_name("gpu_stage.py"), d / "stage.py")
        out_parts.append(d)
    shutil.rmtree(payload)
    return out_parts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="a new folder for the bundle's parts")
    p.add_argument("--config", default=None, help="training recipe (YAML/JSON), as for train")
    p.add_argument("--part-mib", type=int, default=60, help="size limit of one part (transfer)")
    p.add_argument("--replies", type=Path, nargs="+", default=[], metavar="GEN_JSONL",
                   help="reply caches to carry (data/gen-*.jsonl sent back by an earlier GPU "
                        "run): prompts answered there are not answered again")
    p.add_argument("--then", nargs="+", default=[], metavar="CONFIG",
                   help="more recipes trained on the same machine after the first, in order, on "
                        "its prompts and the replies it wrote (e.g. a Medusa head after the "
                        "EAGLE head); complete files: the command line's --key=value overrides "
                        "apply to the first run only")


def run(args: argparse.Namespace, overrides: list[str]) -> list[Path]:
    parts = build(args.out, args.config, overrides, args.part_mib, args.replies, args.then)
    sizes = [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / MiB for p in parts]
    for p, s in zip(parts, sizes, strict=True):
        print(f"{p}  {s:.1f} MiB")
    print(f"on the GPU machine, one transfer per part: python PART/stage.py for each part, the "
          f"last one with --run --out \"$OUT\" ({len(parts)} parts)")
    return parts
