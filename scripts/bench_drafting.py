"""What a serving step's drafting costs the head, outside vLLM, by batch size and tree.

    python -m treedraft.scripts.bench_drafting
    python -m treedraft.scripts.bench_drafting --trees chain:1,chain:3 --batch 1,16 --pairs 4

One drafting step as plugin/proposer.py runs it for greedy requests: B draft sessions of the
shipped EAGLE head (contexts of 100 + 7 i pairs, session i) each commit `--pairs` new pairs
(target features, next token) in one packed head forward (`EagleSession.commit_many`), then
draft the tree together, one packed forward per level (`heads.lookup.draft_hybrids`). The
head runs as the plugin loads it: in this machine's serving dtype, its linear layers and norms
on vLLM's CPU kernels, and, in the `fused` column, its q/k/v and gate/up projections fused
(`EagleHead.fuse_projections`, what the plugin does); the `separate` column runs the head as
saved. The two alternate in one process, `--rounds` rounds of 10 steps each, and the table
shows medians: ms per step and their ratio. The target's weights are random (the head's LM
head reads the target's rows): drafts are the shipped head's arithmetic on random inputs,
speed only.

In the engine a step's drafting also gathers the step's features and feeds the pending pairs
(`treedraft bench --profile`'s `drafting` column), and the target's forward has just evicted
the head's weights from the caches: expect its drafting to cost more than this.
"""

from __future__ import annotations

import argparse
import statistics
import time

TREES = "chain:1,chain:3,dynamic:10,3,3"


def drafting_step(fused: bool, spec, batch: int, pairs: int, dtype):
    """A function running one drafting step of `batch` sessions (see the module doc)."""
    import torch

    from treedraft.heads.common import load_head
    from treedraft.heads.eagle import EagleSession
    from treedraft.heads.lookup import draft_hybrids
    from treedraft.heads.shipped import resolve_head
    from treedraft.plugin.cpu_kernels import use_vllm_gemm, use_vllm_rms_norm

    head = load_head(resolve_head("smollm2-135m-eagle")).to(dtype).eval()
    V, H = head.config.target.vocab_size, head.config.target.hidden_size
    g = torch.Generator().manual_seed(1)
    weights = (torch.randn(V, H, generator=g) * 0.02).to(dtype)
    head.bind_target(weights, weights)
    if fused:
        head.fuse_projections()
    use_vllm_gemm(head)
    use_vllm_rms_norm(head)
    width = len(head.config.target_layer_ids) * H
    sessions = [head.draft_session() for _ in range(batch)]
    for i, s in enumerate(sessions):
        n = 100 + 7 * i
        s.commit(torch.randn(n, width, generator=g).to(dtype),
                 torch.randint(0, V, (n,), generator=g))
    starts = [s.length for s in sessions]
    new = [(torch.randn(pairs, width, generator=g).to(dtype),
            torch.randint(0, V, (pairs,), generator=g)) for _ in sessions]

    def step():
        for s, n in zip(sessions, starts, strict=True):
            s.rewind(n)  # the same context every step
        EagleSession.commit_many([(s, h, t) for s, (h, t) in zip(sessions, new, strict=True)])
        return draft_hybrids([(s.last_token, s, None) for s in sessions], spec)

    return step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=TREES, help=f"comma-separated tree specs (default {TREES})")
    ap.add_argument("--batch", default="1,4,16", help="batch sizes, comma-separated")
    ap.add_argument("--pairs", type=int, default=2,
                    help="pairs each session commits per step (1 + the drafts it accepted)")
    ap.add_argument("--dtype", default="auto", help="auto: this machine's serving dtype")
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args(argv)
    import torch

    from treedraft.heads.machine import describe, resolve_dtype
    from treedraft.heads.tree import parse_tree_spec

    dtype = getattr(torch, resolve_dtype(a.dtype))
    trees = _split_specs(a.trees)
    print(f"[bench_drafting] {describe()}; head {dtype}, {a.pairs} pairs committed per session "
          f"and step; ms per drafting step, median of {a.rounds} rounds of 10", flush=True)
    print("| tree | batch | separate | fused | fused / separate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for text in trees:
        spec = parse_tree_spec(text)
        for batch in (int(b) for b in a.batch.split(",")):
            steps = {k: drafting_step(k, spec, batch, a.pairs, dtype) for k in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            for f in steps.values():  # warm-up
                for _ in range(5):
                    f()
            for r in range(a.rounds):
                for k in ((False, True) if r % 2 else (True, False)):
                    t = time.perf_counter()
                    for _ in range(10):
                        steps[k]()
                    times[k].append((time.perf_counter() - t) / 10 * 1e3)
            sep, fused = (statistics.median(times[k]) for k in (False, True))
            print(f"| {text} | {batch} | {sep:.2f} | {fused:.2f} | {fused / sep:.3f} |",
                  flush=True)


def _split_specs(text: str) -> list[str]:
    """'chain:1,chain:3,dynamic:10,3,3' -> the three specs (a part that does not start a new
    spec, e.g. '3' after 'dynamic:10', belongs to the one before)."""
    out: list[str] = []
    for part in text.split(","):
        if out and ":" not in part:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


if __name__ == "__main__":
    main()
