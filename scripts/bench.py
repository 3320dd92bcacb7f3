"""`treedraft bench`: vLLM without speculation, vLLM ngram, our head as a chain (vLLM's own
rejection sampler) and treedraft trees, side by side in one invocation.

    treedraft bench                  # the main job (10-26 min on 2 cores): 8 MT-bench questions
    treedraft bench --full           # full MT-bench: 80 first turns x 256 tokens, bs 1..32 (hours)
    treedraft bench --limit 2 --max-new-tokens 32 --batch-sizes 1 --temperatures 0   # a look
    treedraft bench --stride 10 --limit 8 --batch-sizes 1 --config no-spec --config chain=1
    treedraft bench --target HF_FOLDER --head HEAD_DIR --config 'tree=dynamic:16,4,4'
    treedraft bench --profile ...    # + where each engine step's time goes (OUT/profile.md)
    treedraft bench --waves ...      # waves of batch-size requests instead of a queue
    treedraft bench --prompts mtbench,humaneval --by-category ...   # τ per MT-bench category

Each configuration runs in its own engine process (scripts/engine.py's `Engine`; with slices,
below, vLLM's engine core runs inside that process, so that it steps only when asked), all of
them up at once, over MT-bench first turns for every batch size and temperature: by default a
queue (below) at least 4 batches deep (with one prompt group, prompts are cycled to fill it).
Every engine first runs an untimed warm-up of each job's shape at 32 tokens per request
(`warmup_jobs`: the engine's code paths and row counts warm, as in a server that has been
running), `auto`'s engine every job whole (its arms measured in each job's contexts;
`--no-warmup` times every engine from its first request); then the engines take turns on each
part of each job a slice at a time (`turns`, `sliced_turn`, below). One progress bar shows
which engine and job run, tokens so far and an estimate of what is left. Writes OUT/bench.json (tokens/s, TPOT, mean
acceptance length, per-depth acceptance, speedup vs no-spec per row, the machine), OUT/bench.md
(the table and `speedup_chart`, the speedups as text bars) and two PNG plots (speedup vs batch
size; acceptance per depth); prints the table
and the best speedup, then one sentence per (T, batch) saying what holds on this machine
(`conclusions`). Rows also hold `tau_per_pass` (tokens per
target pass, `target_passes`), which unlike vLLM's mean acceptance length counts the passes where
prompt lookup drafted nothing. Several prompt sets (`mtbench,humaneval`) give one row per set;
`by_category` one per MT-bench category plus each set's total (`totals`) and a table of
tokens per pass by category in OUT/bench.md.

The queue (`--continuous`, the default): every prompt of a job is queued and at most `batch
size` of them run at once, the next starting as soon as one finishes (what a server with a queue does:
vLLM's continuous batching). Waves end with their slowest request, so a configuration that
finishes some requests early (lookup on a repetitive reply) gains nothing there until the
wave ends, while a queue refills the batch at once; `auto` maximises tokens per second of the
running batch, what a queue measures. A queue's tokens/s (and so its speedup) is its rate while
the batch is full, what a server under steady load delivers: the tokens made from the
`batch size`-th submission to the first end after the queue emptied, over those seconds
(scripts/engine.py's `full_batch_window`; each request's tokens counted pro rata of its life
inside that stretch). The drain would otherwise count against speculation alone:
every request asks for the same number of tokens (`ignore_eos`), so without speculation a
batch's requests end in the same step and the queue never drains, while speculation ends them
steps apart and the last ones run at a smaller batch. `wall_tokens_per_s` in bench.json is the
whole job's tokens over its wall time. TPOT is each request's seconds from submission to its
last token over its tokens, averaged. `--waves`: requests in waves of the batch size instead (with
several prompt groups each prompt runs once and a group smaller than the batch runs as one
smaller wave: the batch column then says `8 (≤3)`); TPOT is then wave wall time / the wave's
longest output.

`--rounds N` (default 2): every job is cut into turns of about two batches (`turns`: 8
prompts at batch 1 make 4 turns of 2, a queue of 32 at batch 8 two of 16); every turn runs N
times in a row. A queue's turn is a queue of its own (the batch fills, refills as requests end,
drains), its rate taken while its batch is full. Each time, every engine runs the turn's queue
in slices of `--slice-tokens` (default 64) output tokens per batch slot, the engines taking
turns slice by slice, the order alternating (A B C, C B A, ...; `sliced_turn`); each engine's
clock runs only in its own slices (scripts/engine.py's `Sliced`). A 2-core machine's speed
moves by 10-30 % over seconds to minutes; a slice is a second or a few, so a slow or fast spell
reaches every configuration alike, where whole turns (seconds to tens of seconds each) let one
configuration run its turns of two rounds back to back inside one spell. `--slice-tokens 0`
runs each turn whole on every engine in turn instead, the order alternating from round to round
(A B C, C B A; `run_order`), each engine's core in its own process as `vllm serve` runs it. A
round of a job is each of its turns once, its results joined (`engine.concat`); each row holds
the median tokens/s over the rounds and the median of the per-round speedups (each against the
baseline's run of the same job and round), with their range (`speedup_range`, shown in the table
as `1.02x (0.97-1.05)`) and every round's figures (`round_tokens_per_s`); `merge_rounds`. The
engines sit idle while another runs (on a GPU each gets 0.9 / n of its memory).

`--seed` (vLLM's seed, the same for every engine; default a new one per run, printed and kept
in bench.json's meta): at T > 0 a configuration's replies are its own draw (speculation changes
how the random numbers are used, so no two configurations sample the same text), and the text
drawn moves a row's speed by several percent at batch 1 (on MT-bench at T=1 two fixed chains'
16 replies accepted their first draft node 47 % and 39 % of steps, scripts/BENCHMARKS.md). Each
round draws new replies, so the rounds' range holds that; a fresh seed per run makes two runs
differ by it too, where one seed for every run would draw every fixed configuration the same
replies each time (`--seed N` does, to repeat a run).

`--profile`: every engine's worker times its step phases (plugin/profile.py: prepare, target
forward, tree attention inside it, verification, KV compaction inside it, drafting, the rest);
rows gain `profile_ms` (milliseconds per engine step) and OUT/profile.md holds the table.

dtype: `auto` (default) is this machine's choice (heads/machine.py): bfloat16 where the CPU
has AMX/AVX512-BF16, float32 on AVX2-only CPUs, where vLLM's bf16 runs several times slower;
`--dtype` overrides it. The main job runs engines eager (each compiled engine takes minutes
to start on a 2-core CPU); `--full` compiles, as `vllm serve` does by default.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

# Presets: the quick default (the README's main job) and the full MT-bench run. Every explicit
# argument of `bench` / `treedraft bench` overrides its preset value.
PRESETS = {
    "quick": {"limit": 8, "stride": 10, "max_new_tokens": 96, "batch_sizes": (1, 8),
              "temperatures": (0.0, 1.0), "enforce_eager": True,
              "rounds": 2, "continuous": True, "warmup": True, "slice_tokens": 64,
              "configs": ("no-spec", "chain=3", "tree=chain:2+lookup:4", "auto")},
    "full": {"limit": 80, "stride": 1, "max_new_tokens": 256, "batch_sizes": (1, 4, 16, 32),
             "temperatures": (0.0, 1.0), "enforce_eager": False,
             "rounds": 1, "continuous": True, "warmup": True, "slice_tokens": 64,
             # small trees: on a CPU every verified token costs compute
             "configs": ("no-spec", "ngram=4", "chain=3", "tree=static:10",
                         "tree=dynamic:10,3,3", "tree=lookup:8",
                         "tree=dynamic:10,3,3+lookup:8", "auto")},
}


def prompt_sets(prompts: str) -> list[str]:
    """'mtbench,humaneval' -> ['mtbench', 'humaneval'] (each set gets --stride and --limit)."""
    names = [p.strip() for p in prompts.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"--prompts {prompts!r}: give prompt sets separated by commas, each "
                         "once (mtbench, humaneval, sharegpt or FILE.jsonl), e.g. mtbench,humaneval")
    return names


def speculative_config(config: str, head: str) -> dict | None:
    """'no-spec' | 'ngram=K' | 'chain=K' | 'tree=SPEC' | 'auto[=SPEC]' | 'spec=JSON' -> vLLM's
    speculative_config.

    tree=SPEC takes hybrid specs ('dynamic:10,3,3+lookup:8') and lookup alone ('lookup:8').
    auto is what `vllm serve` does when only the head is named (each step's node budget chosen
    from measured cost, at most the head's default tree); auto=SPEC drafts at most SPEC.

    spec=JSON is any --speculative-config dict ("model" defaults to the benchmarked head), e.g.
    'spec={"tree": "chain:3", "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 0]]}'.
    """
    kind, _, arg = config.partition("=")
    if kind == "no-spec":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(arg or 4),
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if kind == "chain":
        return {"model": head, "num_speculative_tokens": int(arg or 4)}
    if kind == "tree":
        if arg.strip().startswith("lookup:"):  # prompt lookup alone: no head
            return {"method": "treedraft", "tree": arg}
        return {"model": head, "tree": arg}
    if kind == "auto":
        return {"model": head, **({"tree": f"auto:{arg}"} if arg else {})}
    if kind == "spec":
        try:
            sc = json.loads(arg)
        except json.JSONDecodeError as e:
            raise ValueError(f"bench config {config!r}: spec= needs a JSON object ({e})") from e
        if not isinstance(sc, dict):
            raise ValueError(f"bench config {config!r}: spec= needs a JSON object")
        return {"model": head, **sc}
    raise ValueError(f"bench config {config!r}: use no-spec, ngram=K, chain=K, tree=SPEC, "
                     "auto[=SPEC] or spec=JSON")


def _jobs(groups: dict[str, list[list[int]]], batch_sizes, temperatures,
          max_new_tokens: int, fill: bool = True, continuous: bool = False) -> list[dict]:
    """One job per temperature, batch size and prompt group (named `T{t}-bs{bs}`, plus
    `-{group}` when there are several groups). fill: cycle the prompts to fill a wave (a queue:
    4 batches); continuous: the engine queues the prompts, at most the batch size running (no
    waves)."""
    jobs = []
    for t in temperatures:
        for bs in batch_sizes:
            for group, prompts in groups.items():
                # a queue at least 4 batches deep: a batch refills as requests finish
                n = max(len(prompts), 4 * bs if continuous else bs) if fill else len(prompts)
                wave = [prompts[i % len(prompts)] for i in range(n)]
                name = f"T{t}-bs{bs}" + (f"-{group}" if len(groups) > 1 else "")
                jobs.append({"name": name, "group": group, "prompts": wave, "batch_size": bs,
                             "params": {"temperature": t, "max_tokens": max_new_tokens,
                                        "ignore_eos": True},
                             **({"continuous": True} if continuous else {})})
    return jobs


def warmup_jobs(jobs: list[dict], tokens: int = 32, learns: bool = False) -> list[dict]:
    """Untimed jobs an engine runs first: each job (batch size, temperature, queue or waves,
    every prompt: each engine's prefix cache holds them all) at `tokens` tokens per request, so
    that the timed jobs find the engine's code paths and row counts warm, as in a server that
    has been running. An engine that `learns` which drafts pay (`auto`) runs every job whole
    instead (a round's work, ~200 steps a job at batch 1): its policy has measured its arms in each job's contexts by then, as a server's
    has after its first minute under that load. Timed from its first request, `auto` spends most
    of a round measuring its arms (pass 1 of `scripts/interleave.py` shows that cost)."""
    if learns:
        return [{**j, "name": f"warmup-{j['name']}"} for j in jobs]
    return [{**j, "name": f"warmup-{j['name']}",
             "params": {**j["params"], "max_tokens": min(tokens, j["params"]["max_tokens"])}}
            for j in jobs]


def run_seed(seed: int | None) -> int:
    """The seed a run's engines get: `seed`, or where None a new one (at T > 0 each run then
    samples replies of its own: the module doc's `--seed`)."""
    return random.SystemRandom().randrange(2**31) if seed is None else seed


def learns(spec: dict | None) -> bool:
    """Whether an engine with this speculative config chooses its drafts from what it measures:
    a treedraft head under "auto" (plugin.config.asks_auto, the rule the plugin applies)."""
    from treedraft.plugin.config import asks_auto

    return (bool(spec) and spec.get("method") in (None, "treedraft") and "model" in spec
            and asks_auto(spec.get("tree"), spec))


def target_passes(tokens: int, accepted: int, drafts: int, requests: int) -> int:
    """Target forward passes that yielded tokens (τ/pass = tokens / passes). Unlike vLLM's
    mean acceptance length (1 + accepted / drafting steps), passes that drafted nothing count
    too, so prompt lookup, which drafts only where it finds a match, compares fairly with a head.

    vLLM does not count passes; two lower bounds are: every pass yields one token plus the
    drafts it accepted (tokens - accepted; short where vLLM counted drafts accepted past
    max_tokens in a request's last pass, by up to a few passes per request with a big hybrid
    tree), and every request has its prefill pass plus one per drafting step (drafts +
    requests; short by the passes that drafted nothing, most of them for prompt lookup). The
    larger bound is used: on MT-bench (`treedraft bench`) it is the first for ngram and lookup
    alone, the second for the hybrid tree, and both agree within 0.5 % for the head tree."""
    return max(tokens - accepted, drafts + requests, 1)


def _row(config: str, job: dict, res: dict) -> dict:
    from treedraft.plugin.profile import per_step_ms

    total = sum(len(t) for t in res["tokens"])
    seconds = sum(res["wave_seconds"])
    bs = job["batch_size"]
    longest = [max(len(t) for t in res["tokens"][i : i + bs]) for i in range(0, len(res["tokens"]), bs)]
    rate = None  # continuous: tokens/s while the batch is full (engine.full_batch_window)
    if "request_seconds" in res:  # continuous: per request, submission to last token
        per_token = [s / max(len(t), 1) for s, t in zip(res["request_seconds"], res["tokens"],
                                                          strict=True)]
        tpot = 1000 * sum(per_token) / len(per_token)
        if sum(res.get("full_seconds") or []) > 0:
            rate = sum(res["full_tokens"]) / sum(res["full_seconds"])
    else:  # waves: a wave's time over its longest output
        tpot = 1000 * sum(w / n for w, n in zip(res["wave_seconds"], longest, strict=True)
                          ) / len(longest)
    spec = res["spec"]
    steps = spec["drafts"]
    return {
        "config": config, "prompts": job.get("group", ""), "batch_size": bs,
        "largest_wave": min(bs, len(res["tokens"])),  # < batch_size: a small prompt group
        "temperature": job["params"]["temperature"],
        "tokens": total, "seconds": seconds, "tokens_per_s": rate or total / seconds,
        "wall_tokens_per_s": total / seconds, "tpot_ms": tpot,
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "passes": (passes := target_passes(total, spec["accepted"], steps, len(res["tokens"]))),
        "tau_per_pass": total / passes,
        "accepted": spec["accepted"], "drafts": steps, "draft_tokens": spec["draft_tokens"],
        "acceptance_per_depth": [a / steps for a in spec["accepted_per_pos"]] if steps else [],
        "mean_tree_size": spec["draft_tokens"] / steps if steps else None,
        "accepted_by_source": spec.get("accepted_by_source") or None,  # trees: head/lookup/both
        **({"profile": res["profile"], "profile_ms": per_step_ms(res["profile"])}
           if "profile" in res else {}),
    }


def totals(rows: list[dict], sets: dict[str, list[str]]) -> list[dict]:
    """Rows of whole prompt sets summed from their groups' rows (sets: name -> group names):
    tokens, seconds, accepted drafts and tokens per pass over all of the set's requests;
    tokens/s as if each group's tokens came at that group's rate."""
    out = []
    runs = dict.fromkeys((r["config"], r["batch_size"], r["temperature"]) for r in rows)
    for name, groups in sets.items():
        for config, bs, t in runs:
            part = [r for r in rows if (r["config"], r["batch_size"], r["temperature"]) ==
                    (config, bs, t) and r["prompts"] in groups]
            if len(part) < 2:
                continue
            tokens, accepted = sum(r["tokens"] for r in part), sum(r["accepted"] for r in part)
            drafts, seconds = sum(r["drafts"] for r in part), sum(r["seconds"] for r in part)
            passes = sum(r["passes"] for r in part)
            draft_tokens = sum(r["draft_tokens"] for r in part)
            sources = [r["accepted_by_source"] for r in part if r["accepted_by_source"]]
            depth = max((len(r["acceptance_per_depth"]) for r in part), default=0)
            per_depth = [sum(r["acceptance_per_depth"][d] * r["drafts"] for r in part
                             if d < len(r["acceptance_per_depth"])) / drafts
                         for d in range(depth)] if drafts else []
            keys = list(dict.fromkeys(k for src in sources for k in src))
            out.append({
                "config": config, "prompts": f"{name} (all)", "batch_size": bs, "temperature": t,
                "tokens": tokens, "seconds": seconds,
                # each group's tokens at its own rate (a queue's: while its batch was full)
                "tokens_per_s": tokens / sum(r["tokens"] / r["tokens_per_s"] for r in part),
                "wall_tokens_per_s": tokens / seconds,
                "tpot_ms": sum(r["tpot_ms"] * r["seconds"] for r in part) / seconds,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "passes": passes, "tau_per_pass": tokens / passes, "accepted": accepted,
                "drafts": drafts, "draft_tokens": draft_tokens,
                "largest_wave": max(r["largest_wave"] for r in part),
                "acceptance_per_depth": per_depth,
                "mean_tree_size": draft_tokens / drafts if drafts else None,
                "accepted_by_source": {k: sum(src.get(k, 0) for src in sources) for k in keys}
                if sources else None})
    return out


PROFILE_COLUMNS = ("step", "forward", "tree_attention", "verify", "kv_compaction", "drafting",
                   "prepare", "other")


def turns(job: dict) -> list[dict]:
    """A job's prompts in turns of about two batches each (at least one turn; consecutive
    parts cut at whole batches, so a turn of waves holds whole waves; the prompts in order,
    named `NAME#i`): the engines take turns per turn rather than per job, so every engine's
    share of a job spreads over the job's whole span and a change of the machine's speed
    within it reaches every configuration alike."""
    ps, bs = job["prompts"], job["batch_size"]
    batches = -(-len(ps) // bs)
    k = max(1, batches // 2)
    cuts = [min(len(ps), bs * (batches * i // k)) for i in range(k + 1)]
    return [{**job, "name": f"{job['name']}#{i}", "prompts": ps[a:b]}
            for i, (a, b) in enumerate(itertools.pairwise(cuts))]


def run_order(configs: tuple[str, ...], jobs: list, rounds: int) -> list[tuple[int, object, str]]:
    """(round, job, config) in run order: every job `rounds` times in a row, each time run by
    every configuration in turn, the order alternating (A B C, C B A, A B C, ...), so that
    every pair of rounds cancels a drift of the machine's speed that is linear in time, and
    a configuration's round is minutes, not the whole run, from the baseline's."""
    runs = [(r, j) for j in jobs for r in range(rounds)]
    return [(r, j, c) for n, (r, j) in enumerate(runs)
            for c in (configs if n % 2 == 0 else configs[::-1])]


def sliced_turn(engines: dict, turn: dict, slice_tokens: int, reverse: bool = False,
                events=None, lost=None) -> dict[str, dict]:
    """Every engine runs one continuous turn a slice at a time (`scripts/engine.py` `Sliced`):
    each in turn steps until its requests made `slice_tokens` tokens per batch slot, the order
    alternating from slice to slice (A B C, C B A, ...; `reverse`: starting C B A), until every
    engine's queue has ended; a slice is a few seconds, so the machine's speed changes reach
    every configuration alike. Returns each engine's result (`_run_job`'s format, its seconds
    only those of its own slices). `events(c)`: a progress callback per configuration;
    `lost(c, error)`: called for an engine that fails, which the others go on without."""
    name, tokens = turn["name"], slice_tokens * (turn.get("batch_size") or len(turn["prompts"]))
    live = list(engines)

    def call(c: str, fn):
        try:
            return fn(c)
        except RuntimeError as e:
            live.remove(c)
            if lost is None:
                raise
            lost(c, e)
            return None

    kw = (lambda c: {"progress": events(c)}) if events is not None else (lambda c: {})
    for c in list(live):
        call(c, lambda c: engines[c].start(turn, **kw(c)))
    going, k = list(live), int(reverse)
    while going:
        for c in (going[:] if k % 2 == 0 else going[::-1]):
            if c in live and call(c, lambda c: engines[c].advance(name, tokens, **kw(c))):
                going.remove(c)
        going = [c for c in going if c in live]
        k += 1
    results = {}
    for c in list(live):
        res = call(c, lambda c: engines[c].finish(name, **kw(c)))
        if res is not None:
            results[c] = res
    return results


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def merge_rounds(rows: list[dict], baseline: str) -> list[dict]:
    """Rows of several rounds (each with `round`) -> one row per (config, job): the median
    tokens/s and TPOT over the rounds, the median of the per-round speedups (against the
    baseline's row of the same round and job) and their range; counts (tokens, seconds,
    passes, drafts, accepted) summed over the rounds and what derives from them recomputed
    from the sums (τ/pass, tree size, per-depth acceptance); vLLM's mean acceptance length and
    the step profile in ms averaged. One round: its rows, with `speedup` set."""
    import statistics

    def key(r: dict) -> tuple:
        return (r["batch_size"], r["temperature"], r["prompts"])

    base = {(r["round"], *key(r)): r["tokens_per_s"] for r in rows if r["config"] == baseline}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[(r["round"], *key(r))]
    if len({r["round"] for r in rows}) == 1:
        return rows
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], *key(r)), []).append(r)
    out = []
    for same in groups.values():
        m = dict(same[0])
        del m["round"]
        speedups = [r["speedup"] for r in same]
        m.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in same),
                 tpot_ms=statistics.median(r["tpot_ms"] for r in same),
                 speedup=statistics.median(speedups), speedup_range=[min(speedups), max(speedups)],
                 round_tokens_per_s=[r["tokens_per_s"] for r in same],
                 wall_tokens_per_s=statistics.median(r["wall_tokens_per_s"] for r in same))
        for k in ("tokens", "seconds", "passes", "accepted", "drafts", "draft_tokens"):
            m[k] = sum(r[k] for r in same)
        vals = [r["mean_acceptance_length"] for r in same if r["mean_acceptance_length"]]
        m["mean_acceptance_length"] = sum(vals) / len(vals) if vals else None
        m["tau_per_pass"] = m["tokens"] / m["passes"]
        m["mean_tree_size"] = m["draft_tokens"] / m["drafts"] if m["drafts"] else None
        depths = max(len(r["acceptance_per_depth"]) for r in same)
        m["acceptance_per_depth"] = [  # accepted at depth d over all rounds' drafting steps
            sum(r["acceptance_per_depth"][d] * r["drafts"] for r in same
                if d < len(r["acceptance_per_depth"])) / m["drafts"]
            for d in range(depths)] if m["drafts"] else []
        if all("profile_ms" in r for r in same):
            m["profile_ms"] = {k: sum(r["profile_ms"][k] for r in same) / len(same)
                               for k in same[0]["profile_ms"]}
            m["profile"] = {k: sum(r["profile"][k] for r in same) for k in same[0]["profile"]}
        out.append(m)
    return out


def profile_markdown(rows: list[dict]) -> str:
    """Milliseconds per engine step by phase (tree attention is part of forward, KV compaction
    part of verify); steps and scheduled tokens per step."""
    head, lead = _lead(rows)
    head += ["steps", "tokens/step", *PROFILE_COLUMNS]
    lines = ["| " + " | ".join(h.replace("_", " ") for h in head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        ms, p = r.get("profile_ms") or {}, r.get("profile") or {}
        if not ms:
            continue
        lines.append("| " + " | ".join([*lead(r), f"{p['steps']:.0f}",
                                        f"{p['tokens'] / p['steps']:.1f}",
                                        *(f"{ms[c]:.1f}" for c in PROFILE_COLUMNS)]) + " |")
    return "\n".join(lines) + "\n"


def _lead(rows: list[dict]):
    """Every table's first columns: config, prompts (when the rows cover several prompt
    groups), T, batch (with the largest wave where a prompt group was smaller than the
    batch): (their header, row -> their cells)."""
    groups = len({r.get("prompts", "") for r in rows}) > 1

    def cells(r: dict) -> list[str]:
        wave, bs = r.get("largest_wave", r["batch_size"]), r["batch_size"]
        return [r["config"], *([r["prompts"]] if groups else []), f"{r['temperature']:g}",
                f"{bs}" if wave >= bs else f"{bs} (≤{wave})"]

    return ["config", *(["prompts"] if groups else []), "T", "batch"], cells


def markdown(rows: list[dict]) -> str:
    """The main table."""
    head, lead = _lead(rows)
    head += ["tok/s", "TPOT ms", "speedup", "mean acc. len", "tree size", "τ/pass"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tau = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        size = f"{r['mean_tree_size']:.1f}" if r["mean_tree_size"] else "-"
        speedup = f"{r['speedup']:.2f}x"
        if r.get("speedup_range"):  # several rounds: the median and the range of the rounds
            speedup += " ({:.2f}-{:.2f})".format(*r["speedup_range"])
        lines.append("| " + " | ".join([*lead(r), f"{r['tokens_per_s']:.1f}",
                                        f"{r['tpot_ms']:.1f}", speedup, tau,
                                        size, f"{r['tau_per_pass']:.2f}"]) + " |")
    return "\n".join(lines) + "\n"


def tau_markdown(rows: list[dict]) -> str:
    """Tokens per target pass, configurations by prompt group, one table per (T, batch)."""
    groups = list(dict.fromkeys(r["prompts"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    out = []
    for t, bs in dict.fromkeys((r["temperature"], r["batch_size"]) for r in rows):
        cell = {(r["config"], r["prompts"]): r["tau_per_pass"] for r in rows
                if (r["temperature"], r["batch_size"]) == (t, bs)}
        out += [f"tokens per target pass, T={t:g}, batch {bs}:", "",
                "| config | " + " | ".join(groups) + " |", "|" + "---|" * (len(groups) + 1)]
        out += [f"| {c} | " + " | ".join(f"{cell[c, g]:.2f}" if (c, g) in cell else "-"
                                         for g in groups) + " |" for c in configs]
        out.append("")
    return "\n".join(out)


def speedup_chart(rows: list[dict], baseline: str, per_char: float = 0.1) -> str:
    """Speedup against the baseline as text bars, one block per (T, batch), one bar per
    configuration (the baseline left out), `per_char` x a character, `│` at 1.0x: a plot that
    reads in a terminal, in bench.md and in the README without an image."""
    eighths = " ▏▎▍▌▋▊▉"

    def bar(speedup: float) -> str:
        n = max(0, round(8 * speedup / per_char))
        return "█" * (n // 8) + (eighths[n % 8] if n % 8 else "")

    mark = round(1.0 / per_char)
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != baseline]
    width = max((len(c) for c in configs), default=0)
    span = max([mark + 1, *(len(bar(r["speedup"])) for r in rows)])  # values in one column
    out = []
    for t in sorted({r["temperature"] for r in rows if r["config"] != baseline}):
        out.append(f"speedup vs {baseline}, T={t:g} (█ = {per_char:g}x, │ = 1.0x)")
        for bs in sorted({r["batch_size"] for r in rows
                          if r["temperature"] == t and r["config"] != baseline}):
            here = {r["config"]: r for r in rows
                    if (r["temperature"], r["batch_size"]) == (t, bs)}
            out.append(f"batch {bs}")
            for c in (c for c in configs if c in here):
                r = here[c]
                cells = list(bar(r["speedup"]).ljust(span))
                if cells[mark] == " ":
                    cells[mark] = "│"
                value = f"{r['speedup']:.2f}x"
                if r.get("speedup_range"):
                    value += " ({:.2f}-{:.2f})".format(*r["speedup_range"])
                out.append(f"  {c:<{width}} {''.join(cells)}  {value}")
        out.append("")
    return "\n".join(out)


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG plots (pip install 'treedraft[bench]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for c in configs:
            pts = sorted((r["batch_size"], r["speedup"]) for r in rows
                         if r["config"] == c and r["temperature"] == t)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="batch size", ylabel="speedup vs no-spec", title=f"T={t:g}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    speed = out / "speedup_vs_batch.png"
    fig.savefig(speed, dpi=100)
    fig, ax = plt.subplots(figsize=(6, 4))
    bs1 = [r for r in rows if r["acceptance_per_depth"] and r["batch_size"] == min(
        x["batch_size"] for x in rows) and r["temperature"] == temps[0]]
    for r in bs1:
        d = r["acceptance_per_depth"]
        ax.plot(range(1, len(d) + 1), d, marker="o", label=r["config"])
    ax.set(xlabel="depth", ylabel="P(accepted depth >= d)", title=f"acceptance per depth, T={temps[0]:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    acc = out / "acceptance_per_depth.png"
    fig.savefig(acc, dpi=100)
    return [speed, acc]


def _planned_tokens(jobs: list[dict]) -> int:
    return sum(len(j["prompts"]) * j["params"]["max_tokens"] for j in jobs)


class Progress:
    """One tqdm bar over the whole run: tokens generated of those planned (every engine's
    warm-up and every round of every job), naming the engine and job that run now; tqdm's own
    estimate of the time left."""

    def __init__(self, warm: dict[str, list[dict]], jobs: list[dict], rounds: int) -> None:
        self.planned = sum(_planned_tokens(w) + rounds * _planned_tokens(jobs)
                           for w in warm.values())
        self.bar = None

    def __enter__(self) -> Progress:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.planned, desc="[bench]", unit="tok", dynamic_ncols=True,
                        mininterval=1.0)
        return self

    def __exit__(self, *_) -> None:
        self.bar.close()

    def events(self, what: str):
        """The progress callback of a run of configuration `what`'s engine (its name shown on
        the bar)."""
        self.bar.set_postfix_str(what)

        def on_event(ev: dict) -> None:
            if "ready" in ev:
                self.bar.set_postfix_str(f"{what}: engine up in {ev['ready']:.0f} s")
            else:
                self.bar.update(ev["tokens"])
                self.bar.set_postfix_str(f"{what}, {ev['job']}")
        return on_event


def best_speedup(rows: list[dict], baseline: str) -> str:
    """One line: the fastest configuration against the baseline, per temperature."""
    parts = []
    for t in sorted({r["temperature"] for r in rows}):
        cands = [r for r in rows if r["temperature"] == t and r["config"] != baseline]
        if not cands:
            continue
        b = max(cands, key=lambda r: r["speedup"])
        parts.append(f"T={t:g}: {b['config']} {b['speedup']:.2f}x at batch {b['batch_size']}")
    return f"best speedup vs {baseline}: " + "; ".join(parts) if parts else "no speedup measured"


def _x(r: dict) -> str:
    lo, hi = r.get("speedup_range") or (None, None)
    return f"{r['speedup']:.2f}x" + (f" (rounds {lo:.2f}-{hi:.2f})" if lo is not None else "")


def _rounds(r: dict) -> list[float]:
    """[lowest, highest] speedup over a row's rounds (the speedup twice for a single round)."""
    return r.get("speedup_range") or [r["speedup"]] * 2


def conclusions(rows: list[dict], baseline: str, machine: str, policy: str = "auto") -> list[str]:
    """What holds on this machine, one sentence per temperature and batch size: the fastest
    configuration against the baseline (with the range over rounds), and where `policy` (the
    default a server gets) stands against it. A difference inside the rounds' ranges is said
    to be none, the fastest configuration's against the baseline too."""
    lines = [f"On this machine ({machine}):"]
    for t in sorted({r["temperature"] for r in rows}):
        for bs in sorted({r["batch_size"] for r in rows if r["temperature"] == t}):
            same = [r for r in rows if r["temperature"] == t and r["batch_size"] == bs
                    and r["config"] != baseline]
            if not same:
                continue
            best = max(same, key=lambda r: r["speedup"])
            say = f"- T={t:g}, batch {bs}: "
            if best["speedup"] < 1.0:
                say += f"no configuration beats {baseline} (the best, {best['config']}: " \
                       f"{_x(best)})"
            else:
                say += f"{best['config']} is fastest, {_x(best)} the speed of {baseline}"
                if _rounds(best)[0] < 1.0:
                    say += f": level with {baseline} within the rounds' spread"
            mine = next((r for r in same if r["config"] == policy), None)
            if mine is not None and mine is not best:
                lo, hi = _rounds(mine)[1], _rounds(best)[0]
                within = ("as fast within the rounds' spread" if lo >= hi
                          else "slower beyond the rounds' spread")
                say += f"; {policy} {_x(mine)}: {within}"
            lines.append(say + ".")
    return lines


def bench(target: str = "smollm2-135m", head: str = "smollm2-135m-eagle",
          prompts: str = "mtbench", limit: int | None = None, max_new_tokens: int | None = None,
          batch_sizes=None, temperatures=None, configs=None,
          out: str | Path = "runs/bench", dtype: str = "auto",
          enforce_eager: bool | None = None, stride: int | None = None,
          preset: str = "quick", profile: bool = False, by_category: bool = False,
          rounds: int | None = None, continuous: bool | None = None,
          warmup: bool | None = None, slice_tokens: int | None = None,
          seed: int | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    from treedraft.heads.machine import describe, resolve_dtype
    from treedraft.heads.shipped import resolve_head
    from treedraft.plugin.profile import PROFILE_ENV
    from treedraft.training.data import first_turn, load_prompts, prompt_categories
    from treedraft.training.models import resolve_model
    from treedraft.training.target import encode_chat

    from .engine import Engine, concat

    given = {"limit": limit, "max_new_tokens": max_new_tokens, "batch_sizes": batch_sizes,
             "temperatures": temperatures, "configs": configs, "enforce_eager": enforce_eager,
             "stride": stride, "rounds": rounds, "continuous": continuous, "warmup": warmup,
             "slice_tokens": slice_tokens}
    if preset not in PRESETS:
        raise ValueError(f"bench preset {preset!r}; valid: {', '.join(PRESETS)}")
    o = {k: v if v is not None else PRESETS[preset][k] for k, v in given.items()}
    configs = tuple(o["configs"])
    rounds, continuous = o["rounds"], o["continuous"]
    if rounds < 1:
        raise ValueError(f"bench rounds must be >= 1, got {rounds}")
    if o["slice_tokens"] < 0:
        raise ValueError(f"bench slice tokens must be >= 0 (0: whole turns), got "
                         f"{o['slice_tokens']}")
    sliced = continuous and o["slice_tokens"] > 0  # engines take turns a slice at a time
    seed = run_seed(seed)
    vllm_dtype = resolve_dtype(dtype)
    machine = describe()
    specs = {c: speculative_config(c, str(resolve_head(head))) for c in configs}  # fail early
    target_dir = str(resolve_model(target))
    tok = AutoTokenizer.from_pretrained(target_dir)
    groups: dict[str, list[list[int]]] = {}  # prompt group -> its prompts' token ids
    sets: dict[str, list[str]] = {}  # prompt set -> its groups (categories with by_category)
    for name in prompt_sets(prompts):
        ds = load_prompts(name, limit=o["limit"], stride=o["stride"])
        cats = prompt_categories(ds) if by_category else [name] * len(ds)
        for cat, m in zip(cats, ds["messages"], strict=True):
            groups.setdefault(cat, []).append(encode_chat(tok, first_turn(m)))
            sets.setdefault(name, [])
            if cat not in sets[name]:
                sets[name].append(cat)
    n_prompts = sum(map(len, groups.values()))
    # groups: every prompt once per wave (cycling prompts to fill a wave would weight some twice)
    jobs = _jobs(groups, o["batch_sizes"], o["temperatures"], o["max_new_tokens"],
                 fill=len(groups) == 1, continuous=continuous)
    warm = {c: warmup_jobs(jobs, learns=learns(specs[c])) if o["warmup"] else []
            for c in configs}  # per configuration
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {machine}\n[bench] vLLM dtype {vllm_dtype} (--dtype {dtype}), "
          f"{'eager' if o['enforce_eager'] else 'torch.compile'}; {n_prompts} {prompts} prompts "
          f"({len(groups)} groups: {', '.join(groups)}) x "
          f"{o['max_new_tokens']} tokens, batch sizes {list(o['batch_sizes'])} "
          f"({'a queue, continuous batching' if continuous else 'waves'}), T "
          f"{list(o['temperatures'])}; {len(configs)} configurations: {', '.join(configs)}"
          + (f"; {rounds} rounds in alternating order" if rounds > 1 else "")
          + (f"; engines take turns in slices of {o['slice_tokens']} tokens per batch slot"
             if sliced else "") + f"; seed {seed}", flush=True)
    llm = {"max_num_seqs": max(o["batch_sizes"]), "dtype": vllm_dtype,
           "enforce_eager": o["enforce_eager"], "seed": seed}
    if _cuda():  # the engines are up side by side: each gets its share of the GPU's memory
        llm["gpu_memory_utilization"] = round(0.9 / len(configs), 3)
    engines: dict[str, Engine] = {}
    failed = []
    t0 = time.perf_counter()

    def lost(c: str, e: RuntimeError) -> None:  # a failed engine: the others go on
        if c == configs[0]:
            raise e  # the baseline: nothing to compare with
        engines.pop(c, None)
        i = configs.index(c)
        (out / f"engine-{i}.log").write_text(str(e))
        failed.append(c)
        print(f"[bench] {c} FAILED (its log: {out / f'engine-{i}.log'}): "
              f"{str(e).strip().splitlines()[-1][:300]}; the other configurations go on",
              flush=True)

    with Progress(warm, jobs, rounds) as progress:
        try:
            for i, c in enumerate(configs):  # start every engine and warm it, untimed
                # the worker zeroes this file when its runner starts, then rewrites it per step
                env = {PROFILE_ENV: str((out / f"profile-{i}.json").resolve())} if profile \
                    else {}
                if sliced:  # the engine core in the engine's process: it steps only when asked
                    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                engines[c] = Engine(target_dir, specs[c], llm=llm, env=env)
                try:
                    engines[c].run(warm[c], progress=progress.events(c))
                except RuntimeError as e:
                    lost(c, e)
            parts: dict[tuple, list[dict]] = {}  # (config, job, round) -> its turns' results
            every = [(n, t) for n, j in enumerate(jobs) for t in turns(j)]
            if sliced:
                for k, (rnd, (n, t)) in enumerate((r, nt) for nt in every for r in range(rounds)):
                    res = sliced_turn({c: engines[c] for c in configs if c in engines}, t,
                                      o["slice_tokens"], reverse=k % 2 == 1,
                                      events=progress.events, lost=lost)
                    for c, r in res.items():
                        parts.setdefault((c, n, rnd), []).append(r)
            else:
                for rnd, (n, t), c in run_order(configs, every, rounds):
                    if c not in engines:
                        continue
                    try:
                        res = engines[c].run([t], progress=progress.events(c))
                    except RuntimeError as e:
                        lost(c, e)
                        continue
                    parts.setdefault((c, n, rnd), []).append(res[t["name"]])
            # rows once every turn ran: a failed engine's turns are left out with it
            rows = [{**_row(c, jobs[n], concat(parts[c, n, rnd])), "round": rnd}
                    for n in range(len(jobs)) for rnd in range(rounds) for c in configs
                    if c in engines and (c, n, rnd) in parts]
            for i, c in enumerate(configs):  # each engine's own log (e.g. auto's choices)
                if c in engines:
                    engines[c].close()
                    (out / f"engine-{i}.log").write_text(engines[c].log)
        finally:
            for e in engines.values():
                e.kill()
    if by_category:  # each prompt set's total, per configuration and round
        rows += [{**t, "round": rnd} for c in configs for rnd in range(rounds)
                 for t in totals([r for r in rows if (r["config"], r["round"]) == (c, rnd)],
                                 sets)]
    rows = merge_rounds(rows, configs[0])
    meta = {"target": target, "head": head, "prompts": prompts, "limit": o["limit"],
            "stride": o["stride"], "by_category": by_category,
            "max_new_tokens": o["max_new_tokens"], "baseline": configs[0],
            "dtype": vllm_dtype, "dtype_requested": dtype, "enforce_eager": o["enforce_eager"],
            "machine": machine, "seconds": time.perf_counter() - t0, "profile": profile,
            "rounds": rounds, "continuous": continuous,
            "slice_tokens": o["slice_tokens"] if sliced else None, "seed": seed,
            "failed": failed}
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    if len(groups) > 1:
        table += "\n" + tau_markdown(rows)
    # plots and the closing line: the first prompt set's rows (its total when by category)
    first = next(iter(sets))
    main = f"{first} (all)" if any(r["prompts"] == f"{first} (all)" for r in rows) \
        else sets[first][0]
    shown = [r for r in rows if r["prompts"] == main]
    chart = speedup_chart(shown, configs[0])
    if chart:
        table += f"\nspeedup vs {configs[0]} ({main}):\n\n```text\n{chart}```\n"
    (out / "bench.md").write_text(table)
    if profile:
        ptable = profile_markdown(rows)
        (out / "profile.md").write_text(ptable)
        table += "\nms per engine step (tree attention within forward, KV compaction within " \
                 "verify):\n\n" + ptable
    for p in plots(shown, out):
        print(f"wrote {p}")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'} "
          f"({(time.perf_counter() - t0) / 60:.1f} min; {machine})\n")
    print(table)
    print(best_speedup(shown, configs[0])
          + (f" ({main})" if len(groups) > 1 else ""))
    print("\n".join(conclusions(shown, configs[0], machine)))
    if failed:
        print(f"[bench] FAILED, not in the table: {', '.join(failed)} (engine logs in {out})")
    return rows
