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
* served as `dynamic:8,3,3` trees, its greedy output is identical to vLLM without speculation
  (random weights: few drafts accepted; drafts were made, branching ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from test_speculators import FIXTURES, flat_weights, hub_cache

pytestmark = pytest.mark.vllm

TREE = "dynamic:8,3,3"
VOCAB, DRAFT_VOCAB = 49152, 2048  # SmolLM2's vocabulary, the head's drafted part of it
REPO = "specforge/smollm2-135m-eagle3"  # the hub id the folder is cached under


@pytest.fixture(scope="module")
def target() -> str:
    from treedraft.training.models import resolve_model

    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def flat_head(tmp_path_factory) -> Path:
    """SpecForge's Llama-3.1-70B EAGLE-3 config (flat layout, llama3 rope scaling) with
    SmolLM2's dims, random weights."""
    cfg = json.loads((FIXTURES / "specforge-llama3-70b" / "config.json").read_text())
    cfg.update(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=256, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB)
    out = tmp_path_factory.mktemp("specforge") / "smollm2-eagle3"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(flat_weights(h=576, v=VOCAB, vd=DRAFT_VOCAB, q=576, kv=192, inter=256),
              str(out / "model.safetensors"))
    return out


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
def test_flat_eagle3_head_trees_are_exact_in_vllm(flat_head, target, tmp_path):
    from engine_host import run_engines
    from transformers import AutoTokenizer

    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.target import encode_chat

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [encode_chat(tok, first_turn(m))
               for m in load_prompts("mtbench", limit=4)["messages"]]
    job = {"name": "greedy", "prompts": prompts, "params": {"temperature": 0, "max_tokens": 32}}
    # both engines in one process, no speculation first (tests/engine_host.py)
    runs = run_engines({name: {"target": target, "spec": spec, "jobs": [job]}
                        for name, spec in (("base", None),
                                           ("tree", {"model": str(flat_head), "tree": TREE}))},
                       env={"TREEDRAFT_CACHE": str(tmp_path / "cache")})
    base, tree = runs["base"][0]["greedy"], runs["tree"][0]["greedy"]
    assert "TreeDraftProposer" in runs["tree"][1], runs["tree"][1][-3000:]
    assert all(0 < len(t) <= 32 for t in tree["tokens"])
    assert tree["tokens"] == base["tokens"]
    spec = tree["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] > spec["drafts"], spec  # trees drafted
