"""Several real vLLM engines, one after another, in one process (engine core and worker
in-process): each engine process pays seconds of Python and vLLM imports before it builds its
engine, so tests that need several engines start them here in one child.

    runs = run_engines({"base": {"target": t, "spec": None, "jobs": jobs},
                        "tree": {"target": t, "spec": {...}, "jobs": jobs, "llm": {...}}},
                       env={"TREEDRAFT_TREE_ATTENTION": "kernel"})
    results, log, events = runs["tree"]

Each engine is exactly what `treedraft.scripts.engine.run_engine` starts (its child's `_main`:
the same `LLM(...)` defaults, jobs and result line), built in the order given after the
previous one has been dropped; `log` is the child's output from that engine's start to its
result, `events` its progress events (`ready` first, then one per wave). An engine's own
`env` is set in the child's environment while it is built and runs, for variables read then
(TREEDRAFT_CACHE, TREEDRAFT_TREE_ATTENTION); those read once per process go in `env` for the
whole child (VLLM_PLUGINS; TREEDRAFT_PROFILE, whose timers the plugin installs at start-up).

Order: engines without speculation before tree engines (a tree engine registers tree attention
backends and runner patches that stay in the process; tests/two_engines.py proves a plain engine
built first stays exact), and vLLM's ngram method last: its drafter imports numba, whose objects
make vLLM's Triton-override scan fail when the next engine of the process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

from vllm_run import INPROC

from treedraft.scripts.engine import PROGRESS, RESULT, _drain, engine_env

ENGINE = "TREEDRAFT_ENGINE "  # the child's line before it builds each engine


def run_engines(engines: dict[str, dict], *, env: dict[str, str] | None = None,
                timeout: int = 3600) -> dict[str, tuple[dict, str, list[dict]]]:
    """Run each engine's jobs in one child process, in order; name -> (results, log, events).
    Returns at the last result line; the child shuts its last engine down in the background."""
    paths = []
    for name, e in engines.items():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"name": name, "target": str(e["target"]),
                       "speculative_config": e.get("spec"), "llm": e.get("llm") or {},
                       "jobs": e["jobs"], "env": e.get("env") or {}}, f)
        paths.append(f.name)
    names, out = list(engines), {}
    lines: list[str] = []
    current: str | None = None
    start = events = None
    try:
        proc = subprocess.Popen([sys.executable, __file__, *paths], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**engine_env(), **INPROC, **(env or {})})
        timer = threading.Timer(timeout, proc.kill)  # a hung engine must not hang the tests
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(ENGINE):
                    current, start, events = line[len(ENGINE):].strip(), len(lines) - 1, []
                elif line.startswith(PROGRESS) and events is not None:
                    events.append(json.loads(line[len(PROGRESS):]))
                elif line.startswith(RESULT) and current is not None:
                    out[current] = (json.loads(line[len(RESULT):]), "".join(lines[start:]),
                                    events)
                    if len(out) == len(names):
                        break
        finally:
            if len(out) == len(names):  # the last engine shuts down while the tests go on
                threading.Thread(target=_drain, args=(proc, timer), daemon=True).start()
            else:
                proc.kill()
                proc.wait()
                timer.cancel()
    finally:
        for p in paths:
            os.unlink(p)
    if len(out) < len(names):
        failed = current if current not in out else names[len(out)]
        why = f"killed after {timeout} s" if proc.returncode == -9 else f"exit {proc.returncode}"
        tail = "".join(lines[start:] if start is not None else lines)[-6000:]
        raise RuntimeError(f"vLLM engine {failed!r} failed ({why}); engines done: "
                           f"{list(out)}:\n{tail}")
    return out


def _main(paths: list[str]) -> None:
    import gc

    from treedraft.scripts import engine

    for path in paths:
        with open(path) as f:
            req = json.load(f)
        print(ENGINE + req["name"], flush=True)
        before = {k: os.environ.get(k) for k in req["env"]}
        os.environ.update(req["env"])
        try:
            engine._main(path)  # builds the engine, runs the jobs, prints the result line
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        gc.collect()  # the dropped LLM releases its engine (vLLM's finalizers) before the next
        print(f"engine_host: {req['name']} done, resident memory {_rss_mib()} MiB", flush=True)


def _rss_mib() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    _main(sys.argv[1:])
