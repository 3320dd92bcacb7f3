"""The ``treedraft`` command: thin subcommands that parse arguments and call one function.

    treedraft model smollm2-135m                    # materialize / resolve a model, print its folder
    treedraft machine                               # CPU flags and the dtype picked from them
    treedraft prompts sharegpt --limit 3            # look at a prompt set
    treedraft demo                                  # the main job on the embedded default target
    treedraft eval --head none --prompts mtbench    # offline acceptance evaluator (reference decoder)
    treedraft train --config scripts/recipes/tiny-cpu.yaml --max-steps=20   # train a head
    treedraft bench                                 # vLLM: no-spec vs ngram vs chain vs trees
    treedraft load --url http://127.0.0.1:8000      # mixed request shapes against a vllm serve
    treedraft bundle runs/bundle --config R.yaml    # train on a GPU machine with nothing installed
    treedraft selftest                              # tree-attention kernel vs its torch twin here
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None]]
COMMANDS: dict[str, Command] = {}


def command(name: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register ``fn(args)`` as subcommand ``name``; ``add_arguments(parser)`` adds its flags."""

    def wrap(fn):
        COMMANDS[name] = (add_arguments, fn)
        return fn

    return wrap


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="embedded short name, local Hugging Face folder, or hub id")
    p.add_argument("--force", action="store_true", help="re-materialize an embedded model")


@command("model", _model_args)
def cmd_model(args: argparse.Namespace) -> None:
    """Resolve a model argument (materializing embedded models once) and print the folder."""
    from treedraft.training.models import EMBEDDED_MODELS, materialize, resolve_model

    if args.force and args.name in EMBEDDED_MODELS:
        print(materialize(args.name, force=True))
    else:
        print(resolve_model(args.name))



def _machine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", action="store_true",
                   help="print only the dtype this machine serves fastest (for vllm --dtype)")


@command("machine", _machine_args)
def cmd_machine(args: argparse.Namespace) -> None:
    """This CPU's model, the ISA flags that matter (avx2, avx512_f, avx512_bf16, amx_bf16) and
    the dtypes treedraft picks from them: serving (vLLM's kernels) bfloat16 with AMX or
    AVX512-BF16, training (torch's GEMMs) bfloat16 with AMX only; float32 otherwise."""
    from treedraft.heads.machine import default_dtype, describe

    print(default_dtype() if args.dtype else describe())


def _prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="mtbench | sharegpt | humaneval | FILE.jsonl")
    p.add_argument("--limit", type=int, default=3)


@command("prompts", _prompts_args)
def cmd_prompts(args: argparse.Namespace) -> None:
    """Print the size of a prompt set and its first rows."""
    import json

    from treedraft.training.data import load_prompts

    ds = load_prompts(args.source)
    print(f"{args.source}: {len(ds)} prompts")
    for row in ds.select(range(min(args.limit, len(ds)))):
        print(json.dumps(row, ensure_ascii=False)[:300])



def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)


@command("demo", _demo_args)
def cmd_demo(args: argparse.Namespace) -> None:
    """Main job on the embedded default: materialize the target, answer MT-bench questions with
    vLLM, and check that the reference tree decoder reproduces vLLM's greedy answer."""
    from treedraft.scripts.demo import run_demo

    run_demo(args.target, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)



def _eval_args(p: argparse.ArgumentParser) -> None:
    from treedraft.training.evaluate import EvalConfig

    d = EvalConfig()
    p.add_argument("--target", default=d.target, help="short name, HF folder or hub id")
    p.add_argument("--head", default=d.head, help="checkpoint folder, shipped head name, or 'none'")
    p.add_argument("--prompts", default=d.prompts, help="mtbench | humaneval | sharegpt | FILE.jsonl")
    p.add_argument("--tree", default=None,
                   help="chain:K | JSON paths | static:NODES | dynamic:NODES,DEPTH[,TOPK] "
                        "(default: the head's default_tree)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--stride", type=int, default=1,
                   help="every N-th prompt (mtbench --stride 5: 16 prompts, 2 per category)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="reference: the pure-torch reference decoder, one prompt at a time (the "
                        "ground truth); vllm: a batched vLLM engine with the plugin, same report")
    p.add_argument("--batch-size", type=int, default=16,
                   help="--engine vllm: requests per wave")
    p.add_argument("--dtype", default=None,
                   help="--engine vllm: float32, bfloat16, or auto (the device's serving dtype); "
                        "default: float32 on a CPU (as the reference), auto (bf16) on a GPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="--engine vllm on a GPU: share of its memory vLLM may take (vLLM's "
                        "default 0.9); lower it beside another process on the GPU")


@command("eval", _eval_args)
def cmd_eval(args: argparse.Namespace) -> None:
    """Acceptance evaluator: a head's tree over a prompt set (reference decoder or vLLM)."""
    import json

    from treedraft.training.evaluate import EvalConfig, evaluate, write_report

    cfg = EvalConfig(target=args.target, head=args.head, prompts=args.prompts, tree=args.tree,
                     temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                     max_new_tokens=args.max_new_tokens, limit=args.limit, stride=args.stride,
                     seed=args.seed)
    if args.engine == "vllm":
        from treedraft.scripts.eval_vllm import evaluate_vllm

        report = evaluate_vllm(cfg, batch_size=args.batch_size, dtype=args.dtype,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        report = evaluate(cfg)
    if args.json:
        write_report(report, args.json)
    summary = {k: v for k, v in report.items() if k not in ("outputs", "config")}
    print(json.dumps(summary, indent=1))



def _bench_args(p: argparse.ArgumentParser) -> None:
    from treedraft.scripts.bench import PRESETS

    def ints(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(","))

    def floats(s: str) -> tuple[float, ...]:
        return tuple(float(x) for x in s.split(","))

    q, f = PRESETS["quick"], PRESETS["full"]
    p.add_argument("--full", action="store_true",
                   help=f"the full benchmark: {f['limit']} prompts x {f['max_new_tokens']} tokens, "
                        f"batch sizes {','.join(map(str, f['batch_sizes']))}, torch.compile, "
                        f"configs {' '.join(f['configs'])} (hours on a CPU)")
    p.add_argument("--target", default="smollm2-135m", help="short name, HF folder or hub id")
    p.add_argument("--head", default="smollm2-135m-eagle", help="head folder or shipped name")
    p.add_argument("--prompts", default="mtbench",
                   help="prompt set(s): mtbench | humaneval | sharegpt | FILE.jsonl, or several "
                        "separated by commas (mtbench,humaneval), each one job per row")
    p.add_argument("--by-category", action="store_true",
                   help="one job per MT-bench category (other sets: one each), plus each set's "
                        "total; OUT/bench.md gains tokens per target pass by category")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N prompts of each set (first turns; default {q['limit']}, --full {f['limit']})")
    p.add_argument("--stride", type=int, default=None,
                   help="every N-th prompt, before --limit (mtbench --stride 10: one per "
                        f"category; default {q['stride']}, --full {f['stride']})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default {q['max_new_tokens']}, --full {f['max_new_tokens']}")
    p.add_argument("--batch-sizes", type=ints, default=None,
                   help=f"default {','.join(map(str, q['batch_sizes']))}")
    p.add_argument("--temperatures", type=floats, default=None,
                   help=f"default {','.join(f'{t:g}' for t in q['temperatures'])}")
    p.add_argument("--config", action="append", default=None,
                   help=f"repeatable: no-spec | ngram=K | chain=K | tree=SPEC | auto[=SPEC] | spec=JSON; the "
                        f"first is the speedup baseline (default: {' '.join(q['configs'])})")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md, PNGs")
    p.add_argument("--dtype", default="auto",
                   help="vLLM dtype; auto: bfloat16 where the CPU has AMX/AVX512-BF16, "
                        "float32 on AVX2-only CPUs (bf16 is several times slower there)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run every job N times in a row, each time on every configuration's "
                        "engine in turn, the order alternating (A B C, C B A, ...), and report "
                        "medians and the range of the per-round speedups (a shared machine's "
                        f"speed drifts over minutes; default {q['rounds']})")
    queue = p.add_mutually_exclusive_group()
    queue.add_argument("--continuous", dest="continuous", action="store_true", default=None,
                       help="queue each job's prompts with at most the batch size running, the "
                            "next starting as one finishes (a server's continuous batching; the "
                            "default)")
    queue.add_argument("--waves", dest="continuous", action="store_false",
                       help="waves of batch-size requests instead, each as long as its slowest")
    p.add_argument("--slice-tokens", type=int, default=None,
                   help="with a queue, the engines take turns on each part of a job a slice at "
                        "a time: N output tokens per batch slot, the order alternating, each "
                        "engine's clock running only in its own slices (default "
                        f"{q['slice_tokens']}; 0: each engine runs the part whole in turn)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                   help="time the engines from their first request (default: every engine "
                        "first runs each job's shape for 32 tokens per request, untimed)")
    p.add_argument("--seed", type=int, default=None,
                   help="vLLM's seed for every engine: which replies the T > 0 rows sample "
                        "(default: a new one each run, printed and kept in bench.json; give it "
                        "to draw the same replies again)")
    p.add_argument("--profile", action="store_true",
                   help="also time each engine step's phases (target forward, tree attention, "
                        "verification, KV compaction, drafting, the rest): OUT/profile.md")
    eager = p.add_mutually_exclusive_group()
    eager.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                       help="no torch.compile (the quick default; engines start in ~1 min)")
    eager.add_argument("--compile", dest="enforce_eager", action="store_false",
                       help="torch.compile as `vllm serve` does (the --full default)")


@command("bench", _bench_args)
def cmd_bench(args: argparse.Namespace) -> None:
    """Throughput and acceptance of no-spec, ngram, chain and tree speculation in vLLM."""
    from treedraft.scripts.bench import bench

    bench(args.target, args.head, args.prompts, args.limit, args.max_new_tokens,
          args.batch_sizes, args.temperatures, tuple(args.config) if args.config else None,
          args.out, dtype=args.dtype, enforce_eager=args.enforce_eager, stride=args.stride,
          preset="full" if args.full else "quick", profile=args.profile,
          by_category=args.by_category, rounds=args.rounds, continuous=args.continuous,
          warmup=args.warmup, slice_tokens=args.slice_tokens, seed=args.seed)


OVERRIDES_HELP = (
    "Any TrainConfig key can be set as --key=value (--max-steps=200, "
    "--head.draft-vocab-size=8192; see treedraft/training/config.py). Underscores work as "
    "dashes (--max_steps=200), and Hugging Face TrainingArguments names of the same settings "
    "as ours (--learning-rate for --lr, --num-train-epochs for --epochs, ...).")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML/JSON recipe, e.g. scripts/recipes/smollm2-135m-eagle.yaml")
    p.add_argument("--resume", help="checkpoint dir, or a run's out_dir (its newest checkpoint)")
    p.epilog = OVERRIDES_HELP


@command("train", _train_args)
def cmd_train(args: argparse.Namespace) -> None:
    """Train a draft head: self-distillation data, streamed target features, checkpoints."""
    from treedraft.training.checkpoint import checkpoint_config
    from treedraft.training.config import load_config
    from treedraft.training.loop import train

    base = checkpoint_config(args.resume).to_dict() if args.resume and not args.config else None
    final = train(load_config(args.config, args.overrides, base=base), resume=args.resume)
    if final is not None:  # rank 0 (or the only process)
        print(final)


cmd_train.accepts_overrides = True  # main() hands it the unparsed --key=value arguments


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("head", help="treedraft head folder or shipped name (EAGLE-3 layout or Medusa)")
    p.add_argument("out", help="folder to write")
    p.add_argument("--format", choices=("speculators", "vllm-medusa"), default=None,
                   help="speculators: EAGLE-3 as vLLM/SGLang load it ({'method': 'eagle3'}); "
                        "vllm-medusa: vLLM's Medusa ({'method': 'medusa'}). Default: the one "
                        "of the head's type")
    p.add_argument("--target", default="smollm2-135m",
                   help="the target it drafts for (recorded as the verifier; checked)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="chain length for stock vLLM (default: 3 for EAGLE-3, recorded in the "
                        "config; the number of heads for Medusa, at most that)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights dtype (default: the target checkpoint's, from its config.json: "
                        "float32 for SmolLM2, bfloat16 for Llama-3.1-8B)")


@command("export", _export_args)
def cmd_export(args: argparse.Namespace) -> None:
    """Write a head in another ecosystem's format (EAGLE-3 speculators or vLLM's Medusa). The
    target's config and tokenizer check the head; its weights are not loaded (a Medusa head
    sharing the target's LM head, or an EAGLE head whose LM head is the target's rows, reads
    that one tensor)."""
    import json

    import torch

    from treedraft.heads.common import load_head
    from treedraft.heads.medusa import VLLM_MEDUSA_FORMAT, save_vllm_medusa
    from treedraft.heads.shipped import resolve_head
    from treedraft.heads.speculators import save_speculators
    from treedraft.training.target import (
        checkpoint_dtype,
        open_target,
        read_lm_head,
        target_signature,
    )

    spec = open_target(args.target)
    head = load_head(resolve_head(args.head), target=target_signature(spec.config, spec.tokenizer))
    fmt = args.format or (VLLM_MEDUSA_FORMAT if head.head_type == "medusa" else "speculators")
    dtype = getattr(torch, args.dtype) if args.dtype else checkpoint_dtype(spec.config)
    k = args.num_speculative_tokens
    if fmt == VLLM_MEDUSA_FORMAT:  # checks the head type and k before writing
        if head.head_type == "medusa" and not head.config.own_lm_head:
            head.bind_target(None, read_lm_head(spec))
        out = save_vllm_medusa(head, args.out, dtype=dtype, num_speculative_tokens=k)
        method, k = "medusa", k or head.config.num_heads
    else:
        k = 3 if k is None else k
        if getattr(head.config, "lm_head_from_target", False):
            head.bind_target(None, read_lm_head(spec))
        out = save_speculators(head, args.out, verifier=spec.path, num_speculative_tokens=k,
                               dtype=dtype)
        method = "eagle3"
    spec_json = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": k})
    print(f"wrote {out}: serve it with vllm serve {spec.path} "
          f"--speculative-config '{spec_json}'")


def _load_args(p: argparse.ArgumentParser) -> None:
    from treedraft.scripts.load import add_arguments

    add_arguments(p)


@command("load", _load_args)
def cmd_load(args: argparse.Namespace) -> None:
    """Drive a running `vllm serve` (loopback) with mixed request shapes; JSON report."""
    from treedraft.scripts.load import run

    if run(args):
        sys.exit(1)


def _bundle_args(p: argparse.ArgumentParser) -> None:
    from treedraft.scripts.gpu_bundle import add_arguments

    add_arguments(p)
    p.epilog = OVERRIDES_HELP


@command("bundle", _bundle_args)
def cmd_bundle(args: argparse.Namespace) -> None:
    """Bundle code, wheels, target and prompts to train a head on a bare GPU machine."""
    from treedraft.scripts.gpu_bundle import run

    run(args, args.overrides)


cmd_bundle.accepts_overrides = True  # --key=value training overrides, as for train


def _selftest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="cache dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--heads", default=None, help="query heads, KV heads, head size (default: "
                   "Llama-3.1-8B's 32,8,128 on CUDA, 8,2,32 on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layout", default="LBNHC", choices=["LBNHC", "LBHNC"],
                   help="physical order of vLLM's CUDA cache (LBHNC: FlashInfer on SM100)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


@command("selftest", _selftest_args)
def cmd_selftest(args: argparse.Namespace) -> None:
    """Tree-attention self-test: one synthetic tree step through the Triton kernel and its torch
    twin, as an engine runs before its first tree step (CUDA if available, else CPU under the
    Triton interpreter with small shapes); exits 1 on a mismatch."""
    import json

    import torch

    from treedraft.plugin.attention_cuda import self_test

    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    hq, hkv, d = (int(x) for x in (args.heads or ("32,8,128" if cuda else "8,2,32")).split(","))
    shape = (4, args.block_size, hkv, 2 * d) if args.layout == "LBNHC" else \
        (4, hkv, args.block_size, 2 * d)
    kv = torch.empty(shape, dtype=dtype, device="cuda" if cuda else "cpu")
    kv = kv.transpose(1, 2) if args.layout == "LBNHC" else kv
    try:
        result = {"ok": True, **self_test(kv, hq, hkv, d)}
    except NotImplementedError as e:
        result = {"ok": False, "error": str(e)}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    if not result["ok"]:
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treedraft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").splitlines()[0], description=fn.__doc__)
        add_arguments(p)
        p.set_defaults(_fn=fn)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The subcommand's arguments; what it does not know is `args.overrides` (--key=value
    training overrides) where it accepts them, else an error."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args._fn, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        args._fn(args)
    except (ValueError, FileNotFoundError) as e:
        # Bad input: a clear one-line message and a non-zero exit, not a traceback.
        sys.exit(f"treedraft {args.command}: error: {e}")


if __name__ == "__main__":
    main()
