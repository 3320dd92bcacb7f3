"""Training sequences: prompts (chat template, first user turn) + the target's own replies.

Features
- `encode_prompts`: chat-templated prompt ids; prompts with >= max_seq_len tokens are counted
  and refused (or skipped with long_prompts=skip) before anything expensive runs.
- Self-distillation (`regenerate=True`): the target writes the assistant reply to every prompt,
  batched, at `gen_temperature`. Engines are a lazy registry of "module:function" strings:
  "transformers" (here, left-padded batched `generate`) and "vllm" (plugin/generate.py; only
  plugin/ imports vllm). An engine factory gets (loaded target, cfg) and returns
  `generate(prompts: list[list[int]], temperature) -> list[list[int]]` (replies, EOS kept if
  produced). `gen_temperatures` mixes temperatures (prompt i at temperatures[i % n]).
- Replies are cached as JSONL in out_dir/data/gen-<hash>.jsonl (hash of target, engine and
  sampling settings), appended batch by batch: a killed generation or a re-run only generates
  what is missing. Token ids only: small, not a hidden-state dump.
- Sharded under torchrun (`Shard`): rank r answers the prompts i with i % world == r (the
  transformers engine, on the rank's device; a vLLM engine places itself over
  gen_tensor_parallel_size GPUs, so rank 0's answers all) into a file of its own,
  gen-<hash>.rank<r>.jsonl; after a barrier rank 0 appends the shards to the shared cache and
  removes them, and after a second every rank reads the full cache. A cache read also reads
  the shards a killed run left: a torchrun run and a single process share one cache.
- `regenerate=False`: the dataset's own first assistant reply is used instead.
- Output: `Seq(id, input_ids, prompt_len)`; the loss covers positions >= prompt_len (the reply).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TrainConfig

logger = logging.getLogger(__name__)

# engine name -> "module:factory"; imported only when chosen (vLLM stays out of training/).
ENGINES: dict[str, str] = {
    "transformers": "treedraft.training.generate:transformers_engine",
    "vllm": "treedraft.plugin.generate:vllm_engine",
}


# engines that generate on the device of the process that calls them: each torchrun rank runs one
PER_RANK_ENGINES = frozenset({"transformers"})


@dataclass
class Shard:
    """This process's share of reply generation: prompt i is answered by rank i % world;
    `barrier` waits for every rank (torch.distributed's under torchrun)."""
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None, repr=False)

    def owns(self, i: int, engine: str) -> bool:
        """Whether this rank answers prompt i: its share with an engine that runs on the rank's
        device; all of them on rank 0 with an engine that places itself (vLLM: its
        gen_tensor_parallel_size GPUs)."""
        return i % self.world == self.rank if engine in PER_RANK_ENGINES else self.rank == 0

    def path(self, cache: Path) -> Path:
        """The file this rank appends its replies to: the cache itself in a single process."""
        return cache if self.world == 1 else shard_path(cache, self.rank)


SINGLE = Shard()  # one process answers every prompt


def shard_path(cache: Path, rank: int) -> Path:
    return cache.with_name(f"{cache.stem}.rank{rank}.jsonl")


@dataclass
class Seq:
    id: str
    input_ids: list[int]  # prompt + reply, at most max_seq_len
    prompt_len: int  # reply tokens start here


def encode_prompts(tokenizer, rows: list[tuple[str, list[dict]]], cfg: TrainConfig
                   ) -> list[tuple[str, list[int]]]:
    """(id, prompt ids) per row; too-long prompts are an error (or skipped, long_prompts=skip)."""
    from .data import first_turn
    from .target import encode_chat

    out = [(rid, encode_chat(tokenizer, first_turn(msgs))) for rid, msgs in rows]
    long = [len(ids) for _, ids in out if len(ids) >= cfg.max_seq_len]
    if long and cfg.long_prompts == "error":
        raise ValueError(
            f"{len(long)} of {len(out)} prompts of data={cfg.data!r} have >= max_seq_len="
            f"{cfg.max_seq_len} tokens (longest {max(long)}), leaving no room for a reply; raise "
            f"max_seq_len (e.g. --max-seq-len={max(long) + cfg.gen_max_new_tokens}) or drop "
            "them with --long-prompts=skip"
        )
    if long:
        logger.warning("skipping %d of %d prompts with >= max_seq_len=%d tokens",
                       len(long), len(out), cfg.max_seq_len)
    return [(rid, ids) for rid, ids in out if len(ids) < cfg.max_seq_len]


def build_sequences(loaded, rows: list[tuple[str, list[dict]]], cfg: TrainConfig,
                    data_dir: Path | None, first: frozenset[str] = frozenset(),
                    generate_missing: bool = True, held_out: frozenset[str] = frozenset(),
                    shard: Shard = SINGLE) -> list[Seq]:
    """Prompt + reply sequences for `rows` ((id, messages) pairs), cut at max_seq_len. Rows
    whose reply was not written (gen_time_limit_minutes, or generate_missing=False: the cache
    only) are left out; ids in `first` are answered before the others. With gen_all_replies,
    the cached replies at the other temperatures follow, as ids `<id>@T<t>` (none for the ids
    in `held_out`). Under torchrun (`shard`) each rank answers its share and every rank
    returns the sequences of all ranks' replies."""
    prompts = encode_prompts(loaded.tokenizer, rows, cfg)
    caches = reply_caches(loaded, cfg, data_dir) if cfg.regenerate else []
    if cfg.regenerate:
        replies = regenerate(loaded, prompts, cfg, caches, first, generate_missing, shard)
    else:
        replies = dataset_replies(loaded.tokenizer, rows, dict(prompts))
    seqs = [Seq(rid, (ids + replies[rid])[: cfg.max_seq_len], len(ids)) for rid, ids in prompts
            if rid in replies]
    if cfg.gen_all_replies:
        seqs += other_replies(prompts, cfg, caches, held_out)
    return seqs


def reply_caches(loaded, cfg: TrainConfig, data_dir: Path | None
                 ) -> list[tuple[float, Path | None, dict | None, dict[str, list[int]]]]:
    """(temperature, cache path, its meta, the replies it holds) per reply temperature: each
    has its own cache file, the one a single-temperature run with the same settings uses (no
    file without data_dir)."""
    from dataclasses import replace

    out = []
    for t in cfg.reply_temperatures():
        path, meta = (None, None) if data_dir is None else _cache_path(
            loaded, replace(cfg, gen_temperature=t, gen_temperatures=None), data_dir)
        out.append((t, path, meta, read_cache(path) if path else {}))
    return out


def other_replies(prompts: list[tuple[str, list[int]]], cfg: TrainConfig, caches: list,
                  held_out: frozenset[str]) -> list[Seq]:
    """Each prompt's cached replies (`reply_caches`, read before generation: what it writes is
    at the assigned temperatures) at the gen_temperatures its index does not assign, as
    sequences `<id>@T<t>`; held-out ids get none (their prompts must stay unseen)."""
    out = []
    for j, (t, _, _, cached) in enumerate(caches):
        out += [Seq(f"{rid}@T{t:g}", (ids + cached[rid])[: cfg.max_seq_len], len(ids))
                for i, (rid, ids) in enumerate(prompts)
                if i % len(caches) != j and rid in cached and rid not in held_out]
    if out:
        print(f"[treedraft] gen_all_replies: {len(out)} more sequences from the replies cached "
              "at the temperatures their prompts are not assigned", flush=True)
    return out


def dataset_replies(tokenizer, rows, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The first assistant reply of each row, tokenized by the chat template."""
    from .data import first_turn
    from .target import encode_chat

    out, missing = {}, []
    for rid, msgs in rows:
        if rid not in prompts:
            continue
        prompt = first_turn(msgs)
        reply = next((m for m in msgs[len(prompt):] if m["role"] == "assistant"), None)
        if reply is None:
            missing.append(rid)
            continue
        full = encode_chat(tokenizer, prompt + [reply], add_generation_prompt=False)
        p = prompts[rid]
        if full[: len(p)] != p:
            raise ValueError(f"prompt {rid}: the chat template of prompt+reply does not start "
                             "with the prompt's template; use regenerate=true")
        out[rid] = full[len(p):]
    if missing and not out:
        raise ValueError(f"none of the {len(missing)} prompts has an assistant reply (e.g. "
                         f"{missing[:3]}); use regenerate=true to let the target write them")
    if missing:
        print(f"skipping {len(missing)} of {len(missing) + len(out)} prompts without an assistant "
              f"reply (e.g. {missing[:3]}); regenerate=true lets the target write them")
    return out


def _cache_path(loaded, cfg: TrainConfig, data_dir: Path) -> tuple[Path, dict]:
    from .models import EMBEDDED_MODELS
    from .target import target_signature

    # an embedded target by its name: its converted folder's path differs between machines and
    # stage folders (the replies a GPU run sent back are reused by the next bundle), its
    # weights do not
    ident = loaded.name if loaded.name in EMBEDDED_MODELS else loaded.path
    meta = {"target": ident, "signature": target_signature(loaded.config, loaded.tokenizer)
            .to_dict(), "engine": cfg.gen_engine, "temperature": cfg.gen_temperature,
            "max_new_tokens": cfg.gen_max_new_tokens, "seed": cfg.seed,
            "dtype": generation_dtype(loaded, cfg) if cfg.gen_engine == "transformers"
            else "engine"}
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    return data_dir / f"gen-{digest}.jsonl", meta


def read_cache(path: Path) -> dict[str, list[int]]:
    """The replies in the cache file `path` and in the rank shards beside it."""
    out = {}
    for file in [path, *sorted(path.parent.glob(f"{path.stem}.rank*.jsonl"))]:
        if not file.is_file():
            continue
        with file.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill: generate it again
                    continue
                if "id" in rec:
                    out[rec["id"]] = rec["reply"]
    return out


def merge_shards(path: Path, meta: dict) -> None:
    """Append the rank shards beside the cache file `path` to it and remove them."""
    shards = sorted(path.parent.glob(f"{path.stem}.rank*.jsonl"))
    if not shards:
        return
    if not path.exists():
        path.write_text(json.dumps({"meta": meta}) + "\n")
    with path.open("a") as out:
        for shard in shards:
            out.writelines(line for line in shard.open()  # replies, no header, no cut line
                           if line.startswith('{"id"') and line.endswith("\n"))
            shard.unlink()


def prompts_per_call(cfg: TrainConfig) -> int:
    """Prompts per engine call: a batch for transformers, 64 batches for vLLM (it schedules)."""
    return cfg.gen_batch_size if cfg.gen_engine == "transformers" else 64 * cfg.gen_batch_size


def generation_order(todo: list[tuple[str, list[int]]], window: int | None,
                     first: frozenset[str] = frozenset()) -> list[tuple[str, list[int]]]:
    """Ids in `first`, then the rest; each sorted longest first (similar lengths share a batch,
    less left padding) over the whole list (window None) or within consecutive windows of
    `window` prompts, so a run cut short by a time limit has answered a sample of every length."""
    out = []
    for group in ([p for p in todo if p[0] in first], [p for p in todo if p[0] not in first]):
        step = window or max(len(group), 1)
        for i in range(0, len(group), step):
            out += sorted(group[i: i + step], key=lambda p: -len(p[1]))
    return out


def regenerate(loaded, prompts: list[tuple[str, list[int]]], cfg: TrainConfig,
               caches: list, first: frozenset[str] = frozenset(),
               generate_missing: bool = True, shard: Shard = SINGLE) -> dict[str, list[int]]:
    """Replies by the target to each prompt, from the caches (`reply_caches`) where present.
    With `gen_temperatures` prompt i is answered at temperatures[i % n], and batches of the
    temperatures take turns. With `gen_time_limit_minutes` no new batch starts after that
    long: the prompts not answered by then get no reply (ids in `first` are answered first, in
    every temperature). generate_missing=False reads the caches only (gen_cache_only; the
    resume of a run whose generation was cut, which must see the same data).
    Under torchrun (`shard`) this rank answers the prompts i with i % world == rank, then
    every rank reads all ranks' replies (`gather_shards`)."""
    if shard.world > 1 and generate_missing and any(c[1] is None for c in caches):
        raise ValueError("reply generation under torchrun shares the replies through the reply "
                         "cache: give a data_dir")
    done: dict[str, list[int]] = {}
    groups = []  # (temperature, cache path, meta, prompts to generate)
    for j, (t, path, meta, cached) in enumerate(caches):
        part = [(i, rid, ids) for i, (rid, ids) in enumerate(prompts) if i % len(caches) == j]
        done.update({rid: cached[rid] for _, rid, _ in part if rid in cached})
        todo = [(rid, ids) for i, rid, ids in part
                if rid not in cached and shard.owns(i, cfg.gen_engine)]
        # longest first, so each batch holds similar lengths (less left padding), within
        # windows of 16 batches under a time limit: a cut stays unbiased
        window = None if cfg.gen_time_limit_minutes is None else 16 * prompts_per_call(cfg)
        todo = generation_order(todo, window, first)
        if todo:
            groups.append((t, path, meta, todo))
    if groups and generate_missing:
        _generate(loaded, cfg, groups, done, len(caches), shard)
    if shard.world > 1 and generate_missing:
        done.update(gather_shards(prompts, caches, shard))
    if (missing := sum(rid not in done for rid, _ in prompts)) and shard.rank == 0:
        why = (f"gen_time_limit_minutes={cfg.gen_time_limit_minutes}" if generate_missing
               else "replies read from the cache only")
        print(f"[treedraft] {why}: {len(prompts) - missing} of {len(prompts)} prompts have a "
              f"reply; the other {missing} are left out (a later run with the same data_dir "
              "answers them)", flush=True)
    return done


def gather_shards(prompts: list[tuple[str, list[int]]], caches: list, shard: Shard
                  ) -> dict[str, list[int]]:
    """Every rank's replies, once each rank has written its share: rank 0 merges the shards
    into the caches between two barriers, then each rank reads the caches."""
    shard.barrier()  # every rank's shard is complete
    if shard.rank == 0:
        for _, path, meta, _ in caches:
            merge_shards(path, meta)
    shard.barrier()  # the caches hold every reply
    done = {}
    for j, (_, path, _, _) in enumerate(caches):
        cached = read_cache(path)
        done.update({rid: cached[rid] for rid, _ in prompts[j::len(caches)] if rid in cached})
    return done


def _generate(loaded, cfg: TrainConfig, groups: list, done: dict, n_temps: int,
              shard: Shard = SINGLE) -> None:
    """Answer each group's prompts (temperature, cache path, meta, ordered prompts), one batch
    of each group in turn, until done or past gen_time_limit_minutes; replies into `done` and
    appended to the group's cache (this rank's shard of it under torchrun)."""
    import time

    from tqdm.auto import tqdm

    module, fn = ENGINES[cfg.gen_engine].split(":")
    generate = getattr(importlib.import_module(module), fn)(loaded, cfg)
    chunk = prompts_per_call(cfg)
    temps = "/".join(f"{g[0]:g}" for g in groups)
    temp_note = "" if n_temps == 1 else f", T={temps}"
    rank_note = "" if shard.world == 1 else f", rank {shard.rank}/{shard.world}"
    bar = tqdm(total=sum(len(g[3]) for g in groups), unit="prompt", disable=not cfg.progress,
               desc=f"self-distill ({cfg.gen_engine}{temp_note}{rank_note})", position=shard.rank)
    groups = [(t, path and shard.path(path), meta, todo) for t, path, meta, todo in groups]
    for _, path, meta, _ in groups:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_text(json.dumps({"meta": meta}) + "\n")
    # one batch of each temperature in turn: a cut leaves every temperature its share
    batches = [[(t, path, todo[i: i + chunk]) for i in range(0, len(todo), chunk)]
               for t, path, _, todo in groups]
    order = [b[r] for r in range(max(map(len, batches))) for b in batches if r < len(b)]
    deadline = None if cfg.gen_time_limit_minutes is None else (
        time.perf_counter() + 60 * cfg.gen_time_limit_minutes)
    try:
        for t, path, part in order:
            if deadline is not None and time.perf_counter() > deadline:
                break
            replies = generate([ids for _, ids in part], t)
            lines = []
            for (rid, _), reply in zip(part, replies, strict=True):
                done[rid] = reply
                lines.append(json.dumps({"id": rid, "reply": reply}) + "\n")
            if path:
                with path.open("a") as f:
                    f.writelines(lines)
            bar.update(len(part))
    finally:
        bar.close()
        # an engine that loaded its own copy of the target frees it: the training target
        # loads only after this returns
        getattr(generate, "close", lambda: None)()


def generation_dtype(loaded, cfg: TrainConfig) -> str:
    """The dtype the transformers engine generates in: the run's compute dtype on the target's
    device (bf16 on a GPU or an AMX CPU: decoding is bound by reading the weights, which bf16
    halves). Part of the reply cache's key."""
    return cfg.compute_dtype(loaded.device)


def transformers_engine(loaded, cfg: TrainConfig):
    """Batched `generate` with left padding; replies cut after the first EOS.

    The training loop hands a target without weights (`open_target`): the engine loads it in
    `generation_dtype` and `generate.close()` frees it before the training target loads, so one
    copy of the target is resident at a time. A loaded target is used as it is where its dtype
    is the generation dtype, else the engine loads its own copy in that dtype."""
    from transformers import GenerationConfig

    from .target import load_target

    tok = loaded.tokenizer
    dtype = getattr(torch, generation_dtype(loaded, cfg))
    own = loaded.model is None or next(loaded.model.parameters()).dtype != dtype
    model = (load_target(loaded.path, dtype=dtype, device=loaded.device).model if own
             else loaded.model)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    device = next(model.parameters()).device
    calls = [0]

    @torch.inference_mode()
    def generate(prompts: list[list[int]], temperature: float) -> list[list[int]]:
        greedy = temperature == 0
        gen_cfg = GenerationConfig(
            max_new_tokens=cfg.gen_max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else temperature, top_k=None, top_p=None,
            eos_token_id=eos, pad_token_id=pad)
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: prompts end at the same column
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        torch.manual_seed(cfg.seed + calls[0])
        calls[0] += 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=gen_cfg)
        replies = []
        for row in out[:, width:].tolist():
            cut = row.index(eos) + 1 if eos in row else len(row)
            replies.append(row[:cut])
        return replies

    def close() -> None:
        nonlocal model
        model = None
        if own:
            import gc

            gc.collect()  # the copy is gone before the training target loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    generate.close = close
    return generate
