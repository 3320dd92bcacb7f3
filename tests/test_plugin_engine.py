"""treedraft heads inside a real vLLM engine on CPU (SmolLM2, shipped heads): exact output.

One engine per configuration runs the same jobs (scripts/engine.py; the base engine in vLLM's
default processes (the script, an engine core, a worker), the others with vLLM's engine core
and worker in-process, which starts in about half the time, most of them one after another in
one child process: tests/engine_host.py, HOSTS below):
* greedy: 5 MT-bench first turns and 3 HumanEval problems of different lengths, submitted
  together (batch 8, mixed prefill and decode), 48 tokens. Chain (vLLM's rejection sampler) and
  a hybrid tree (dynamic tree + prompt-lookup branches), both drafted by the shipped EAGLE-3
  head given as a speculators-format folder (import), the shipped EAGLE head's hybrid tree under
  pressure (below), prompt lookup alone (no head) and a tree of the shipped Medusa head must be
  token-identical to vLLM without
  speculation; a divergence is tolerated only at an fp near-tie of the target (top-2 logit gap
  < 1e-3, reported), at most once. Lookup branches must have been accepted.
* pressure: the hybrid-tree engine with a KV cache of 5 blocks of 128 tokens and a 64-token
  step budget for the same 8 requests: preemption happens (counted by vLLM), the step budget
  chunks the prompts and cuts trees to a prefix (fewer scheduled than drafted nodes), and
  outputs are still identical.
* serving shapes: one batch mixing a request that runs into `max_model_len` (vLLM
  skips its drafter for the whole batch near the end; the requests beside it must still be
  answered exactly), `allowed_token_ids` with a repetition penalty, `logprobs` and a seeded sampled request whose prompt is
  prefilled in several chunks, on the pressure engine (max_model_len 512, 64-token steps) and
  without speculation: greedy outputs identical, every allowed token allowed, one logprob per
  token equal to no-speculation's, and the engine survives the seeded request.
* parameters trees cannot honour (bad_words, min_tokens, presence/frequency penalties, a JSON
  schema, prompt_logprobs) in one batch, on the tree and the chain engines: greedy tokens and
  prompt logprobs identical to no speculation; in tree mode none of them is drafted for.
* a streaming-input session (vLLM's AsyncLLM) whose second chunk asks for a repetition
  penalty after a first chunk drafted as trees: identical to no speculation.
* stock engines: vLLM's own ngram speculation with treedraft installed (its patches in the
  engine's process) and with treedraft's plugin not loaded: the same tokens, drafts and
  acceptances per depth.
* two engines in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no speculation, a tree, then
  the first engine again give identical outputs (the tree engine gets tree attention although
  vLLM cached the first engine's backend choice; no step state crosses engines).
* auto: `"tree": "auto:dynamic:10,3,3+lookup:4"` (each step's spec among fixed arms, nothing to
  the whole tree, by the tokens/s each realized) is identical too, drafted, and logged the arms
  it measured and the best.
* batch-size schedule: vLLM's `num_speculative_tokens_per_batch_size` caps the tree at 2 nodes
  at batch <= 2 and turns drafting off above; outputs are still identical, and the draft counts
  show the cap (single stream: trees of at most 2 nodes; batch 8: no drafts while all 8 run).
* bfloat16: the hybrid tree's greedy output may leave no-speculation's only
  where the token it chose is, in no-speculation's run, within BF16_ULPS ulps of the top raw
  logit (logprobs_mode raw_logits, top 5; ulps at a typical logit's magnitude at least,
  tests/near_tie.py); every divergence is printed with that gap.
* the base engine (no speculation) answers "What is the capital of France?" with Paris, and
  the treedraft plugin loaded in its engine processes (the log names their pids).
* step profile (`treedraft bench --profile`): the no-spec and lookup engines time their step
  phases per job; nested phases add up, only the tree engine drafts and runs tree attention.
* parity: single-stream (2 prompts), the acceptance vLLM counts per depth equals the offline evaluator's
  (`treedraft eval`'s reference decoder) for the same head, prompts and tree (chain:3, the
  hybrid tree, lookup alone): number of steps that drafted and accepted count at every depth
  equal within one step per prompt (vLLM may cut a request's last drafts at max_tokens; the reference does not).
  Its prompts ran in the greedy job before, so the target takes their first blocks from its
  prefix cache (in blocks of 32 tokens: tree mode): the tree engine logs that the head took its
  context there from the greedy job's draft sessions (heads/prefix.py).
* exports in stock vLLM (treedraft's plugin disabled with VLLM_PLUGINS=none): vLLM's own
  EAGLE-3 on the shipped EAGLE-3-layout head written in the speculators format, and vLLM's own
  Medusa on the shipped Medusa head written in its Medusa format: the parity job's greedy
  output equals no-speculation's and the per-depth acceptance equals the reference decoder's
  chain with the treedraft folder of the same head.
* sampling: 300 samples of the first 3 tokens of a fixed, repetitive prompt at T=0.8/top-p 0.9
  and at T=1/top-k 5; the joint distribution of the 3 tokens with speculation (chain, hybrid
  tree, and a tree spec whose head trees are chains with lookup nodes, QCHAIN, at T=1/top-k:
  tree mode draws the chains from q, grafts the lookup nodes after them and verifies the chain
  nodes against q) equals the one without (chi-square homogeneity test, significance 1e-3), and drafts
  were accepted during those jobs (so the spec path really ran). The chain samples its drafts
  from the head's q and gives q to vLLM's rejection sampler (the engine log says so); the chain
  is sampled at T=0.8/top-p only (its q path is the same code for top-k).
"""

from __future__ import annotations

import re

import pytest
import torch
from near_tie import BF16_ULPS
from scipy.stats import chi2_contingency
from vllm_run import INPROC

from treedraft.plugin.profile import PROFILE_ENV
from treedraft.scripts.engine import run_engine
from treedraft.scripts.eval_vllm import eval_jobs
from treedraft.training.evaluate import EvalConfig, engine_summary
from treedraft.training.models import resolve_model
from treedraft.training.target import encode_chat

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EAGLE = "smollm2-135m-eagle"
HYBRID = "dynamic:10,3,3+lookup:6"
QCHAIN = "dynamic:3,3,1+lookup:4"  # tree mode, the head's trees chains of 3, lookup grafted
QTREE = "static:6+lookup:4"  # a fixed shape: sampled requests draw its siblings from q
TREE = {"model": EAGLE, "tree": HYBRID}
EAGLE3 = "smollm2-135m-eagle3"  # shipped EAGLE-3-layout head (exported/imported below)
LOOKUP = {"method": "treedraft", "tree": "lookup:8"}
MEDUSA = "smollm2-135m-medusa"
MEDUSA_TREE = "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
MEDUSA_K = 4  # the shipped Medusa head's number of heads: stock vLLM drafts one token per head
SAMPLES = 300
# a short raw prompt (300 prefills stay cheap) that repeats itself, so lookup proposes too
SAMPLE_TEXT = "The sea is blue and the sky is blue. The sea is"
SCHEDULE = [[1, 2, 2], [3, 256, 0]]  # batch <= 2: at most 2 draft nodes; above: none
PARITY = 2  # single-stream prompts of the parity job (MT-bench first turns)
LONG_PROMPT = 490  # tokens: the serving job's long request reaches max_model_len 512 (pressure)
NEWLINE = 198  # SmolLM2's "\n"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PARAMS = {"topp": {"temperature": 0.8, "top_p": 0.9}, "topk": {"temperature": 1.0, "top_k": 5}}


@pytest.fixture(scope="module")
def target() -> str:
    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    from treedraft.training.data import first_turn, load_prompts

    rows = [*load_prompts("mtbench", limit=5)["messages"],
            *load_prompts("humaneval", limit=3)["messages"]]
    return [encode_chat(tokenizer, first_turn(m)) for m in rows]


def _jobs(prompts, tokenizer, sampling: bool = True) -> list[dict]:
    # parity: the job `treedraft eval --engine vllm` runs, single stream
    parity = eval_jobs(prompts[:PARITY], EvalConfig(max_new_tokens=48), 1, name="parity")
    jobs = [{"name": "greedy", "prompts": prompts, "params": {"temperature": 0, "max_tokens": 48}},
            *parity]
    if sampling:
        sample = tokenizer(SAMPLE_TEXT)["input_ids"]
        jobs += [{"name": name, "prompts": [sample],
                  "params": {**p, "max_tokens": 3, "n": SAMPLES}} for name, p in PARAMS.items()]
    return jobs


def _queued_job(prompts) -> dict:
    """The greedy job's prompts queued (`treedraft bench --continuous`): at most 3 run, the next
    joins as one finishes; every other request samples (T=1, seeded)."""
    return {"name": "queued", "prompts": prompts, "batch_size": 3, "continuous": True,
            "params": [{"temperature": 0, "max_tokens": 48} if i % 2 == 0 else
                       {"temperature": 1.0, "seed": i, "max_tokens": 48}
                       for i in range(len(prompts))]}


def _serving_job(prompts) -> dict:
    """Request shapes a server receives, in one batch (see the module docstring)."""
    long = [t for i in (5, 6, 7, 1) for t in prompts[i]][:LONG_PROMPT]
    greedy = {"temperature": 0, "max_tokens": 48}
    # constrained: the tokens of a code problem but the newline, for a chat question, and a
    # repetition penalty (the unconstrained argmax is often outside, or a repeat); seeded: a prompt that is not a prefix of the long one (no prefix-cache hit,
    # so its prefill is chunked)
    return {"name": "serving", "prompts": [long, prompts[0], prompts[1], prompts[6]],
            "params": [{"temperature": 0, "max_tokens": 64, "ignore_eos": True},
                       {**greedy, "allowed_token_ids": sorted(set(prompts[7]) - {NEWLINE}),
                        "repetition_penalty": 1.5},
                       {**greedy, "logprobs": 2},
                       {"temperature": 0.8, "seed": 7, "max_tokens": 16}]}


JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
               "required": ["answer"]}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


def _shapes_job(prompts, tokenizer) -> dict:
    """Greedy requests whose sampling parameters trees cannot honour, in one batch: each is
    sampled by vLLM's own sampler (no drafts in tree mode) and must equal no speculation."""
    capital = encode_chat(tokenizer, CAPITAL)  # a short answer: min_tokens runs past its EOS
    greedy = {"temperature": 0, "max_tokens": 32}
    return {"name": "shapes", "prompts": [prompts[2], capital, prompts[3], capital, prompts[4]],
            "params": [{**greedy, "bad_words": [" the", " The", " a"]},
                       {**greedy, "min_tokens": 24},
                       {**greedy, "presence_penalty": 1.0, "frequency_penalty": 0.5},
                       {**greedy, "structured_outputs": {"json": JSON_SCHEMA}},
                       {**greedy, "max_tokens": 16, "prompt_logprobs": 1}]}


# Engines that share a child process (tests/engine_host.py: each child pays seconds of imports
# once), in the order they are built there: no speculation first, vLLM's ngram method last,
# qchain before the other tree engines (its test reads a line vLLM logs once per process).
# VLLM_PLUGINS is read once per process, hence a child of its own for stock vLLM.
HOSTS = {"plugin": ["base_bf16", "chain", "qchain", "qtree", "tree", "pressure", "medusa", "auto",
                    "schedule", "tree_bf16", "ngram"],
         "stock": ["stock_eagle3", "stock_medusa", "ngram_stock"]}
HOST_ENV = {"plugin": {}, "stock": {"VLLM_PLUGINS": "none"}}


class Runs(dict):
    """name -> (results, log); each configuration's engine is started on first use: its host's
    engines (HOSTS) all at once, in one child, each result read as it comes."""

    def __init__(self, configs: dict):
        super().__init__()
        self.configs = configs
        self.events: dict[str, list[dict]] = {}  # name -> the engine's progress events
        self.hosts: dict[str, object] = {}

    def engine(self, name: str) -> dict:
        """The configuration's (target, spec, jobs, llm[, env]) tuple as engine keywords."""
        target, spec, jobs, llm, *env = self.configs[name]
        return {"target": target, "spec": spec, "jobs": jobs, "llm": llm,
                "env": env[0] if env else {}}

    def __missing__(self, name: str):
        from engine_host import EngineHost

        host = next((h for h, names in HOSTS.items() if name in names), None)
        if host is None:
            # base runs in vLLM's default processes (the script, an engine core and a worker;
            # the plugin loads in each), lookup with the step profile, which is installed once
            # per process (TREEDRAFT_PROFILE); tests/test_serve.py serves trees through
            # `vllm serve`
            e = self.engine(name)
            events = self.events[name] = []
            env = {**({} if name == "base" else INPROC), **e["env"]}
            self[name] = run_engine(e["target"], e["spec"], e["jobs"], llm=e["llm"],
                                    progress=events.append, env=env, background_shutdown=True)
            return self[name]
        # The others share a child (engine core and worker in-process: starts in about half
        # the time; vLLM's CPU platform calls that executor unsupported because of its OMP
        # set-up, yet every engine test passes in it)
        if host not in self.hosts:
            self.hosts[host] = EngineHost({n: self.engine(n) for n in HOSTS[host]},
                                          env=HOST_ENV[host])
        results, log, self.events[name] = self.hosts[host].get(name)
        self[name] = results, log
        return self[name]


@pytest.fixture(scope="module")
def eagle3_export(tmp_path_factory, target) -> str:
    """The shipped EAGLE-3-layout head written in the speculators format (treedraft export)."""
    from treedraft.heads.speculators import save_speculators
    from treedraft.training.target import load_head_for, load_target, target_signature

    loaded = load_target(target)
    head = load_head_for(EAGLE3, loaded.model, target_signature(loaded.model, loaded.tokenizer))
    out = tmp_path_factory.mktemp("export") / "smollm2-135m-eagle3-speculators"
    return str(save_speculators(head, out, verifier=target, num_speculative_tokens=3))


@pytest.fixture(scope="module")
def medusa_export(tmp_path_factory, target) -> str:
    """The shipped Medusa head written in vLLM's own Medusa format (treedraft export)."""
    from treedraft.heads.medusa import save_vllm_medusa
    from treedraft.training.target import load_head_for, load_target, target_signature

    loaded = load_target(target)
    head = load_head_for(MEDUSA, loaded.model, target_signature(loaded.model, loaded.tokenizer))
    return str(save_vllm_medusa(head, tmp_path_factory.mktemp("export") / "medusa-vllm"))


@pytest.fixture(scope="module")
def runs(target, prompts, tokenizer, eagle3_export, medusa_export, tmp_path_factory):
    jobs = _jobs(prompts, tokenizer)
    greedy = jobs[:1]
    serving = _serving_job(prompts)
    shapes = _shapes_job(prompts, tokenizer)
    small_kv = {"num_gpu_blocks_override": 5, "block_size": 128,  # 5 blocks of 128 tokens
                "max_model_len": 512}
    profiles = tmp_path_factory.mktemp("profile")  # step profiles (plugin/profile.py)
    capital = {"name": "capital", "prompts": [encode_chat(tokenizer, CAPITAL)],
               "params": {"temperature": 0, "max_tokens": 12}}
    runs = Runs({
        "base": (target, None, [*jobs, serving, capital, shapes], None,
                 {PROFILE_ENV: str(profiles / "base.json")}),
        # chains by an EAGLE-3 head given in the speculators format (import)
        "chain": (target, {"model": eagle3_export, "num_speculative_tokens": 3},
                  [*(j for j in jobs if j["name"] != "topk"), shapes], None,
                  {"TREEDRAFT_CACHE": str(tmp_path_factory.mktemp("cache"))}),
        # the hybrid tree drafted by an EAGLE-3 head given in the speculators format (import)
        "tree": (target, {"model": eagle3_export, "tree": HYBRID}, [*jobs, shapes], None,
                 {"TREEDRAFT_CACHE": str(tmp_path_factory.mktemp("cache"))}),
        # tree mode whose head trees are chains (what "auto" drafts for a sampling batch), with
        # lookup nodes: sampled requests draw the chains from the head's q, graft lookup nodes
        # after them, and verify_trees verifies the chains' nodes against q
        "qchain": (target, {"model": EAGLE, "tree": QCHAIN},
                   [j for j in jobs if j["name"] == "topk"], None),
        # a static tree: sampled requests draw each node's children from the head's q without
        # replacement (heads.sampling.draft_sampled_trees), verify_trees tests them against q
        "qtree": (target, {"model": EAGLE, "tree": QTREE},
                  [j for j in jobs if j["name"] == "topk"], None),
        # the same folder in stock vLLM: its own EAGLE-3, treedraft's plugin not loaded (export)
        "stock_eagle3": (target, {"method": "eagle3", "model": eagle3_export,
                                  "num_speculative_tokens": 3}, jobs[1:2], None),
        # the shipped Medusa head exported to vLLM's Medusa format, in stock vLLM (export)
        "stock_medusa": (target, {"method": "medusa", "model": medusa_export,
                                  "num_speculative_tokens": MEDUSA_K}, jobs[1:2], None),
        # vLLM's own ngram with treedraft installed, and with treedraft's plugin not loaded
        "ngram": (target, NGRAM, jobs[1:2], None),
        "ngram_stock": (target, NGRAM, jobs[1:2], None),  # VLLM_PLUGINS=none (HOST_ENV)
        "lookup": (target, LOOKUP, jobs[:2], None, {PROFILE_ENV: str(profiles / "lookup.json")}),
        "medusa": (target, {"model": MEDUSA, "tree": MEDUSA_TREE}, greedy, None),
        # preemption (5 blocks of 128 tokens) and chunked prefill cutting trees (64-token steps)
        "pressure": (target, TREE, [*greedy, serving, *jobs[1:2]],
                     {**small_kv, "max_num_batched_tokens": 64, "max_num_seqs": 8}),
        # "tree": "auto": each step's spec among fixed arms, by measured tokens/s (heads/policy.py)
        "auto": (target, {"model": EAGLE, "tree": "auto:dynamic:10,3,3+lookup:4"},
                 [*greedy, _queued_job(prompts)], None),
        "schedule": (target, {**TREE, "num_speculative_tokens_per_batch_size": SCHEDULE},
                     [jobs[1], {"name": "wide", "prompts": prompts, "params": {
                         "temperature": 0, "max_tokens": 16, "ignore_eos": True}}], None),
        # bfloat16 (vLLM's CPU default where the CPU has AMX): the hybrid tree against no
        # speculation, which reports the top-5 raw logits at every token
        "base_bf16": (target, None, [{**greedy[0], "params": {**greedy[0]["params"],
                                                              "logprobs": 5}}],
                      {"dtype": "bfloat16", "logprobs_mode": "raw_logits"}),
        "tree_bf16": (target, TREE, greedy, {"dtype": "bfloat16"}),
    })
    yield runs
    for host in runs.hosts.values():
        host.close()


def test_engine_reports_progress_as_it_runs(runs):
    """`treedraft bench` shows progress from these events: engine ready, then every wave."""
    results, _ = runs["base"]
    events = runs.events["base"]
    assert "ready" in events[0] and events[0]["ready"] > 0
    waves = events[1:]
    assert [e["job"] for e in waves] == ["greedy", *["parity"] * PARITY, "topp", "topk",
                                         "serving", "capital", "shapes"]
    for name in ("greedy", "parity"):
        got = sum(e["tokens"] for e in waves if e["job"] == name)
        assert got == sum(map(len, results[name]["tokens"])) > 0


def test_smollm2_knows_the_capital_and_every_process_loads_the_plugin(runs, tokenizer):
    """The materialized SmolLM2 answers in vLLM; the plugin loads in the engine processes."""
    results, log = runs["base"]
    text = tokenizer.decode(results["capital"]["tokens"][0], skip_special_tokens=True)
    assert "Paris" in text, text
    pids = set(re.findall(r"treedraft plugin loaded \(vLLM 0\.32\.0\S*, pid (\d+)\)", log))
    assert len(pids) >= 2, f"plugin must load in the engine processes too; saw pids {pids}"


def test_step_profile_times_each_phase(runs):
    """`treedraft bench --profile`: the worker's phase times, per job, for any engine."""
    base, tree = runs["base"][0]["greedy"]["profile"], runs["lookup"][0]["greedy"]["profile"]
    print(f"step profile, greedy job: no-spec {base}; lookup tree {tree}")
    # without drafts a step gives each request one token at most
    assert base["steps"] >= max(map(len, runs["base"][0]["greedy"]["tokens"]))
    for p in (base, tree):
        assert p["step"] > 0 and p["forward"] > 0 and p["verify"] > 0
        # nested phases: every timed phase lies inside the step, the tree parts inside theirs
        assert p["other"] > -1e-3, p
        assert p["tree_attention"] <= p["forward"] and p["kv_compaction"] <= p["verify"]
    assert base["drafting"] == base["tree_attention"] == base["kv_compaction"] == 0  # no spec
    assert tree["drafting"] > 0 and tree["tree_attention"] > 0  # lookup drafted branching trees
    # scheduled tokens per step: the trees' nodes ride along with each root
    assert tree["tokens"] / tree["steps"] > base["tokens"] / base["steps"]


def test_bf16_tree_diverges_only_where_no_speculation_is_at_a_near_tie(runs, prompts):
    """In bfloat16 a tree's rows run in other shapes than no speculation's (several rows per
    request through the target's matmuls and the attention kernel's multi-row path; the torch
    recomputation where a tree gets no scratch blocks), so a greedy tree may pick another token
    where the target's top logits are (nearly) tied.
    Every divergence from no speculation is reported with the gap, in no speculation's run,
    between its top raw logit and the logit of the token the tree chose, and fails beyond
    BF16_ULPS bfloat16 ulps of the top logit (counted at a typical logit's magnitude at least,
    tests/near_tie.py), or if that token is not in its top 5: a logic error shows up as a
    divergence at a clear gap (tens of ulps and more); measured divergences are at 0-2 ulps,
    as vLLM's own bf16 chains' are, and the bound leaves room for other CPUs' kernels."""
    from near_tie import divergences

    base = runs["base_bf16"][0]["greedy"]
    res = runs["tree_bf16"][0]["greedy"]
    assert res["spec"]["drafts"] > 0 and res["spec"]["accepted"] > 0, res["spec"]
    report = divergences(base, res)
    print(f"bf16 tree vs no speculation: {len(report)} of {len(prompts)} prompts diverge; "
          f"at each, no speculation's top logit minus the tree's token's: {report}")
    assert all(r["ulps"] <= BF16_ULPS for r in report), (
        f"a bf16 tree chose a token > {BF16_ULPS} ulps below no speculation's top logit: "
        f"{report}")


def _top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _check_identical(base: list[list[int]], got: list[list[int]], prompts, target, name: str):
    diverged = [i for i, (a, b) in enumerate(zip(base, got, strict=True)) if a != b]
    if not diverged:
        return
    from treedraft.training.target import load_target

    model = load_target(target).model
    gaps = []
    for i in diverged:
        pairs = zip(base[i], got[i], strict=False)
        k = next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(base[i]), len(got[i])))
        gaps.append((i, k, _top2_gap(model, prompts[i] + base[i][:k])))
    print(f"{name}: divergences (prompt, token index, target top-2 logit gap): {gaps}")
    assert len(gaps) <= 1 and all(g < 1e-3 for *_, g in gaps), (
        f"{name} output differs from no-speculation beyond fp near-ties: {gaps}")


@pytest.mark.parametrize("name", ["chain", "tree", "lookup", "medusa", "pressure",
                                  "stock_eagle3", "stock_medusa", "auto"])
def test_greedy_outputs_identical_to_no_speculation(runs, name, prompts, target):
    job = "parity" if name.startswith("stock_") else "greedy"  # stock vLLM: the parity job only
    base = runs["base"][0][job]["tokens"]
    res = runs[name][0][job]
    assert all(0 < len(t) <= 48 for t in res["tokens"])
    _check_identical(base, res["tokens"], prompts, target, name)
    assert res["spec"]["drafts"] > 0, "speculation never ran"
    if name == "pressure":
        assert res["spec"]["preemptions"] > 0, "the small KV cache did not force preemption"
        # some trees were scheduled only in part
        assert res["spec"]["draft_tokens"] < 16 * res["spec"]["drafts"]  # 10 head + 6 lookup
    if name in ("tree", "lookup"):  # /metrics by source: every accepted token has one
        by_source = res["spec"]["accepted_by_source"]
        assert sum(by_source.values()) >= res["spec"]["accepted"] > 0, res["spec"]
        assert by_source["lookup"] + by_source["both"] > 0, by_source  # lookup was accepted
        if name == "lookup":  # no head: every accepted draft came from prompt lookup
            assert by_source["head"] == by_source["both"] == 0, by_source
    if name == "stock_eagle3":  # vLLM's own EAGLE-3 ran our export and accepted its drafts
        log = runs[name][1]
        assert "Eagle3LlamaForCausalLM" in log and "method='eagle3'" in log
        assert "custom_class" not in log and "TreeDraftProposer" not in log
        assert res["spec"]["accepted"] > 0
    elif name == "stock_medusa":  # vLLM's own Medusa ran our export and accepted its drafts
        log = runs[name][1]
        assert "method='medusa'" in log, log[-3000:]
        assert "custom_class" not in log and "TreeDraftProposer" not in log
        assert res["spec"]["accepted"] > 0
    elif name not in ("chain", "auto"):  # trees were drafted: more draft tokens than verify steps
        assert res["spec"]["draft_tokens"] > res["spec"]["drafts"]
    if name == "auto":  # the policy measured its arms and said which it found best
        log = runs[name][1]
        said = re.findall(r"treedraft auto: batch <= (\d+), (greedy|sampled): best (\S+); "
                          r"tokens/s per request by arm: ([^;]*); steps so far by arm: (.*)",
                          log)
        assert said, log[-3000:]
        measured = 0  # the most arms one line ranked
        first = {}  # per sampling class, its first line's (rates, steps)
        for line in said:  # each line's best is the fastest arm it measured in that context
            rates = dict(re.findall(r"(\S+) ([\d.]+)(?:,|$)", line[3]))
            steps = dict(re.findall(r"(\S+) (\d+)(?:,|$)", line[4]))
            assert line[2] in rates, line
            assert float(rates[line[2]]) == max(map(float, rates.values())), line
            assert steps and all(int(n) > 0 for n in steps.values()), line
            measured = max(measured, len(rates))
            first.setdefault(line[1], (rates, steps))
        assert measured >= 2, said  # it measured more than drafting nothing somewhere
        # a class's first context starts at drafting nothing (later ones start at the best of
        # the nearest measured context): its first line has measured that arm alone
        for rates, steps in first.values():
            assert list(rates) == ["none"] and "none" in steps, first


def test_auto_under_a_queue_of_greedy_and_sampled_requests(runs, prompts, target):
    """auto with requests joining a running batch as others finish (continuous batching), greedy
    and sampled ones mixed (each temperature class with its own arms, heads/policy.py): the
    greedy ones are answered as without speculation, the queue ran at most 3 at a time."""
    base = runs["base"][0]["greedy"]["tokens"]
    res = runs["auto"][0]["queued"]
    greedy = range(0, len(prompts), 2)
    _check_identical([base[i] for i in greedy], [res["tokens"][i] for i in greedy],
                     [prompts[i] for i in greedy], target, "auto, queued")
    assert all(len(t) == 48 or res["finish_reasons"][i] == "stop"
               for i, t in enumerate(res["tokens"]))
    assert len(res["request_seconds"]) == len(prompts) and len(res["wave_seconds"]) == 1
    # a queue of 3: the job took longer than any one request, less than all of them in a row
    assert max(res["request_seconds"]) < res["wave_seconds"][0] < sum(res["request_seconds"])
    # the queue's stretch at full batch (treedraft bench's rate): shorter than the job, every
    # request's share of it at most its tokens, the first request's whole but for the moments
    # it took to submit the next two (the stretch starts at the third submission: on a loaded
    # 2-core machine a few ms, 0.1 % of the request's life in one CI run)
    (seconds,), share = res["full_seconds"], res["full_tokens"]
    assert 0 < seconds < res["wave_seconds"][0] and len(share) == len(prompts)
    assert all(0 <= s <= len(t) + 1e-9 for s, t in zip(share, res["tokens"], strict=True))
    assert share[0] == pytest.approx(len(res["tokens"][0]), rel=0.02)
    assert res["spec"]["drafts"] > 0


def test_serving_request_shapes_answered_exactly(runs, prompts, target):
    base, res = runs["base"][0]["serving"], runs["pressure"][0]["serving"]
    job = _serving_job(prompts)
    room = 512 - LONG_PROMPT  # the long request stops at max_model_len on the pressure engine
    assert len(res["tokens"][0]) == min(room, len(base["tokens"][0])), res["finish_reasons"]
    expect = [base["tokens"][0][:room], *base["tokens"][1:3]]
    _check_identical(expect, res["tokens"][:3], job["prompts"], target, "serving")
    allowed = set(job["params"][1]["allowed_token_ids"])
    assert res["tokens"][1] and set(res["tokens"][1]) <= allowed, res["tokens"][1]
    # logprobs: one per generated token, the target's own (equal to no speculation's)
    got, ref = res["logprobs"][2], base["logprobs"][2]
    assert got is not None and len(got) == len(res["tokens"][2]) and None not in got, got
    if res["tokens"][2] == base["tokens"][2]:
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), atol=1e-3), (got, ref)
    # the seeded request, prefilled in 64-token chunks, is answered (vLLM rewinds its generator
    # with set_offset, which CPU generators lack: plugin/runner.py sample_tokens)
    assert len(res["tokens"][3]) == 16 and res["finish_reasons"][3] == "length"
    assert res["spec"]["drafts"] > 0  # trees were verified in the same batches


@pytest.mark.parametrize("name", ["tree", "chain"])
def test_parameters_trees_cannot_honour_are_answered_exactly(runs, name, tokenizer):
    """bad_words, min_tokens, presence/frequency penalties, structured output (JSON schema) and
    prompt_logprobs beside each other: greedy tokens identical to no speculation (fp32: no
    tolerance), the JSON answer parses, prompt logprobs equal, no banned word generated."""
    import json

    base, res = runs["base"][0]["shapes"], runs[name][0]["shapes"]
    assert res["tokens"] == base["tokens"], [tokenizer.decode(t) for t in res["tokens"]]
    text = tokenizer.decode(res["tokens"][0])
    assert not any(w in text for w in (" the ", " The ")), text
    assert len(res["tokens"][1]) >= 24  # min_tokens: past the answer's end of turn
    assert "answer" in json.loads(tokenizer.decode(res["tokens"][3], skip_special_tokens=True))
    got, ref = res["prompt_logprobs"][4], base["prompt_logprobs"][4]
    assert got is not None and len(got) == len(ref) and got[0] is None
    assert torch.allclose(torch.tensor(got[1:]), torch.tensor(ref[1:]), atol=1e-4)
    if name == "tree":  # tree mode drafts for none of these requests
        assert res["spec"]["drafts"] == 0


def test_streaming_session_that_changes_parameters_mid_request_is_exact(target, tokenizer):
    """A streaming-input session (one request id, prompt chunks with their own SamplingParams):
    its first chunk is drafted for as a tree, its second asks for a repetition penalty, which
    trees cannot honour. vLLM replaces the request's SamplingParams; the proposer reads them
    again (it stops drafting) and the root row's penalty history holds no unverified drafts, so
    the whole session equals no speculation token for token (fp32, greedy)."""
    from stream_session import run_session

    chunks = [{"prompt": tokenizer(SAMPLE_TEXT)["input_ids"],
               "params": {"temperature": 0, "max_tokens": 16}},
              {"prompt": tokenizer(" Again, the sea is blue and the sky is")["input_ids"],
               "params": {"temperature": 0, "max_tokens": 16, "repetition_penalty": 1.8}}]
    base, _ = run_session(target, None, chunks)
    got, _ = run_session(target, {"model": EAGLE, "tree": "dynamic:10,3,3"}, chunks)
    assert len(base) > 16 and got == base, (tokenizer.decode(got), tokenizer.decode(base))


def test_stock_spec_decoding_is_untouched_by_the_installed_plugin(runs):
    """vLLM's own ngram speculation with treedraft installed (its plugin loaded in the engine)
    and without it (VLLM_PLUGINS=none): the same tokens, drafts and acceptances per depth."""
    with_plugin, stock = runs["ngram"][0], runs["ngram_stock"][0]
    # in-process engines: the plugin's patches are in the engine's process, or not at all
    assert runs.events["ngram"][0]["treedraft_patches"] > 0
    assert runs.events["ngram_stock"][0]["treedraft_patches"] == 0
    assert with_plugin["parity"]["tokens"] == stock["parity"]["tokens"]
    a, b = with_plugin["parity"]["spec"], stock["parity"]["spec"]
    assert a["drafts"] > 0 and a["accepted"] > 0
    assert (a["drafts"], a["accepted"], a["accepted_per_pos"]) == (
        b["drafts"], b["accepted"], b["accepted_per_pos"])


def test_batch_size_schedule_caps_drafts(runs, prompts, target):
    base, res = runs["base"][0], runs["schedule"][0]
    _check_identical(base["parity"]["tokens"], res["parity"]["tokens"], prompts, target,
                     "parity")
    single = res["parity"]["spec"]
    assert single["drafts"] > 0 and single["accepted"] > 0, single
    assert single["drafts"] < single["draft_tokens"] <= 2 * single["drafts"], single
    # 8 requests that run together to the end (ignore_eos): drafts only in the first steps,
    # while the engine (its own process) has not received all 8 yet; 16 steps otherwise
    wide = res["wide"]
    assert wide["spec"]["drafts"] <= 3, wide["spec"]
    assert wide["spec"]["draft_tokens"] <= 2 * wide["spec"]["drafts"], wide["spec"]
    assert all(len(t) == 16 for t in wide["tokens"])
    for b, w in zip(base["greedy"]["tokens"], wide["tokens"], strict=True):
        assert w[: len(b)] == b[:16]


REFERENCE: dict[tuple, dict] = {}  # (head, tree) -> the reference decoder's parity report


# chain and tree: the EAGLE-3 head imported from the speculators format; pressure: the shipped
# EAGLE head's hybrid tree (treedraft folder) under a 64-token step budget; stock_eagle3 / stock_medusa: vLLM's own EAGLE-3 / Medusa on the exported folder; all against
# the reference decoder on the treedraft folder of the same head
@pytest.mark.parametrize("name, tree, head_name", [
    ("chain", "chain:3", EAGLE3), ("tree", HYBRID, EAGLE3), ("pressure", HYBRID, EAGLE),
    ("lookup", LOOKUP["tree"], None),
    ("stock_eagle3", "chain:3", EAGLE3), ("stock_medusa", f"chain:{MEDUSA_K}", MEDUSA)])
def test_acceptance_per_depth_matches_offline_evaluator(runs, name, tree, head_name, target,
                                                        torch_threads):
    from treedraft.training.data import load_prompts
    from treedraft.training.evaluate import run_eval
    from treedraft.training.target import load_head_for, load_target, target_signature

    rows = load_prompts("mtbench", limit=PARITY)
    key = (head_name, tree)  # chain and stock_eagle3 share the same reference run
    if key not in REFERENCE:
        loaded = load_target(target)
        head = (load_head_for(head_name, loaded.model,
                              target_signature(loaded.model, loaded.tokenizer))
                if head_name else None)
        REFERENCE[key] = run_eval(loaded, head, list(zip(rows["id"], rows["messages"],
                                                         strict=True)),
                                  tree=tree, max_new_tokens=48, progress=False)
    ref = REFERENCE[key]
    res = runs[name][0]["parity"]
    spec = res["spec"]
    ref_counts = [round(r * ref["num_verify_steps"]) for r in ref["per_position_acceptance"]]
    steps = ref["num_drafting_steps"]  # vLLM counts steps that drafted (lookup may find none)
    got = spec["accepted_per_pos"][: len(ref_counts)]
    print(f"{name}: vLLM steps {spec['drafts']} per-depth {got}; reference steps {steps} "
          f"per-depth {ref_counts}")
    # Expected equal; tolerance: one verify step per prompt (vLLM's scheduler may cut the drafts
    # of a request's last step at max_tokens, which the reference decoder does not do).
    tol = len(rows)
    assert abs(spec["drafts"] - steps) <= tol
    assert all(abs(g - r) <= tol for g, r in zip(got, ref_counts, strict=True))
    assert sum(spec["accepted_per_pos"][len(ref_counts):]) == 0
    # `treedraft eval --engine vllm`'s report of this job: the reference's tau over the steps
    # that drafted, within the same tolerance
    report = engine_summary(spec, res["tokens"], tree, ref["tree_depth"])
    ref_tau = 1 + sum(ref_counts) / steps
    assert abs(report["mean_acceptance_length"] - ref_tau) <= tol * ref["tree_depth"] / steps
    assert report["tokens_generated"] == ref["tokens_generated"]
    if name == "tree":  # parity's prompts ran in the greedy job before: the target took their
        # first 32-token blocks from its prefix cache (tree mode's CPU block size; the chain
        # engine's blocks of 128 are longer than these prompts), the head its context there
        # (without it these requests draft with no context before the hit)
        assert "started after a prefix-cache hit" in runs[name][1]
    if name in ("chain", "stock_eagle3", "stock_medusa"):  # the head's drafts were accepted
        assert ref["accepted_by_source"]["head"] > 0
    else:  # the lookup branches were accepted too
        by_source = ref["accepted_by_source"]
        assert by_source["lookup"] + by_source["both"] > 0, by_source


# the chain's q path is the same code for both settings: top-p only there (CI time)
@pytest.mark.parametrize("name, job", [("chain", "topp"), ("tree", "topp"), ("tree", "topk"),
                                       ("qchain", "topk"), ("qtree", "topk")])
def test_sampled_distribution_equals_no_speculation(runs, name, job):
    base = [tuple(t) for t in runs["base"][0][job]["tokens"]]
    res = runs[name][0][job]
    spec = [tuple(t) for t in res["tokens"]]
    assert len(base) == len(spec) == SAMPLES
    assert res["spec"]["accepted"] >= 25, f"too few accepted drafts to test: {res['spec']}"
    cats = sorted(set(base) | set(spec))
    table = [[base.count(c) for c in cats], [spec.count(c) for c in cats]]
    keep = [j for j in range(len(cats)) if table[0][j] + table[1][j] >= 10]
    rare = [j for j in range(len(cats)) if j not in keep]
    rows = [[r[j] for j in keep] + [sum(r[j] for j in rare)] for r in table]
    rows = [r[:-1] for r in rows] if rows[0][-1] + rows[1][-1] == 0 else rows
    p = chi2_contingency(rows).pvalue
    print(f"{name}/{job}: {len(keep)} categories, p = {p:.3g}, spec {res['spec']}")
    assert p > 1e-3
    if name == "chain":  # sampled chains drafted from q and handed q to the rejection sampler
        assert "pass q to vLLM's rejection sampler as draft probabilities" in runs[name][1]
    if name == "qchain":  # tree mode drew chains from q and verified them against q, with
        # lookup nodes grafted after them (one-hot proposals) accepted too
        assert "tree mode verifies head chains drawn from the head's q against q" in runs[name][1]
        by_source = res["spec"]["accepted_by_source"]
        assert by_source["head"] > 0 and by_source["lookup"] + by_source["both"] > 0, by_source
    if name == "qtree":  # siblings drawn from q without replacement, verified against q
        assert "tree mode verifies head trees drawn from the head's q" in runs[name][1]
        assert res["spec"]["accepted_by_source"]["head"] > 0


def test_two_engines_in_one_process_stay_exact(target, prompts):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from treedraft.scripts.engine import engine_env

    request = {"target": target, "spec": TREE, "prompts": prompts[:3], "max_tokens": 24}
    env = {**engine_env(), **INPROC}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("two_engines.py")),
                           json.dumps(request)], capture_output=True, text=True, timeout=900,
                          env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TREEDRAFT_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    first, tree, again, drafts = json.loads(lines[-1].split(" ", 1)[1])
    assert drafts > 0, "the tree engine never drafted"
    _check_identical(first, tree, prompts[:3], target, "tree after a plain engine")
    assert again == first, "the plain engine changed after a tree engine ran in its process"
