"""The GPU bundle (scripts/gpu_bundle.py, scripts/gpu_stage.py), dry-run on this CPU.

`treedraft bundle` packs a short run of the tiny recipe (real SmolLM2 GGUF, ShareGPT prompts);
each part is staged from its own folder into an empty stage folder as on the GPU machine, the
last one with --run: the files are reassembled and checked, the bundled wheels installed, and
`treedraft train` runs two steps with the bundle's code (not this checkout's), target file and
prompts; the head comes back in pieces that reassemble into a loadable head. A part that was
not staged is named.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest

pytestmark = pytest.mark.slow

TINY = ["--prompt_offset=2", "--num_prompts=6", "--eval_prompts=0", "--gen_max_new_tokens=8", "--max_steps=2",
        "--batch_size=2", "--max_seq_len=128", "--eval_max_new_tokens=4", "--progress=false"]


def test_bundle_trains_on_a_bare_machine_dry_run(tmp_path, monkeypatch):
    from treedraft.heads.common import load_head
    from treedraft.scripts.cli import main
    from treedraft.training.models import EMBEDDED_MODELS

    bundle = tmp_path / "bundle"
    main(["bundle", str(bundle), "--config", "scripts/recipes/tiny-cpu.yaml", "--part-mib", "40",
          *TINY])
    parts = sorted(bundle.glob("part-*"))
    gguf = EMBEDDED_MODELS["smollm2-135m"].size
    assert len(parts) >= 3 and gguf > 2 * 40 << 20  # the GGUF travels in chunks
    for p in parts:
        assert sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) <= 40 << 20
    manifest = json.loads((parts[0] / "manifest.json").read_text())
    assert {"code.tar.gz", "prompts.jsonl.gz", "config.json"} <= set(manifest["files"])
    assert any(f.startswith("wheels/datasets-") for f in manifest["files"])
    assert any(f.startswith("wheels/gguf-") for f in manifest["files"])
    assert not any(f.startswith("wheels/torch-") for f in manifest["files"])
    assert manifest["files"]["code.tar.gz"]["size"] < 4 << 20  # no zoo weights in the code
    # what the bundled wheels need and do not carry is checked on the machine before anything
    assert {"pandas", "pyarrow", "numpy"} <= set(manifest["installed"])
    assert "dill" not in manifest["installed"]  # bundled

    stage, out = tmp_path / "stage", tmp_path / "out"
    stage_py = [sys.executable, "-I"]  # isolated: nothing of this checkout on sys.path
    for p in parts[:-1]:
        subprocess.run([*stage_py, str(p / "stage.py"), "--stage", str(stage)], check=True,
                       cwd=tmp_path)
    proc = subprocess.run([*stage_py, str(parts[-1] / "stage.py"), "--stage", str(stage),
                           "--run", "--out", str(out)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"treedraft from {stage / 'site'}" in proc.stdout, proc.stdout[-2000:]
    pieces = sorted(out.glob("head.tar.gz.*"))
    assert 1 <= len(pieces) <= 8 and all(p.stat().st_size <= 16 << 20 for p in pieces)
    blob = b"".join(p.read_bytes() for p in pieces)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "back")
    head = load_head(tmp_path / "back" / "final")
    # the replies the target wrote come back too: a reply cache for later runs
    replies = [n for n in names if n.startswith("data/gen-") and n.endswith(".jsonl")]
    assert len(replies) == 1
    lines = (tmp_path / "back" / replies[0]).read_text().splitlines()
    assert all(len(json.loads(ln)["reply"]) > 0 for ln in lines[1:])
    # with regenerate the prompts travel as their first turn only (the target writes replies),
    # from prompt_offset on: the run reads them from the first row (offset applied once)
    import gzip

    from transformers import AutoTokenizer

    from treedraft.training.models import resolve_model
    from treedraft.training.target import encode_chat

    rows = [json.loads(ln) for ln in gzip.open(stage / "payload" / "prompts.jsonl.gz", "rt")]
    assert len(rows) == 6 and all(r["messages"][-1]["role"] == "user" for r in rows)
    assert json.loads((stage / "payload" / "config.json").read_text())["prompt_offset"] == 0
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    fit = [r["id"] for r in rows if len(encode_chat(tok, r["messages"])) < 128]
    assert sorted(json.loads(ln)["id"] for ln in lines[1:]) == sorted(fit)
    assert head.config.target.hidden_size == 576
    log = (tmp_path / "back" / "train_log.jsonl").read_text().splitlines()
    assert sum('"lr"' in ln for ln in log) == 2  # two optimizer steps
    # the next call on this machine continues the run from its checkpoint (a run in pieces)
    proc = subprocess.run([*stage_py, str(parts[-1] / "stage.py"), "--stage", str(stage), "--run",
                           "--resume", "--out", str(tmp_path / "out-r"), "--", "--max_steps=3"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming from" in proc.stdout and "step-0000002" in proc.stdout, proc.stdout[-2000:]
    blob = b"".join(p.read_bytes() for p in sorted((tmp_path / "out-r").glob("head.tar.gz.*")))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        log_r = tar.extractfile("train_log.jsonl").read().decode().splitlines()
    assert [json.loads(ln)["step"] for ln in log_r if '"lr"' in ln] == [1, 2, 3]

    # a run that failed (or was stopped) after a checkpoint sends that checkpoint back as final/
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage", parts[-1] / "stage.py")
    stage_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage_mod)
    run = stage / "payload" / "run"
    import shutil

    shutil.rmtree(run / "final")
    pieces = stage_mod.send_back(run, tmp_path / "o-failed")
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in pieces))) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "back-failed")
    assert "final/trainer_state.pt" not in names and "train_log.jsonl" in names
    assert load_head(tmp_path / "back-failed" / "final").config.target.hidden_size == 576
    # a later run in this stage folder starts clean (train() clears its out_dir first): one that
    # saves nothing sends nothing back, never the earlier run's head; the replies stay
    kept = sorted((run / "data").glob("gen-*.jsonl"))
    stage_mod.clear_outputs(run)
    assert stage_mod.newest_head(run) is None and not (run / "train_log.jsonl").exists()
    assert kept and sorted((run / "data").glob("gen-*.jsonl")) == kept

    # the replies sent back travel in the next bundle: that run answers no prompt again, and a
    # second head (--then: Medusa) trains after it on the same prompts and replies
    medusa = tmp_path / "medusa.yaml"
    medusa.write_text("\n".join([
        "target: smollm2-135m", "head_type: medusa", "head: {num_heads: 2, num_layers: 1}",
        "data: sharegpt", "prompt_offset: 2", "num_prompts: 6", "eval_prompts: 0",
        "long_prompts: skip", "gen_max_new_tokens: 8", "max_seq_len: 128", "dtype: float32",
        "batch_size: 2", "max_steps: 2", "warmup_steps: 1", "eval_max_new_tokens: 4",
        "acceptance_depth: 2", "progress: false", "out_dir: runs/unused"]))
    again = tmp_path / "bundle2"
    main(["bundle", str(again), "--config", "scripts/recipes/tiny-cpu.yaml", "--part-mib", "40",
          "--replies", str(tmp_path / "back" / replies[0]), "--then", str(medusa), *TINY])
    stage2, out2 = tmp_path / "stage2", tmp_path / "out2"
    parts2 = sorted(again.glob("part-*"))
    for p in parts2[:-1]:
        subprocess.run([*stage_py, str(p / "stage.py"), "--stage", str(stage2)], check=True)
    proc = subprocess.run([*stage_py, str(parts2[-1] / "stage.py"), "--stage", str(stage2),
                           "--run", "--out", str(out2)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    blob = b"".join(p.read_bytes() for p in sorted(out2.glob("head.tar.gz.*")))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        gens = [m for m in tar.getmembers() if m.name.startswith("data/gen-")]
        assert [m.name for m in gens] == [replies[0]]  # the same cache: no new settings hash
        assert tar.extractfile(gens[0]).read().decode().splitlines() == lines  # nothing added
        tar.extractall(tmp_path / "back2")
    assert load_head(tmp_path / "back2" / "run-2" / "final").head_type == "medusa"
    log2 = (tmp_path / "back2" / "run-2" / "train_log.jsonl").read_text().splitlines()
    assert sum('"lr"' in ln for ln in log2) == 2
    assert load_head(tmp_path / "back2" / "final").head_type == "eagle"
    # what does not fit the 8 pieces stays behind, replies first, then later heads, never the
    # first head
    monkeypatch.setattr(stage_mod, "PIECE", 1 << 16)
    run2 = stage2 / "payload" / "run"
    every = stage_mod.send_back(run2, tmp_path / "o-all", [run2.with_name("run-2")],
                                pieces_max=10_000)
    fewer = stage_mod.send_back(run2, tmp_path / "o-fewer", [run2.with_name("run-2")],
                                pieces_max=len(every) - 1)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in fewer))) as tar:
        kept = tar.getnames()
    assert len(fewer) < len(every) and "final/config.json" in kept
    assert not any(n.startswith("data/") for n in kept)
    with pytest.raises(SystemExit, match="the head alone"):
        stage_mod.send_back(run2, tmp_path / "o-one", [run2.with_name("run-2")], pieces_max=1)
    # the first run's data cannot change alone when later runs share it
    proc = subprocess.run([*stage_py, str(parts2[-1] / "stage.py"), "--stage", str(stage2),
                           "--run", "--out", str(tmp_path / "o5"), "--", "--num_prompts=3"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "cannot change for the first alone" in proc.stderr
    # a later run must train on the first one's prompts: a different selection is named
    medusa.write_text(medusa.read_text().replace("num_prompts: 6", "num_prompts: 7"))
    with pytest.raises(SystemExit, match=r"num_prompts=7 differ"):
        main(["bundle", str(tmp_path / "bundle4"), "--config", "scripts/recipes/tiny-cpu.yaml",
              "--then", str(medusa), *TINY])
    with pytest.raises(SystemExit, match="not a reply cache"):
        main(["bundle", str(tmp_path / "bundle3"), "--config", "scripts/recipes/tiny-cpu.yaml",
              "--replies", str(tmp_path / "back" / "train_log.jsonl"), *TINY])

    # a machine without a distribution the wheels need is named before anything is installed
    with pytest.raises(SystemExit, match=r"lacks \['no-such-dist-xyz'\]"):
        stage_mod.check_machine({"installed": ["no-such-dist-xyz"]})
    # a run past --limit-minutes is stopped (with its children), and what exists goes back
    stage3, out3 = tmp_path / "stage3", tmp_path / "out3"
    for p in parts[:-1]:
        subprocess.run([*stage_py, str(p / "stage.py"), "--stage", str(stage3)], check=True)
    proc = subprocess.run([*stage_py, str(parts[-1] / "stage.py"), "--stage", str(stage3), "--run",
                           "--out", str(out3), "--limit-minutes", "0.05"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "ran past --limit-minutes" in proc.stdout, proc.stdout[-2000:]
    assert "status 124" in proc.stderr + proc.stdout and sorted(out3.glob("head.tar.gz.*"))

    # a part that never reached the machine is named
    fresh = tmp_path / "fresh"
    proc = subprocess.run([*stage_py, str(parts[-1] / "stage.py"), "--stage", str(fresh),
                           "--run", "--out", str(tmp_path / "o2")], capture_output=True, text=True)
    assert proc.returncode != 0 and "parts [1" in proc.stderr + proc.stdout


def test_the_gpu_run_streams_features_unless_asked_to_cache():
    from treedraft.scripts.gpu_bundle import stream_on_gpu
    from treedraft.training.config import load_config

    recipe = "scripts/recipes/smollm2-135m-eagle.yaml"  # caches: the CPU's shipped recipe
    assert load_config(recipe, []).cache_features
    cfg = load_config(recipe, [])
    stream_on_gpu(cfg, [])
    assert cfg.cache_features is False
    asked = ["--cache-features=true"]
    cfg = load_config(recipe, asked)
    stream_on_gpu(cfg, asked)
    assert cfg.cache_features is True
