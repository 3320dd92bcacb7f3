"""Stage one part of a treedraft GPU bundle; with --run (after the last part) train and send
the head back. Standalone: runs on a machine where treedraft is not installed.

    python part-1/stage.py                           # copy this part to the stage folder
    python part-2/stage.py --run --out "$OUT"        # last part: check, install, train, write back
    python part-2/stage.py --run --out "$OUT" -- --max-steps=100    # extra `treedraft train` args
    python part-2/stage.py --run --out "$OUT" --limit-minutes 8     # train at most 8 minutes
    python part-2/stage.py --run --resume --out "$OUT" -- --time-limit-minutes=4   # go on

A run in pieces (a machine lent for calls of a few minutes each: one lost call then loses one
piece, not the run): give the bundle's config `budget_minutes` (the run's training time over
all its pieces: one schedule), train each piece with `-- --time-limit-minutes=M`, and continue
the next with `--resume` (the run's newest checkpoint, optimizer included, on this machine's
disk; every piece sends back the head as it stands).

A bundle built with --then trains its configs in order (the later ones on the first one's prompts
and replies); --limit-minutes bounds them all together, extra args go to the first.

What comes back (head.tar.gz.000, ...): final/ (or, when training failed or ran past
--limit-minutes, the newest checkpoint as final/ with the log saying so), train_log.jsonl and the
replies the target wrote (data/gen-*.jsonl, reusable as a reply cache: put them in a run's
data_dir).

The stage folder (--stage, default /tmp/treedraft-bundle) survives between transfers only while
the machine stays busy; a part that is missing when --run starts is named, with what to send.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# import names of what the machine must already have (the bundle does not carry them)
PREINSTALLED = ("torch", "transformers", "safetensors", "tokenizers", "accelerate", "yaml", "tqdm",
                "numpy", "pyarrow")
PIECE = 15 << 20  # bytes per file sent back (the limit is 16 MiB and 8 files)
# what a bundle's later runs (--then) share with the first: the config keys that select the
# prompts and key the reply cache (gpu_bundle.SAME_DATA, which imports this one)
SAME_DATA = ("target", "data", "prompt_offset", "num_prompts", "eval_prompts", "long_prompts",
             "max_seq_len", "regenerate", "gen_engine", "gen_temperature", "gen_temperatures",
             "gen_max_new_tokens", "seed", "dtype", "data_dir", "out_dir")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def stage_part(here: Path, stage: Path) -> dict:
    manifest = json.loads((here / "manifest.json").read_text())
    stage.mkdir(parents=True, exist_ok=True)
    for src in here.rglob("*"):
        if src.is_file() and src.name not in ("stage.py", "manifest.json"):
            dst = stage / "parts" / src.relative_to(here)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    (stage / "manifest.json").write_text(json.dumps(manifest))
    (stage / "parts" / f".part-{manifest['part']}").touch()
    print(f"[bundle] part {manifest['part']} of {manifest['parts']} staged in {stage}")
    return manifest


def assemble(stage: Path, manifest: dict) -> Path:
    """Reassemble every file from its chunks into stage/files; refuse anything missing or bad."""
    parts = stage / "parts"
    missing = [i for i in range(1, manifest["parts"] + 1) if not (parts / f".part-{i}").exists()]
    if missing:
        raise SystemExit(f"[bundle] parts {missing} are not staged in {stage} (the machine may have "
                         f"been given back between transfers): send them again with stage.py, "
                         "then run the last one with --run")
    root = stage / "payload"
    for rel, entry in manifest["files"].items():
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with dst.open("wb") as f:
            for chunk in entry["chunks"]:
                f.write((parts / chunk).read_bytes())
        if dst.stat().st_size != entry["size"] or sha256_of(dst) != entry["sha256"]:
            raise SystemExit(f"[bundle] {rel} is corrupt after reassembly (size or sha256 "
                             "differs from the manifest): send its parts again")
    return root


def check_machine(manifest: dict) -> None:
    """PREINSTALLED (import names) and the distributions the bundled wheels require without
    carrying them (manifest "installed") must be on this machine already."""
    missing = [m for m in PREINSTALLED if importlib.util.find_spec(m) is None]
    for dist in manifest.get("installed", []):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        raise SystemExit(f"[bundle] this machine lacks {missing}, which the bundle expects to be "
                         f"installed already (it carries only what such machines miss)")


def install(root: Path, site: Path) -> None:
    """Bundled wheels whose distribution is not installed yet, without dependencies, into site;
    then treedraft's code."""
    site.mkdir(parents=True, exist_ok=True)
    todo = []
    for whl in sorted((root / "wheels").glob("*.whl")):
        dist = whl.name.split("-")[0]
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            todo.append(str(whl))
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--upgrade", "--target", str(site), *todo], check=True)
    with tarfile.open(root / "code.tar.gz") as tar:
        tar.extractall(site)
    print(f"[bundle] installed {len(todo)} wheels and treedraft into {site}")


def clear_outputs(run: Path) -> None:
    """Remove what an earlier run in this stage folder left in `run` (its head, checkpoints and
    log), so that a run that saves nothing sends nothing back rather than the old head; the
    reply caches (run/data) stay: they are the bundle's, or replies this machine wrote."""
    for name in ("final", "checkpoints"):
        shutil.rmtree(run / name, ignore_errors=True)
    (run / "train_log.jsonl").unlink(missing_ok=True)


def train(root: Path, stage: Path, extra: list[str], limit_s: float | None = None,
          config: str = "config.json", resume: bool = False) -> tuple[Path, int]:
    """Run `treedraft train` on one of the bundle's configs; returns (its out_dir, exit status;
    124 when stopped at limit_s). `resume`: continue the run from its newest checkpoint in this
    stage folder (a run without one starts afresh, said)."""
    cfg = json.loads((root / config).read_text())
    fill = lambda v: v.replace("{stage}", str(root)) if isinstance(v, str) else v  # noqa: E731
    cfg = {k: fill(v) for k, v in cfg.items()}
    run = Path(cfg["out_dir"])
    found = sorted((run / "checkpoints").glob("step-*/trainer_state.pt")) if resume else []
    if found:
        print(f"[bundle] {config}: resuming from {found[-1].parent}", flush=True)
        extra = [*extra, "--resume", str(found[-1].parent)]
    else:
        if resume:
            print(f"[bundle] {config}: no checkpoint under {run} to resume (this machine's "
                  "disk was not kept?): training from the start", flush=True)
        clear_outputs(run)
    cfg_path = stage / config
    cfg_path.write_text(json.dumps(cfg, indent=1))
    # Batches of varying length fragment the CUDA caching allocator; expandable segments avoid
    # the free-and-retry stalls (a user's own PYTORCH_CUDA_ALLOC_CONF wins)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ,
           "PYTHONPATH": str(stage / "site"), "TREEDRAFT_FILES_DIR": str(root / "files"),
           "TREEDRAFT_FILES_ONLY": "1", "TREEDRAFT_CACHE": str(stage / "cache")}
    probe = "import treedraft.training as t; print('[bundle] treedraft from', t.__file__)"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    proc = subprocess.Popen([sys.executable, "-m", "treedraft.scripts.cli", "train", "--config",
                             str(cfg_path), *extra], env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        print(f"[bundle] {config}: training ran past --limit-minutes (its {limit_s / 60:.2f} "
              "min left): stopping it; the newest checkpoint goes back", flush=True)
        stop_group(proc)
        rc = 124
    return Path(cfg["out_dir"]), rc


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process and its children (its own session), SIGKILL after grace_s."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def newest_head(run: Path) -> Path | None:
    """run/final, else the newest checkpoint (a run that failed or was stopped), else None."""
    if (run / "final" / "config.json").is_file():
        return run / "final"
    found = sorted((run / "checkpoints").glob("step-*/config.json"))
    return found[-1].parent if found else None


def send_back(run: Path, out: Path, later: list[Path] = (), pieces_max: int = 8) -> list[Path]:
    """The head (final/ or the newest checkpoint, as final/, without optimizer state),
    train_log.jsonl and the reply caches (data/gen-*.jsonl) as head.tar.gz.000, .001, ... (at
    most `pieces_max` files); the later runs' heads and logs under their folder's name
    (run-2/final/, ...). What exists is sent, also after a failed run. When it all does not fit,
    the reply caches stay behind first, then the later runs' heads (each said), never the first
    head."""
    out.mkdir(parents=True, exist_ok=True)
    heads = [(r, "" if r == run else f"{r.name}/", newest_head(r)) for r in (run, *later)]
    for r, _, head in heads:
        if head is None:
            print(f"[bundle] {r.name}: no head was saved (training failed before its first "
                  "checkpoint)")
    replies = sorted((run / "data").glob("gen-*.jsonl"))
    for keep_replies, keep_later in ((True, len(later)), (False, len(later)),
                                     *((False, k) for k in range(len(later) - 1, -1, -1))):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for r, prefix, head in heads[: 1 + keep_later]:
                if head is not None:
                    tar.add(head, arcname=f"{prefix}final", filter=lambda t: t if t.isdir() or
                            t.name.endswith((".json", ".safetensors")) else None)  # no optimizer
                if (r / "train_log.jsonl").is_file():
                    tar.add(r / "train_log.jsonl", arcname=f"{prefix}train_log.jsonl")
            for gen in replies if keep_replies else ():
                tar.add(gen, arcname=f"data/{gen.name}")
        data = buf.getvalue()
        count = -(-len(data) // PIECE)  # pieces of at most PIECE bytes
        if count <= pieces_max:
            break
        print(f"[bundle] {len(data) >> 20} MiB is more than {pieces_max} pieces: leaving "
              + ("the reply caches" if keep_replies else f"{heads[keep_later][0].name}") + " behind",
              flush=True)
    else:
        raise SystemExit(f"[bundle] the head alone is {len(data) >> 20} MiB: more than "
                         f"{pieces_max} pieces")
    for _, _, head in heads[: 1 + keep_later]:
        if head is not None:
            print(f"[bundle] sending back {head}", flush=True)
    pieces = [out / f"head.tar.gz.{i:03d}" for i in range(count)]
    for i, p in enumerate(pieces):
        p.write_bytes(data[i * PIECE : (i + 1) * PIECE])
    print(f"[bundle] head written to {out}: {[p.name for p in pieces]}; "
          "reassemble with: cat head.tar.gz.* | tar xz")
    return pieces


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=Path, default=Path("/tmp/treedraft-bundle"))
    p.add_argument("--run", action="store_true", help="after the last part: train")
    p.add_argument("--out", type=Path, default=None, help="where the trained head goes")
    p.add_argument("--limit-minutes", type=float, default=None,
                   help="stop training after this long and send back the newest checkpoint")
    p.add_argument("--resume", action="store_true",
                   help="continue each run from its newest checkpoint in the stage folder (an "
                        "earlier --run on this machine), instead of starting it afresh")
    args = p.parse_args(argv)
    if args.limit_minutes is not None and args.limit_minutes <= 0:
        p.error(f"--limit-minutes {args.limit_minutes:g} must be > 0")
    manifest = stage_part(Path(__file__).resolve().parent, args.stage)
    if not args.run:
        return
    if args.out is None:
        p.error("--run needs --out (the folder whose files come back)")
    runs = manifest.get("runs", ["config.json"])
    if len(runs) > 1 and (same := [a for a in extra if a.lstrip("-").split("=")[0].replace(
            "-", "_") in SAME_DATA]):
        p.error(f"{same}: the later runs ({', '.join(runs[1:])}) train on the first run's "
                "prompts and replies, so these cannot change for the first alone; build the "
                "bundle with them instead")
    check_machine(manifest)
    root = assemble(args.stage, manifest)
    install(root, args.stage / "site")
    import time

    deadline = None if args.limit_minutes is None else time.monotonic() + 60 * args.limit_minutes
    outs, failed = [], []
    for i, config in enumerate(runs):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            print(f"[bundle] no time left for {config} (--limit-minutes)", flush=True)
            failed.append((config, "not started"))
            continue
        # the command line's extra arguments go to the first run, like the bundle's overrides
        run, rc = train(root, args.stage, extra if i == 0 else [], left, config, args.resume)
        outs.append(run)
        if rc != 0:
            failed.append((config, f"status {rc}"))
    send_back(outs[0], args.out, outs[1:])
    if failed:
        raise SystemExit(f"[bundle] treedraft train exited with {failed}; what was saved was "
                         "sent back")


if __name__ == "__main__":
    main()
