"""What tree attention costs a target step on vLLM's CPU kernel (plugin/attention_cpu.py), by piece.

    python -m treedraft.scripts.bench_tree_attention
    python -m treedraft.scripts.bench_tree_attention --prefix 200,2000 --trees chain:3,static:16

One request's step, built as the plugin builds it: a KV cache of the target's layer shape
(default SmolLM2-135M: 3 KV heads of 64, 9 query heads, 30 layers) in blocks of 32, a committed
prefix of P tokens, the tree's rows after it, scratch blocks past the request's. Per tree and
prefix it times, per target step (each layer's cache its own tensor, as in vLLM), in ms:

- `kernel`: vLLM's `cpu_attention_with_kv_cache` over the tree's chain cover (`TreeSeqs`): one
  causal sequence per root-to-leaf chain, each reading the whole prefix;
- `one seq`: the same kernel over the tree's rows as ONE causal sequence (wrong attention for a
  tree: the least a kernel that reads the prefix once per request would pay);
- `copies`: each layer's scratch copies (`TreeSeqs.copy_kv`: the prefix's partial last block and
  the chains' slots);
- `perm`: each layer's query and output row permutation.

Trees: `chain:K`, `static:N` (the shipped EAGLE head's N-node shape) or `paths:...`, each with an
optional `+lookup:M` (M lookup nodes as a chain from the root, a proposal that leaves the head's
at the first token: two chains). Speed only: the tests check the attention's values.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

TREES = "chain:3,chain:2+lookup:4,static:6,static:10,static:16"


def tree_parents(spec: str, rates) -> list[int]:
    """The parents list of a tree spec's shape (root first)."""
    from treedraft.heads.tree import fixed_parents, parse_tree_spec

    s = parse_tree_spec(spec)
    if s.kind not in ("paths", "static"):
        raise SystemExit(f"--trees: {spec!r}: a dynamic tree's shape depends on the text; give "
                         "static:N (the head's N-node shape) or paths")
    parents = list(fixed_parents(s.head_spec, rates))
    for j in range(s.lookup):  # a chain from the root
        parents.append(0 if j == 0 else len(parents) - 1)
    return parents


def step_costs(parents: list[int], prefix: int, layers: int, heads: int, kv_heads: int,
               head_size: int, dtype, isa: str, reps: int, block_size: int = 32) -> dict:
    """Milliseconds per target step (`layers` layers) of each piece (module doc); median of
    `reps` steps."""
    import statistics

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from treedraft.heads.tree import tree_buffers
    from treedraft.plugin.attention_cpu import TreeSeqs, slot_layout
    from treedraft.plugin.tree_step import TreeRequest

    bs, n = block_size, len(parents)
    own = -(-(prefix + n) // bs)
    scratch = range(own, own + 2 * n + 2)  # at most two blocks per chain
    caches = [torch.randn(scratch.stop, kv_heads, bs, 2 * head_size).to(dtype)
              for _ in range(layers)]
    tree = TreeRequest(req_index=0, req_id="r", qs=0, root_pos=prefix, tokens=[0] * n,
                       parents=parents, depths=tree_buffers(parents).depths.tolist(),
                       is_chain=False)

    def metadata(q_lens: list[int], seq_lens: list[int], tables: torch.Tensor):
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(q_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size,
            seq_lens=lens, dtype=dtype, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)
        return CPUAttentionMetadata(
            num_actual_tokens=sum(q_lens), max_query_len=max(q_lens), query_start_loc=qsl,
            max_seq_len=max(seq_lens), seq_lens=lens, block_table=tables,
            slot_mapping=torch.zeros(0, dtype=torch.long), scheduler_metadata=sched)

    md = metadata([n], [prefix + n], torch.arange(own, dtype=torch.int32)[None])
    seqs = TreeSeqs([tree], md, bs, scratch)
    meta = seqs.metadata(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads,
                                         head_size=head_size, kv_cache_dtype="auto"),
                         SimpleNamespace(isa=isa), dtype)
    layout = slot_layout(caches[0], isa)
    query = torch.randn(n, heads, head_size).to(dtype)
    out = torch.empty_like(query)

    def kernel(m, q, o, cache):
        k, v = cache.view(cache.shape[0], kv_heads, 2 * bs, head_size).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(q, k, v, o, m.query_start_loc, m.seq_lens,
                                        head_size ** -0.5, True, None, -1, m.block_table, 0.0,
                                        m.scheduler_metadata, None)

    times: dict[str, list[float]] = {"kernel": [], "one seq": [], "copies": [], "perm": []}
    for _ in range(reps + 1):  # the first step warms up
        spent = dict.fromkeys(times, 0.0)
        for cache in caches:  # a tree step, layer after layer
            t0 = time.perf_counter()
            seqs.copy_kv(cache, layout)
            t1 = time.perf_counter()
            q, o = query, out
            if seqs.perm is not None:
                q, o = query.index_select(0, seqs.perm), torch.empty_like(out)
            t2 = time.perf_counter()
            kernel(meta, q, o, cache)
            t3 = time.perf_counter()
            if seqs.perm is not None:
                out.index_copy_(0, seqs.perm, o)
            spent["copies"] += t1 - t0
            spent["perm"] += t2 - t1 + time.perf_counter() - t3
            spent["kernel"] += t3 - t2
        t0 = time.perf_counter()
        for cache in caches:  # its rows as one sequence, as cold in the CPU's caches
            kernel(md, query, out, cache)
        spent["one seq"] = time.perf_counter() - t0
        for k, v in spent.items():
            times[k].append(v)
    return {"chains": len(seqs.seq_lens), **{k: 1e3 * statistics.median(v[1:])
                                             for k, v in times.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=TREES, help=f"comma-separated tree specs (default {TREES})")
    ap.add_argument("--prefix", default="100,500,1500",
                    help="committed tokens before the tree, comma-separated")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto: this machine's serving dtype")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # vLLM 0.32: the ISA it picks

    from treedraft.heads.common import read_config
    from treedraft.heads.machine import describe, resolve_dtype
    from treedraft.heads.shipped import resolve_head

    dtype = getattr(torch, resolve_dtype(a.dtype))
    isa = _get_attn_isa(dtype, 32, a.head_size)
    rates = read_config(resolve_head("smollm2-135m-eagle"))["acceptance_rates"]
    print(f"[bench_tree_attention] {describe()}; {dtype}, ISA {isa!r}, {a.layers} layers of "
          f"{a.heads} query / {a.kv_heads} KV heads of {a.head_size}; ms per target step, median "
          f"of {a.reps}", flush=True)
    print("| tree | rows | chains | prefix | kernel | one seq | copies | perm | added |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for spec in a.trees.split(","):
        parents = tree_parents(spec, rates)
        for prefix in (int(p) for p in a.prefix.split(",")):
            c = step_costs(parents, prefix, a.layers, a.heads, a.kv_heads, a.head_size, dtype,
                           isa, a.reps)
            added = c["kernel"] + c["copies"] + c["perm"] - c["one seq"]
            print(f"| {spec} | {len(parents)} | {c['chains']} | {prefix} | {c['kernel']:.2f} | "
                  f"{c['one seq']:.2f} | {c['copies']:.2f} | {c['perm']:.2f} | {added:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
