"""Several real vLLM engines, one after another, in one process (engine core and worker
in-process): each engine process pays seconds of Python and vLLM imports before it builds its
engine, so tests that need several engines start them here in one child.

    runs = run_engines({"base": {"target": t, "spec": None, "jobs": jobs},
                        "tree": {"target": t, "spec": {...}, "jobs": jobs, "llm": {...}}},
                       env={"TREEDRAFT_TREE_ATTENTION": "kernel"})
    results, log, events = runs["tree"]

    host = EngineHost({...})          # started now; each result read as it comes
    results, log, events = host.get("tree")

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

from treedraft.scripts.engine import PROGRESS, RESULT, _why, engine_env

ENGINE = "TREEDRAFT_ENGINE "  # the child's line before it builds each engine


class EngineHost:
    """The child that builds `engines` one after another (started at once), read as it runs:
    `get(name)` waits for that engine's result; earlier engines' tests need not wait for later
    ones. When the last result is in, the child shuts its last engine down while the tests go
    on. An engine that fails ends the child: `get` of it, or of any engine after it, raises
    RuntimeError with the failed engine's log."""

    def __init__(self, engines: dict[str, dict], *, env: dict[str, str] | None = None,
                 timeout: int = 3600) -> None:
        self.names, self.timeout = list(engines), timeout
        self.out: dict[str, tuple[dict, str, list[dict]]] = {}
        self.lines: list[str] = []
        self.current: str | None = None
        self.start: int | None = None
        self.ended = False  # the child exited and its output is read (under `lock`)
        self.lock = threading.Condition()
        self.paths = []
        for name, e in engines.items():
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"name": name, "target": str(e["target"]),
                           "speculative_config": e.get("spec"), "llm": e.get("llm") or {},
                           "jobs": e["jobs"], "env": e.get("env") or {}}, f)
            self.paths.append(f.name)
        self.proc = subprocess.Popen([sys.executable, __file__, *self.paths],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**engine_env(), **INPROC, **(env or {})})
        self.timer = threading.Timer(timeout, self.proc.kill)  # a hung engine fails the tests
        self.timer.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        events: list[dict] = []
        try:
            for line in self.proc.stdout:
                with self.lock:
                    self.lines.append(line)
                    if line.startswith(ENGINE):
                        self.current, self.start = line[len(ENGINE):].strip(), len(self.lines) - 1
                        events = []
                    elif line.startswith(PROGRESS):
                        events.append(json.loads(line[len(PROGRESS):]))
                    elif line.startswith(RESULT) and self.current is not None:
                        self.out[self.current] = (json.loads(line[len(RESULT):]),
                                                  "".join(self.lines[self.start:]), events)
                        self.lock.notify_all()
            self.proc.wait()
        finally:
            self.timer.cancel()
            for p in self.paths:
                os.unlink(p)
            with self.lock:
                self.ended = True
                self.lock.notify_all()

    def close(self) -> None:
        """Stop a child whose engines are not all done (tests that needed only some of them);
        one that is done shuts its last engine down on its own."""
        with self.lock:
            if len(self.out) == len(self.names) or self.ended:
                return
        self.proc.kill()

    def get(self, name: str) -> tuple[dict, str, list[dict]]:
        """(results, log, events) of engine `name`, once its jobs are done."""
        with self.lock:
            while name not in self.out and not self.ended:
                self.lock.wait()
            if name in self.out:
                return self.out[name]
            failed = self.current if self.current not in self.out else \
                self.names[len(self.out)]
            tail = "".join(self.lines[self.start:] if self.start is not None else self.lines)
        raise RuntimeError(f"vLLM engine {failed!r} failed ({_why(self.proc, self.timeout)}) "
                           f"before {name!r}; engines done: {list(self.out)}:\n{tail[-6000:]}")


def run_engines(engines: dict[str, dict], *, env: dict[str, str] | None = None,
                timeout: int = 3600) -> dict[str, tuple[dict, str, list[dict]]]:
    """Run each engine's jobs in one child process, in order; name -> (results, log, events).
    Returns at the last result line; the child shuts its last engine down in the background."""
    host = EngineHost(engines, env=env, timeout=timeout)
    return {name: host.get(name) for name in engines}


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
