"""The `treedraft` command end to end (real console script, real SmolLM2).

* `treedraft eval` with a randomly initialized EAGLE head: tau ~ 1 (nothing to accept), every
  metric present, and greedy outputs identical to the `--head none` plain-decoding baseline.
* Bad input stops with one clear line and a non-zero exit: unknown model, bad tree spec,
  a JSONL line with neither `prompt` nor `messages`; `treedraft eval --engine vllm` refuses a
  bad tree, a lookup tree with a head and a bad batch size before any engine starts.
* One CLI style (parse only): every flag of every subcommand is dashed; `train` and `bundle`
  hand every TrainConfig key, dashed, underscored or as its Hugging Face name, to the config
  as an override (none swallowed by a flag of their own), where the spellings set one field.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# the console script of the environment running the tests
TREEDRAFT = shutil.which("treedraft", path=str(Path(sys.executable).parent))


def run(*args: str) -> subprocess.CompletedProcess:
    assert TREEDRAFT, "the treedraft console script is not installed"
    return subprocess.run([TREEDRAFT, *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def random_eagle(tmp_path_factory) -> Path:
    from treedraft.training.target import init_head, load_target

    loaded = load_target("smollm2-135m")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("heads") / "random-eagle"
    init_head("eagle", loaded.model, loaded.tokenizer).save_pretrained(path)
    return path


@pytest.mark.slow
def test_eval_random_head_matches_plain_decoding(random_eagle, tmp_path):
    common = ["--prompts", "mtbench", "--stride", "40", "--limit", "2", "--max-new-tokens", "12"]
    spec = run("eval", "--head", str(random_eagle), "--tree", "chain:3", *common,
               "--json", str(tmp_path / "spec.json"))
    assert spec.returncode == 0, spec.stderr
    plain = run("eval", "--head", "none", *common, "--json", str(tmp_path / "plain.json"))
    assert plain.returncode == 0, plain.stderr
    s = json.loads((tmp_path / "spec.json").read_text())
    p = json.loads((tmp_path / "plain.json").read_text())
    for key in ("mean_acceptance_length", "per_position_acceptance", "num_verify_steps",
                "tokens_generated", "tree", "alpha_implied"):
        assert key in s, key
    assert s["tree"] == "chain:3" and len(s["per_position_acceptance"]) == 3
    assert 1.0 <= s["mean_acceptance_length"] < 1.1, s["mean_acceptance_length"]
    assert [o["tokens"] for o in s["outputs"]] == [o["tokens"] for o in p["outputs"]]
    assert [o["id"] for o in s["outputs"]] == ["mtbench-81", "mtbench-121"]  # 1st and 41st
    assert json.loads(spec.stdout)["tokens_generated"] == s["tokens_generated"]


def test_unknown_model_is_one_clear_line():
    r = run("model", "smollm3")
    assert r.returncode != 0
    assert "unknown model 'smollm3'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bad_tree_spec_is_refused(random_eagle):
    r = run("eval", "--head", str(random_eagle), "--tree", "chain:0", "--limit", "1")
    assert r.returncode != 0
    assert "chain:K" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_eval_vllm_refuses_bad_input_before_the_engine(random_eagle, monkeypatch):
    # each would only fail minutes later inside the engine; here: one line, no engine started
    r = run("eval", "--engine", "vllm", "--head", str(random_eagle), "--limit", "1",
            "--tree", "chain:0")
    assert r.returncode != 0 and "chain:K" in r.stderr and "Traceback" not in r.stderr
    from treedraft.scripts import engine, eval_vllm
    from treedraft.training.evaluate import EvalConfig

    monkeypatch.setattr(engine, "run_engine", None)  # calling it would fail the test
    for kw, bs, msg in [({"tree": "lookup:4"}, 16, "drafts without a head: use --head none"),
                        ({}, 0, "--batch-size 0 must be >= 1")]:
        with pytest.raises(ValueError, match=msg):
            eval_vllm.evaluate_vllm(EvalConfig(head=str(random_eagle), limit=1, **kw),
                                    batch_size=bs, progress=False)


@pytest.mark.slow
def test_export_refuses_the_eagle1_layout(tmp_path):
    r = run("export", "smollm2-135m-eagle", str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "'eagle1' layout" in r.stderr and "--head.layout=eagle3" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_medusa_for_stock_vllm(tmp_path):
    out = tmp_path / "medusa"
    r = run("export", "smollm2-135m-medusa", str(out), "--num-speculative-tokens", "5")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "this Medusa head has 4 heads" in r.stderr and "give 1..4" in r.stderr, r.stderr[-2000:]
    assert not out.exists()
    r = run("export", "smollm2-135m-eagle3", str(out), "--format", "vllm-medusa")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "holds Medusa heads" in r.stderr and "'eagle' head" in r.stderr, r.stderr[-2000:]
    r = run("export", "smollm2-135m-medusa", str(out))  # the format follows the head's type
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"method": "medusa"' in r.stdout and '"num_speculative_tokens": 4' in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 4 and cfg["original_lm_head"]


def test_eval_vllm_jobs_and_configs():
    from treedraft.scripts.eval_vllm import eval_jobs, speculative_config
    from treedraft.training.evaluate import EvalConfig, engine_summary

    assert speculative_config(None, None) is None
    assert speculative_config(None, "lookup:8") == {"method": "treedraft", "tree": "lookup:8"}
    assert speculative_config("/h", "chain:5") == {"model": "/h", "tree": "chain:5"}
    greedy = eval_jobs([[1], [2]], EvalConfig(max_new_tokens=7), 2)[0]
    assert [p.get("seed") for p in greedy["params"]] == [None, None]
    assert greedy["params"][0] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 7}
    sampled = eval_jobs([[1], [2], [3]], EvalConfig(temperature=1.0, seed=5), None)[0]
    assert [p["seed"] for p in sampled["params"]] == [5, 6, 7]  # the reference's seed + i
    # vLLM counters -> the reference's report keys: 10 steps accepting 6, 3, 1 at depths 1..3
    counts = {"drafts": 10, "draft_tokens": 30, "accepted": 10, "accepted_per_pos": [6, 3, 1],
              "accepted_by_source": {"head": 10}}
    r = engine_summary(counts, [[0] * 12, [0] * 8], "chain:3", 3)
    assert r["mean_acceptance_length"] == 2.0 and r["tokens_generated"] == 20
    assert r["per_position_acceptance"] == [0.6, 0.3, 0.1] and r["mean_tree_size"] == 3.0
    assert 0 < r["alpha_implied"] < 1


def test_bad_jsonl_line_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"text": "no prompt here"}\n')
    r = run("prompts", str(f))
    assert r.returncode != 0
    assert "line 2" in r.stderr and "prompt" in r.stderr and "messages" in r.stderr


def test_bench_configs_rows_and_table():
    from treedraft.scripts.bench import _row, markdown, speculative_config

    assert speculative_config("no-spec", "H") is None
    assert speculative_config("chain=3", "H") == {"model": "H", "num_speculative_tokens": 3}
    assert speculative_config("tree=dynamic:10,3,3", "H") == {"model": "H", "tree": "dynamic:10,3,3"}
    assert speculative_config("ngram=4", "H")["method"] == "ngram"
    assert speculative_config("tree=chain:2+lookup:8", "H") == {"model": "H", "tree": "chain:2+lookup:8"}
    assert speculative_config("tree=lookup:8", "H") == {"method": "treedraft", "tree": "lookup:8"}
    assert speculative_config("auto", "H") == {"model": "H"}  # only the head: what serve does
    assert speculative_config("auto=chain:3", "H") == {"model": "H", "tree": "auto:chain:3"}
    sched = 'spec={"tree": "chain:3", "num_speculative_tokens_per_batch_size": [[1, 4, 3]]}'
    assert speculative_config(sched, "H") == {
        "model": "H", "tree": "chain:3", "num_speculative_tokens_per_batch_size": [[1, 4, 3]]}
    with pytest.raises(ValueError, match="bench config 'bogus'"):
        speculative_config("bogus", "H")
    with pytest.raises(ValueError, match="spec= needs a JSON object"):
        speculative_config("spec=[1]", "H")
    spec = {"drafts": 2, "draft_tokens": 6, "accepted": 2, "accepted_per_pos": [2, 0, 0],
            "mean_acceptance_length": 2.0}
    row = _row("chain=3", {"batch_size": 2, "params": {"temperature": 0}},
               {"tokens": [[1, 2, 3], [4, 5]], "wave_seconds": [0.5], "spec": spec})
    assert row["tokens_per_s"] == 10 and row["tpot_ms"] == pytest.approx(500 / 3)
    assert row["acceptance_per_depth"] == [1.0, 0.0, 0.0] and row["mean_tree_size"] == 3
    assert row["accepted_by_source"] is None  # chains: vLLM verifies, no sources
    # 5 tokens in 4 passes: 2 prefills + 2 drafting steps (tokens - accepted = 3 is less)
    assert row["passes"] == 4 and row["tau_per_pass"] == 1.25
    row["speedup"] = 1.5
    assert "| chain=3 | 0 | 2 | 10.0 | 166.7 | 1.50x | 2.00 | 3.0 | 1.25 |" in markdown([row])


def test_bench_continuous_jobs_and_their_tpot():
    """--continuous: the engine queues a job's prompts (no waves); TPOT averages each request's
    seconds from submission to its last token over its tokens."""
    from treedraft.scripts.bench import _jobs, _row

    job = _jobs({"all": [[1], [2], [3]]}, (2,), (1.0,), 8, fill=False, continuous=True)[0]
    assert job["continuous"] and job["batch_size"] == 2 and len(job["prompts"]) == 3
    assert "continuous" not in _jobs({"all": [[1]]}, (2,), (1.0,), 8)[0]
    spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [],
            "mean_acceptance_length": None}
    row = _row("no-spec", job, {"tokens": [[1] * 4, [2] * 2, [3] * 4], "wave_seconds": [2.0],
                                "request_seconds": [0.8, 0.2, 1.2], "spec": spec})
    assert row["tokens_per_s"] == row["wall_tokens_per_s"] == 5.0  # no stretch at full batch
    assert row["tpot_ms"] == pytest.approx(1000 * (0.2 + 0.1 + 0.3) / 3)
    # the queue's stretch at full batch: its tokens over its seconds (two queues, one per turn)
    row = _row("no-spec", job, {"tokens": [[1] * 4, [2] * 2, [3] * 4], "wave_seconds": [2.0],
                                "request_seconds": [0.8, 0.2, 1.2],
                                "full_tokens": [4.0, 2.0, 1.0], "full_seconds": [0.25, 0.25],
                                "spec": spec})
    assert row["tokens_per_s"] == pytest.approx(14.0) and row["wall_tokens_per_s"] == 5.0



def test_interleave_plans_groups_or_a_queue():
    """scripts/interleave.py: groups of --batch prompts, the last one shorter; --continuous:
    every prompt in one generation, at most --batch of them running (the engine's queue)."""
    from treedraft.scripts.interleave import plan

    prompts = [[i] for i in range(10)]
    groups, seqs = plan(prompts, 4, continuous=False)
    assert [len(g) for g in groups] == [4, 4, 2] and sum(groups, []) == prompts and seqs == 4
    assert plan(prompts, 1, continuous=False)[1] == 4
    groups, seqs = plan(prompts, 16, continuous=False)
    assert groups == [prompts] and seqs == 16
    groups, seqs = plan(prompts, 3, continuous=True)
    assert groups == [prompts] and seqs == 3


def test_interleave_summary_pairs_prompts_against_the_first_config():
    """scripts/interleave.py: speed against the first configuration as the ratio of totals, the
    median of per-prompt ratios and the last pass alone; unequal counts are refused."""
    from treedraft.scripts.interleave import summarize

    s = summarize({"base": [2.0, 4.0, 2.0, 4.0], "fast": [1.0, 4.0, 1.0, 2.0]}, per_pass=2)
    assert s["base"] == {"seconds": 12.0, "vs_first": 1.0, "median_vs_first": 1.0,
                         "last_pass_vs_first": 1.0}
    assert s["fast"]["vs_first"] == pytest.approx(1.5)
    assert s["fast"]["median_vs_first"] == pytest.approx(2.0)  # ratios 2, 1, 2, 2
    assert s["fast"]["last_pass_vs_first"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="fast: 1 generations timed, the baseline has 2"):
        summarize({"base": [1.0, 1.0], "fast": [1.0]}, per_pass=2)


def test_interleave_op_tally_counts_a_phases_torch_ops_per_call():
    """scripts/interleave.py --ops: the ops a wrapped function ran under torch's profiler, per
    call after the warm-up calls, most self time first; what it returns is passed through."""
    import torch

    from treedraft.scripts.interleave import OP_PHASES, OpTally

    assert set(OP_PHASES) == {"drafting", "verify", "forward", "prepare"}
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    sizes = []

    def phase(n: int) -> torch.Tensor:
        sizes.append(n)
        for _ in range(n):
            x = torch.mm(a, b)
        return torch.add(x, 1.0)

    tally = OpTally(skip=1, limit=2)
    wrapped = tally.wrap(phase)
    assert wrapped(5).shape == (256, 256)  # warm-up: run, not profiled
    for _ in range(2):
        assert torch.equal(wrapped(3), torch.add(torch.mm(a, b), 1.0))
    wrapped(7)  # past the limit: run, not profiled
    assert sizes == [5, 3, 3, 7] and tally.calls == 2
    rows = {name: (calls, ms) for name, calls, ms in tally.rows()}
    assert rows["aten::mm"][0] == 3.0 and rows["aten::add"][0] == 1.0  # per call, warm-up left out
    assert all(ms >= 0 for _, ms in rows.values()) and rows["aten::mm"][1] > 0
    ranked = [ms for _, _, ms in tally.rows()]
    assert ranked == sorted(ranked, reverse=True)
    assert tally.summary().startswith("2 calls profiled: ")
    assert len(tally.rows(top=1)) == 1


def test_interleave_lockstep_slices_equal_work_in_turns():
    """scripts/interleave.py --lockstep: in every slice each engine steps until it has made the
    slice's share of tokens (or ends), the order rotating by slice; engines given the same work
    end in the same slice, so each slice's seconds are paired."""
    from treedraft.scripts.interleave import engine_labels, lockstep

    assert engine_labels(["no-spec", "chain=3", "no-spec", "no-spec"]) == [
        "no-spec", "chain=3", "no-spec #2", "no-spec #3"]  # A/A engines get their own names

    left = {"fast": 20, "slow": 20}  # tokens each engine's queue still holds
    per_step = {"fast": 3, "slow": 1}
    calls = []

    def step(c):
        calls.append(c)
        made = min(per_step[c], left[c])
        left[c] -= made
        return made

    times = lockstep(["slow", "fast"], step, lambda c: left[c] > 0, slice_tokens=6)
    assert left == {"fast": 0, "slow": 0}
    assert len(times["fast"]) == len(times["slow"]) == 4  # 6, 12, 18, 20 tokens
    assert calls.count("fast") == 7 and calls.count("slow") == 20
    # slice 1 starts with "fast" (rotation by slice index), slice 2 with "slow"
    assert calls[:3] == ["fast", "fast", "slow"] and calls[8:10] == ["slow"] * 2
    assert calls[14:16] == ["fast", "fast"]


def test_bench_rounds_alternate_and_merge_to_paired_medians():
    from treedraft.scripts.bench import markdown, merge_rounds, run_order

    # each job's rounds in a row, every configuration in turn, the order alternating throughout
    assert [(r, j + c) for r, j, c in run_order(("a", "b", "c"), ["x", "y"], 2)] == [
        (0, "xa"), (0, "xb"), (0, "xc"), (1, "xc"), (1, "xb"), (1, "xa"),
        (0, "ya"), (0, "yb"), (0, "yc"), (1, "yc"), (1, "yb"), (1, "ya")]
    assert [(r, c) for r, _, c in run_order(("a", "b"), ["x"], 3)] == [
        (0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]

    def row(config, rnd, tok_s):
        return {"config": config, "round": rnd, "prompts": "", "batch_size": 1,
                "temperature": 0.0, "tokens_per_s": tok_s, "wall_tokens_per_s": tok_s,
                "tpot_ms": 1000 / tok_s,
                "tokens": 10, "seconds": 10 / tok_s, "mean_acceptance_length": None,
                "mean_tree_size": None, "tau_per_pass": 1.0, "passes": 10, "accepted": 0,
                "drafts": 0, "draft_tokens": 0, "acceptance_per_depth": []}

    # the machine slows in round 2: no-spec 20 -> 16; auto 21 -> 16 -> 22
    rows = [row("no-spec", 0, 20.0), row("auto", 0, 21.0), row("auto", 1, 16.0),
            row("no-spec", 1, 16.0), row("no-spec", 2, 20.0), row("auto", 2, 22.0)]
    merged = {r["config"]: r for r in merge_rounds(rows, "no-spec")}
    auto = merged["auto"]
    # paired speedups 1.05, 1.0, 1.1: median 1.05 (medians of tok/s would say 21/20 = 1.05 too,
    # but the range shows what the rounds disagreed on)
    assert auto["speedup"] == pytest.approx(1.05) and auto["speedup_range"] == pytest.approx(
        [1.0, 1.1])
    assert auto["tokens_per_s"] == 21.0 and auto["round_tokens_per_s"] == [21.0, 16.0, 22.0]
    assert merged["no-spec"]["speedup"] == 1.0 and "round" not in auto
    assert "| auto | 0 | 1 | 21.0 | 47.6 | 1.05x (1.00-1.10) |" in markdown([auto])
    # counts add up over the rounds, and what derives from them is recomputed from the sums
    drafted = [{**r, "passes": 8, "accepted": a, "drafts": 4, "draft_tokens": 8,
                "acceptance_per_depth": [a / 4, 0.0]} for r, a in zip(rows, (2, 2, 4, 4, 2, 2), strict=True)]
    m = {r["config"]: r for r in merge_rounds(drafted, "no-spec")}["auto"]
    assert (m["tokens"], m["passes"], m["drafts"], m["accepted"]) == (30, 24, 12, 8)
    assert m["tau_per_pass"] == 30 / 24 and m["mean_tree_size"] == 2.0
    assert m["acceptance_per_depth"] == pytest.approx([8 / 12, 0.0])
    one = merge_rounds([row("no-spec", 0, 20.0), row("auto", 0, 21.0)], "no-spec")
    assert [r["speedup"] for r in one] == pytest.approx([1.0, 1.05])  # one round: as before
    assert "speedup_range" not in one[1]


def test_bench_tokens_per_pass_and_category_totals():
    """τ/pass counts passes that drafted nothing (lookup), which vLLM's acceptance length
    leaves out; category rows sum to a set's total; jobs per group never repeat a prompt."""
    from treedraft.scripts.bench import (
        _jobs,
        _row,
        markdown,
        prompt_sets,
        target_passes,
        tau_markdown,
        totals,
    )

    # lookup drafted in 10 of 40 passes and accepted 20 drafts: vLLM says 3.0, per pass 1.5
    assert target_passes(tokens=60, accepted=20, drafts=10, requests=2) == 40
    assert target_passes(tokens=60, accepted=40, drafts=28, requests=2) == 30  # a head: exact
    job = {"batch_size": 2, "params": {"temperature": 0}}

    def row(group, tokens, accepted, drafts):
        spec = {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted": accepted,
                "accepted_per_pos": [accepted, 0, 0, 0],
                "mean_acceptance_length": 1 + accepted / drafts,
                "accepted_by_source": {"head": 0, "lookup": accepted, "both": 0}}
        return _row("tree=lookup:4", {**job, "group": group},
                    {"tokens": [[0] * (tokens // 2)] * 2, "wave_seconds": [1.0], "spec": spec})

    rows = [row("math", 60, 20, 10), row("coding", 40, 20, 18)]
    assert [r["tau_per_pass"] for r in rows] == [1.5, 2.0]
    rows[1]["accepted_by_source"] = {"head": 5, "lookup": 15}  # a source the first lacks
    total, = totals(rows, {"mtbench": ["math", "coding"], "humaneval": ["humaneval"]})
    assert total["prompts"] == "mtbench (all)" and total["passes"] == 60  # 40 + 20
    assert total["tau_per_pass"] == pytest.approx(100 / 60)
    assert total["mean_acceptance_length"] == pytest.approx(1 + 40 / 28)
    assert total["accepted_by_source"] == {"head": 5, "lookup": 35, "both": 0}
    # per depth: P(accepted >= 1) of each group, weighted by its drafting steps
    assert total["acceptance_per_depth"] == pytest.approx([40 / 28, 0, 0, 0])
    for r in [*rows, total]:
        r["speedup"] = 1.0
    assert "| tree=lookup:4 | mtbench (all) | 0 | 2 |" in markdown([*rows, total])
    small = {**rows[0], "batch_size": 8}  # a group of 2 prompts at batch 8: one wave of 2
    assert "| tree=lookup:4 | math | 0 | 8 (≤2) |" in markdown([small, total])
    assert "| tree=lookup:4 | 1.50 | 2.00 | 1.67 |" in tau_markdown([*rows, total])
    jobs = _jobs({"math": [[1], [2], [3]], "coding": [[4]]}, (8,), (0.0,), 16, fill=False)
    assert [(j["name"], len(j["prompts"])) for j in jobs] == [("T0.0-bs8-math", 3),
                                                             ("T0.0-bs8-coding", 1)]
    assert len(_jobs({"all": [[1]]}, (8,), (0.0,), 16)[0]["prompts"]) == 8  # one set: filled
    assert prompt_sets("mtbench, humaneval") == ["mtbench", "humaneval"]
    with pytest.raises(ValueError, match="separated by commas"):
        prompt_sets("mtbench,,humaneval")


def test_bench_profile_rows_and_table():
    from treedraft.plugin.profile import delta
    from treedraft.scripts.bench import _row, profile_markdown

    before = {"step": 1.0, "prepare": 0.1, "forward": 0.5, "tree_attention": 0.2, "verify": 0.1,
              "kv_compaction": 0.05, "drafting": 0.2, "steps": 10, "tokens": 40}
    after = {"step": 3.0, "prepare": 0.2, "forward": 1.5, "tree_attention": 0.6, "verify": 0.3,
             "kv_compaction": 0.1, "drafting": 0.6, "steps": 30, "tokens": 120}
    d = delta(before, after)
    assert d["steps"] == 20 and d["other"] == pytest.approx(2.0 - 0.1 - 1.0 - 0.2 - 0.4)
    spec = {"drafts": 2, "draft_tokens": 6, "accepted": 2, "accepted_per_pos": [2, 0, 0],
            "mean_acceptance_length": 2.0}
    row = _row("tree=x", {"batch_size": 2, "params": {"temperature": 0}},
               {"tokens": [[1, 2, 3], [4, 5]], "wave_seconds": [0.5], "spec": spec, "profile": d})
    assert row["profile_ms"]["step"] == pytest.approx(100.0)  # 2 s over 20 steps
    assert row["profile_ms"]["tree_attention"] == pytest.approx(20.0)
    table = profile_markdown([row, {**row, "profile_ms": {}}])  # rows without a profile: skipped
    assert table.count("| tree=x |") == 1
    assert "| tree=x | 0 | 2 | 20 | 4.0 | 100.0 | 50.0 | 20.0 | 10.0 | 2.5 | 20.0 | 5.0 | 15.0 |" \
        in table, table


def test_bench_progress_counts_every_engine_and_round_and_closing_line():
    from treedraft.scripts.bench import PRESETS, Progress, best_speedup

    jobs = [{"prompts": [[1]] * 4, "params": {"max_tokens": 64}},
            {"prompts": [[1]] * 8, "params": {"max_tokens": 64}}]
    short = [{"prompts": [[1]] * 2, "params": {"max_tokens": 32}}]
    p = Progress({"no-spec": short, "chain=2": short, "auto": jobs}, jobs, rounds=2)
    # three engines: each its warm-up (auto's the jobs whole) and two rounds
    assert p.planned == 2 * (2 * 32 + 2 * 12 * 64) + 3 * 12 * 64
    with p:
        on_event = p.events("chain=2")
        on_event({"ready": 12.0})
        assert p.bar.n == 0 and "chain=2: engine up in 12 s" in str(p.bar)
        on_event({"job": "T0.0-bs1", "tokens": 64})
        on_event({"job": "T0.0-bs1", "tokens": 64})
        assert p.bar.n == 128 and "chain=2, T0.0-bs1" in str(p.bar)
    rows = [{"config": c, "temperature": t, "batch_size": b, "speedup": s} for c, t, b, s in [
        ("no-spec", 0, 1, 1.0), ("chain=2", 0, 1, 1.2), ("chain=2", 0, 8, 0.9),
        ("tree=x", 0, 1, 1.1), ("no-spec", 1, 1, 1.0), ("chain=2", 1, 1, 0.8)]]
    assert best_speedup(rows, "no-spec") == (
        "best speedup vs no-spec: T=0: chain=2 1.20x at batch 1; T=1: chain=2 0.80x at batch 1")
    assert PRESETS["quick"]["enforce_eager"] and not PRESETS["full"]["enforce_eager"]
    assert PRESETS["full"]["limit"] == 80 and PRESETS["full"]["max_new_tokens"] == 256


def test_bench_main_job_warms_engines_queues_and_says_what_holds():
    """The default job: every engine first runs each job untimed (short; auto's whole), a queue 4
    batches deep, two rounds; the closing lines name the fastest configuration per (T, batch)
    and where auto stands, a difference inside the rounds' ranges called none (against the
    baseline too)."""
    from treedraft.scripts.bench import (
        PRESETS,
        _jobs,
        conclusions,
        learns,
        speculative_config,
        warmup_jobs,
    )

    q = PRESETS["quick"]
    assert q["continuous"] and q["warmup"] and q["rounds"] >= 2
    jobs = _jobs({"mtbench": [[1], [2], [3]]}, (1, 8), (0.0,), 128, fill=True, continuous=True)
    assert [len(j["prompts"]) for j in jobs] == [4, 32]
    warm = warmup_jobs(jobs)
    assert [w["name"] for w in warm] == ["warmup-T0.0-bs1", "warmup-T0.0-bs8"]
    assert [w["prompts"] for w in warm] == [j["prompts"] for j in jobs]  # every prompt cached
    assert all(w["params"]["max_tokens"] == 32 and w["continuous"] for w in warm)
    assert jobs[0]["params"]["max_tokens"] == 128  # the timed jobs unchanged
    # an engine that learns its drafts (auto) warms up on every job whole: its arms measured
    full = warmup_jobs(jobs, learns=True)
    assert [(w["name"], w["prompts"], w["params"]) for w in full] == [
        (f"warmup-{j['name']}", j["prompts"], j["params"]) for j in jobs]
    learning = {c: learns(speculative_config(c, "HEAD")) for c in (
        "no-spec", "ngram=3", "chain=3", "tree=chain:2+lookup:4", "tree=lookup:8", "auto",
        "auto=dynamic:16,4,4", 'spec={"tree": "auto:chain:3"}', 'spec={"tree": "chain:3"}',
        'spec={"num_speculative_tokens_per_batch_size": [[1, 2, 3]]}',
        'spec={"method": "eagle3"}')}
    assert [c for c, yes in learning.items() if yes] == [
        "auto", "auto=dynamic:16,4,4", 'spec={"tree": "auto:chain:3"}']

    def row(config, bs, s, lo, hi):
        return {"config": config, "temperature": 0.0, "batch_size": bs, "speedup": s,
                "speedup_range": [lo, hi]}

    lines = conclusions([row("no-spec", 1, 1, 1, 1), row("chain=3", 1, 1.6, 1.5, 1.7),
                         row("auto", 1, 1.55, 1.52, 1.62), row("no-spec", 8, 1, 1, 1),
                         row("chain=3", 8, 0.9, 0.85, 0.95), row("auto", 8, 0.5, 0.45, 0.55)],
                        "no-spec", "CPU X: amx_bf16 yes")
    assert lines[0] == "On this machine (CPU X: amx_bf16 yes):"
    assert lines[1] == ("- T=0, batch 1: chain=3 is fastest, 1.60x (rounds 1.50-1.70) the speed "
                        "of no-spec; auto 1.55x (rounds 1.52-1.62): as fast within the rounds' "
                        "spread.")
    assert lines[2].startswith("- T=0, batch 8: no configuration beats no-spec (the best, "
                               "chain=3: 0.90x") and "slower beyond the rounds' spread" in lines[2]
    # a best whose rounds reach below the baseline is not called faster than it
    lines = conclusions([row("no-spec", 8, 1, 1, 1), row("auto", 8, 1.03, 0.70, 1.36)],
                        "no-spec", "CPU X")
    assert lines[1] == ("- T=0, batch 8: auto is fastest, 1.03x (rounds 0.70-1.36) the speed of "
                        "no-spec: level with no-spec within the rounds' spread.")


def test_bench_speedup_chart_bars_scale_mark_and_ranges():
    """bench.md's plot as text: a bar per configuration and (T, batch), 0.1x a character in
    eighths, `│` at 1.0x where a bar ends short of it, values aligned, the rounds' range."""
    from treedraft.scripts.bench import speedup_chart

    def row(config, t, bs, s, **kw):
        return {"config": config, "temperature": t, "batch_size": bs, "speedup": s, **kw}

    chart = speedup_chart([row("no-spec", 0.0, 1, 1.0), row("auto", 0.0, 1, 1.5,
                                                             speedup_range=[1.4, 1.6]),
                           row("ngram=4", 0.0, 1, 0.85), row("no-spec", 0.0, 16, 1.0),
                           row("auto", 0.0, 16, 0.95), row("auto", 1.0, 4, 1.0)], "no-spec")
    lines = chart.splitlines()
    assert lines[0] == "speedup vs no-spec, T=0 (█ = 0.1x, │ = 1.0x)"
    assert not any(ln.startswith("  no-spec") for ln in lines)  # the baseline has no bar
    block = lines[lines.index("batch 1") + 1 : lines.index("batch 16")]
    bars = {ln.split()[0]: ln for ln in block}
    assert bars["auto"].count("█") == 15 and bars["auto"].endswith("1.50x (1.40-1.60)")
    assert bars["ngram=4"].count("█") == 8 and "▌ │" in bars["ngram=4"]  # 0.85: 8.5 chars
    assert len({ln.index("x") for ln in block}) == 1  # the values start in one column
    below = lines[lines.index("batch 16") + 1]
    assert below.count("█") == 9 and "▌│" in below and below.endswith("0.95x")
    assert "speedup vs no-spec, T=1" in chart and "batch 4" in chart
    assert speedup_chart([row("no-spec", 0.0, 1, 1.0)], "no-spec") == ""  # nothing to plot


@pytest.mark.parametrize("slice_tokens", [0, 64])
def test_bench_reports_the_other_configs_when_one_engine_fails(tmp_path, monkeypatch, capsys,
                                                              slice_tokens):
    """An engine that dies (e.g. a baseline vLLM method at T=1) costs its own row, not the bench:
    the other configurations run and are tabled, the failure is named with its log; a failed
    baseline stops the bench (nothing to compare with). The same with the engines taking turns
    in slices (start, advance, finish per turn) and without (one run per turn). Every engine
    gets the run's seed: a new one unless given."""
    from treedraft.scripts import engine
    from treedraft.scripts.bench import bench

    calls, seeds = [], []

    class Fake:  # the engine's result format, without an engine
        def __init__(self, target_dir, spec, **kw):
            self.spec, self.log, self.jobs = spec, "engine log", {}
            seeds.append(kw["llm"]["seed"])

        def start(self, job, **kw):
            self.jobs[job["name"]] = job
            self.run([{**job, "op": "start"}])

        def advance(self, name, tokens, **kw):
            return self.run([{"name": name, "op": "advance"}])[name]["done"]

        def finish(self, name, **kw):
            return self.run([self.jobs.pop(name)])[name]

        def run(self, jobs, **kw):
            calls.append(self.spec)
            if self.spec is not None and self.spec.get("method") == "ngram":
                raise RuntimeError("vLLM engine run failed (exit 1):\nWorker failed with error 'x'")
            res = {}
            for j in jobs:
                if j.get("op"):
                    res[j["name"]] = {"done": True}
                    continue
                n, bs = len(j["prompts"]), j["batch_size"]
                res[j["name"]] = {"tokens": [[1] * j["params"]["max_tokens"]] * n,
                                  "wave_seconds": [1.0] * -(-n // bs),
                                  "spec": {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                                           "accepted_per_pos": [],
                                           "mean_acceptance_length": None}}
            return res

        def close(self):
            pass

        kill = close

    monkeypatch.setattr(engine, "Engine", Fake)
    kw = dict(prompts="mtbench", limit=2, max_new_tokens=4, batch_sizes=[1], temperatures=[0],
              out=tmp_path / "b", rounds=1, slice_tokens=slice_tokens)
    rows = bench(configs=["no-spec", "ngram=3", "chain=2"], **kw)
    # each engine warmed once, then the job's two turns (a queue of 4 at batch 1), each a run
    # or a start, one slice and a finish: the failed engine gets no second call
    per_turn = 3 if slice_tokens else 1
    assert len(calls) == 3 + 2 * 2 * per_turn
    assert {r["config"] for r in rows} == {"no-spec", "chain=2"}
    out = capsys.readouterr().out
    assert "ngram=3 FAILED" in out and "Worker failed with error 'x'" in out
    assert "FAILED, not in the table: ngram=3" in out
    assert "Worker failed" in (tmp_path / "b" / "engine-1.log").read_text()
    meta = json.loads((tmp_path / "b" / "bench.json").read_text())["meta"]
    assert meta["failed"] == ["ngram=3"]
    # every engine got the run's seed, drawn afresh (T > 0 replies differ from run to run)
    assert len(seeds) == 3 and set(seeds) == {meta["seed"]} and f"seed {seeds[0]}" in out
    seeds.clear()
    bench(configs=["no-spec", "chain=2"], **{**kw, "seed": 7})
    assert seeds == [7, 7]
    md = (tmp_path / "b" / "bench.md").read_text()  # the chart of what ran, the baseline left out
    assert "speedup vs no-spec, T=0" in md and "  chain=2 " in md and "ngram=3" not in md
    with pytest.raises(RuntimeError, match="engine run failed"):
        bench(configs=["ngram=3", "no-spec"], **kw)


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_stays_up_across_runs_and_a_failed_one_says_why():
    """`treedraft bench`'s engines: one real vLLM engine process takes job lists in turn (the
    same greedy job gives the same tokens each time; `ready` reported once), exits cleanly when
    closed; a child that dies raises with its log's end, not a hang."""
    from vllm_run import INPROC

    from treedraft.scripts.engine import Engine
    from treedraft.training.models import resolve_model

    job = {"name": "a", "prompts": [[1, 2, 3, 4]], "batch_size": 1,
           "params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}}
    events = []
    with Engine(str(resolve_model("smollm2-135m")), None, llm={"max_num_seqs": 2},
                env=INPROC) as e:
        first = e.run([job], progress=events.append)
        second = e.run([job, {**job, "name": "b"}], progress=events.append)
    assert e.proc.returncode == 0, e.log[-3000:]
    assert len(first["a"]["tokens"][0]) == 8
    assert first["a"]["tokens"] == second["a"]["tokens"] == second["b"]["tokens"]
    assert [ev for ev in events if "ready" in ev] == events[:1]
    # the same job run in slices (`treedraft bench`): the same tokens; its clock leaves out
    # the pauses between its slices
    sliced = {**job, "prompts": [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4]], "batch_size": 2,
              "continuous": True}
    with Engine(str(resolve_model("smollm2-135m")), None, llm={"max_num_seqs": 2},
                env=INPROC) as e:
        whole = e.run([{**sliced, "name": "w"}])["w"]
        e.start(sliced)
        t, slices = time.perf_counter(), 1
        while not e.advance("a", 6):  # 6 tokens a slice (3 per batch slot)
            time.sleep(0.5)
            slices += 1
        part = e.finish("a")
        wall = time.perf_counter() - t
    assert part["tokens"] == whole["tokens"] and slices >= 4
    assert part["finish_reasons"] == ["length"] * 3
    assert part["wave_seconds"][0] < wall - 0.5 * (slices - 1)
    assert part["full_seconds"] and max(part["request_seconds"]) <= part["wave_seconds"][0]
    bad = Engine(str(resolve_model("smollm2-135m")), None, llm={"no_such_argument": 1},
                 env=INPROC)
    with pytest.raises(RuntimeError, match=r"engine run failed \(exit 1\)") as err:
        bad.run([job], timeout=600)
    assert "no_such_argument" in str(err.value) and bad.proc.poll() is not None


def test_engine_whose_progress_callback_raises_is_stopped(tmp_path, monkeypatch):
    """An exception in `Engine.run`'s progress callback (a user's Ctrl-C in the bar) stops the
    child at once instead of leaving it running; the exception reaches the caller. The child
    here is a stand-in process that reports one progress event and then hangs."""
    from treedraft.scripts import engine

    child = tmp_path / "python"
    child.write_text("#!/bin/sh\necho 'TREEDRAFT_PROGRESS {\"ready\": 1.0}'\nexec sleep 600\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    e = engine.Engine("no-target", None)

    def progress(ev: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        e.run([], progress=progress, timeout=60)
    assert e.proc.poll() == -9  # killed, not left running until the timer
    assert not Path(e._request).exists()


def test_serve_bench_pairs_each_round_with_its_baseline():
    """`vllm bench serve`'s cross-check: a run's speedup is against the baseline's run of the
    same round, T and concurrency; rows hold the median and the range."""
    from treedraft.scripts.serve_bench import markdown, summarize

    runs = [{"config": c, "temperature": 0.0, "concurrency": cc, "round": r, "tokens_per_s": v}
            for c, cc, r, v in [("no-spec", 1, 0, 20.0), ("auto", 1, 0, 30.0),
                                ("auto", 1, 1, 24.0), ("no-spec", 1, 1, 16.0),
                                ("no-spec", 8, 0, 100.0), ("auto", 8, 0, 90.0)]]
    rows = {(r["config"], r["concurrency"]): r for r in summarize(runs, "no-spec")}
    auto = rows[("auto", 1)]
    assert auto["round_speedups"] == [1.5, 1.5] and auto["speedup"] == 1.5  # drift cancels
    assert auto["tokens_per_s"] == 27.0 and rows[("no-spec", 1)]["speedup"] == 1.0
    assert rows[("auto", 8)]["speedup_range"] == pytest.approx([0.9, 0.9])
    assert "| auto | 0 | 1 | 27.0 | 1.50x (1.50-1.50) |" in markdown(list(rows.values()))


def test_full_batch_window_counts_the_queue_at_full_batch_not_whole_requests():
    """A queue's rate at full batch counts what its stretch at full batch made, not the requests
    that ended in it (Little's law over those favours the fast ones: it said 13.3 here)."""
    from treedraft.scripts.engine import full_batch_window

    # batch 2, 10 tokens each: a (10 tokens/s) and b (5/s) start at 0; c (5/s) takes a's slot
    # at 1.0. Full from 0 until b ends at 2.0 (c is the last, then runs alone until 3.0): a's
    # and b's 10 tokens and half of c's, 25 tokens in 2 s (15/s, then 10/s)
    starts, ends = [0.0, 0.0, 1.0], [1.0, 2.0, 3.0]
    share, seconds = full_batch_window(starts, ends, [10, 10, 10], 2)
    assert share == pytest.approx([10.0, 10.0, 5.0]) and seconds == pytest.approx(2.0)
    assert sum(share) / seconds == pytest.approx(12.5)
    # every request at once, none refilled: full until the first ends
    share, seconds = full_batch_window([0.0, 0.0], [1.0, 4.0], [10, 20], 2)
    assert share == pytest.approx([10.0, 5.0]) and seconds == pytest.approx(1.0)
    assert full_batch_window([0.0], [1.0], [10], 2) is None  # never a full batch


def test_engines_bind_their_threads_to_the_cpus_the_process_may_use():
    """The engines treedraft starts (bench, serve_bench, the tests' engines) bind vLLM's OpenMP
    threads to the CPUs of the process's affinity: all of them, or the share taskset, a cgroup
    or a test worker (tests/conftest.py) leaves it; in vLLM's list syntax."""
    import os

    from vllm.utils.cpu_resource_utils import parse_id_list

    last = max(os.sched_getaffinity(0))
    code = ("from treedraft.scripts.engine import engine_env; "
            "print(engine_env()['VLLM_CPU_OMP_THREADS_BIND'])")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, preexec_fn=lambda: os.sched_setaffinity(0, {last}))
    assert parse_id_list(out.stdout.strip()) == [last]
    mine = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert parse_id_list(out.stdout.strip()) == mine


def test_serving_takes_the_port_it_waits_on_and_refuses_another_in_the_command(tmp_path):
    """`serving` adds `--port PORT` itself, so the port whose /health it waits for is the one
    the server listens on; a command that names a port too is refused before anything starts."""
    from treedraft.scripts.serve_bench import serving

    log = tmp_path / "serve.log"
    with pytest.raises(ValueError, match="give the port as `port`"):
        with serving(["vllm", "serve", "m", "--port", "8200"], 8201, log):
            pass
    assert not log.exists()
    # a command that exits at once: the error names the port it was given and the log's end
    with pytest.raises(RuntimeError, match="vllm serve on port 8202 exited"):
        with serving([sys.executable, "-c", "import sys; print(sys.argv[1:])"], 8202, log):
            pass
    assert "'--port', '8202'" in log.read_text()


def test_machine_command_prints_flags_and_dtype():
    from treedraft.heads.machine import default_dtype

    r = run("machine")
    assert r.returncode == 0 and "avx2" in r.stdout and "amx_bf16" in r.stdout, r.stderr
    r = run("machine", "--dtype")
    assert r.returncode == 0 and r.stdout.strip() == default_dtype()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from treedraft.scripts.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_flag_of_every_command_is_dashed():
    """One style, vLLM's (--max-model-len): no long option is spelled with underscores."""
    bad = [f"treedraft {name} {opt}" for name, p in _subparsers().items()
           for action in p._actions for opt in action.option_strings if "_" in opt]
    assert not bad, bad


@pytest.mark.parametrize("command", ["train", "bundle"])
def test_training_overrides_pass_through_in_every_spelling(command):
    import dataclasses

    from treedraft.scripts.cli import parse_args
    from treedraft.training.config import HF_ALIASES, TrainConfig, load_config, parse_overrides

    keys = [f.name for f in dataclasses.fields(TrainConfig)] + list(HF_ALIASES)
    dashed = [f"--{k.replace('_', '-')}=1" for k in keys]
    under = [f"--{k}=1" for k in keys]
    out = ["runs/b"] if command == "bundle" else []
    args = parse_args([command, *out, "--config", "r.yaml", *dashed, *under])
    # none is taken for (or as an abbreviation of) one of the command's own flags
    assert args.config == "r.yaml" and args.overrides == dashed + under
    for d, u in zip(dashed, under, strict=True):
        assert parse_overrides([d]) == parse_overrides([u]), (d, u)
    for spelling in ("--max-steps=20", "--max_steps=20"):
        assert load_config(None, parse_args([command, *out, spelling]).overrides).max_steps == 20
    assert load_config(None, parse_args([command, *out, "--learning-rate=3e-4"]).overrides).lr \
        == 3e-4


def test_commands_without_overrides_refuse_unknown_flags(capsys):
    from treedraft.scripts.cli import parse_args

    assert parse_args(["eval", "--max-new-tokens", "5"]).max_new_tokens == 5
    with pytest.raises(SystemExit):
        parse_args(["eval", "--max-steps=3"])
    assert "unrecognized arguments: --max-steps=3" in capsys.readouterr().err


def test_bench_engines_take_turns_a_slice_at_a_time():
    """`sliced_turn`: every engine starts the turn, then they advance it a slice each (the
    slice's tokens: per batch slot), the order alternating from slice to slice, an engine whose
    queue ended left out of the next ones; an engine that fails is handed to `lost` and the
    others finish the turn."""
    from treedraft.scripts.bench import sliced_turn

    log = []

    class Turns:  # an engine whose queue ends after `slices` slices (the call order recorded)
        def __init__(self, name, slices, fails=False):
            self.name, self.left, self.fails = name, slices, fails

        def start(self, job, **kw):
            log.append(("start", self.name))

        def advance(self, name, tokens, **kw):
            log.append((tokens, self.name))
            self.left -= 1
            if self.fails and self.left == 0:
                raise RuntimeError("engine run failed")
            return self.left == 0

        def finish(self, name, **kw):
            log.append(("finish", self.name))
            return {"tokens": [[self.name]]}

    turn = {"name": "T0-bs2#0", "batch_size": 2, "prompts": [[1]] * 4}
    engines = {"a": Turns("a", 3), "b": Turns("b", 2), "c": Turns("c", 3, fails=True)}
    lost = []
    res = sliced_turn(engines, turn, 10, lost=lambda c, e: lost.append(c))
    assert log[:3] == [("start", "a"), ("start", "b"), ("start", "c")]
    assert [c for t, c in log[3:] if t == 20] == ["a", "b", "c", "c", "b", "a", "a", "c"]
    assert lost == ["c"] and res == {"a": {"tokens": [["a"]]}, "b": {"tokens": [["b"]]}}
    assert log[-2:] == [("finish", "a"), ("finish", "b")]
    log.clear()
    sliced_turn({"a": Turns("a", 1), "b": Turns("b", 1)}, turn, 10, reverse=True)
    assert [c for t, c in log if t == 20] == ["b", "a"]  # the other round starts from the end


def test_bench_engines_take_turns_a_few_requests_at_a_time():
    """A job is cut into turns of about two batches, run in alternating order turn by turn, so
    that a slow spell reaches every configuration; a round's turns join into one result."""
    from treedraft.scripts.bench import run_order, turns
    from treedraft.scripts.engine import concat

    job = {"name": "T0-bs1", "batch_size": 1, "prompts": [[i] for i in range(8)]}
    parts = turns(job)
    assert [t["name"] for t in parts] == [f"T0-bs1#{i}" for i in range(4)]
    assert [t["prompts"] for t in parts] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    assert [len(t["prompts"]) for t in turns({**job, "batch_size": 8,
                                              "prompts": [[0]] * 32})] == [16, 16]
    assert [len(t["prompts"]) for t in turns({**job, "batch_size": 8,
                                              "prompts": [[0]] * 3})] == [3]
    assert [len(t["prompts"]) for t in turns({**job, "prompts": [[0]] * 5})] == [2, 3]
    # cut at whole batches (a turn of waves holds whole waves): 40 prompts at batch 8
    assert [len(t["prompts"]) for t in turns({**job, "batch_size": 8,
                                              "prompts": [[0]] * 40})] == [16, 24]
    order = [(r, t["name"][-1], c) for r, t, c in run_order(("a", "b"), parts[:2], 2)]
    assert order == [(0, "0", "a"), (0, "0", "b"), (1, "0", "b"), (1, "0", "a"),
                     (0, "1", "a"), (0, "1", "b"), (1, "1", "b"), (1, "1", "a")]

    def res(tokens, secs, drafts, accepted, per_pos, source):
        return {"tokens": tokens, "wave_seconds": [sum(secs)], "request_seconds": secs,
                "full_tokens": [float(len(t)) for t in tokens], "full_seconds": [sum(secs)],
                "logprobs": [None] * len(tokens),
                "spec": {"drafts": drafts, "draft_tokens": 3 * drafts, "accepted": accepted,
                         "preemptions": 0, "accepted_per_pos": per_pos,
                         "accepted_by_source": source,
                         "mean_acceptance_length": 1 + accepted / drafts},
                "profile": {"steps": drafts, "forward": 0.5}}

    one = concat([res([[1, 2]], [1.0], 2, 2, [2, 0], {"head": 2}),
                  res([[3], [4, 5, 6]], [0.5, 1.5], 4, 1, [1, 0, 0], {"lookup": 1})])
    assert one["tokens"] == [[1, 2], [3], [4, 5, 6]] and one["request_seconds"] == [1.0, 0.5, 1.5]
    assert one["wave_seconds"] == [1.0, 2.0] and len(one["logprobs"]) == 3
    assert one["spec"] == {"drafts": 6, "draft_tokens": 18, "accepted": 3, "preemptions": 0,
                           "accepted_per_pos": [3, 0, 0],
                           "accepted_by_source": {"head": 2, "lookup": 1},
                           "mean_acceptance_length": 1.5}
    assert one["profile"] == {"steps": 6, "forward": 1.0}
    # waves: two turns of whole waves (16 and 24 prompts at batch 8) make one row of 5 waves
    from treedraft.scripts.bench import _row

    spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [],
            "mean_acceptance_length": None}
    waves = concat([{"tokens": [[1] * 4] * n, "wave_seconds": [1.0] * (n // 8),
                     "spec": spec} for n in (16, 24)])
    row = _row("no-spec", {"batch_size": 8, "params": {"temperature": 0}}, waves)
    assert row["tokens"] == 160 and row["tpot_ms"] == 250.0
