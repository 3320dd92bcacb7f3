"""`TrainConfig`: the one source of truth of a training run.

    cfg = load_config("scripts/recipes/smollm2-135m-eagle.yaml", ["--lr=3e-4", "--head.num-heads=3"])

Features
- Every knob of `treedraft train` is a field of `TrainConfig`, with its default and a comment.
- `load_config(file, overrides)`: a YAML or JSON file, then `--key=value` overrides, each value
  typed from the field's annotation (`--max-steps=none`, `--cache-features=true`,
  `--head.target-layer-ids=[2,15,27]`). `--head.KEY=VALUE` sets one head-config override.
  Keys are written with dashes on the command line (as vLLM's flags); underscores are
  equivalent, and Hugging Face `TrainingArguments` names of the same settings are accepted
  for ours (`HF_ALIASES`: `--learning-rate` sets `lr`). An unknown key is an error that lists
  the valid keys.
- `validate()` checks values (head type, engine, dtype, ...) before any expensive work.
- `diff(a, b)` names the keys that differ except `RESUMABLE_KEYS` (what --resume may change).
- `save(path)` writes the config as JSON next to every checkpoint (`train_config.json`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEAD_TYPES = ("eagle", "medusa")
GEN_ENGINES = ("transformers", "vllm")
DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", *DTYPES)  # auto: from the machine (heads/machine.py)
TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")
LONG_PROMPTS = ("error", "skip")
SCHEDULES = ("cosine", "wsd")
OOV_ROWS = ("keep", "mask")
CONFIG_FILE = "train_config.json"


@dataclass
class TrainConfig:
    # --- model
    target: str = "smollm2-135m"  # embedded short name, HF folder or hub id
    head_type: str = "eagle"  # eagle | medusa
    head: dict[str, Any] = field(default_factory=dict)  # head-config overrides, e.g.
    #   eagle: target_layer_ids, draft_vocab_size, intermediate_size; medusa: num_heads, num_layers
    init_from: str | None = None  # start from this head's weights (folder or shipped name; same
    #   head_type and shape), e.g. to continue a finished run with a new schedule or more data
    #   A NEW eagle head (no init_from, no --resume) defaults to EAGLE-3 (exportable to stock
    #   vLLM): layout eagle3, fuse_norm true, target_layer_ids auto = (2, L//2, L-3), vLLM's
    #   default auxiliary layers (heads/speculators.py default_layer_ids; clamped into 0..L-1
    #   for targets of fewer than 7 layers); `head:` keys override each
    target_dtype: str = "auto"  # the target's weights: auto | float32 | bfloat16 | float16.
    #   auto: the run's compute dtype on a GPU (bfloat16: 16 GB for an 8B target, not 32),
    #   float32 on a CPU (torch's bf16 GEMMs are slower there except with AMX)
    memory_check: bool = True  # print the memory estimate (target weights + head + optimizer +
    #   activations) before loading and refuse a run that would not fit the GPU (or the RAM)
    # --- data
    data: str = "sharegpt"  # sharegpt | humaneval | FILE.jsonl (never mtbench)
    num_prompts: int = 1000  # training prompts (the first ones of `data`, MT-bench rows dropped)
    prompt_offset: int = 0  # skip this many prompts of `data` first: continue a head (init_from)
    #   on prompts it has not seen (the shipped EAGLE head saw the first 2400 of sharegpt)
    eval_prompts: int = 4  # held-out prompts after the training ones (same source)
    long_prompts: str = "error"  # prompts with >= max_seq_len tokens: error | skip
    regenerate: bool = True  # self-distillation: the target writes the replies
    gen_engine: str = "transformers"  # transformers | vllm
    gen_temperature: float = 0.7
    gen_temperatures: list[float] | None = None  # a mix, e.g. [0, 1]: prompt i's reply is
    #   written at gen_temperatures[i % n] (the temperatures the head will serve); replaces
    #   gen_temperature. Each temperature has its own reply cache (shared with single-T runs)
    gen_max_new_tokens: int = 256
    gen_batch_size: int = 16
    gen_tensor_parallel_size: int = 1  # vllm engine: GPUs the generation engine shards the
    #   target over (vLLM's tensor_parallel_size); single-process runs only (see gen_only)
    gen_gpu_memory_utilization: float = 0.9  # vllm engine: share of the GPU vLLM may take; it
    #   starts before the training target loads and is shut down before it does
    gen_only: bool = False  # write the replies, then stop before the training target loads:
    #   generate once with a vLLM engine over all GPUs, then train under torchrun on the cache
    gen_time_limit_minutes: float | None = None  # stop writing replies after this long and train
    #   on those written (prompts taken in data order, length-sorted within windows, so a cut
    #   keeps an unbiased sample; held-out prompts first); None = answer every prompt
    gen_cache_only: bool = False  # write no replies: train on the prompts the reply cache in
    #   data_dir answers (e.g. a GPU run's, for a second head on the same data), skip the rest
    gen_all_replies: bool = False  # also train on each training prompt's cached replies at the
    #   gen_temperatures its index does not assign (e.g. the greedy replies an all-T=0 run wrote
    #   to the odd prompts that [0, 1] answers at T=1): more sequences, no generation; the
    #   held-out prompts never get them
    max_seq_len: int = 1024  # prompt + reply tokens; longer sequences are cut
    # --- optimisation
    batch_size: int = 4  # sequences per micro-batch (per process)
    length_buckets: int = 16  # micro-batches of similar length: each window of this many
    # micro-batches of the epoch's shuffled order is sorted by length, then the micro-batches are
    # shuffled again (1 = plain random batches; padding was ~35% of positions that way)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20  # none with init_from: continuing a trained head does not warm up again
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay: constant, then linear to 0)
    decay_fraction: float = 0.2  # wsd: the last fraction of the run (steps or time) that decays
    max_steps: int | None = None  # None -> epochs over the training sequences; 0 with
    #   init_from: no training, measure that head's acceptance rates and save it with them
    epochs: float = 1.0
    grad_clip: float = 1.0  # max grad norm; 0 = off
    unroll_steps: int = 3  # EAGLE training-time test depth D (1 = plain teacher forcing)
    unroll_curriculum: float = 0.0  # EAGLE: the unroll depth grows from 1 to unroll_steps over
    #   this first fraction of the run (steps, or time with time_limit_minutes); 0 = full depth
    step_weights: list[float] | None = None  # weight of unroll step / Medusa head k; None -> decay**k
    step_weight_decay: float = 0.8
    feature_loss_weight: float = 0.0  # EAGLE-1 smooth-L1 regression to the target's feature
    oov_rows: str = "keep"  # EAGLE with a draft vocab: rows whose target argmax lies outside it
    #   keep (labels renormalised over the draft vocab) | mask (left out of the loss, EAGLE-3)
    dtype: str = "auto"  # autocast of target + head forward (and the generation copy):
    #   auto | float32 | bfloat16. bf16 is ~2x on CPUs with AMX, 1.4x SLOWER with AVX512-BF16
    #   and no AMX, ~3.5x SLOWER on AVX2-only CPUs; auto picks bf16 only where it is fast for
    #   the job (training: AMX; vLLM generation: AMX or AVX512-BF16); soft labels stay float32
    num_threads: int | None = None  # torch intra-op threads; None = torch's default. On a
    #   shared CPU, fewer threads than cores avoids OpenMP oversubscription (10x slowdowns)
    compile: bool = False  # torch.compile target forward, head forward and KL: ~5 min of
    #   compiling at start; ~2x for the float32 target on CPU, little on top of bfloat16
    # --- evaluation, checkpoints, logging
    eval_every: int = 0  # steps between run_eval on the held-out prompts; 0 = only at the end
    measure_every: int = 0  # steps between teacher-forced held-out top-1/top-k per unroll depth
    #   (a target + head forward over the held-out sequences; logged as `heldout`); 0 = end only
    eval_tree: str | None = None  # None -> the head's default_tree
    eval_max_new_tokens: int = 64  # 0 = no run_eval (the teacher-forced `heldout` stays)
    eval_temperature: float = 0.0
    acceptance_depth: int = 6  # depths measured for head.config.acceptance_rates (EAGLE)
    acceptance_topk: int = 8  # ranks measured per depth
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest step checkpoints kept (0 = keep all)
    out_dir: str = "runs/train"
    data_dir: str | None = None  # cache of regenerated replies; None -> out_dir/data (share it
    #   between runs with the same target, data and gen_* settings)
    seed: int = 0
    # Per invocation (not inherited by --resume): stop early with a checkpoint after this many
    # steps / minutes of THIS run; the schedule still targets max_steps, so --resume continues
    # the same curve (time-boxed sessions, and how the tests simulate a kill).
    stop_after_steps: int | None = None
    time_limit_minutes: float | None = None
    # The run's training time over ALL its invocations (each --resume adds its own; the
    # checkpoint keeps the sum): the schedule's clock (decay finished when it is spent) and the
    # run's end. Lets a time-boxed run go on in pieces (a GPU lent for calls of a few minutes:
    # --time-limit-minutes per call, --resume the next) on ONE schedule; time_limit_minutes
    # alone restarts its clock at each invocation.
    budget_minutes: float | None = None
    progress: bool = True  # tqdm bars
    # --- optional feature cache (default: stream target features, no disk)
    cache_features: bool = False
    cache_dtype: str = "bfloat16"
    cache_topk: int = 64  # target distribution stored as its top-k (renormalised in the loss)

    def validate(self) -> None:
        """Raise ValueError naming the bad key and its valid values."""
        choices = {"head_type": HEAD_TYPES, "gen_engine": GEN_ENGINES, "dtype": COMPUTE_DTYPES,
                   "target_dtype": TARGET_DTYPES,
                   "cache_dtype": DTYPES, "long_prompts": LONG_PROMPTS, "schedule": SCHEDULES,
                   "oov_rows": OOV_ROWS}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ValueError(f"{key}={getattr(self, key)!r}; valid values: {', '.join(valid)}")
        positive = ["num_prompts", "gen_max_new_tokens", "gen_batch_size", "max_seq_len",
                    "batch_size", "length_buckets", "grad_accum", "unroll_steps", "acceptance_depth",
                    "acceptance_topk", "cache_topk", "gen_tensor_parallel_size"]
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        temps = self.reply_temperatures()
        if not temps or any(t < 0 for t in temps):
            raise ValueError(f"gen_temperatures={self.gen_temperatures!r} must be a non-empty list "
                             "of temperatures >= 0 (0 = greedy), e.g. --gen-temperatures=[0,1]"
                             if self.gen_temperatures is not None else
                             f"gen_temperature={self.gen_temperature} must be >= 0 (0 = greedy)")
        for key in ("time_limit_minutes", "budget_minutes"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be > 0 (or none)")
        if self.gen_time_limit_minutes is not None and self.gen_time_limit_minutes <= 0:
            raise ValueError(f"gen_time_limit_minutes={self.gen_time_limit_minutes} must be > 0 "
                             "(or none: answer every prompt)")
        if not 0 < self.gen_gpu_memory_utilization <= 1:
            raise ValueError(f"gen_gpu_memory_utilization={self.gen_gpu_memory_utilization} must "
                             "be in (0, 1]: the share of the GPU the vLLM engine may take")
        if self.eval_max_new_tokens < 0:
            raise ValueError(f"eval_max_new_tokens={self.eval_max_new_tokens} must be >= 0 "
                             "(0 = no run_eval at the end)")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1 (or none: use epochs; "
                             "0 with init_from: measure only)")
        if self.max_steps == 0 and not self.init_from:
            raise ValueError("max_steps=0 trains nothing: it measures init_from's acceptance "
                             "rates on the held-out sequences and saves that head with them; "
                             "set init_from=HEAD, or max_steps >= 1 to train")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs} must be > 0 when max_steps is none")
        if not 0 <= self.unroll_curriculum <= 1:
            raise ValueError(f"unroll_curriculum={self.unroll_curriculum} must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.prompt_offset < 0:
            raise ValueError(f"prompt_offset={self.prompt_offset} must be >= 0")
        if self.eval_prompts < 0:
            raise ValueError(f"eval_prompts={self.eval_prompts} must be >= 0")
        if self.data == "mtbench":
            raise ValueError("data=mtbench: MT-bench is the evaluation set, never train on it")

    def reply_temperatures(self) -> list[float]:
        """The temperatures self-distillation writes replies at: `gen_temperatures` (prompt i at
        the i-th mod n) or the single `gen_temperature`."""
        return [self.gen_temperature] if self.gen_temperatures is None else self.gen_temperatures

    def compute_dtype(self, device: Any = None, workload: str = "train") -> str:
        """`dtype` with 'auto' resolved for the device that runs the work ('bfloat16' or
        'float32'): training's torch GEMMs by default, `workload='serve'` for a vLLM engine
        (generation). device None: a GPU where one is visible, else this CPU (its flags)."""
        from treedraft.heads.machine import resolve_dtype

        return resolve_dtype(self.dtype, work_device(device), workload=workload)

    def target_torch_dtype(self, device: Any = None) -> Any:
        """The torch dtype the target's weights load in on `device` (`target_dtype`)."""
        import torch

        device = work_device(device)
        if self.target_dtype != "auto":
            return getattr(torch, self.target_dtype)
        if device.type == "cuda":
            return getattr(torch, self.compute_dtype(device))
        return torch.float32

    def loss_weights(self, n: int, what: str) -> list[float]:
        """Weight of each of the n loss terms (EAGLE unroll steps / Medusa heads)."""
        if self.step_weights is None:
            return [self.step_weight_decay**k for k in range(n)]
        if len(self.step_weights) != n:
            raise ValueError(f"step_weights has {len(self.step_weights)} entries but there are "
                             f"{n} {what}: give one weight each (or none for decay**k)")
        return list(self.step_weights)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def work_device(device: Any = None) -> Any:
    """`device` as a torch.device; None: cuda where a GPU is visible, else cpu."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# Keys a --resume may change: they do not alter the math of the steps already taken.
RESUMABLE_KEYS = frozenset({
    "out_dir", "data_dir", "max_steps", "epochs", "eval_every", "measure_every", "eval_tree",
    "eval_max_new_tokens",
    "eval_temperature", "save_every", "keep_checkpoints", "stop_after_steps",
    "time_limit_minutes", "progress", "acceptance_depth", "acceptance_topk", "num_threads",
    "memory_check", "gen_only", "gen_tensor_parallel_size", "gen_gpu_memory_utilization",
})


PER_RUN_KEYS = ("stop_after_steps", "time_limit_minutes")


def diff(a: TrainConfig, b: TrainConfig, ignore: frozenset[str] = RESUMABLE_KEYS) -> list[str]:
    """Keys whose values differ between a and b (outside `ignore`), as 'key: a -> b'."""
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} -> {db[k]!r}" for k in da if k not in ignore and da[k] != db[k]]


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """`value` (from a file, or a string from the command line) as type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, inner[0], value)
    if isinstance(value, str) and tp is not str:
        value = _parse_scalar(value, origin or tp)
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}
    base = origin or tp
    if base in ok:
        if not ok[base](value):
            raise ValueError(f"{key}={value!r} is not a valid {base.__name__}")
        return float(value) if base is float else value
    if base in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}={value!r} must be a list")
        item = args[0] if args else Any
        items = [v if item is Any else _coerce(key, item, v) for v in value]
        return tuple(items) if base is tuple else items
    if base is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r} must be a mapping")
        return dict(value)
    return value


def _parse_scalar(text: str, tp: Any) -> Any:
    """A command-line string as `tp`: "1e-3" -> 0.001, "3" -> 3, "true" -> True, "[1, 2]"."""
    import yaml

    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            return text  # reported by the type check with the key's name
    return yaml.safe_load(text)


def _valid_keys_msg() -> str:
    return ", ".join(f.name for f in dataclasses.fields(TrainConfig))


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from a mapping; unknown keys and wrongly typed values are errors."""
    hints = _hints()
    unknown = sorted(set(d) - set(hints))
    if unknown:
        close = [f"{k} -> {m[0]}" for k in unknown
                 if (m := difflib.get_close_matches(k, hints, n=1))]
        raise ValueError(
            f"unknown config keys {unknown}; valid keys: {_valid_keys_msg()}"
            + (f". Did you mean: {', '.join(close)}?" if close else "")
            + ". Dashes work as underscores; Hugging Face TrainingArguments names accepted: "
            + ", ".join(f"{hf} (= {ours})" for hf, ours in HF_ALIASES.items()))
    return TrainConfig(**{k: _coerce(k, hints[k], v) for k, v in d.items()})


# Hugging Face `TrainingArguments` names of the same settings, accepted for ours (files and
# overrides; checkpoints and recipes keep ours). Same-named ones need no entry (warmup_steps,
# weight_decay, seed, max_steps). eval_steps has no alias: eval_every and measure_every both fit.
HF_ALIASES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm": "grad_clip",
    "output_dir": "out_dir",
    "save_steps": "save_every",
    "save_total_limit": "keep_checkpoints",
    "torch_compile": "compile",
}


def canonical_key(key: str) -> str:
    """Our name of a config key: dashes as underscores (`max-steps` -> `max_steps`), Hugging
    Face names as ours (`learning-rate` -> `lr`)."""
    key = key.replace("-", "_")
    return HF_ALIASES.get(key, key)


def canonical_keys(d: dict[str, Any], where: str) -> dict[str, Any]:
    """`d` with every key spelled as ours; two spellings of one key in `d` are an error."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = canonical_key(str(key))
        if name in out:
            raise ValueError(f"{where}: {key!r} sets {name!r} a second time; keep one of them")
        out[name] = value
    return out


def parse_overrides(args: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """['--learning-rate=1e-3', '--head.num-heads=3'] -> ({'lr': '1e-3'}, {'num_heads': 3})
    (keys as `canonical_key` spells them)."""
    import yaml

    flat: dict[str, Any] = {}
    head: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"override {arg!r} must look like --key=value")
        key, value = arg[2:].split("=", 1)
        key = canonical_key(key)
        if key.startswith("head."):
            head[key[5:]] = yaml.safe_load(value)
        else:
            flat[key] = value
    return flat, head


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                base: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- `base` (e.g. a checkpoint's config) <- YAML/JSON file <- --key=value
    overrides (`--head={}` replaces the head overrides, `--head.KEY=V` sets one); validated."""
    d: dict[str, Any] = dict(base or {})
    if path is not None:
        d.update(canonical_keys(read_file(path), str(path)))
    flat, head = parse_overrides(overrides)
    d.update(flat)
    if head:
        d["head"] = {**_coerce("head", dict, d.get("head") or {}), **head}
    cfg = from_dict(d)
    cfg.validate()
    return cfg


def read_file(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    d = yaml.safe_load(path.read_text()) or {}  # YAML is a superset of JSON
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a mapping of config keys, got {type(d).__name__}")
    return d
