"""`treedraft train` under torchrun: two real processes (gloo on the CPU) train one head.

Proves: two ranks launched by torchrun each write the replies of their share of the prompts
(prompt i on rank i % 2) and both train on all of them; the merged reply cache is the one a
single process reads (it generates nothing more); the two ranks train two DDP steps on a tiny
target and end with the same head weights, and those weights (and the logged losses) are the
single-process run's with the same sequences per step (batch_size 1 x 2 ranks = batch_size 1 x
grad_accum 2: DDP averages the ranks' mean losses as accumulation averages the
micro-batches'); only rank 0 writes the run. The script is its own worker (`--worker`): each
rank saves the head it ends with and what it generated and trained on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny_llama import tiny_llama


def overrides(target: Path, prompts: Path, data: Path, out: Path, **kw) -> list[str]:
    base = dict(target=target, data=prompts, num_prompts=7, eval_prompts=1, data_dir=data,
                gen_max_new_tokens=10, max_seq_len=64, batch_size=1, length_buckets=1,
                max_steps=2, warmup_steps=1, lr=3e-3, unroll_steps=2, measure_every=0,
                eval_max_new_tokens=0, acceptance_depth=2, out_dir=out, progress="false",
                num_threads=1)
    return [f"--{k}={v}" for k, v in {**base, **kw}.items()] + ["--head.draft_vocab_size=256"]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "train_log.jsonl").open()) if "loss" in r]


def test_two_torchrun_processes_train_the_single_process_head(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from treedraft.training import generate
    from treedraft.training.config import load_config
    from treedraft.training.loop import train

    target = tiny_llama(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n"
                               for i in range(8)))
    data = tmp_path / "data"  # the ranks write the replies, the single run reads them
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, "--worker", str(ddp), *overrides(target, prompts, data, ddp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [json.loads((ddp / f"data-rank{r}.json").read_text()) for r in (0, 1)]
    order = seen[0]["prompts"]
    assert len(order) == 8 and seen[1]["prompts"] == order
    for r in (0, 1):  # each rank wrote its share, each trained on every reply
        assert sorted(seen[r]["generated"]) == sorted(order[r::2])
        assert sorted(seen[r]["sequences"]) == sorted(order)
    caches = sorted(data.iterdir())  # the shards merged into the one cache a single run reads
    assert [p.name for p in caches if "rank" in p.name] == [] and len(caches) == 1
    assert len(generate.read_cache(caches[0])) == 8

    def no_generation(*a, **kw):
        raise AssertionError("the single run found a reply missing from the merged cache")

    monkeypatch.setattr(generate, "_generate", no_generation)
    single = train(load_config(None, overrides(target, prompts, data, tmp_path / "single",
                                               grad_accum=2)))
    ranks = [load_file(ddp / f"head-rank{r}.safetensors") for r in (0, 1)]
    mine = load_file(single / "model.safetensors")
    assert ranks[0].keys() == ranks[1].keys() and set(mine) <= set(ranks[0])
    for k in ranks[0]:
        torch.testing.assert_close(ranks[0][k], ranks[1][k], rtol=0, atol=0)
    for k in mine:
        torch.testing.assert_close(ranks[0][k], mine[k], rtol=1e-4, atol=1e-5)
    a, b = losses(tmp_path / "single"), losses(ddp)
    assert len(a) == len(b) == 2 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    assert (ddp / "final" / "model.safetensors").is_file()


def _worker(out: str, args: list[str]) -> None:
    """One torchrun rank: `train`, saving the head each rank ends with (at its final
    measurement, which every rank runs), the prompts it generated replies for and the sequences
    it trained and measured on (data-rank<r>.json)."""
    from safetensors.torch import save_file

    from treedraft.training import generate, loop
    from treedraft.training.config import load_config

    rank, measure = int(os.environ["RANK"]), loop.log_heldout
    seen = {"prompts": [], "generated": [], "sequences": []}
    regenerate, _generate, prepare_data = generate.regenerate, generate._generate, loop.prepare_data

    def record_regenerate(loaded, prompts, *a, **kw):
        seen["prompts"] = [rid for rid, _ in prompts]
        return regenerate(loaded, prompts, *a, **kw)

    def record_generate(loaded, cfg, groups, *a, **kw):
        seen["generated"] += [rid for _, _, _, todo in groups for rid, _ in todo]
        return _generate(loaded, cfg, groups, *a, **kw)

    def record_prepare_data(*a, **kw):
        train_seqs, eval_seqs, eval_rows = prepare_data(*a, **kw)
        seen["sequences"] = [s.id for s in train_seqs + eval_seqs]
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"data-rank{rank}.json").write_text(json.dumps(seen))
        return train_seqs, eval_seqs, eval_rows

    generate.regenerate, generate._generate = record_regenerate, record_generate
    loop.prepare_data = record_prepare_data

    def log_heldout(cfg, head, *a, **kw):
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()},
                  str(Path(out) / f"head-rank{rank}.safetensors"))
        return measure(cfg, head, *a, **kw)

    loop.log_heldout = log_heldout
    loop.train(load_config(None, args))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], sys.argv[3:])
