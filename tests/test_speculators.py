"""EAGLE-3 heads in the speculators format (heads/speculators.py), tiny configs, no vLLM.

* export -> import is the identity (same logits, same drafted trees), for every norm option,
  `norm_output`, a Qwen3 draft layer (q/k norms) and Llama-3.1 rope scaling;
* the exported tensors computed the way vLLM 0.32's `llama_eagle3.py` / `qwen3_eagle3.py`
  compute them (written out below from those files, on the exported names) give our head's
  features and logits;
* published EAGLE-3 configs (tests/fixtures/eagle3, SOURCES.md there: flat and speculators
  format) read field by field as vLLM 0.32's config code reads them, and each, shrunk to tiny
  dims with random weights named as the flat layout names them (`midlayer.*`), imports with
  vLLM's math and vLLM's default depth; Llama-3.1 rope frequencies equal vLLM's;
* bad folders (speculators or flat) are refused naming the field and both values, a sliding
  window and more than one draft layer included; a source that is neither a folder nor a
  downloadable hub id is refused; export refuses the eagle1 layout and the post-norm output
  layer;
* `load_head` takes a hub id (`org/name`): resolved through the hub cache (offline, prepared
  here), it loads the same head as the folder; a missing id is refused by resolve(), a missing
  local folder stays a FileNotFoundError;
* Medusa heads in vLLM's own Medusa format (heads/medusa.py save_vllm_medusa): the exported
  tensors computed the way vLLM 0.32's `medusa.py` computes them give our heads' logits, with the
  target's LM head shared or each head's own.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_heads import H, Tree, V, make_eagle, make_medusa, sig, target_weights

from treedraft.heads import load_head
from treedraft.heads.common import is_hub_id
from treedraft.heads.eagle import LLAMA3_ROPE_KEYS, rope_inv_freq
from treedraft.heads.speculators import draft_layer, load_speculators, save_speculators

IDS = (1, 2, 3)  # target layers (L = 4): all < L, as vLLM's auxiliary layers must be


def eagle3(**kw):
    return make_eagle(layout="eagle3", target_layer_ids=IDS, draft_vocab_size=20, **kw)


def _llama3_inv_freq(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    """vLLM 0.32 rotary_embedding/llama3_rope.py `_compute_inv_freq`, written out."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    wave = 2 * math.pi / inv
    smooth = (orig / wave - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wave < orig / high, inv, torch.where(wave > orig / low, inv / factor, mid))


def _spec(cfg: dict) -> dict:
    """The options vLLM 0.32 reads from a config of ours or a fixture, spelled out: a
    speculators config through speculators/algos.py (norm_before_residual defaults to True),
    a flat one as plain attributes (every option False)."""
    speculators = "speculators_model_type" in cfg
    lay = cfg["transformer_layer_config"] if speculators else cfg
    rope = lay.get("rope_parameters") or lay.get("rope_scaling") or {}
    nh = lay["num_attention_heads"]
    return {"nh": nh, "nkv": lay.get("num_key_value_heads") or nh,
            "d": lay.get("head_dim") or lay["hidden_size"] // nh,
            "theta": rope.get("rope_theta", lay.get("rope_theta", 10000.0)),
            "llama3": rope if rope.get("rope_type") == "llama3" else None,
            "qk_norm": speculators and lay.get("model_type") == "qwen3",
            "norm_before_residual": cfg.get("norm_before_residual", speculators),
            "norm_before_fc": cfg.get("norm_before_fc", False),
            "fc_norm": cfg.get("fc_norm", False), "norm_output": cfg.get("norm_output", False),
            "eps": lay.get("rms_norm_eps", 1e-6)}


def _vllm_eagle3(w: dict, sp: dict, hidden, ids, positions, n_aux: int = len(IDS),
                 embed=None):
    """vLLM 0.32 llama_eagle3.py / qwen3_eagle3.py on one sequence (no KV cache):
    combine_hidden_states, the first decoder layer (qwen3: q_norm / k_norm per head before
    RoPE), the final norm; returns (the feature fed to the next step: prenorm, or post-norm
    with norm_output; logits over the target vocab)."""
    eps = sp["eps"]

    def rms(x, weight):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    nh, nkv, d = sp["nh"], sp["nkv"], sp["d"]
    x = hidden
    if sp["norm_before_fc"]:
        x = rms(x, w["input_norm.weight"])
    if sp["fc_norm"]:
        x = torch.cat([rms(c, w[f"fc_norm.{i}.weight"])
                       for i, c in enumerate(x.chunk(n_aux, -1))], -1)
    h = x @ w["fc.weight"].T
    emb = F.embedding(ids, target_weights()[0] if embed is None else embed)
    emb = rms(emb, w["midlayer.input_layernorm.weight"])
    if sp["norm_before_residual"]:
        h = rms(h, w["midlayer.hidden_norm.weight"])
        residual = h
    else:
        residual = h
        h = rms(h, w["midlayer.hidden_norm.weight"])
    a = torch.cat([emb, h], -1)
    T = a.shape[0]
    q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, d)
    k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, d)
    v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, d).transpose(0, 1)
    if sp["qk_norm"]:
        q, k = rms(q, w["midlayer.self_attn.q_norm.weight"]), rms(k, w["midlayer.self_attn.k_norm.weight"])
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    inv = 1.0 / (sp["theta"] ** (torch.arange(0, d, 2).float() / d))
    if sp["llama3"]:
        inv = _llama3_inv_freq(inv, sp["llama3"])
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t):  # neox style, as vLLM's Llama and Qwen3
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, -1)
    residual = o @ w["midlayer.self_attn.o_proj.weight"].T + residual
    m = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    m = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
         ) @ w["midlayer.mlp.down_proj.weight"].T
    prenorm = m + residual
    normed = rms(prenorm, w["norm.weight"])
    draft = normed @ w["lm_head.weight"].T
    if "d2t" not in w:
        return (normed if sp["norm_output"] else prenorm), draft
    full = torch.full((T, V), float("-inf"))
    full[:, torch.arange(draft.shape[-1]) + w["d2t"]] = draft  # vLLM: base + d2t offsets
    return (normed if sp["norm_output"] else prenorm), full


# Llama-3.1 scaling shrunk with the head (head_dim 8, wavelengths 6, 167, 4443, 118k): one
# frequency kept (< 512 / 4), one interpolated, two slowed (> 512)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}


@pytest.mark.parametrize("opts", [{}, {"norm_before_residual": True}, {"fuse_norm": True},
                                  {"norm_before_fc": True}, {"norm_output": True},
                                  {"qk_norm": True, "rope_theta": 1e6},
                                  {"rope_scaling": LLAMA3, "rope_theta": 5e5}])
def test_export_import_round_trip_and_vllm_math(tmp_path, opts):
    head = eagle3(**opts)
    out = save_speculators(head, tmp_path / "spec", verifier="smollm2", num_speculative_tokens=4)
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 20
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(IDS)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert w["fc.weight"].shape == (H, 3 * H)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H  # attention reads 2H
    assert torch.equal(w["d2t"] + torch.arange(20), head.d2t)  # offsets, as EAGLE-3 stores
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 20
    assert not any(k.startswith(("embed_tokens", "combine")) for k in w)
    # the speculators library (0.9.0, not installable here: it pins datasets<=5.1) documents
    # these fields of Eagle3SpeculatorConfig / SpeculatorsConfig / GreedyTokenProposalConfig
    assert set(cfg) - {"treedraft_target", "treedraft"} <= {
        "speculators_model_type", "architectures", "transformer_layer_config",
        "draft_vocab_size", "norm_before_residual", "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output",
        "embed_requires_grad", "speculators_config", "speculators_version"}
    sc = cfg["speculators_config"]
    assert set(sc) == {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
    assert set(sc["proposal_methods"][0]) == {"proposal_type", "speculative_tokens",
                                              "verifier_accept_k", "accept_tolerance"}
    assert set(sc["verifier"]) == {"name_or_path", "architectures"}

    back = load_head(out, target=sig())
    assert back.config.layout == "eagle3" and back.config.target_layer_ids == IDS
    back.bind_target(*target_weights())
    back.eval()
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(7, 3 * H, generator=g), torch.randint(0, V, (7,), generator=g)
    pos = torch.arange(7)[None] * 9  # up to 54: across LLAMA3's scaled wavelengths
    mine, _ = head(head.project(hidden)[None], ids[None], pos)
    theirs, _ = back(back.project(hidden)[None], ids[None], pos)
    torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    assert cfg["transformer_layer_config"]["model_type"] == ("qwen3" if "qk_norm" in opts
                                                             else "llama")
    feature, logits = _vllm_eagle3(w, _spec(cfg), hidden, ids, pos[0])
    torch.testing.assert_close(mine[0], feature, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.logits(mine[0]), logits, rtol=1e-5, atol=1e-4)

    # drafting a tree from the imported head: identical log-probs
    tree = Tree(torch.tensor([int(ids[-1]), 3, 5]), torch.tensor([-1, 0, 0]))
    got = []
    for h in (head, back):
        s = h.draft_session()
        s.commit(hidden, ids)
        got.append(s.expand(tree, [0, 1, 2]))
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)


def test_import_accepts_layers0_names_and_own_embedding(tmp_path):
    head = eagle3()
    out = save_speculators(head, tmp_path / "spec", verifier="smollm2")
    w = load_file(str(out / "model.safetensors"))
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}  # speculators' naming
    emb = torch.randn(V, H)
    w["embed_tokens.weight"] = emb
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["treedraft_target"]  # a third-party folder: the target is known only on load
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="load it with the target"):
        load_head(out)
    back = load_head(out, target=sig())
    assert back.config.own_embedding and torch.equal(back.embed_tokens.weight, emb)
    torch.testing.assert_close(back.layer.q_proj.weight, head.layer.q_proj.weight)


def test_export_writes_the_target_rows_of_a_head_that_reads_them(tmp_path):
    """A head whose LM head is the target's rows (lm_head_from_target, not saved by treedraft)
    exports them as its own lm_head, which stock vLLM reads; the import equals the head."""
    head = eagle3(lm_head_from_target=True)
    head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:20])
    out = save_speculators(head, tmp_path / "spec", verifier="smollm2")
    w = load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(w["lm_head.weight"], head.target_lm_head[head.d2t])
    back = load_head(out, target=sig())
    back.bind_target(*target_weights())
    f = torch.randn(2, H)
    torch.testing.assert_close(back.logits(f), head.logits(f), rtol=0, atol=0)


def _export(tmp_path):
    out = save_speculators(eagle3(), tmp_path / "spec", verifier="smollm2")
    return out, json.loads((out / "config.json").read_text()), load_file(
        str(out / "model.safetensors"))


@pytest.mark.parametrize("edit, msg", [
    (lambda c, w: c.update(speculators_model_type="mlp_speculator"),
     r"speculators_model_type='mlp_speculator' is not supported \(supported: 'eagle3'\)"),
    (lambda c, w: c["transformer_layer_config"].update(num_hidden_layers=2),
     r"num_hidden_layers=2 is not supported \(supported: 1\).*\"method\": \"eagle3\""),
    (lambda c, w: w.pop("d2t"), r"draft_vocab_size=20 < vocab_size=50 but the weights have no d2t"),
    (lambda c, w: w.update({"fc.weight": torch.zeros(H, 2 * H)}),
     rf"fuse.weight has shape \[{H}, {2 * H}\], the config needs \[{H}, {3 * H}\]"),
    (lambda c, w: c["treedraft_target"].update(vocab_size=99),
     r"head was trained for vocab_size=99, target has 50"),
    (lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[1, 4]),
     r"\[1, 4\] has \[4\] outside 0..3"),
    (lambda c, w: w.update({"mask_hidden": torch.zeros(3 * H)}), "parallel drafting"),
    (lambda c, w: c["transformer_layer_config"].update(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}),
     r"transformer_layer_config.rope_parameters.rope_type='yarn' is not supported"),
    (lambda c, w: c["transformer_layer_config"].update(
        rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_parameters=None),
     r"rope_scaling of type 'llama3' lacks \['low_freq_factor'"),
    (lambda c, w: c["transformer_layer_config"].update(
        layer_types=["sliding_attention"], sliding_window=4096),
     r"layer_types\[0\]='sliding_attention' is not supported .*refused rather than served "
     "with full attention"),
    (lambda c, w: c["transformer_layer_config"].update(use_sliding_window=True,
                                                       sliding_window=4096),
     r"transformer_layer_config.use_sliding_window=True is not supported"),
    (lambda c, w: c["transformer_layer_config"].update(attention_bias=True),
     r"attention_bias=True is not supported"),
    (lambda c, w: c["transformer_layer_config"].update(hidden_act="gelu"),
     r"hidden_act='gelu' is not supported \(supported: 'silu'\)"),
    (lambda c, w: c["transformer_layer_config"].update(model_type="mistral"),
     r"model_type='mistral' is not supported \(supported: 'llama' or 'qwen3'\)"),
    (lambda c, w: c["transformer_layer_config"].update(partial_rotary_factor=0.5),
     r"partial_rotary_factor=0.5 is not supported"),
    (lambda c, w: c["transformer_layer_config"].update(logit_scale=2.0),
     r"logit_scale=2.0 is not supported"),
    (lambda c, w: c.update(target_hidden_size=64), r"target_hidden_size=64 is not supported"),
    (lambda c, w: c["transformer_layer_config"].update(
        eagle_config={"use_aux_hidden_state": False}),
     r"eagle_config.use_aux_hidden_state=False is not supported"),
    (lambda c, w: c["transformer_layer_config"].pop("intermediate_size"),
     r"transformer_layer_config.intermediate_size is missing"),
    (lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[1, 1, 2]), "repeats a layer"),
    (lambda c, w: c["transformer_layer_config"].update(num_aux_hidden_states=2),
     r"num_aux_hidden_states=2 but eagle_aux_hidden_state_layer_ids has 3 layers"),
])
def test_bad_speculators_folders_are_refused(tmp_path, edit, msg):
    out, cfg, w = _export(tmp_path)
    edit(cfg, w)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=msg):
        load_speculators(out, target=sig())


def test_import_follows_vllm_layer_order_rope_and_default_tree(tmp_path):
    out, cfg, w = _export(tmp_path)
    lay = cfg["transformer_layer_config"]
    assert lay["num_aux_hidden_states"] == 3  # vLLM sizes fc from it (3 when absent)
    assert lay["rope_parameters"] == {"rope_type": "default", "rope_theta": lay["rope_theta"]}
    # a third-party folder: ids listed out of order (vLLM feeds fc in ascending layer order),
    # rope only in transformers 5 style, no recorded tree
    cfg["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]
    del lay["rope_theta"], cfg["treedraft"]
    lay["rope_parameters"]["rope_theta"] = 1234.0
    (out / "config.json").write_text(json.dumps(cfg))
    head = load_speculators(out, target=sig())
    assert head.config.target_layer_ids == IDS and head.config.rope_theta == 1234.0
    assert head.config.default_tree == "chain:3"  # the folder's own speculative_tokens


def test_export_refuses_what_stock_vllm_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="ascending, distinct ids"):
        save_speculators(make_eagle(layout="eagle3", target_layer_ids=(3, 1, 2)),
                         tmp_path / "d", verifier="t")
    with pytest.raises(ValueError, match=r"'eagle1' layout.*--head.layout=eagle3"):
        save_speculators(make_eagle(), tmp_path / "a", verifier="t")
    with pytest.raises(ValueError, match=r"\[4\] cannot be exported .*pre-norm"):
        save_speculators(make_eagle(layout="eagle3", target_layer_ids=(1, 4)), tmp_path / "b",
                         verifier="t")
    with pytest.raises(ValueError, match="allows one of them"):
        save_speculators(eagle3(fuse_norm=True, norm_before_fc=True), tmp_path / "c",
                         verifier="t")
    assert not any((tmp_path / d).exists() for d in "abcd")


def _vllm_medusa(w: dict, cfg: dict, hidden, k: int):
    """vLLM 0.32 medusa.py, head k: ResidualBlock (x + SiLU(Linear(x)) per layer), then its LM
    head (the one shared `lm_head`, loaded from lm_heads.0, with original_lm_head)."""
    x = hidden
    for j in range(cfg["num_hidden_layers"]):
        lin = x @ w[f"blocks.{k}.layers.{j}.weight"].T
        if cfg["medusa_fc_bias"]:
            lin = lin + w[f"blocks.{k}.layers.{j}.bias"]
        x = x + F.silu(lin)
    lm = w["lm_heads.0.weight"] if cfg["original_lm_head"] else w[f"lm_heads.{k}.weight"]
    return x @ lm.T


@pytest.mark.parametrize("opts", [{}, {"own_lm_head": True}, {"num_layers": 2}])
def test_medusa_export_is_vllms_medusa_math(tmp_path, opts):
    from treedraft.heads.medusa import save_vllm_medusa

    heads = make_medusa(**opts)
    out = save_vllm_medusa(heads, tmp_path / "medusa")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["model_type"] == "medusa" and cfg["truncated_vocab_size"] == cfg["vocab_size"] == V
    # vLLM's MedusaConfig renames every top-level key holding "num" (to num_heads or
    # num_hidden_layers): the export has just those two
    assert sorted(key for key in cfg if "num" in key) == ["num_heads", "num_hidden_layers"]
    assert cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == opts.get("num_layers", 1)
    # the target's LM head is written once, not once per head
    lm_keys = sorted(key for key in w if key.startswith("lm_heads."))
    assert lm_keys == [f"lm_heads.{k}.weight"
                       for k in range(3 if opts.get("own_lm_head") else 1)]
    assert cfg["original_lm_head"] is not bool(opts.get("own_lm_head"))
    hidden = torch.randn(5, H)
    with torch.no_grad():
        ours = heads(hidden)  # [5, K, V]
    for k in range(3):
        torch.testing.assert_close(_vllm_medusa(w, cfg, hidden, k), ours[:, k])


def test_medusa_export_refuses_other_heads(tmp_path):
    from treedraft.heads.medusa import save_vllm_medusa

    with pytest.raises(ValueError, match="holds Medusa heads; this is a 'eagle' head"):
        save_vllm_medusa(eagle3(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="has 3 heads .*give 1..3"):  # vLLM: one token per head
        save_vllm_medusa(make_medusa(), tmp_path / "out", num_speculative_tokens=4)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="'medusa' layout"):  # and the other way round
        save_speculators(make_medusa(), tmp_path / "out2", verifier="t")


# ---------------------------------------------------------------- published configs
FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"  # sources: SOURCES.md there
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _vllm_reads(cfg: dict) -> dict:
    """What vLLM 0.32 builds its EAGLE-3 drafter from: the hf config its loader makes of this
    config.json (speculators format: SpeculatorsConfig; flat: the transformers config that
    EAGLEConfig wraps), rope standardized by patch_rope_parameters, read with the getattr
    defaults of llama_eagle3.py / qwen3_eagle3.py."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm.transformers_utils.config import patch_rope_parameters

    cfg = copy.deepcopy(cfg)
    if "speculators_model_type" in cfg:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        hf = SpeculatorsConfig(**SpeculatorsConfig.extract_transformers_pre_trained_config(cfg))
    else:
        hf = AutoConfig.for_model(**cfg)
    patch_rope_parameters(hf)
    rope = dict(hf.rope_parameters)
    eagle_config = getattr(hf, "eagle_config", None) or {}
    types = getattr(hf, "layer_types", None) or []
    return {
        "hidden_size": hf.hidden_size, "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads, "intermediate_size": hf.intermediate_size,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "rms_norm_eps": hf.rms_norm_eps, "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None if rope["rope_type"] == "default" else {
            k: rope[k] for k in ("rope_type", *LLAMA3_ROPE_KEYS)},
        "qk_norm": hf.architectures[0] == "Eagle3Qwen3ForCausalLM",
        "norm_before_residual": bool(getattr(hf, "norm_before_residual", False)),
        "norm_before_fc": bool(eagle_config.get("norm_before_fc",
                                                getattr(hf, "norm_before_fc", False))),
        "fuse_norm": bool(getattr(hf, "fc_norm", False)),
        "norm_output": bool(getattr(hf, "norm_output", False)),
        # vLLM's draft layer 0 attends through a window only where layer_types says so
        "sliding_window": hf.sliding_window if types[:1] == ["sliding_attention"] else None,
        "num_hidden_layers": hf.num_hidden_layers,
        "draft_vocab_size": getattr(hf, "draft_vocab_size", None) or hf.vocab_size,
    }


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_published_config_reads_as_vllm_reads_it(name):
    cfg = _fixture(name)
    ours = draft_layer(name, cfg)
    vllm = _vllm_reads(cfg)
    assert vllm["num_hidden_layers"] == 1 and vllm["sliding_window"] is None
    ours["head_dim"] = ours["head_dim"] or ours["hidden_size"] // ours["num_attention_heads"]
    for field, value in ours.items():
        assert value == vllm[field], f"{name}: {field}: treedraft {value!r}, vLLM {vllm[field]!r}"
    assert cfg["draft_vocab_size"] == vllm["draft_vocab_size"]


def reshaped(cfg: dict, dims: dict, draft_vocab: int) -> dict:
    """The same config with the layer's `dims` (`head_dim` only where the config names one)
    and a `draft_vocab`-token draft vocabulary; every structural field (rope scaling, norms,
    layout) kept. A speculators config takes the dims in its `transformer_layer_config`; the
    draft vocabulary is top-level in both formats."""
    speculators = "speculators_model_type" in cfg
    layer = dict(cfg["transformer_layer_config"] if speculators else cfg)
    layer.update({k: v for k, v in dims.items() if k != "head_dim" or "head_dim" in layer})
    out = {**cfg, "transformer_layer_config": layer} if speculators else layer
    return {**out, "draft_vocab_size": draft_vocab}


def _shrink(cfg: dict) -> dict:
    """The same config at test_heads' dims (H=32, 4 heads of 8, V=50, a 20-token draft
    vocabulary)."""
    return reshaped(cfg, dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, intermediate_size=64, vocab_size=V), 20)


def flat_weights(seed: int = 0, n_aux: int = 3, vd: int = 20, *, h: int = H, v: int = V,
                 q: int = 32, kv: int = 16, inter: int = 64) -> dict[str, torch.Tensor]:
    """Random weights named as the flat layout stores them (EAGLE authors', SpecForge's):
    hidden h, vocabulary v (vd of it drafted), q / kv rows of the attention projections
    (heads x head_dim), MLP width inter; test_heads' dims by default."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (h, n_aux * h), "norm.weight": (h,), "lm_head.weight": (vd, h),
              "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h),
              "midlayer.mlp.down_proj.weight": (h, inter)}
    w = {k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1
         else torch.randn(s, generator=g) * s[-1] ** -0.5 for k, s in shapes.items()}
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    w["d2t"] = ids - torch.arange(vd)  # offsets, as EAGLE-3 stores them
    w["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill(0, ids, True)
    return w


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_published_config_imports_with_vllms_math(tmp_path, name):
    cfg = _shrink(_fixture(name))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = flat_weights()
    save_file(w, str(tmp_path / "model.safetensors"))
    target = sig(num_hidden_layers=8)  # vLLM's default layers (2, 4, 5): none named here
    head = load_head(tmp_path, target=target)
    depth = 3  # a flat config names no depth
    if "speculators_model_type" in cfg:  # the depth vLLM drafts a speculators folder with
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        depth = SpeculatorsConfig.extract_vllm_speculative_config(cfg)["num_speculative_tokens"]
    assert head.config.target_layer_ids == (2, 4, 5)
    assert head.config.default_tree == f"chain:{depth}"
    assert head.config.rope_scaling == _vllm_reads(cfg)["rope_scaling"]
    head.bind_target(*target_weights())
    head.eval()
    g = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(7, 3 * H, generator=g), torch.randint(0, V, (7,), generator=g)
    pos = torch.arange(7) * 700  # across the fixtures' scaled wavelengths
    with torch.no_grad():
        mine, _ = head(head.project(hidden)[None], ids[None], pos[None])
    feature, logits = _vllm_eagle3(w, _spec(cfg), hidden, ids, pos)
    torch.testing.assert_close(mine[0], feature, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.logits(mine[0]), logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("edit, msg", [
    (lambda c: c.update(num_hidden_layers=2), r": num_hidden_layers=2 is not supported"),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=64),
     r": layer_types\[0\]='sliding_attention' is not supported"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     r": rope_scaling.rope_type='dynamic' is not supported"),
])
def test_flat_layout_refusals_name_the_top_level_field(tmp_path, edit, msg):
    cfg = _shrink(_fixture("specforge-llama3-8b"))
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(flat_weights(), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=msg):
        load_speculators(tmp_path, target=sig(num_hidden_layers=8))


def test_llama3_rope_frequencies_are_vllms():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    rs = _fixture("specforge-llama3-70b")["rope_scaling"]
    emb = object.__new__(Llama3RotaryEmbedding)  # just the frequency math, no custom op
    emb.rotary_dim, emb.head_size = 128, 128
    emb.scaling_factor, emb.low_freq_factor = rs["factor"], rs["low_freq_factor"]
    emb.high_freq_factor, emb.orig_max_position = (rs["high_freq_factor"],
                                                   rs["original_max_position_embeddings"])
    torch.testing.assert_close(rope_inv_freq(128, 5e5, rs, "cpu"),
                               emb._compute_inv_freq(5e5), rtol=0, atol=0)


def test_source_neither_folder_nor_hub_id_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a local folder nor a downloadable hub id"):
        load_speculators("treedraft-tests/no-such-eagle3-head", target=sig())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is a file; give the EAGLE-3 folder"):
        load_speculators(tmp_path / "config.json", target=sig())


def hub_cache(monkeypatch, root: Path, repo: str, folder: Path) -> None:
    """`folder` as hub repository `repo` already downloaded into a Hugging Face hub cache at
    `root` (huggingface_hub's layout: refs/main -> snapshots/<commit>), the hub offline: a hub
    id resolves without a network."""
    from huggingface_hub import constants

    commit = "0" * 40
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_id_loads_through_the_hub_cache_and_a_missing_one_is_refused(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(_shrink(_fixture("specforge-llama3-70b"))))
    save_file(flat_weights(), str(src / "model.safetensors"))
    hub_cache(monkeypatch, tmp_path / "hub", "specforge/tiny-eagle3", src)
    target = sig(num_hidden_layers=8)
    head = load_head("specforge/tiny-eagle3", target=target)
    direct = load_head(src, target=target)
    assert head.config == direct.config and head.config.rope_scaling["rope_type"] == "llama3"
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(),
                                                 direct.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="'specforge/no-such-head' is neither a local folder "
                                         "nor a downloadable hub id.*give a folder"):
        load_head("specforge/no-such-head", target=target)
    # local paths stay local: a missing folder is read_config's error, an existing relative
    # `a/b` folder is no hub id
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_head(tmp_path / "no" / "folder")
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("/org/name") and not is_hub_id("./org/name") and is_hub_id("org/name")
    shutil.copytree(src, tmp_path / "org" / "name")
    assert not is_hub_id("org/name")
    assert load_head("org/name", target=target).config == direct.config
