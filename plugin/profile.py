"""Step profile: where an engine step's time goes (`TREEDRAFT_PROFILE=FILE`, `treedraft bench --profile`).

With `TREEDRAFT_PROFILE` naming a file in the environment of the engine (its worker inherits
it), every V1 model runner built in that process times its step phases and rewrites FILE
(JSON, atomically) after each step; any engine, treedraft's or not (no speculation, vLLM's
ngram, chains, trees). Cumulative seconds per phase:

- `step`: `execute_model` + `sample_tokens` (the runner's whole step; vLLM's scheduler and the
  frontend are outside it);
- `prepare`: `_prepare_inputs` (input tensors; tree mode: the step's tree buffers and positions);
- `forward`: `_model_forward`, the target's forward over every scheduled row; it includes
- `tree_attention`: what branching trees add to attention in every layer (plugin/attention_cpu.py:
  the chain cover's metadata, scratch copies and row permutation, and the torch recomputation of
  trees left over);
- `verify`: `_sample` (no speculation: sampling; chains: vLLM's rejection sampler; trees:
  tree verification), which includes
- `kv_compaction`: moving accepted tree nodes' K/V to sequential slots (plugin/kv.py);
- `drafting`: `propose_draft_token_ids` (the head or lookup proposing the next drafts);
- `other` (derived by readers): step - prepare - forward - verify - drafting (vLLM's bookkeeping,
  logits, output lists).

Also `steps` (runner steps that scheduled tokens) and `tokens` (scheduled tokens, drafts
included). The timers wrap the runner instance's bound methods once its `__init__` has run,
i.e. outside treedraft's own class patches, so a phase includes treedraft's part of it. Readers
(scripts/engine.py) take differences of the file between jobs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .patching import Patch

PROFILE_ENV = "TREEDRAFT_PROFILE"
PHASES = ("step", "prepare", "forward", "tree_attention", "verify", "kv_compaction", "drafting")
COUNTS = ("steps", "tokens")
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
# runner method -> phase it is timed as
TIMED = {"execute_model": "step", "sample_tokens": "step", "_prepare_inputs": "prepare",
         "_model_forward": "forward", "_sample": "verify",
         "propose_draft_token_ids": "drafting"}


class StepProfile:
    """One runner's cumulative phase times, written to `path` after every step. On CUDA each
    timer synchronizes the device (otherwise kernels' time lands in whichever phase syncs)."""

    def __init__(self, path: str | os.PathLike, sync: bool = False) -> None:
        self.path = Path(path)
        self.sync = sync
        self.totals = dict.fromkeys((*PHASES, *COUNTS), 0.0)

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.totals))
        os.replace(tmp, self.path)


def _timed(profile: StepProfile, name: str, bound):
    phase = TIMED[name]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return bound(*args, **kwargs)
        finally:
            if profile.sync:
                import torch

                torch.cuda.synchronize()
            profile.add(phase, time.perf_counter() - t)
            if name == "execute_model":
                n = int(getattr(args[0], "total_num_scheduled_tokens", 0) or 0)
                profile.totals["steps"] += n > 0
                profile.totals["tokens"] += n
            elif name == "_sample":  # the tree step's own timers (attention, compaction)
                from . import tree_step

                step = tree_step.of_runner(bound.__self__)
                if step is not None:
                    profile.add("tree_attention", step.attention_seconds)
                    profile.add("kv_compaction", step.compaction_seconds)
            elif name == "sample_tokens":  # the end of a step
                profile.write()

    return timed


def instrument(runner, path: str | os.PathLike) -> StepProfile:
    """Time `runner`'s step phases into `path` (instance attributes over the class methods).
    The file starts at zero (a reader's first 'before' must not be an earlier engine's)."""
    profile = StepProfile(path, sync=getattr(runner.device, "type", "cpu") == "cuda")
    for name in TIMED:
        setattr(runner, name, _timed(profile, name, getattr(runner, name)))
    profile.write()
    return profile


def _rank0() -> bool:
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _wrap_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        path = os.environ.get(PROFILE_ENV)
        if path and _rank0():  # one writer per engine (tensor parallel ranks run the same steps)
            instrument(self, path)

    return __init__


WORKER_PATCHES = [
    Patch(f"{RUNNER}.__init__", _wrap_init,
          f"per-phase step times into ${PROFILE_ENV} (set in this process's environment)"),
]


def read(path: str | os.PathLike | None) -> dict[str, float]:
    """The profile file's totals ({} before the worker wrote any)."""
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def delta(before: dict, after: dict) -> dict[str, float]:
    """after - before per key, and `other` = step - the timed phases inside it."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (*PHASES, *COUNTS)}
    d["other"] = d["step"] - d["prepare"] - d["forward"] - d["verify"] - d["drafting"]
    return d


def per_step_ms(d: dict) -> dict[str, float]:
    """Milliseconds per step of each phase (and `other`) of a `delta`."""
    steps = d.get("steps") or 0
    if not steps:
        return {}
    return {k: 1000 * d[k] / steps for k in (*PHASES, "other")}
