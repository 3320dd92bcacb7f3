"""Run jobs on one real vLLM engine in a child process; used by `treedraft bench` and the tests.

vLLM spawns an engine-core and a worker process and logs to stdout, so every engine lives in its
own `python -m treedraft.scripts.engine REQUEST.json` process. A request names the target,
`speculative_config` (None = no speculation), extra `LLM(...)` arguments and a list of jobs:

    {"name": str, "prompts": [[token ids], ...], "params": {vllm SamplingParams kwargs},
     "batch_size": int | None,    # None: all prompts at once; else waves of batch_size
     "continuous": bool}          # optional: at most batch_size requests run, a new one
                                  # starts as one finishes (a queued server), no waves

`params` may also be a list with one dict per prompt (a batch of mixed request shapes).

`Engine` keeps such a child up across calls: its request has `"jobs": null` and the child reads
one JSON list of jobs per stdin line, printing a result line for each, until stdin closes.
`run_engine` is one `Engine` run once and closed (with `background_shutdown`, it returns as soon
as the child has printed its result and the engine shuts down, seconds, while the caller goes
on). A request with its jobs in the file runs them and exits (tests/engine_host.py).

`params` may name `structured_outputs` as a dict of StructuredOutputsParams fields.

A job with `"op"` runs a continuous job a slice at a time (`Sliced`; `Engine.start`,
`Engine.advance`, `Engine.finish`), so that several engines take turns every few seconds on
the same queue (`treedraft bench`); it needs the engine core in the child's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0 in its environment).

The child prints one line ``TREEDRAFT_RESULT {...}``: per job the generated token ids, their
logprobs (per output, the sampled tokens' logprobs; null where the request asked for none),
the prompt tokens' logprobs (`prompt_logprobs`; null where not asked),
every position's returned [token, logprob] pairs largest first (`top_logprobs`: with
`logprobs: k`, the top k and the sampled token's; raw logits under `logprobs_mode:
raw_logits`), the
finish reasons, the wall time of each wave (continuous: one for the whole job, each
request's seconds from its submission to its last token, `request_seconds`, and the queue's
stretch at full batch, `full_tokens` per request and `full_seconds`: `full_batch_window`)
and the change of
vLLM's spec-decode counters during the job
(and, when `TREEDRAFT_PROFILE` is in the engine's environment, the change of the worker's step
profile: seconds per phase, steps, scheduled tokens; plugin/profile.py). While it
runs it prints ``TREEDRAFT_PROGRESS {...}`` lines (engine ready, with the number of patches
treedraft applied in the script's process; after each wave: job, tokens), which `Engine.run`
hands to its `progress` callback as they arrive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PREEMPTIONS = "vllm:num_preemptions"
BY_SOURCE = "vllm:treedraft_accepted_tokens_by_source"  # label source: head / lookup / both


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's OpenMP threads on the CPUs this process may use (all of them, or what taskset or
    # a cgroup allows), one per CPU
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    return env


RESULT, PROGRESS = "TREEDRAFT_RESULT ", "TREEDRAFT_PROGRESS "


def run_engine(target: str, speculative_config: dict | None, jobs: list[dict], *,
               llm: dict | None = None, timeout: int = 1200,
               progress: Callable[[dict], None] | None = None,
               env: dict[str, str] | None = None,
               background_shutdown: bool = False) -> tuple[dict, str]:
    """Run `jobs` on a fresh engine (an `Engine` closed after one `run`); returns (results by
    job name, the child's log up to its result line).

    progress: called in this thread's caller with each event the child reports, as it comes:
    {"ready": seconds to start the engine} once, then {"job": name, "tokens": n} per wave.
    env: extra environment of the engine process (e.g. VLLM_PLUGINS=none: stock vLLM).
    background_shutdown: return at the result line and let the engine shut down (seconds)
    in a background thread (the tests); otherwise wait until it has exited and freed its
    memory (on a GPU, vLLM's start-up memory check of an engine started next would see this
    one's)."""
    engine = Engine(target, speculative_config, llm=llm, env=env)
    results = engine.run(jobs, progress=progress, timeout=timeout)  # kills and raises on failure
    if background_shutdown:
        threading.Thread(target=engine.close, daemon=True).start()
    else:
        engine.close()
    return results, engine.log


class Engine:
    """One vLLM engine in its own process, kept up across `run` calls: each call sends a list of
    jobs and returns their results, so that several engines can take turns on the same jobs
    (`treedraft bench` pairs configurations in time). The child starts at once; the first `run`
    waits for it. `close()` ends it (stdin closed: it shuts down and exits), `kill()` stops it
    now, as does a `run` that fails or is interrupted.

        with Engine(target, spec, llm={"max_num_seqs": 8}) as e:
            first = e.run([job_a])       # {job name: result}
            again = e.run([job_a, job_b])
    """

    def __init__(self, target: str, speculative_config: dict | None, *,
                 llm: dict | None = None, env: dict[str, str] | None = None) -> None:
        request = {"target": str(target), "speculative_config": speculative_config,
                   "llm": llm or {}, "jobs": None}  # no jobs: the child serves them from stdin
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(request, f)
        self._request = f.name
        self.lines: list[str] = []  # the child's output so far
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treedraft.scripts.engine", f.name], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**engine_env(), **(env or {})})

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def run(self, jobs: list[dict], *, progress: Callable[[dict], None] | None = None,
            timeout: int = 7200) -> dict:
        """Run `jobs` (run_engine's format); results by job name. progress: as run_engine's
        (`ready` once, on the first call). A child that fails or runs past `timeout` seconds
        is stopped and raises RuntimeError with its log's end."""
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        done = False
        try:
            self.proc.stdin.write(json.dumps(jobs) + "\n")
            self.proc.stdin.flush()
            done = _read_result(self.proc, self.lines, progress)
        except OSError:  # the child is gone (a broken pipe)
            pass
        finally:
            timer.cancel()
            if not done:  # the child failed or hung, or the progress callback raised: stop it
                self.kill()
        if not done:
            raise RuntimeError(f"vLLM engine run failed ({_why(self.proc, timeout)}):\n"
                               f"{self.log[-6000:]}")
        return json.loads(self.lines[-1][len(RESULT):])

    def start(self, job: dict, **kw) -> None:
        """Queue a continuous job to run a slice at a time (`Sliced`; the engine's core in its
        process: env VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        self.run([{**job, "op": "start"}], **kw)

    def advance(self, name: str, tokens: int, **kw) -> bool:
        """Run job `name` until its requests made `tokens` more tokens; whether it ended."""
        return self.run([{"name": name, "op": "advance", "tokens": tokens}], **kw)[name]["done"]

    def finish(self, name: str, **kw) -> dict:
        """The result of a job run in slices (`_run_job`'s format), once it ended."""
        return self.run([{"name": name, "op": "finish"}], **kw)[name]

    def close(self, timeout: int = 300) -> None:
        """Let the engine shut down and wait for it (its memory freed before the caller
        starts another)."""
        if self.proc.poll() is None:
            timer = threading.Timer(timeout, self.proc.kill)
            timer.start()
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            _drain(self.proc, timer)
        self._unlink()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._unlink()

    def _unlink(self) -> None:
        if os.path.exists(self._request):
            os.unlink(self._request)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.kill() if exc_type is not None else self.close()


def _read_result(proc: subprocess.Popen, lines: list[str],
                 progress: Callable[[dict], None] | None) -> bool:
    """Read the child's lines into `lines` up to its next result line (True; it is the last
    line read), handing progress events to `progress`; False where the output ends first."""
    for line in proc.stdout:
        lines.append(line)
        if progress is not None and line.startswith(PROGRESS):
            progress(json.loads(line[len(PROGRESS):]))
        if line.startswith(RESULT):
            return True
    return False


def _why(proc: subprocess.Popen, timeout: int) -> str:
    proc.wait()
    return f"killed after {timeout} s" if proc.returncode == -9 else f"exit {proc.returncode}"


def _drain(proc: subprocess.Popen, timer: threading.Timer) -> None:
    """Read an engine's shutdown log to its end (vLLM's children write to the same pipe) and
    reap it; the timer still kills an engine that hangs on the way out."""
    try:
        for _ in proc.stdout:
            pass
        proc.wait()
    finally:
        timer.cancel()


def _report(event: dict) -> None:
    print(PROGRESS + json.dumps(event), flush=True)


def spec_counters(llm) -> dict:
    out = {name: 0 for name in (*SPEC_COUNTERS, PREEMPTIONS)}
    out[PER_POS] = []
    out[BY_SOURCE] = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS or m.name == PREEMPTIONS:
            out[m.name] = m.value
        elif m.name == PER_POS:
            out[PER_POS] = list(m.values)
        elif m.name == BY_SOURCE:
            out[BY_SOURCE][m.labels["source"]] = m.value
    return out


def counter_delta(before: dict, after: dict) -> dict:
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    draft_tokens = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
    accepted = after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]]
    prev = before[PER_POS] or [0] * len(after[PER_POS])
    per_pos = [a - b for a, b in zip(after[PER_POS], prev, strict=False)]
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
            "preemptions": after[PREEMPTIONS] - before[PREEMPTIONS],
            "accepted_per_pos": per_pos,
            # tree mode: accepted draft tokens by the source that proposed them
            "accepted_by_source": {k: v - before[BY_SOURCE].get(k, 0)
                                   for k, v in after[BY_SOURCE].items()},
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def concat(results: list[dict]) -> dict:
    """The results of several parts of one job (`_run_job`'s, in order) as one: per-request
    lists and wave times joined, spec counters and the step profile summed, the mean
    acceptance length recomputed from the sums."""
    if len(results) == 1:
        return results[0]
    out: dict = {}
    for k, v in results[0].items():
        if isinstance(v, list):
            out[k] = [x for r in results for x in r[k]]
    specs = [r["spec"] for r in results]
    depth = max(len(s["accepted_per_pos"]) for s in specs)
    spec = {k: sum(s.get(k, 0) for s in specs) for k in ("drafts", "draft_tokens", "accepted",
                                                          "preemptions")}
    spec["accepted_per_pos"] = [sum(s["accepted_per_pos"][d] for s in specs
                                    if d < len(s["accepted_per_pos"])) for d in range(depth)]
    sources = [s.get("accepted_by_source") or {} for s in specs]
    spec["accepted_by_source"] = {k: sum(src.get(k, 0) for src in sources)
                                  for k in dict.fromkeys(k for src in sources for k in src)}
    spec["mean_acceptance_length"] = (1 + spec["accepted"] / spec["drafts"] if spec["drafts"]
                                      else None)
    out["spec"] = spec
    if "profile" in results[0]:
        out["profile"] = {k: sum(r["profile"][k] for r in results) for k in results[0]["profile"]}
    return out


def sampling_params(kwargs: dict):
    """vLLM SamplingParams from JSON kwargs; `structured_outputs` given as a dict of
    StructuredOutputsParams fields (e.g. {"json": SCHEMA})."""
    from vllm import SamplingParams

    kwargs = dict(kwargs)
    if isinstance(kwargs.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def _run_job(llm, job: dict) -> dict:
    op = job.get("op")  # a job run a slice at a time (`Sliced`)
    if op == "start":
        _SLICED[job["name"]] = Sliced(llm, job)
        return {}
    if op == "advance":
        return {"done": _SLICED[job["name"]].advance(job["tokens"])}
    if op == "finish":
        return _SLICED.pop(job["name"]).result()
    if op is not None:
        raise ValueError(f"job op {op!r}: start, advance or finish")
    from treedraft.plugin import profile

    prompts, params, bs = _job_inputs(job)
    before = spec_counters(llm)
    prof = os.environ.get(profile.PROFILE_ENV)  # the worker's step profile (plugin/profile.py)
    prof_before = profile.read(prof)
    tokens, logprobs, top, finish, waves, prompt_lps = [], [], [], [], [], []
    queue = None
    if job.get("continuous"):  # one run of the whole queue
        t = time.perf_counter()
        outs, starts, ends = _continuous(llm, prompts, params, bs, job["name"])
        runs = [(outs, time.perf_counter() - t)]
        queue = _queue_times(starts, ends, [sum(len(c.token_ids) for c in o.outputs)
                                            for o in outs], bs)
    else:
        runs = _waves(llm, prompts, params, bs, job["name"])
    for outs, seconds in runs:
        waves.append(seconds)
        new = [c for o in outs for c in o.outputs]
        tokens += [list(c.token_ids) for c in new]
        logprobs += [None if c.logprobs is None else
                     # None where an entry is missing or is not the sampled token's
                     [lp[tok].logprob if tok in lp else None
                      for tok, lp in zip(c.token_ids, c.logprobs, strict=False)]
                     + [None] * (len(c.token_ids) - len(c.logprobs))
                     for c in new]
        # every position's returned [token, logprob] pairs (top-k and the sampled token's),
        # largest first
        top += [None if c.logprobs is None else
                [sorted(([t, e.logprob] for t, e in lp.items()), key=lambda x: -x[1])
                 for lp in c.logprobs]
                for c in new]
        finish += [c.finish_reason for c in new]
        # per prompt token, its logprob under the target (prompt_logprobs; None: not asked)
        prompt_lps += [None if o.prompt_logprobs is None else
                       [None if lp is None else lp[t].logprob
                        for t, lp in zip(o.prompt_token_ids, o.prompt_logprobs, strict=False)]
                       for o in outs for _ in o.outputs]
    out = {"tokens": tokens, "logprobs": logprobs, "top_logprobs": top, "finish_reasons": finish,
           "prompt_logprobs": prompt_lps,
           "wave_seconds": waves, "spec": counter_delta(before, spec_counters(llm))}
    if queue is not None:
        out.update(queue)
    if prof:
        out["profile"] = profile.delta(prof_before, profile.read(prof))
    return out


def _job_inputs(job: dict) -> tuple[list, list, int]:
    """A job's prompts (TokensPrompt), SamplingParams (one per prompt) and batch size."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    raw = job["params"]
    params = ([sampling_params(p) for p in raw] if isinstance(raw, list)
              else [sampling_params(raw)] * len(prompts))
    return prompts, params, job.get("batch_size") or len(prompts)


def _queue_times(starts: list[float], ends: list[float], lengths: list[int], bs: int) -> dict:
    """A continuous job's times: each request's seconds and the queue's stretch at full batch
    (`full_batch_window`: tokens per request inside it, its seconds)."""
    window = full_batch_window(starts, ends, lengths, bs)
    return {"request_seconds": [e - s for s, e in zip(starts, ends, strict=True)],
            "full_tokens": window[0] if window else [0.0] * len(starts),
            "full_seconds": [window[1]] if window else []}


def _waves(llm, prompts: list, params: list, bs: int, name: str):
    """(outputs, seconds) of each wave of `bs` prompts, reported as it ends."""
    for i in range(0, len(prompts), bs):
        t = time.perf_counter()
        outs = llm.generate(prompts[i : i + bs], params[i : i + bs], use_tqdm=False)
        seconds = time.perf_counter() - t
        _report({"job": name, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)})
        yield outs, seconds


def _continuous(llm, prompts: list, params: list, bs: int, name: str
                ) -> tuple[list, list[float], list[float]]:
    """Generate with at most `bs` requests in the engine, submitting the next prompt as soon
    as one finishes (what a server with a queue and continuous batching does): the outputs in
    prompt order and each request's submission and end times (`time.perf_counter`)."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("continuous job: the engine still runs requests of an earlier job")
    ids = [f"{name}-{i}" for i in range(len(prompts))]
    where = {rid: i for i, rid in enumerate(ids)}
    outs: list = [None] * len(prompts)
    started = [0.0] * len(prompts)
    ended = [0.0] * len(prompts)
    nxt = running = 0
    while nxt < len(prompts) or running:
        while nxt < len(prompts) and running < bs:
            params[nxt].output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate does
            started[nxt] = time.perf_counter()
            where[engine.add_request(ids[nxt], prompts[nxt], params[nxt])] = nxt  # vLLM's id
            nxt, running = nxt + 1, running + 1
        for o in engine.step():
            if o.finished:
                i = where[o.request_id]
                outs[i], ended[i] = o, time.perf_counter()
                running -= 1
                _report({"job": name, "tokens": sum(len(c.token_ids) for c in o.outputs)})
    return outs, started, ended


class Sliced:
    """A continuous job run a slice at a time, so that several engines can take turns every few
    seconds on the same queue (`treedraft bench`'s slices): `Engine.start` queues nothing yet,
    each `Engine.advance` steps the engine until the job's requests have made `tokens` more
    tokens (or all ended), `Engine.finish` returns the job's result as `_run_job` does (token
    ids, finish reasons, the queue's times; no logprobs). The job's clock runs only while it
    advances: its requests' times and its seconds leave out what ran between its slices. It
    needs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); a core in a
    process of its own keeps stepping between slices."""

    def __init__(self, llm, job: dict) -> None:
        from vllm.sampling_params import RequestOutputKind

        from treedraft.plugin import profile

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("a job run in slices needs the engine core in this process: "
                               "start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0")
        if not job.get("continuous"):
            raise ValueError(f"job {job['name']!r}: only a continuous job runs in slices")
        self.llm, self.engine, self.name = llm, llm.llm_engine, job["name"]
        if self.engine.has_unfinished_requests():
            raise RuntimeError("sliced job: the engine still runs requests of an earlier job")
        self.prompts, self.params, self.bs = _job_inputs(job)
        for sp in self.params:
            if sp.n != 1 or sp.logprobs is not None or sp.prompt_logprobs is not None:
                raise ValueError(f"job {self.name!r}: a sliced job returns one output's token "
                                 "ids per request (no n > 1, no logprobs)")
            sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens: the slice's count
        self.before = spec_counters(llm)
        self.prof = os.environ.get(profile.PROFILE_ENV)
        self.prof_before = profile.read(self.prof)
        n = len(self.prompts)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.started, self.ended = [0.0] * n, [0.0] * n
        self.where: dict[str, int] = {}  # vLLM's request id -> prompt index
        self.nxt = self.running = 0
        self.clock = 0.0  # seconds this job has advanced

    @property
    def done(self) -> bool:
        return self.nxt == len(self.prompts) and not self.running

    def advance(self, tokens: int) -> bool:
        """Step until the requests made `tokens` more tokens or the job ended (at most
        `batch_size` running, the next submitted as one ends); whether it ended."""
        t0 = time.perf_counter()

        def now() -> float:
            return self.clock + time.perf_counter() - t0

        made = 0
        while made < tokens and not self.done:
            while self.nxt < len(self.prompts) and self.running < self.bs:
                i = self.nxt
                self.started[i] = now()
                rid = f"{self.name}-{i}"  # outputs name it, or the id vLLM returns for it
                self.where[rid] = i
                self.where[self.engine.add_request(rid, self.prompts[i], self.params[i])] = i
                self.nxt, self.running = i + 1, self.running + 1
            for o in self.engine.step():
                i = self.where[o.request_id]
                new = o.outputs[0].token_ids
                self.tokens[i] += new
                made += len(new)
                if o.finished:
                    self.ended[i], self.finish[i] = now(), o.outputs[0].finish_reason
                    self.running -= 1
                    _report({"job": self.name, "tokens": len(self.tokens[i])})
        self.clock = now()
        return self.done

    def result(self) -> dict:
        from treedraft.plugin import profile

        if not self.done:
            raise RuntimeError(f"job {self.name!r} finished before its requests ended")
        n = len(self.prompts)
        out = {"tokens": self.tokens, "logprobs": [None] * n, "top_logprobs": [None] * n,
               "finish_reasons": self.finish, "prompt_logprobs": [None] * n,
               "wave_seconds": [self.clock],
               "spec": counter_delta(self.before, spec_counters(self.llm)),
               **_queue_times(self.started, self.ended, [len(t) for t in self.tokens],
                              self.bs)}
        if self.prof:
            out["profile"] = profile.delta(self.prof_before, profile.read(self.prof))
        return out


_SLICED: dict[str, Sliced] = {}  # this engine's jobs run in slices, by name


def full_batch_window(starts: list[float], ends: list[float], tokens: list[int], batch: int
                      ) -> tuple[list[float], float] | None:
    """A queue's stretch at full batch, from its requests' submission and end times (one
    clock) and output lengths, where each freed slot takes the next request at once (an
    engine's queue, a client at fixed concurrency): it runs from the `batch`-th submission
    to the first end after the last submission, after which the batch drains. Returns each
    request's tokens inside the stretch, pro rata of the part of its life the stretch holds
    (its tokens taken as even over its life), and the stretch's seconds: their ratio is the
    queue's tokens/s at full batch, what a server under steady load delivers. (Counting
    whole requests that ended at full batch instead, by Little's law, leaves out the slow
    ones still running when the queue empties and so favours configurations whose requests'
    speeds vary: a tree with prompt lookup.) None where fewer than `batch` requests ran."""
    if len(starts) < batch or batch < 1:
        return None
    last = max(starts)
    begin = sorted(starts)[batch - 1]
    end = min((e for e in ends if e > last), default=last)
    if end <= begin:
        return None
    share = [n * max(0.0, min(e, end) - max(s, begin)) / (e - s) if e > s else 0.0
             for s, e, n in zip(starts, ends, tokens, strict=True)]
    return share, end - begin


def _main(path: str) -> None:
    from vllm import LLM

    with open(path) as f:
        req = json.load(f)
    kwargs = {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32", "seed": 0,
              "disable_log_stats": False, **req["llm"]}
    t = time.perf_counter()
    llm = LLM(req["target"], speculative_config=req["speculative_config"], **kwargs)
    from treedraft.plugin import patching

    # patches treedraft applied in this process (with the engine in-process: the engine's own)
    _report({"ready": time.perf_counter() - t, "treedraft_patches": len(patching.applied())})
    if req.get("jobs") is not None:
        results = {job["name"]: _run_job(llm, job) for job in req["jobs"]}
        print(RESULT + json.dumps(results), flush=True)
        return
    for line in sys.stdin:  # `Engine`: a list of jobs per line, until stdin closes
        results = {job["name"]: _run_job(llm, job) for job in json.loads(line)}
        print(RESULT + json.dumps(results), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
