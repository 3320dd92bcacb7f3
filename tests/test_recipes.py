"""The real-target recipes (Llama-3.1-8B, Qwen3-8B, Qwen2.5-7B, EAGLE-3) before any GPU runs them.

Proves: each recipe goes through reply generation, target features, two training steps and
`treedraft export` on a tiny random model of its architecture (the same transformers config
class, 7 layers so `target_layer_ids: auto` is vLLM's (2, 3, 4), SmolLM2's tokenizer), leaving an
EAGLE-3 head with the recipe's draft vocabulary that exports with those auxiliary layers; the
exported Llama head loads and drafts in stock vLLM's EAGLE-3 on the CPU (one engine start: the
three exports load through the same `Eagle3LlamaForCausalLM` draft, and the targets' auxiliary
hidden states are vLLM's `SupportsEagle3`, whose list of architectures is checked against the
installed vLLM); the trained Llama head itself is evaluated by `treedraft eval --engine vllm`
through the treedraft plugin (tau per depth on MT-bench, the reference decoder's greedy text),
and that evaluation's engine takes the device's dtype and GPU share (bf16 and
--gpu-memory-utilization on a GPU, faked; float32 on a CPU); at the real sizes each recipe resolves its documented layers and its memory
estimate is the one its header states and fits an 80 GB GPU; a target vLLM 0.32 cannot take
auxiliary hidden states from (Gemma-2) and a run that would not fit are refused before any
weights load (their target folders hold none).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treedraft.heads.common import load_head
from treedraft.scripts.cli import main
from treedraft.training.config import load_config
from treedraft.training.loop import train

RECIPES = Path(__file__).resolve().parent.parent / "scripts" / "recipes"
# recipe -> (transformers config class, architecture, the real model's config, its aux layers)
ARCHS = {
    "llama-3.1-8b-eagle3": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False), (2, 16, 29)),
    "qwen3-8b-eagle3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
        (2, 18, 33)),
    "qwen2.5-7b-eagle3": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False), (2, 14, 25)),
}
TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=7,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            initializer_range=0.3)
PROMPTS = ["Hi there", "What is 2+2?", "Tell me a joke.", "Name a colour.", "Count to five.",
           "Why is the sky blue?", "Write a haiku."]


def tiny_target(root: Path, config_class: str, weights: bool = True, **kw) -> Path:
    """A random model of `config_class` (small dims) saved with SmolLM2's tokenizer; with
    weights=False only its config and tokenizer (what a refusal before loading needs)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treedraft.training.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    cfg = getattr(transformers, config_class)(**{**TINY, **kw}, bos_token_id=tok.bos_token_id,
                                              eos_token_id=tok.eos_token_id)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    else:
        cfg.architectures = [config_class.replace("Config", "ForCausalLM")]
        cfg.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def dry_run(recipe: str, target: Path, prompts: Path, out: Path) -> list[str]:
    """Overrides that shrink a recipe to a CPU dry run of every stage, keeping its head, loss,
    layout and schedule: 6 prompts, 8-token replies by transformers, 2 steps."""
    return [f"--target={target}", f"--data={prompts}", "--num-prompts=6", "--eval-prompts=1",
            "--gen-engine=transformers", "--gen-max-new-tokens=8", "--gen-batch-size=8",
            "--max-seq-len=64", "--batch-size=2", "--grad-accum=1", "--max-steps=2",
            "--warmup-steps=1", "--measure-every=0", "--save-every=0",
            "--eval-max-new-tokens=0", "--acceptance-depth=2", "--num-threads=1",
            f"--out-dir={out}", "--progress=false"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """recipe -> (tiny target folder, trained head folder, export folder), built once each."""
    done: dict[str, tuple[Path, Path, Path]] = {}

    def get(recipe: str) -> tuple[Path, Path, Path]:
        if recipe not in done:
            root = tmp_path_factory.mktemp(recipe)
            target = tiny_target(root / "target", ARCHS[recipe][0])
            prompts = root / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
            cfg = load_config(RECIPES / f"{recipe}.yaml", dry_run(recipe, target, prompts,
                                                                   root / "run"))
            final = train(cfg)
            main(["export", str(final), str(root / "spec"), f"--target={target}"])
            done[recipe] = (target, final, root / "spec")
        return done[recipe]

    return get


@pytest.mark.parametrize("recipe", list(ARCHS))
def test_recipe_dry_run_trains_an_exportable_eagle3_head(recipe, exported):
    assert load_config(RECIPES / f"{recipe}.yaml").head["target_layer_ids"] == "auto"
    target, final, spec = exported(recipe)
    head = load_head(final)
    assert head.config.layout == "eagle3" and head.config.fuse_norm
    assert head.config.target_layer_ids == (2, 3, 4)  # vLLM's (2, L//2, L-3) for L = 7
    assert head.config.draft_vocab_size == 32000
    assert head.config.target.architecture == ARCHS[recipe][1]
    log = [json.loads(ln) for ln in (final.parent / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2]
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert cfg["draft_vocab_size"] == 32000
    assert cfg["speculators_config"]["verifier"]["architectures"] == [ARCHS[recipe][1]]


@pytest.mark.parametrize("recipe", list(ARCHS))
def test_recipe_at_the_real_size_fits_an_80gb_gpu_as_its_header_says(recipe):
    """The recipe's stated memory is the run's own estimate at the real model's size (a
    meta-device target and head: nothing is allocated)."""
    import transformers

    from treedraft.training.preflight import check_architecture, estimate_memory
    from treedraft.training.target import head_overrides, new_head

    cls, arch, dims, layers = ARCHS[recipe]
    hf = getattr(transformers, cls)(**dims)
    hf.architectures = [arch]
    cfg = load_config(RECIPES / f"{recipe}.yaml", ["--target-dtype=bfloat16"])
    head_cfg = head_overrides("eagle", hf, cfg.head, new=True)
    assert tuple(head_cfg["target_layer_ids"]) == layers
    check_architecture(cfg, hf, head_cfg)

    class Tok:
        def get_vocab(self):
            return {"<s>": 0}

    with torch.device("meta"):
        head = new_head("eagle", hf, Tok(), **head_cfg)
    gib = estimate_memory(cfg, hf, head, torch.device("cpu")).total / 2**30
    stated = float(re.search(r"~([\d.]+) GiB =", (RECIPES / f"{recipe}.yaml").read_text())[1])
    assert abs(gib - stated) < 0.1 and gib < 80 * 1e9 / 2**30, (gib, stated)


def test_unsupported_architecture_and_oversized_runs_are_refused_before_loading(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    # config and tokenizer only: a run that tried to load weights would fail differently
    gemma = tiny_target(tmp_path / "gemma", "Gemma2Config", weights=False, head_dim=32)
    base = dry_run("x", gemma, prompts, tmp_path / "run")
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.*SupportsEagle3.*"
                                         r"--head.layout=eagle1 --head.target-layer-ids=\[7\]"):
        train(load_config(None, base))
    llama = tiny_target(tmp_path / "llama", "LlamaConfig", weights=False)
    with pytest.raises(ValueError, match=r"would not fit: about .* GiB per process .*"
                                         r"--memory-check=false"):
        train(load_config(None, dry_run("x", llama, prompts, tmp_path / "run2")
                          + ["--batch-size=1000000"]))


@pytest.mark.vllm
def test_eagle3_architectures_are_vllms(tmp_path):
    """EAGLE3_ARCHITECTURES is the installed vLLM's registry filtered by supports_eagle3."""
    from treedraft.training.preflight import EAGLE3_ARCHITECTURES

    code = ("import importlib, json\n"
            "from vllm.model_executor.models import registry\n"
            "from vllm.model_executor.models.interfaces import supports_eagle3\n"
            "out = []\n"
            "for arch, (mod, cls) in registry._TEXT_GENERATION_MODELS.items():\n"
            "    try:\n"
            "        c = getattr(importlib.import_module(f'vllm.model_executor.models.{mod}'), cls)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    if supports_eagle3(c):\n"
            "        out.append(arch)\n"
            "print('ARCHS ' + json.dumps(sorted(out)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ARCHS "))
    assert set(json.loads(line[6:])) == EAGLE3_ARCHITECTURES, proc.stderr[-2000:]


@pytest.mark.vllm
def test_exported_llama_recipe_head_drafts_in_stock_vllm(exported):
    from vllm_run import run_vllm

    target, _, spec = exported("llama-3.1-8b-eagle3")
    texts, log = run_vllm(str(target), [[{"role": "user", "content": "Hi there"}]], max_tokens=8,
                          max_model_len=256, speculative_config={
                              "method": "eagle3", "model": str(spec),
                              "num_speculative_tokens": 2})
    assert len(texts) == 1 and "Eagle3LlamaForCausalLM" in log, log[-3000:]


def test_eval_vllm_engine_takes_the_devices_dtype_and_gpu_share(monkeypatch):
    from treedraft.scripts import eval_vllm
    from treedraft.training.evaluate import EvalConfig

    settings = eval_vllm.engine_settings
    assert settings(None, 0.5, "cpu") == {"dtype": "float32"}  # the reference's; no GPU share
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert settings(None, 0.5, "cuda") == {"dtype": "bfloat16", "gpu_memory_utilization": 0.5}
    assert settings("float32", None, "cuda") == {"dtype": "float32"}
    with pytest.raises(ValueError, match="--gpu-memory-utilization 1.5 must be in"):
        settings(None, 1.5, "cpu")
    # on a (faked) GPU box an EAGLE-3-layout head goes to the plugin in bf16 with the GPU share
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}

    def run_engine(target, spec, jobs, *, llm, **kw):
        seen.update(spec=spec, llm=llm)
        raise KeyboardInterrupt  # stop before any engine

    monkeypatch.setattr("treedraft.scripts.engine.run_engine", run_engine)
    with pytest.raises(KeyboardInterrupt):
        eval_vllm.evaluate_vllm(EvalConfig(head="smollm2-135m-eagle3", tree="chain:3", limit=1),
                                gpu_memory_utilization=0.4, progress=False)
    assert "method" not in seen["spec"] and seen["spec"]["tree"] == "chain:3"  # the plugin's
    assert seen["llm"]["dtype"] == "bfloat16" and seen["llm"]["gpu_memory_utilization"] == 0.4


@pytest.mark.vllm
def test_eval_vllm_measures_the_recipe_head_through_the_plugin(exported, monkeypatch):
    import functools

    from treedraft.scripts import engine
    from treedraft.scripts.eval_vllm import evaluate_vllm
    from treedraft.training.evaluate import EvalConfig, evaluate

    # the engine's core and worker in its process (tests/vllm_run.py: starts in about half the
    # time of three processes), shut down in the background once it has answered
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(engine, "run_engine",
                        functools.partial(engine.run_engine, background_shutdown=True))
    target, final, _ = exported("llama-3.1-8b-eagle3")
    assert load_head(final).config.layout == "eagle3"
    cfg = EvalConfig(target=str(target), head=str(final), tree="chain:2", limit=2, stride=40,
                     max_new_tokens=8)
    report = evaluate_vllm(cfg, batch_size=2, progress=False)
    assert report["dtype"] == "float32" and report["num_drafting_steps"] > 0
    assert len(report["per_position_acceptance"]) == 2 and report["mean_acceptance_length"] >= 1
    reference = evaluate(cfg)["outputs"]  # greedy: the same text
    assert [o["tokens"] for o in report["outputs"]] == [o["tokens"] for o in reference]
