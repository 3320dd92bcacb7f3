"""A published-layout EAGLE-3 head served as trees by treedraft in a real vLLM engine (CPU).

* the flat layout SpecForge and the EAGLE authors publish (`architectures:
  ["LlamaForCausalLMEagle3"]`, the fields of tests/fixtures/eagle3/specforge-llama3-70b:
  Llama-3.1 rope scaling), shaped for the embedded SmolLM2-135M target (hidden 576, 9 heads of
  64, vocabulary 49152, a 2048-token draft vocabulary; tiny random weights), given to
  `--speculative-config` as a folder or as a hub id (`org/name`, resolved through a prepared,
  offline hub cache) with no method, becomes treedraft's proposer with its imported head; a
  hub id that cannot be fetched fails at start-up with resolve()'s message; a hub repository
  whose config.json is no head is not fetched further: left to vLLM without a method, refused
  with method "treedraft";
* every published config in tests/fixtures/eagle3 (SpecForge's flat ones and a speculators-format
  one), shaped the same way, served as `dynamic:8,3,3` trees: its greedy output is identical to
  vLLM without speculation (random weights: few drafts accepted; drafts were made, branching
  ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from test_speculators import FIXTURE_NAMES, FIXTURES, flat_weights, hub_cache, reshaped

pytestmark = pytest.mark.vllm

TREE = "dynamic:8,3,3"
VOCAB, DRAFT_VOCAB = 49152, 2048  # SmolLM2's vocabulary, the head's drafted part of it
REPO = "specforge/smollm2-135m-eagle3"  # the hub id the folder is cached under


@pytest.fixture(scope="module")
def target() -> str:
    from treedraft.training.models import resolve_model

    return str(resolve_model("smollm2-135m"))


def _smollm2_shaped(name: str, root: Path) -> Path:
    """The published config `name` (tests/fixtures/eagle3) with SmolLM2's dims and random
    weights, every other field as published (test_speculators.reshaped)."""
    cfg = reshaped(json.loads((FIXTURES / name / "config.json").read_text()),
                   dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, intermediate_size=256, vocab_size=VOCAB), DRAFT_VOCAB)
    out = root / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(flat_weights(h=576, v=VOCAB, vd=DRAFT_VOCAB, q=576, kv=192, inter=256),
              str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def flat_head(tmp_path_factory) -> Path:
    """SpecForge's Llama-3.1-70B EAGLE-3 config (flat layout, llama3 rope scaling) with
    SmolLM2's dims, random weights."""
    return _smollm2_shaped("specforge-llama3-70b", tmp_path_factory.mktemp("specforge"))


def _engine_config(target: str, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, speculative_config=spec, enforce_eager=True,
                      dtype="float32", max_model_len=1024).create_engine_config()


def test_flat_folder_and_hub_id_become_the_tree_proposer(flat_head, target, tmp_path,
                                                         monkeypatch):
    from treedraft.heads import load_head
    from treedraft.plugin.config import _head_dir

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    hub_cache(monkeypatch, tmp_path / "hub", REPO, flat_head)
    dirs = []
    for model in (str(flat_head), REPO):
        cfg = _engine_config(target, {"model": model, "tree": TREE})
        td = cfg.additional_config["treedraft"]
        assert cfg.speculative_config.method == "custom_class", model
        assert cfg.speculative_config.num_speculative_tokens == 8
        assert td["head_type"] == "eagle" and td["tree"] == TREE
        assert td["head_dir"].startswith(str(tmp_path / "cache" / "imported")), td
        dirs.append(td["head_dir"])
    head = load_head(dirs[1])  # what the workers load: the imported treedraft folder
    assert head.config.layout == "eagle3" and head.config.target_layer_ids == (2, 15, 27)
    assert head.config.rope_scaling["rope_type"] == "llama3"
    assert head.config.draft_vocab_size == DRAFT_VOCAB
    with pytest.raises(ValueError, match="'specforge/no-such-head' is neither a local folder "
                                         "nor a downloadable hub id"):
        _engine_config(target, {"model": "specforge/no-such-head", "tree": TREE})
    # no method, a hub repository that holds no head (a draft model): its config.json is read,
    # the rest left to vLLM (resolve(), which would fetch the weights, is not called)
    draft = tmp_path / "draft-model"
    draft.mkdir()
    (draft / "config.json").write_text((Path(target) / "config.json").read_text())
    hub_cache(monkeypatch, tmp_path / "hub", "org/draft-model", draft)

    def no_fetch(source):
        raise AssertionError(f"{source} fetched")

    monkeypatch.setattr("treedraft.heads.speculators.resolve", no_fetch)
    assert _head_dir("org/draft-model") is None
    with pytest.raises(ValueError, match="treedraft head folder.*got 'org/draft-model'"):
        _engine_config(target, {"model": "org/draft-model", "method": "treedraft",
                                "tree": TREE})
    assert _head_dir(REPO, "eagle3") is None  # vLLM's own EAGLE-3: not fetched by treedraft


@pytest.mark.slow
def test_published_eagle3_heads_trees_are_exact_in_vllm(target, tmp_path):
    from engine_host import run_engines
    from transformers import AutoTokenizer

    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.target import encode_chat

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [encode_chat(tok, first_turn(m))
               for m in load_prompts("mtbench", limit=4)["messages"]]
    job = {"name": "greedy", "prompts": prompts, "params": {"temperature": 0, "max_tokens": 32}}
    heads = {name: _smollm2_shaped(name, tmp_path) for name in FIXTURE_NAMES}
    # every engine in one process, no speculation first (tests/engine_host.py)
    engines = {"base": {"target": target, "spec": None, "jobs": [job]}}
    engines.update({name: {"target": target, "spec": {"model": str(head), "tree": TREE},
                           "jobs": [job]} for name, head in heads.items()})
    runs = run_engines(engines, env={"TREEDRAFT_CACHE": str(tmp_path / "cache")})
    base = runs["base"][0]["greedy"]
    for name in heads:
        tree, log = runs[name][0]["greedy"], runs[name][1]
        assert "TreeDraftProposer" in log, (name, log[-3000:])
        assert all(0 < len(t) <= 32 for t in tree["tokens"]), name
        assert tree["tokens"] == base["tokens"], name
        spec = tree["spec"]
        assert spec["drafts"] > 0 and spec["draft_tokens"] > spec["drafts"], (name, spec)
