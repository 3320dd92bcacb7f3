"""`treedraft train` end to end on a TINY target (SmolLM2's tokenizer, hidden 32, 2 layers).

Proves: both head types train in seconds through the CLI and leave a loadable head with
provenance and measured acceptance rates; a run stopped at step k and resumed to N logs the same
per-step losses and ends with the same weights as an uninterrupted run (and reuses the cached
replies instead of regenerating); the optional feature cache trains, is refused when built with
other settings (naming them) or larger than the free disk (before the target runs), and its size
estimate holds; bench_recipes' throughput summary; the target features and
soft labels are the target's own (hidden_states layers, next-token log-probs, Medusa offsets);
config files + --key=value overrides are typed, with dashed, underscored and Hugging Face
spellings of a key setting the same field; every bad input fails with a clear error before
the expensive part (unknown key, unknown head type/key, empty data, too-long prompts, resume
with a different config); the target's dtype and the vLLM engine's follow the device that runs
the work, and the replies are written by an engine copy of the target that is freed before the
training copy loads (one copy at a time); a new EAGLE head is EAGLE-3.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from treedraft.heads.common import load_head
from treedraft.scripts.cli import main
from treedraft.training import generate
from treedraft.training.config import HF_ALIASES, TrainConfig, load_config
from treedraft.training.features import TargetFeatures
from treedraft.training.generate import Seq
from treedraft.training.loop import train
from treedraft.training.losses import medusa_rows

PROMPTS = ["Hi there", "What is 2+2?", "Tell me a joke.", "Name a colour.",
           "Why is the sky blue?", "Write a haiku.", "Count to five.", "Say hello in French."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, prompts.jsonl): a random 2-layer Llama saved with SmolLM2's tokenizer."""
    from tiny_llama import tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    tiny_llama(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root / "target", prompts


def args(tiny, out, **kw) -> list[str]:
    target, prompts = tiny
    base = dict(target=target, data=prompts, num_prompts=7, eval_prompts=1, gen_max_new_tokens=10,
                max_seq_len=64, batch_size=2, max_steps=4, warmup_steps=1, lr=3e-3,
                eval_max_new_tokens=4, out_dir=out, progress="false", unroll_steps=2)
    return [f"--{k}={v}" for k, v in {**base, **kw}.items()]


def cfg_of(tiny, out, **kw) -> TrainConfig:
    return load_config(None, args(tiny, out, **kw))


def losses(out) -> list[float]:
    lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "eagle3_tied", "medusa"])
def test_cli_train_writes_loadable_head(tiny, tmp_path, capsys, head_type):
    eagle3 = ["--head.draft_vocab_size=512", "--head.layout=eagle3", "--head.fuse_norm=true",
              "--head.target_layer_ids=[0,1]"]
    extra = {"eagle": ["--head.draft_vocab_size=512"],
             # EAGLE-3's layer and per-layer norms before fuse, layers vLLM can export
             "eagle3": eagle3,
             # ... drafting with the target's LM head rows (never trained, never saved)
             "eagle3_tied": [*eagle3, "--head.lm_head_from_target=true"],
             "medusa": ["--head.num_heads=2"]}[head_type]
    tied = head_type.endswith("_tied")
    layout = head_type.removesuffix("_tied")
    head_type = layout.replace("eagle3", "eagle")
    main(["train", *args(tiny, tmp_path, head_type=head_type, measure_every=2), *extra])
    final = tmp_path / "final"
    assert str(final) in capsys.readouterr().out
    head = load_head(final)
    assert head.head_type == head_type
    depth = 6 if head_type == "eagle" else 2
    rates = head.config.acceptance_rates
    assert len(rates) == depth and all(len(r) == 8 for r in rates)
    prov = json.loads((final / "provenance.json").read_text())
    assert {"git_revision", "command", "packages", "data", "train_config", "eval"} <= set(prov)
    assert prov["data"]["train_sequences"] == 7 and prov["packages"]["torch"]
    assert prov["eval"]["mean_acceptance_length"] >= 1.0
    assert json.loads((final / "train_config.json").read_text())["head_type"] == head_type
    assert len(losses(tmp_path)) == 4
    log = [json.loads(ln) for ln in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    held = [(r["step"], r["heldout"]) for r in log if "heldout" in r]  # the learning curve
    assert [s for s, _ in held] == [2, 4]
    assert all(len(h["top1"]) == depth and all(0 <= a <= b <= 1 for a, b in
                                               zip(h["top1"], h["topk"], strict=True))
               for _, h in held)
    assert held[-1][1]["top1"] == [r[0] for r in rates]  # the rates the head ships with
    ckpts = sorted((tmp_path / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-0000004"]
    assert {"trainer_state.pt", "train_config.json", "provenance.json"} <= {
        p.name for p in ckpts[0].iterdir()}
    if tied:  # the target's rows: never trained, never saved, bound again at load
        from transformers import AutoModelForCausalLM

        assert "lm_head.weight" not in load_file(final / "model.safetensors")
        target = AutoModelForCausalLM.from_pretrained(tiny[0])
        lm = target.get_output_embeddings().weight.detach()
        head.bind_target(target.get_input_embeddings().weight.detach(), lm)
        assert torch.equal(head.lm_head.weight, lm[head.d2t])
    if layout == "eagle3":  # trained in EAGLE-3's layout: exports for stock vLLM, loads back
        from treedraft.heads.speculators import save_speculators

        assert head.config.layout == "eagle3" and head.fuse_norms is not None
        out = save_speculators(head, tmp_path / "spec", verifier="tiny")
        back = load_head(out, target=head.config.target)
        assert back.config.fuse_norm and back.config.target_layer_ids == (0, 1)
        with pytest.raises(ValueError, match="eagle3 layout feeds a pre-norm stream"):
            train(cfg_of(tiny, tmp_path / "fl", feature_loss_weight=0.1,
                         **{"head.layout": "eagle3"}))


def test_kill_and_resume_matches_uninterrupted(tiny, tmp_path, monkeypatch):
    kw = dict(max_steps=6, grad_accum=2, warmup_steps=2)
    full, part = tmp_path / "full", tmp_path / "part"
    dv = ["--head.draft_vocab_size=256"]
    train(load_config(None, args(tiny, full, **kw) + dv))
    train(load_config(None, args(tiny, part, stop_after_steps=3, **kw) + dv))
    assert len(losses(part)) == 3
    # the resumed run must reuse the cached replies: any generation attempt fails
    monkeypatch.setitem(generate.ENGINES, "transformers", "no_such_module:engine")
    main(["train", "--resume", str(part)])
    a, b = losses(full), losses(part)
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6, (a, b)
    wa, wb = load_file(full / "final" / "model.safetensors"), load_file(
        part / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


def test_init_from_continues_from_a_heads_weights(tiny, tmp_path):
    dv = ["--head.draft_vocab_size=256"]
    first = tmp_path / "first"
    train(load_config(None, args(tiny, first, max_steps=3) + dv))
    src = load_head(first / "final")
    # zero lr: the new run's head must stay exactly the source head (draft vocab included)
    second = tmp_path / "second"
    train(load_config(None, args(tiny, second, max_steps=1, lr=0.0, warmup_steps=0,
                                 init_from=first / "final") + dv))
    got = load_file(second / "final" / "model.safetensors")
    for k, v in src.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0)
    assert not torch.equal(got["d2t"], torch.arange(256))  # the source's chosen vocabulary
    with pytest.raises(ValueError, match=r"init_from=.*draft_vocab_size: 256 there, 128 here"):
        train(load_config(None, args(tiny, tmp_path / "third", init_from=first / "final")
                          + ["--head.draft_vocab_size=128"]))


def test_max_steps_0_measures_init_froms_acceptance_rates_and_trains_nothing(tiny, tmp_path):
    first = tmp_path / "first"
    train(load_config(None, args(tiny, first, max_steps=2, head_type="medusa")))
    src = load_head(first / "final")
    src.config.acceptance_rates = [[0.5] * 8] * src.config.num_heads  # stale: another head's
    src.save_pretrained(tmp_path / "stale")
    out = tmp_path / "measured"
    train(load_config(None, args(tiny, out, max_steps=0, head_type="medusa",
                                 init_from=tmp_path / "stale")))
    got = load_head(out / "final")
    for k, v in src.state_dict().items():  # not one optimizer step
        torch.testing.assert_close(got.state_dict()[k], v, atol=0, rtol=0)
    assert got.config.acceptance_rates == load_head(first / "final").config.acceptance_rates
    assert not any("loss" in r for r in map(json.loads, (out / "train_log.jsonl").open()))
    with pytest.raises(ValueError, match=r"max_steps=0 trains nothing.*set init_from=HEAD"):
        load_config(None, args(tiny, tmp_path / "x", max_steps=0))


def test_ceiling_script_no_tree_beats_the_oracle_of_its_size(tiny, tmp_path):
    """scripts/ceiling.py end to end on the tiny target with an untrained head: the head's
    4-node tree never beats the best 4-node tree, and the ceiling grows with the nodes."""
    from treedraft.scripts import ceiling
    from treedraft.training.target import init_head, load_target

    target, prompts = tiny
    loaded = load_target(target)
    init_head("eagle", loaded.model, loaded.tokenizer).save_pretrained(tmp_path / "head")
    for s in ("1", "2"):
        r = ceiling.main(["--target", str(target), "--head", str(tmp_path / "head"), "--tree",
                          "dynamic:4,3,2", "--prompts", str(prompts), "--stride", "1", "--limit",
                          "2", "--max-new-tokens", "6", "--every", "2", "--nodes", "4",
                          "--draft-temperature", s, "--json", str(tmp_path / "r.json")])
        oracle = [r["oracle_expected_tau"][n] for n in ("1", "2", "4")]
        assert r["positions"] >= 4 and r["mean_tree_size"] == 4
        assert 1 < oracle[0] <= oracle[1] <= oracle[2] <= 5 and oracle[2] > oracle[0]
        assert 1 <= r["head_expected_tau"] <= oracle[2] + 1e-9
        assert json.loads((tmp_path / "r.json").read_text()) == r


def test_lr_schedules_end_their_decay_with_the_run():
    from treedraft.training.loop import lr_lambda

    wsd = lr_lambda(2, 10, "wsd", 0.5)  # warmup 2 steps, stable to half-way, then linear to 0
    assert [round(wsd(s), 3) for s in range(11)] == [
        0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_lambda(2, 10)(10) == 0.0 and lr_lambda(2, 10)(6) == pytest.approx(0.5)
    used = [0.0]  # share of a time budget used: the decay ends when the time runs out
    timed = lr_lambda(0, 10_000, "wsd", 0.2, clock=lambda: used[0])
    for share, want in ((0.5, 1.0), (0.9, 0.5), (1.3, 0.0)):
        used[0] = share
        assert timed(10) == pytest.approx(want)
    used[0] = 0.5
    assert lr_lambda(0, 10_000, clock=lambda: used[0])(10) == pytest.approx(0.5)  # cosine


def test_length_buckets_cut_padding_and_keep_every_sequence():
    import random

    from treedraft.training.distributed import Dist
    from treedraft.training.loop import DataOrder

    lengths = [random.Random(i).randint(20, 1000) for i in range(400)]
    d = Dist(rank=0, world=1)

    def epoch(buckets: int, start: dict | None = None):
        cfg = TrainConfig(batch_size=4, length_buckets=buckets)
        order = DataOrder(len(lengths), cfg, d, position=start, lengths=lengths)
        return [order.next() for _ in range(order.per_epoch)], order

    def padding(batches) -> float:
        pos = sum(4 * max(lengths[i] for i in b) for b in batches)
        return 1 - sum(lengths[i] for b in batches for i in b) / pos

    plain, _ = epoch(1)
    bucketed, order = epoch(16)
    assert sorted(i for b in bucketed for i in b) == list(range(400))  # each sequence once
    assert padding(bucketed) < padding(plain) / 3, (padding(bucketed), padding(plain))
    assert bucketed == epoch(16)[0]  # seeded
    assert order.next() != bucketed[0]  # the next epoch has its own order
    resumed, _ = epoch(16, {"epoch": 0, "micro": 50})  # a resume continues the same order
    assert resumed[: len(bucketed) - 50] == bucketed[50:]


def test_init_from_does_not_warm_up_again(tiny, tmp_path):
    first = tmp_path / "first"
    train(load_config(None, args(tiny, first, max_steps=1)))
    second = tmp_path / "second"
    train(load_config(None, args(tiny, second, max_steps=2, warmup_steps=3, schedule="wsd",
                                 decay_fraction=0.5, init_from=first / "final")))
    lines = [json.loads(ln) for ln in (second / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in lines if "lr" in r]  # the rate for the next step, after each step
    assert lrs == [pytest.approx(3e-3), 0.0]  # full rate at once, decayed at the last step


def test_budget_minutes_keeps_one_schedule_across_resumes(tiny, tmp_path):
    """A run in pieces (time_limit_minutes / stop_after_steps per invocation, --resume the next)
    follows ONE schedule over budget_minutes: the checkpoint keeps the minutes trained, and a
    resume continues the clock where it stood instead of starting it again."""
    from treedraft.training import checkpoint as ckpt_io

    out = tmp_path / "run"
    train(load_config(None, args(tiny, out, max_steps=100_000, warmup_steps=0, schedule="wsd",
                                 decay_fraction=0.5, budget_minutes=10, stop_after_steps=2)))
    lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines if "lr" in r] == [pytest.approx(3e-3)] * 2  # stable phase
    ckpt = ckpt_io.find_checkpoint(out)
    state = ckpt_io.load_state(ckpt)
    assert 0 < state["trained_seconds"] < 600
    # as if 9 min 58 s of the 10 had been trained: the resumed run is at the end of its decay
    state["trained_seconds"] = 598.0
    torch.save(state, ckpt / ckpt_io.STATE_FILE)
    main(["train", "--resume", str(out)])
    lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in lines if "lr" in r]
    assert len(lrs) > 2 and lrs[:2] == [pytest.approx(3e-3)] * 2
    assert 0 <= lrs[2] < 3e-3 * (2.5 / 60) / 0.5, lrs[:4]  # <= 2.5 s of 600 left, decay half
    assert lrs[-1] < 3e-5 and len(lrs) < 100_000  # the budget, not max_steps, ended the run
    last = ckpt_io.find_checkpoint(out)
    assert ckpt_io.load_state(last)["trained_seconds"] > 600
    assert (out / "final" / "model.safetensors").is_file()
    # a resume that finds the budget spent trains no step: it measures and saves the head
    (out / "final" / "model.safetensors").unlink()
    main(["train", "--resume", str(out)])
    after = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in after if "lr" in r] == lrs
    assert (out / "final" / "model.safetensors").is_file()


def test_resume_with_different_config_is_refused(tiny, tmp_path):
    train(cfg_of(tiny, tmp_path, max_steps=2))
    with pytest.raises(ValueError, match=r"different config: lr: 0.003 -> 0.01") as e:
        train(cfg_of(tiny, tmp_path, max_steps=3, lr=0.01), resume=tmp_path)
    assert "unroll_steps" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg_of(tiny, tmp_path), resume=tmp_path / "nowhere")


@pytest.mark.parametrize("head", [{"head.draft_vocab_size": 128},
                                  {"head_type": "medusa", "head": "{}", "head.num_heads": 2}])
def test_feature_cache_trains(tiny, tmp_path, head):  # the shipped recipes of both head types
    train(cfg_of(tiny, tmp_path, cache_features="true", cache_topk=16, max_steps=2, eval_prompts=0,
                 **head))
    assert list((tmp_path / "features").glob("shard-*.safetensors"))
    assert all(x == x for x in losses(tmp_path))  # no NaN


def test_feature_cache_matches_streamed_features(tiny, tmp_path):
    from treedraft.training.features import FeatureCache
    from treedraft.training.losses import eagle_loss
    from treedraft.training.target import init_head, load_target

    loaded = load_target(str(tiny[0]))
    torch.manual_seed(0)
    head = init_head("eagle", loaded.model, loaded.tokenizer, draft_vocab_size=64)
    head.set_draft_vocab(torch.randperm(49152)[:64])
    t2d = torch.full((49152,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(64)
    seqs = [Seq(str(i), torch.randint(0, 49152, (n,)).tolist(), p)
            for i, (n, p) in enumerate([(9, 3), (6, 2), (12, 5)])]
    full_topk = TargetFeatures(loaded.model, (2,), topk=49152)  # top-k = everything
    cache = FeatureCache(tmp_path, seqs, full_topk, batch_size=2, dtype=torch.float32,
                         fingerprint={}, t2d=t2d, progress=False)
    assert len(list(tmp_path.glob("shard-*.safetensors"))) == 1
    streamed = TargetFeatures(loaded.model, (2,), label_ids=head.d2t)([seqs[2], seqs[0]])
    cached = cache([2, 0])
    assert torch.equal(cached.label_mask, streamed.label_mask)
    att = streamed.attention  # padding differs (zeros vs features of pad tokens), unused
    torch.testing.assert_close(cached.features[att], streamed.features[att])
    assert torch.equal(cached.labels.top1, streamed.labels.top1)
    with torch.no_grad():
        a, _ = eagle_loss(head, streamed, [1.0, 0.5])
        b, _ = eagle_loss(head, cached, [1.0, 0.5])
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)  # cache keeps log-probs in fp16


def test_a_feature_cache_of_other_settings_is_refused_naming_the_mismatch(tiny, tmp_path):
    from treedraft.training.features import FeatureCache
    from treedraft.training.target import load_target

    loaded = load_target(str(tiny[0]))
    torch.manual_seed(0)
    seqs = [Seq(str(i), torch.randint(0, 49152, (n,)).tolist(), 3) for i, n in enumerate([9, 12])]
    src = TargetFeatures(loaded.model, (2,), topk=8)

    def cache(seqs=seqs, layers=(2,)):
        return FeatureCache(tmp_path, seqs, src, batch_size=2, dtype=torch.float32,
                            fingerprint={"layers": list(layers), "topk": 8}, progress=False)

    cache()
    shard = tmp_path / "shard-00000.safetensors"
    built = shard.stat().st_mtime_ns
    assert torch.equal(cache()([1]).features, cache()([1]).features)  # same settings: reused
    assert shard.stat().st_mtime_ns == built  # not rebuilt
    with pytest.raises(ValueError, match=r"layers: \[2\] in the cache, \[1\] here.*delete"):
        cache(layers=(1,))
    other = [Seq(s.id, [t + 1 for t in s.input_ids], 3) for s in seqs]  # another tokenizer
    with pytest.raises(ValueError, match="token ids of the training sequences"):
        cache(seqs=other)
    assert shard.stat().st_mtime_ns == built  # a refused cache is left as it was


def test_a_feature_cache_larger_than_the_free_disk_is_refused_before_the_target_runs(
        tiny, tmp_path, monkeypatch):
    import shutil

    from treedraft.training import features
    from treedraft.training.target import load_target

    loaded = load_target(str(tiny[0]))
    torch.manual_seed(0)
    seqs = [Seq(str(i), torch.randint(0, 49152, (n,)).tolist(), 5)
            for i, n in enumerate([40, 64, 33, 50])]
    src = TargetFeatures(loaded.model, (1, 2), topk=16, need_final=True)
    need = features.cache_bytes(seqs, src, torch.bfloat16)
    features.FeatureCache(tmp_path / "ok", seqs, src, batch_size=2, dtype=torch.bfloat16,
                          fingerprint={}, progress=False)
    real = sum(f.stat().st_size for f in (tmp_path / "ok").glob("shard-*"))
    assert 0.9 * real <= need <= 1.1 * real, (need, real)  # the estimate printed up front
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(features.shutil, "disk_usage",
                        lambda p: usage._replace(free=need // 2))
    ran = []
    monkeypatch.setattr(src, "base", lambda *a, **k: ran.append(1))  # the target must not run
    with pytest.raises(ValueError, match=r"needs about .* MB .* free.*cache_topk"):
        features.FeatureCache(tmp_path / "big", seqs, src, batch_size=2, dtype=torch.bfloat16,
                              fingerprint={}, progress=False)
    assert not ran and not list((tmp_path / "big").glob("shard-*"))


def test_bench_recipes_counts_useful_tokens_per_epoch_and_charges_the_cache():
    from treedraft.scripts.bench_recipes import summarize

    log = [{"step": 0, "heldout": {"top1": [0.1, 0.05]}},
           {"step": 1, "epoch": 0, "tokens": 300, "tokens_per_s": 100.0, "padding": 0.25},
           {"step": 2, "epoch": 1, "tokens": 400, "tokens_per_s": 400.0, "padding": 0.0},
           {"step": 3, "epoch": 1, "tokens": 200, "tokens_per_s": 200.0, "padding": 0.5},
           {"step": 3, "heldout": {"top1": [0.3, 0.2]}}]
    r = summarize(log, extra_seconds=5.0)  # 3 + 1 + 1 s of steps, 5 s of cache
    assert r["tokens"] == 900 and r["steps"] == 3
    assert r["tokens_per_hour"] == pytest.approx(3600 * 900 / 10)
    assert r["per_epoch"][0]["tokens_per_hour"] == pytest.approx(3600 * 100)
    assert r["later_epochs_tokens_per_hour"] == pytest.approx(3600 * 300)
    assert r["per_epoch"][1]["padding"] == pytest.approx(1 - 600 / 800)
    assert r["padding"] == pytest.approx(1 - 900 / 1200)
    assert r["heldout_top1"] == [0.3, 0.2]  # the last measurement, not the first
    assert summarize(log[:2])["later_epochs_tokens_per_hour"] is None
    with pytest.raises(ValueError, match="no training steps"):
        summarize(log[:1])


def test_bench_recipes_links_a_finished_cache_and_refuses_an_unfinished_one(tmp_path):
    from treedraft.scripts.bench_recipes import link_cache

    src = tmp_path / "built" / "features"
    src.mkdir(parents=True)
    (src / "shard-00000.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(SystemExit, match="no meta.json there"):  # a killed build
        link_cache(src, tmp_path / "a" / "features")
    assert not (tmp_path / "a").exists()
    (src / "meta.json").write_text("{}")
    link_cache(src, tmp_path / "a" / "features")
    linked = tmp_path / "a" / "features" / "shard-00000.safetensors"
    assert linked.stat().st_ino == (src / "shard-00000.safetensors").stat().st_ino  # no copy
    assert (tmp_path / "a" / "features" / "meta.json").read_text() == "{}"


def test_target_features_and_labels_are_the_targets(tiny):
    from treedraft.training.target import load_target

    loaded = load_target(str(tiny[0]))
    seqs = [Seq("a", [1, 5, 9, 200, 7, 3], 3), Seq("b", [4, 8, 15, 16], 2)]
    batch = TargetFeatures(loaded.model, (1, 2), need_final=True)(seqs)
    ids = torch.tensor([[1, 5, 9, 200, 7, 3], [4, 8, 15, 16, 0, 0]])
    att = ids.new_tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad():
        out = loaded.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    # labels at p = prompt_len-1 .. len-2: the next token is a reply token
    assert batch.label_mask.nonzero().tolist() == [[0, 2], [0, 3], [0, 4], [1, 1], [1, 2]]
    for b, n in enumerate([6, 4]):
        torch.testing.assert_close(batch.features[b, :n, :32], out.hidden_states[1][b, :n])
        torch.testing.assert_close(batch.features[b, :n, 32:], out.hidden_states[2][b, :n])
    torch.testing.assert_close(batch.final_hidden[0], out.hidden_states[-1][0])
    want = torch.log_softmax(out.logits.float(), -1)[batch.label_mask]
    torch.testing.assert_close(batch.labels.logprobs, want, atol=1e-5, rtol=1e-5)
    # Medusa head k at position t is trained on the target's distribution at t+k
    lp_all = torch.log_softmax(out.logits.float(), -1)
    for k in (1, 2):
        q, rows = medusa_rows(batch.label_index(), k)
        for (b, t), r in zip(q.nonzero().tolist(), rows.tolist(), strict=True):
            torch.testing.assert_close(batch.labels.logprobs[r], lp_all[b, t + k],
                                       atol=1e-5, rtol=1e-5)
    # a draft vocab restricts and renormalises the labels; top-1 stays the full-vocab argmax
    sub = torch.tensor([3, 7, 9, 100])
    small = TargetFeatures(loaded.model, (2,), label_ids=sub)(seqs)
    torch.testing.assert_close(small.labels.logprobs,
                               torch.log_softmax(out.logits.float()[batch.label_mask][:, sub], -1),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(small.labels.top1, want.argmax(-1))


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("head_type: medusa\nlr: 0.001\nhead:\n  num_heads: 3\nmax_steps: 10\n")
    cfg = load_config(f, ["--lr=1e-3", "--max_steps=none", "--epochs=2", "--cache-features=true",
                          "--head.num_layers=2", "--step_weights=[1, 0.5, 0.25]",
                          "--eval_tree=chain:3"])
    assert cfg.head_type == "medusa" and cfg.lr == 1e-3 and cfg.max_steps is None
    assert cfg.epochs == 2.0 and cfg.cache_features is True
    assert cfg.head == {"num_heads": 3, "num_layers": 2}
    assert cfg.step_weights == [1.0, 0.5, 0.25] and cfg.eval_tree == "chain:3"
    assert TrainConfig().loss_weights(3, "steps") == pytest.approx([1, 0.8, 0.64])
    saved = tmp_path / "c.json"
    cfg.save(saved)
    assert load_config(saved) == cfg
    assert load_config(f, ["--head={}", "--head.num_layers=3"]).head == {"num_layers": 3}


@pytest.mark.parametrize("over, match", [
    (["--bogus=1"], r"unknown config keys \['bogus'\]; valid keys: target, head_type"),
    (["--lr=fast"], r"lr='fast' is not a valid float"),
    (["--head_type=lstm"], r"head_type='lstm'; valid values: eagle, medusa"),
    (["--gen_engine=sglang"], r"gen_engine='sglang'; valid values: transformers, vllm"),
    (["--data=mtbench"], r"never train on it"),
    (["--gen_temperatures=[0,-1]"], r"gen_temperatures=\[0.0, -1.0\] must be a non-empty list"),
    (["--gen_temperatures=[]"], r"gen_temperatures=\[\] must be a non-empty list"),
    (["--gen_temperature=-0.5"], r"gen_temperature=-0.5 must be >= 0"),
    (["--gen_time_limit_minutes=0"], r"gen_time_limit_minutes=0.0 must be > 0"),
    (["--budget_minutes=-1"], r"budget_minutes=-1.0 must be > 0"),
    (["lr=1"], r"must look like --key=value"),
])
def test_bad_config_errors(over, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, over)


def test_dashed_underscored_and_hugging_face_keys_set_the_same_field(tmp_path):
    dashed = load_config(None, ["--max-steps=7", "--cache-features=true", "--head.num-heads=3",
                                "--gen-temperatures=[0,1]"])
    under = load_config(None, ["--max_steps=7", "--cache_features=true", "--head.num_heads=3",
                               "--gen_temperatures=[0,1]"])
    assert dashed == under
    assert (dashed.max_steps, dashed.cache_features, dashed.head) == (7, True, {"num_heads": 3})
    hf = load_config(None, ["--learning-rate=3e-4", "--num_train_epochs=2",
                            "--per-device-train-batch-size=8", "--gradient_accumulation_steps=2",
                            "--max-grad-norm=0.5", "--output-dir=runs/x", "--save-steps=50",
                            "--save-total-limit=3", "--torch-compile=true", "--warmup-steps=5"])
    assert (hf.lr, hf.epochs, hf.batch_size, hf.grad_accum, hf.grad_clip, hf.out_dir,
            hf.save_every, hf.keep_checkpoints, hf.compile, hf.warmup_steps) == (
        3e-4, 2.0, 8, 2, 0.5, "runs/x", 50, 3, True, 5)
    fields = {f for f in TrainConfig.__dataclass_fields__}
    assert set(HF_ALIASES.values()) <= fields and not set(HF_ALIASES) & fields
    # a recipe may use the Hugging Face names too; the command line still wins over the file
    f = tmp_path / "hf.yaml"
    f.write_text("learning_rate: 1.0e-3\nnum-train-epochs: 3\n")
    assert (load_config(f).lr, load_config(f).epochs) == (1e-3, 3.0)
    assert load_config(f, ["--lr=2e-4"]).lr == 2e-4
    f.write_text("lr: 1.0e-3\nlearning_rate: 2.0e-3\n")
    with pytest.raises(ValueError, match=r"'learning_rate' sets 'lr' a second time"):
        load_config(f)


@pytest.mark.parametrize("key", ["--max-stepz=3", "--max_stepz=3"])
def test_unknown_key_names_it_and_the_closest_valid_key(key):
    with pytest.raises(ValueError, match=r"unknown config keys \['max_stepz'\]; valid keys: "
                                         r"target, .*Did you mean: max_stepz -> max_steps\?"):
        load_config(None, [key])
    with pytest.raises(ValueError, match=r"\['logging_steps'\].*TrainingArguments names "
                                         r"accepted: learning_rate \(= lr\)"):
        load_config(None, ["--logging-steps=10"])  # no such setting here: not an alias


def record_engine(monkeypatch, reply=None, delay: float = 0.0) -> list[tuple[int, float]]:
    """Replace the reply engine by one that records (prompts, temperature) per call and answers
    each prompt with reply(temperature) (None: the real engine's replies) after `delay` s."""
    import time

    calls, real = [], generate.transformers_engine

    def engine(loaded, cfg):
        gen = real(loaded, cfg) if reply is None else None

        def run(prompts, temperature):
            calls.append((len(prompts), temperature))
            time.sleep(delay)
            if gen is not None:
                return gen(prompts, temperature)
            return [list(reply(temperature)) for _ in prompts]
        return run

    monkeypatch.setattr(generate, "transformers_engine", engine)
    return calls


def test_gen_temperatures_mix_round_robin_with_a_cache_per_temperature(tiny, tmp_path,
                                                                        monkeypatch):
    from treedraft.training.data import load_prompts
    from treedraft.training.target import load_target

    target, prompts = tiny
    ds = load_prompts(prompts, purpose="train", limit=6)
    rows = list(zip(ds["id"], ds["messages"], strict=True))
    loaded, data = load_target(target), tmp_path / "data"
    calls = record_engine(monkeypatch)
    mix = generate.build_sequences(loaded, rows, cfg_of(tiny, tmp_path, gen_temperatures="[0,1]"),
                                   data)
    assert len(mix) == 6 and calls == [(3, 0.0), (3, 1.0)]  # one engine, a call per temperature
    files = {}
    for path in data.glob("gen-*.jsonl"):
        head, *lines = path.read_text().splitlines()
        files[json.loads(head)["meta"]["temperature"]] = sorted(json.loads(ln)["id"] for ln in lines)
    assert files == {0.0: sorted(r for r, _ in rows[0::2]), 1.0: sorted(r for r, _ in rows[1::2])}
    # a single greedy run shares the T=0 cache: only the other three prompts are generated
    calls.clear()
    greedy = generate.build_sequences(loaded, rows, cfg_of(tiny, tmp_path, gen_temperature=0), data)
    assert calls == [(3, 0.0)]
    same = {s.id: s.input_ids for s in greedy}
    assert all(same[s.id] == s.input_ids for s in mix if s.id in files[0.0])


def test_generation_order_first_ids_then_length_sorted_windows():
    todo = [(f"p{i}", [0] * n) for i, n in enumerate([1, 5, 3, 2, 9, 4])]
    ids = lambda order: [rid for rid, _ in order]  # noqa: E731
    assert ids(generate.generation_order(todo, None)) == ["p4", "p1", "p5", "p2", "p3", "p0"]
    # windows of 3 prompts in data order: a cut after any window is a sample of every length
    assert ids(generate.generation_order(todo, 3)) == ["p1", "p2", "p0", "p4", "p5", "p3"]
    assert ids(generate.generation_order(todo, 3, frozenset({"p0", "p3"}))) == [
        "p3", "p0", "p4", "p1", "p2", "p5"]


def test_gen_time_limit_stops_generation_and_answers_held_out_prompts_first(tiny, tmp_path,
                                                                           monkeypatch, capsys):
    from treedraft.training.data import load_prompts
    from treedraft.training.target import load_target

    target, prompts = tiny
    ds = load_prompts(prompts, purpose="train", limit=6)
    rows = list(zip(ds["id"], ds["messages"], strict=True))
    # two batches start inside the 1.8 s limit, the third does not
    calls = record_engine(monkeypatch, lambda t: [7, 8], delay=1.0)
    # T=0 answers prompts 0, 2, 4 and T=1 prompts 1, 3, 5; batches of 2 take turns
    cfg = cfg_of(tiny, tmp_path, gen_temperatures="[0,1]", gen_batch_size=2,
                 gen_time_limit_minutes=0.03)
    held_out = frozenset({rows[5][0], rows[3][0]})
    loaded, data = load_target(target), tmp_path / "data"
    seqs = generate.build_sequences(loaded, rows, cfg, data, held_out)
    assert calls == [(2, 0.0), (2, 1.0)]  # each temperature its share, held-out ones first
    assert held_out <= {s.id for s in seqs} and len(seqs) == 4
    assert "4 of 6 prompts have a reply; the other 2 are left out" in capsys.readouterr().out
    # from the cache only (a resume of this run, a DDP rank > 0): the same four, no engine
    same = generate.build_sequences(loaded, rows, cfg, data, held_out, generate_missing=False)
    assert calls == [(2, 0.0), (2, 1.0)] and [s.id for s in same] == [s.id for s in seqs]
    assert "replies read from the cache only: 4 of 6" in capsys.readouterr().out
    # a later run without the limit answers the rest; the cache keeps the first four
    cfg.gen_time_limit_minutes = None
    seqs = generate.build_sequences(loaded, rows, cfg, data, held_out)
    assert calls[2:] == [(1, 0.0), (1, 1.0)] and len(seqs) == 6


def test_gen_all_replies_trains_on_the_other_temperatures_cached_replies(tiny, tmp_path,
                                                                         monkeypatch, capsys):
    from treedraft.training.data import load_prompts
    from treedraft.training.target import load_target

    target, prompts = tiny
    ds = load_prompts(prompts, purpose="train", limit=6)
    rows = list(zip(ds["id"], ds["messages"], strict=True))
    calls = record_engine(monkeypatch, lambda t: [7, 8] if t == 0 else [9])
    loaded, data = load_target(target), tmp_path / "data"
    # an earlier all-greedy run answered all six prompts at T=0
    generate.build_sequences(loaded, rows, cfg_of(tiny, tmp_path, gen_temperature=0), data)
    assert calls == [(6, 0.0)]
    held_out = frozenset({rows[3][0]})
    cfg = cfg_of(tiny, tmp_path, gen_temperatures="[0,1]")
    plain = generate.build_sequences(loaded, rows, cfg, data, held_out, held_out=held_out)
    assert calls[1:] == [(3, 1.0)] and len(plain) == 6  # the odd prompts answered at T=1
    cfg.gen_all_replies = True
    seqs = generate.build_sequences(loaded, rows, cfg, data, held_out, held_out=held_out)
    assert calls[1:] == [(3, 1.0)]  # nothing generated
    assert [s.id for s in seqs[:6]] == [s.id for s in plain]
    # the greedy replies of prompts 1 and 5 join; prompt 3 is held out and gets none
    extra = seqs[6:]
    assert [s.id for s in extra] == [f"{rows[1][0]}@T0", f"{rows[5][0]}@T0"]
    assert all(s.input_ids[s.prompt_len:] == [7, 8] for s in extra)
    assert [s.input_ids[: s.prompt_len] for s in extra] == [
        p.input_ids[: p.prompt_len] for p in (plain[1], plain[5])]
    assert "gen_all_replies: 2 more sequences" in capsys.readouterr().out


def test_gen_cache_only_trains_on_the_cached_replies_and_writes_none(tiny, tmp_path,
                                                                    monkeypatch, capsys):
    from treedraft.training.data import load_prompts
    from treedraft.training.target import load_target

    target, prompts = tiny
    calls = record_engine(monkeypatch, lambda t: [7, 8, 9])
    data, out = tmp_path / "data", tmp_path / "run"
    kw = dict(data_dir=data, num_prompts=6, eval_prompts=0, max_steps=1)
    ds = load_prompts(prompts, purpose="train", limit=3)  # a cache that answers 3 of the 6
    generate.build_sequences(load_target(target), list(zip(ds["id"], ds["messages"], strict=True)),
                             cfg_of(tiny, out, **kw), data)
    assert [n for n, _ in calls] == [3]
    cache = sorted(data.glob("gen-*.jsonl"))
    before = [p.read_text() for p in cache]
    main(["train", *args(tiny, out, **kw), "--gen_cache_only=true"])
    assert [n for n, _ in calls] == [3]  # no engine call: the other three prompts are left out
    assert "replies read from the cache only: 3 of 6 prompts" in capsys.readouterr().out
    assert [p.read_text() for p in sorted(data.glob("gen-*.jsonl"))] == before
    assert (out / "final" / "config.json").is_file()


def test_cli_reports_bad_input_as_error_line(tmp_path):
    with pytest.raises(SystemExit, match=r"treedraft train: error: unknown config keys \['nope'\]"):
        main(["train", "--nope=1"])


def test_bad_inputs_fail_before_expensive_work(tiny, tmp_path, monkeypatch):
    # generation would fail loudly: every error below must come before it
    monkeypatch.setitem(generate.ENGINES, "transformers", "no_such_module:engine")
    with pytest.raises(ValueError, match=r"unknown eagle head keys \['num_heads'\]"):
        train(cfg_of(tiny, tmp_path, **{"head.num_heads": 3}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no prompts"):
        train(cfg_of(tiny, tmp_path, data=empty))
    with pytest.raises(ValueError, match=r"gave 8 prompts after prompt_offset=0, but eval_prompts=8 are held out"):
        train(cfg_of(tiny, tmp_path, eval_prompts=8))
    with pytest.raises(ValueError, match=r"8 of 8 prompts .* have >= max_seq_len=12 tokens "
                                         r".*--max-seq-len=.*--long-prompts=skip"):
        train(cfg_of(tiny, tmp_path, max_seq_len=12))
    with pytest.raises(ValueError, match="step_weights has 1 entries but there are 2 unroll"):
        train(cfg_of(tiny, tmp_path, step_weights="[1.0]"))
    with pytest.raises(ValueError, match="none of the 8 prompts has an assistant reply.*regenerate=true"):
        train(cfg_of(tiny, tmp_path, regenerate="false"))
    assert not (tmp_path / "data").exists()


def test_unroll_curriculum_deepens_to_the_full_depth(tiny, tmp_path):
    from treedraft.training.loop import curriculum_depth

    assert [curriculum_depth(p, 4, 0.5) for p in (0, 0.1, 0.2, 0.4, 0.5, 1)] == [1, 1, 2, 3, 4, 4]
    assert curriculum_depth(0.0, 4, 0.0) == 4
    train(cfg_of(tiny, tmp_path, unroll_steps=3, unroll_curriculum=0.5, max_steps=4))
    log = [json.loads(ln) for ln in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [len(r["top1"]) for r in log if "loss" in r] == [1, 2, 3, 3]  # depth per step
    with pytest.raises(ValueError, match=r"unroll_curriculum=1.5 must be in \[0, 1\]"):
        cfg_of(tiny, tmp_path, unroll_curriculum=1.5).validate()


def test_prompt_offset_skips_the_first_prompts(tiny, tmp_path):
    from treedraft.training.loop import load_rows

    train_all, held_all = load_rows(cfg_of(tiny, tmp_path, num_prompts=7, eval_prompts=1))
    rows = train_all + held_all
    train_rows, held = load_rows(cfg_of(tiny, tmp_path, num_prompts=3, eval_prompts=2,
                                        prompt_offset=2))
    assert [r[0] for r in train_rows] == [r[0] for r in rows[2:5]]
    assert [r[0] for r in held] == [r[0] for r in rows[5:7]]
    with pytest.raises(ValueError, match="after prompt_offset=7, but eval_prompts=1"):
        load_rows(cfg_of(tiny, tmp_path, prompt_offset=7))


@pytest.mark.parametrize("recipe", ["smollm2-135m-eagle", "smollm2-135m-eagle3",
                                    "smollm2-135m-medusa", "tiny-cpu",
                                    "qwen2.5-coder-0.5b-eagle3"])
def test_recipes_load_and_validate(recipe):
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "recipes" / f"{recipe}.yaml"
    cfg = load_config(path, [])
    cfg.validate()
    assert cfg.head_type in ("eagle", "medusa") and cfg.data != "mtbench"


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_vllm_generation_engine_runs_in_the_runs_serving_dtype(dtype):
    """vLLM's default is the checkpoint's dtype (bf16 for SmolLM2): ~3.5x slower on AVX2-only
    CPUs. The engine takes the run's dtype as resolved for serving on this machine (the dtype
    the head is served and evaluated with)."""
    from types import SimpleNamespace

    from treedraft.heads.machine import resolve_dtype
    from treedraft.plugin.generate import llm_kwargs

    cfg = TrainConfig(dtype=dtype, max_seq_len=100, gen_max_new_tokens=28)
    kwargs = llm_kwargs(SimpleNamespace(path="/some/target"), cfg)
    assert kwargs["dtype"] == resolve_dtype(dtype) == cfg.compute_dtype(workload="serve")
    assert kwargs["model"] == "/some/target" and kwargs["max_model_len"] == 128


def test_target_dtype_and_generation_follow_the_device_that_runs_the_work(monkeypatch):
    """auto: the target in bf16 on a GPU (16 GB for an 8B model, not 32), float32 on a CPU; the
    vLLM engine's dtype from the GPU it runs on, not the host CPU's flags; its tensor parallel
    size and memory share are the run's; a GPU without that share free is refused first."""
    from types import SimpleNamespace

    from treedraft.plugin.generate import check_gpu_memory, llm_kwargs

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cfg = TrainConfig(gen_tensor_parallel_size=2, gen_gpu_memory_utilization=0.5)
    assert cfg.target_torch_dtype("cpu") == torch.float32
    assert cfg.target_torch_dtype("cuda") == torch.bfloat16
    assert TrainConfig(target_dtype="float16").target_torch_dtype("cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = llm_kwargs(SimpleNamespace(path="/t"), cfg)
    assert kw["dtype"] == "bfloat16"
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.5
    check_gpu_memory(cfg, free=41 * 2**30, total=80 * 2**30)
    with pytest.raises(ValueError, match=r"only 10.0 of 80.0 GiB are free.*below 0.12"):
        check_gpu_memory(cfg, free=10 * 2**30, total=80 * 2**30)
    with pytest.raises(ValueError, match="target_dtype='fp8'; valid values: auto, float32"):
        TrainConfig(target_dtype="fp8").validate()


def test_replies_are_written_before_the_training_target_loads_one_copy_at_a_time(
        tiny, tmp_path, monkeypatch):
    """The generation engine loads its own copy of the target (in the generation dtype) and
    frees it; the training target (target_dtype) loads after: never two copies at once."""
    import gc
    import weakref

    from treedraft.training import target as target_mod

    real, events, copies = target_mod.load_target, [], []

    def load(*a, **kw):
        gc.collect()
        events.append((kw.get("dtype"), sum(r() is not None for r in copies)))
        loaded = real(*a, **kw)
        copies.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(target_mod, "load_target", load)
    final = train(cfg_of(tiny, tmp_path, target_dtype="bfloat16", dtype="bfloat16",
                         max_steps=2, eval_max_new_tokens=0))
    assert events == [(torch.bfloat16, 0), (torch.bfloat16, 0)]  # generation, then training
    assert load_head(final).config.layout == "eagle3"  # a new head: EAGLE-3 by default
    assert len(losses(tmp_path)) == 2


def test_export_reads_the_targets_config_and_tokenizer_not_its_weights(tmp_path, capsys):
    import shutil
    from pathlib import Path

    from safetensors import safe_open

    from treedraft.heads.shipped import resolve_head
    from treedraft.training.models import resolve_model

    real = Path(resolve_model("smollm2-135m"))
    bare = tmp_path / "bare"  # config.json and tokenizer, no weight files
    bare.mkdir()
    for f in real.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    main(["export", "smollm2-135m-eagle3", str(tmp_path / "spec"), f"--target={bare}"])
    assert "vllm serve" in capsys.readouterr().out
    head = load_head(resolve_head("smollm2-135m-eagle3"))
    state = load_file(tmp_path / "spec" / "model.safetensors")
    assert state["fc.weight"].dtype == torch.float32  # SmolLM2's checkpoint dtype
    torch.testing.assert_close(state["fc.weight"], head.fuse.weight.float(), rtol=0, atol=0)
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    main(["export", "smollm2-135m-eagle3", str(tmp_path / "spec16"), f"--target={bare}"])
    assert load_file(tmp_path / "spec16" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    # a Medusa head on the target's LM head reads that one tensor, and says so where it is absent
    with pytest.raises(SystemExit, match="pass --target the full Hugging Face folder"):
        main(["export", "smollm2-135m-medusa", str(tmp_path / "m0"), f"--target={bare}"])
    main(["export", "smollm2-135m-medusa", str(tmp_path / "medusa")])
    lm = load_file(tmp_path / "medusa" / "model.safetensors")["lm_heads.0.weight"]
    with safe_open(str(real / "model.safetensors"), framework="pt") as f:  # tied to embeddings
        assert torch.equal(lm, f.get_tensor("model.embed_tokens.weight").to(lm.dtype))


def test_replies_sharded_across_ranks_are_gathered_into_one_cache(tiny, tmp_path, monkeypatch):
    import threading

    from treedraft.training.target import open_target

    loaded, cfg, data = open_target(tiny[0]), cfg_of(tiny, tmp_path), tmp_path / "data"
    rows = [(f"p{i}", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    asked: dict[str, list] = {}

    def engine(loaded, cfg):  # a reply per prompt: its length, recorded per rank (thread)
        def generate_(prompts, temperature):
            asked.setdefault(threading.current_thread().name, []).extend(map(tuple, prompts))
            return [[len(p)] for p in prompts]
        return generate_

    monkeypatch.setattr(generate, "transformers_engine", engine)
    barrier, seqs = threading.Barrier(2, timeout=60), {}

    def rank(r: int) -> None:
        seqs[r] = generate.build_sequences(loaded, rows, cfg, data,
                                           shard=generate.Shard(r, 2, barrier.wait))

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prompts = generate.encode_prompts(loaded.tokenizer, rows, cfg)
    for r in (0, 1):  # prompt i on rank i % 2, every rank ends with every reply
        assert sorted(asked[f"rank{r}"]) == sorted(tuple(ids) for _, ids in prompts[r::2])
        assert [(s.id, s.input_ids) for s in seqs[r]] == [
            (rid, ids + [len(ids)]) for rid, ids in prompts]
    cache, = data.iterdir()  # the shards merged into the single process's cache
    single = generate.build_sequences(loaded, rows, cfg, data, generate_missing=False)
    assert [s.input_ids for s in single] == [s.input_ids for s in seqs[0]]
    # a killed torchrun run's shard counts until the next run merges it
    generate.shard_path(cache, 1).write_text('{"id": "late", "reply": [7]}\n{"id": "cu')
    assert generate.read_cache(cache)["late"] == [7]
    generate.merge_shards(cache, {})
    assert list(data.iterdir()) == [cache] and generate.read_cache(cache)["late"] == [7]
