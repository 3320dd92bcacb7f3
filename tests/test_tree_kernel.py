"""plugin/tree_kernel.py: the Triton tree-attention kernel (its own source, run by Triton's
interpreter on CPU), its torch twin, the cache views and the slot copies.

Proves, on steps of several trees (chain, star, random, one longer than a q-tile and one over
32 nodes) with prefixes 0, 1, bs-1, bs, bs+1 and 3bs+5 (bs = 16, 32):
- both impls equal an independent fp32 SDPA over each tree's dense prefix + ancestors (heads/
  tree.py's mask) within the dtype's output rounding, in fp32, fp16 and bf16; on vLLM's CUDA
  cache in LBNHC, LBHNC and a layer-interleaved order, and on the CPU `vec` cache; GQA groups
  1, 4 and 7; split-KV forced off, forced on, and chosen for a fake GPU;
- rows outside the trees keep their bytes, and NaN in every cache slot the contract does not
  read (unused blocks, slots past the prefix, the table's padding block) never reaches a row;
- interpreted Triton == the twin, and (vllm marker) the twin == the CPU backend's torch path
  (attention_cpu.TreeBatch + masked SDPA) on the same step;
- the source compiles for sm_90 through triton's compiler and ptxas (no GPU needed);
- kv_views equal FlashAttention's own split of the cache and the CPU layout's definition;
  copy_slots equals copying slot by slot; TreeMeta's bits equal tree_buffers' ancestor mask;
- the module imports without vLLM (and triton only on first launch); scripts/gpu_check.py
  --cpu-smoke runs its whole matrix/timing path and passes; where the kernel raises, the GPU
  check stops after its preflight, and a matrix whose first cases all raise stops early.

Triton's interpreter: triton decides interpreted vs compiled when `triton.jit` runs, and its
own @jit helpers (tl.max, tl.zeros, ...) were decorated when triton was first imported. The
kernel module therefore decorates its kernels itself, interpreted for CPU tensors, and calls
only builtins and `tl.reduce` with triton's stock combine functions, so the interpreter runs
it in this pytest process whether or not something (vLLM) imported triton first.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from treedraft.heads.tree import tree_buffers
from treedraft.plugin import tree_kernel as tk

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# |o - ref| <= tol * (1 + |ref|): one ulp of the output dtype (the interpreter's fp32 -> bf16
# conversion truncates where the GPU rounds to nearest)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ----------------------------------------------------------------------------- step builder


def chain(n):
    return [-1] + list(range(n - 1))


def star(n):
    return [-1] + [0] * (n - 1)


def rand_tree(n, seed):
    g = random.Random(seed)
    return [-1] + [g.randrange(i) for i in range(1, n)]


def make_cache(nb, hkv, bs, d, dtype, layout):
    """One layer's cache [nb, Hkv, bs, 2D] (logical) in a physical order, filled with NaN."""
    if layout == "LBNHC":  # vLLM's default: physical [nb, bs, Hkv, 2D]
        kv = torch.empty(nb, bs, hkv, 2 * d, dtype=dtype).transpose(1, 2)
    elif layout == "LBHNC":  # FlashInfer on SM100: physical = logical
        kv = torch.empty(nb, hkv, bs, 2 * d, dtype=dtype)
    elif layout == "BLNHC":  # layers interleaved per block: [nb, L=2, bs, Hkv, 2D], layer 1
        kv = torch.empty(nb, 2, bs, hkv, 2 * d, dtype=dtype)[:, 1].transpose(1, 2)
    else:  # CPU vec
        kv = torch.empty(nb, hkv, bs, 2 * d, dtype=dtype)
    kv.fill_(float("nan"))
    return kv, tk.kv_views(kv, d, "vec" if layout == "vec" else "flash")


@dataclass
class Step:
    query: torch.Tensor  # [T, Hq, D] (views of one qkv tensor, like vLLM's)
    key: torch.Tensor
    value: torch.Tensor
    kv: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    meta: tk.TreeMeta
    trees: list  # (qs, P, parents, req)
    prefix_k: list  # per tree [P, Hkv, D] the committed K/V as written
    prefix_v: list
    scale: float


def make_step(trees, *, dtype=torch.float32, layout="LBNHC", g=1, hkv=2, d=16, bs=16,
              q_tile=16, seed=0, write_tree_slots=False) -> Step:
    """trees: (P, parents) per tree; each gets its own request with shuffled blocks. Filler
    rows (other requests) sit before, between and after the trees."""
    gen = torch.Generator().manual_seed(seed)
    hq = g * hkv
    need = [-(-(P + len(par)) // bs) for P, par in trees]
    nb = 1 + sum(need) + 3  # block 0: the table's padding (NaN); 3 unused (NaN)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    width = max(need) + 1
    table = torch.zeros(len(trees) + 1, width, dtype=torch.int32)  # row 0: a non-tree request
    placed, qs = [], 3
    for t, (P, par) in enumerate(trees):
        blocks, perm = perm[: need[t]], perm[need[t]:]
        table[t + 1, : need[t]] = torch.tensor(blocks, dtype=torch.int32)
        placed.append((qs, P, par, t + 1))
        qs += len(par) + 2
    T = qs + 1
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], 1)
    q, k, v = q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)
    kv, (kc, vc) = make_cache(nb, hkv, bs, d, dtype, layout)
    pk, pv = [], []
    for qs, P, par, r in placed:
        K = torch.randn(P, hkv, d, generator=gen).to(dtype)
        V = torch.randn(P, hkv, d, generator=gen).to(dtype)
        pos = torch.arange(P)
        blk = table[r].long()[pos // bs]
        kc[blk, :, pos % bs] = K  # [P, Hkv, D]
        vc[blk, :, pos % bs] = V
        if write_tree_slots:  # the CPU path reads the tree back from the cache
            pos = P + torch.arange(len(par))
            blk = table[r].long()[pos // bs]
            kc[blk, :, pos % bs] = k[qs : qs + len(par)]
            vc[blk, :, pos % bs] = v[qs : qs + len(par)]
        pk.append(K)
        pv.append(V)
    meta = tk.TreeMeta.build(placed, q_tile=q_tile)
    return Step(q, k, v, kv, kc, vc, table, meta, placed, pk, pv, d**-0.5)


def reference(s: Step) -> dict[int, torch.Tensor]:
    """Per tree row: fp32 SDPA over [dense prefix | tree] with [ones | ancestor mask]."""
    out = {}
    g = s.query.shape[1] // s.key.shape[1]
    for (qs, P, par, _), K, V in zip(s.trees, s.prefix_k, s.prefix_v, strict=True):
        n = len(par)
        k = torch.cat([K, s.key[qs : qs + n]]).float().transpose(0, 1)  # [Hkv, P+n, D]
        v = torch.cat([V, s.value[qs : qs + n]]).float().transpose(0, 1)
        mask = torch.ones(n, P + n, dtype=torch.bool)
        mask[:, P:] = tree_buffers(par).ancestor_mask
        q = s.query[qs : qs + n].float().transpose(0, 1)  # [Hq, n, D]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0),
                                           v.repeat_interleave(g, 0), attn_mask=mask,
                                           scale=s.scale)
        for i in range(n):
            out[qs + i] = o[:, i]
    return out


def run(s: Step, impl, **kw):
    sentinel = torch.randn(s.query.shape, generator=torch.Generator().manual_seed(7))
    out = sentinel.to(s.query.dtype)
    before = out.clone()
    tk.tree_attention(s.query, s.key, s.value, s.k_cache, s.v_cache, s.block_table, s.meta,
                      s.scale, out, impl=impl, **kw)
    return before, out


def check(s: Step, impl, **kw) -> tuple[torch.Tensor, float]:
    before, out = run(s, impl, **kw)
    ref = reference(s)
    err = max(((out[r].float() - o).abs() / (1 + o.abs())).max().item() for r, o in ref.items())
    assert err <= TOL[s.query.dtype], f"{impl}: max error {err:.3g} > {TOL[s.query.dtype]}"
    others = [r for r in range(out.shape[0]) if r not in ref]
    assert others and torch.equal(out[others].view(torch.uint8), before[others].view(torch.uint8))
    return out, err


# ----------------------------------------------------------------------------- kernel

def P6(bs):
    return [0, 1, bs - 1, bs, bs + 1, 3 * bs + 5]


SHAPES = [chain(5), star(6), rand_tree(7, 1), rand_tree(4, 2), chain(1), rand_tree(9, 3)]

# (dtype, layout, g, hkv, d, bs, q_tile, num_segments): a covering set, not a cross product
CASES = [
    (torch.float32, "LBNHC", 1, 2, 16, 16, 16, 1),
    (torch.float32, "LBHNC", 4, 1, 16, 32, 16, 3),
    (torch.float32, "vec", 7, 1, 16, 16, 4, 1),
    (torch.bfloat16, "LBNHC", 4, 2, 32, 16, 16, 1),
    (torch.bfloat16, "vec", 1, 2, 16, 32, 16, 2),
    (torch.bfloat16, "LBHNC", 7, 1, 16, 32, 16, 1),
    (torch.float16, "LBNHC", 7, 1, 24, 16, 4, 4),
    (torch.float16, "vec", 4, 1, 16, 32, 16, 1),
    (torch.bfloat16, "BLNHC", 4, 1, 16, 16, 8, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    [str(c[0]).split(".")[1], c[1], f"g{c[2]}", f"d{c[4]}", f"bs{c[5]}", f"seg{c[7]}"]))
def test_kernel_matches_reference(case):
    dtype, layout, g, hkv, d, bs, q_tile, nseg = case
    trees = list(zip(P6(bs), SHAPES, strict=True))
    s = make_step(trees, dtype=dtype, layout=layout, g=g, hkv=hkv, d=d, bs=bs, q_tile=q_tile)
    out_triton, _ = check(s, "triton", num_segments=nseg)
    out_torch, _ = check(s, "torch")
    torch.testing.assert_close(out_triton.float(), out_torch.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("nseg", [1, 3])
def test_kernel_large_trees(nseg):
    """A 40-node tree (two ancestor words, 10 q-tiles of 4 nodes) beside a 20-node chain."""
    trees = [(3 * 16 + 5, rand_tree(40, 5)), (16, chain(20))]
    s = make_step(trees, g=4, hkv=1, bs=16, q_tile=4)
    out_triton, _ = check(s, "triton", num_segments=nseg)
    out_torch, _ = check(s, "torch")
    torch.testing.assert_close(out_triton, out_torch, atol=1e-5, rtol=0)


def test_kernel_auto_split():
    """num_segments=None on a fake 64-SM GPU: choose_segments splits a long prefix."""
    trees = [(1100, rand_tree(3, 9)), (600, star(2))]
    s = make_step(trees, g=2, hkv=1, bs=32)
    assert tk.choose_segments(s.meta, 1, 2, num_sms=64) > 1
    check(s, "triton", num_sms=64)


def test_choose_segments():
    def meta(P, n):
        return tk.TreeMeta.build([(0, p, chain(k), 0) for p, k in zip(P, n, strict=True)])

    assert tk.choose_segments(meta([100], [16]), 8, 4, 132) == 1  # short prefix
    assert tk.choose_segments(meta([8192] * 32, [16] * 32), 8, 4, 132) == 1  # grid full
    one = tk.choose_segments(meta([8192], [16]), 8, 4, 132)
    assert one == 16  # traffic cap: 8192 / (8 * 4 * 16)
    assert tk.choose_segments(meta([8192], [64]), 8, 4, 132) == 4
    assert tk.choose_segments(meta([1 << 20], [1]), 8, 1, 132) == 33  # two waves


def test_empty_step_writes_nothing():
    s = make_step([(5, chain(2))])
    empty = tk.TreeMeta.build([])
    out = torch.zeros_like(s.query)
    for impl in ("triton", "torch"):
        tk.tree_attention(s.query, s.key, s.value, s.k_cache, s.v_cache, s.block_table, empty,
                          s.scale, out, impl=impl)
    assert not out.any()


@pytest.mark.parametrize("split", [False, True])
def test_kernel_compiles_for_hopper(split):
    """The same source through triton's real compiler and ptxas for sm_90 (no GPU needed):
    what the interpreter does not check (types, layouts, the pipeliner) at a Llama-8B shape,
    with the stride specialisation a real launch gets (unit strides along D)."""
    import inspect

    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:
        pytest.skip("triton has no nvidia backend here")
    fwd, reduce = tk._kernels(interpret=False)
    const = dict(sq_d=1, sk_d=1, sv_d=1, skc_d=1, svc_d=1, so_d=1, G=4, GP=4, BLOCK_Q=16,
                 BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, HEAD_D=128, PAGE=16, NUM_HQ=32,
                 SPLIT=split, DOT_F32=False, SEG_P=8)
    partial = {"ACC", "MAX", "SUM"}

    def signature(fn):
        sig = {}
        for name in inspect.signature(fn.fn).parameters:
            if name in const:
                sig[name] = "constexpr"
            elif name.isupper():  # pointers
                sig[name] = "*fp32" if name in partial else "*i32" if name in (
                    "BT", "TREES", "TILES", "ANC", "ROWS") else "*bf16"
            else:
                sig[name] = "fp32" if name == "scale_log2" else "i32"
        return sig

    target = GPUTarget("cuda", 90, 32)
    for fn in (fwd, reduce) if split else (fwd,):
        sig = signature(fn)
        consts = {k: v for k, v in const.items() if k in sig}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=target,
                                options={"num_warps": 4, "num_stages": 3})
        assert kernel.asm["cubin"]


# ----------------------------------------------------------------------------- metadata, views


def test_tree_meta_bits_and_tiles():
    par = rand_tree(70, 11)  # three words; bit 31 sets the int32 sign
    meta = tk.TreeMeta.build([(4, 9, chain(3), 2), (10, 0, par, 0)], q_tile=32)
    assert meta.trees.tolist() == [[4, 3, 9, 2, 0], [10, 70, 0, 0, 3]]
    assert meta.tiles.tolist() == [[0, 0], [1, 0], [1, 32], [1, 64]]
    assert meta.rows.tolist() == [4, 5, 6] + list(range(10, 80))
    assert meta.anc.shape == (73, 3) and meta.anc.dtype == torch.int32
    words = meta.anc[3:].long() & 0xFFFFFFFF
    j = torch.arange(70)
    bits = (words[:, j // 32] >> (j % 32)) & 1
    assert torch.equal(bits.bool(), tree_buffers(par).ancestor_mask)
    with pytest.raises(ValueError, match="topological"):
        tk.TreeMeta.build([(0, 0, [-1, 2, 0], 0)])
    with pytest.raises(ValueError, match="power of 2"):
        tk.TreeMeta.build([(0, 0, [-1], 0)], q_tile=12)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_flash_views_match_flash_attention_split(layout):
    kv, (k, v) = make_cache(5, 3, 16, 8, torch.float32, layout)
    kv.copy_(torch.randn(kv.shape))
    # vllm flash_attn.py: key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    fk, fv = kv.transpose(1, 2).split(8, dim=-1)
    assert torch.equal(k, fk.transpose(1, 2)) and torch.equal(v, fv.transpose(1, 2))
    assert k.data_ptr() == kv.data_ptr()  # views, not copies


def test_vec_views_match_cpu_layout():
    nb, h, bs, d = 3, 2, 16, 8
    kv = torch.randn(nb, h, bs, 2 * d)
    k, v = tk.kv_views(kv, d, "vec")
    flat = kv.view(nb, h, 2, bs * d)  # per block and head: K^T [D, bs], then V [bs, D]
    assert torch.equal(k, flat[:, :, 0].reshape(nb, h, d, bs).transpose(2, 3))
    assert torch.equal(v, flat[:, :, 1].reshape(nb, h, bs, d))
    k[1, 0, 5, 3] = 42.0  # a view: writes land in the cache
    assert flat[1, 0, 0, 3 * bs + 5] == 42.0
    with pytest.raises(ValueError, match="layout"):
        tk.kv_views(kv, d, "amx")


@pytest.mark.parametrize("layout", ["LBNHC", "vec"])
def test_copy_slots_equals_sequential_copies(layout):
    bs = 16
    kv, (k, v) = make_cache(6, 2, bs, 8, torch.float32, layout)
    kv.copy_(torch.randn(kv.shape))
    # two requests' compactions: positions P + a_j -> P + j, a_j increasing, a_j >= j
    moves = []
    for blocks, P, acc in (([3, 1], 14, [2, 5, 6, 11]), ([5, 0, 2], 30, [1, 3, 4])):
        for j, a in enumerate(acc, start=1):
            src, dst = P + a, P + j
            moves.append((blocks[src // bs] * bs + src % bs, blocks[dst // bs] * bs + dst % bs))
    want = kv.clone()
    wk, wv = tk.kv_views(want, 8, "vec" if layout == "vec" else "flash")
    for s, d in moves:
        wk[d // bs, :, d % bs] = wk[s // bs, :, s % bs]
        wv[d // bs, :, d % bs] = wv[s // bs, :, s % bs]
    tk.copy_slots(k, v, [s for s, _ in moves], [d for _, d in moves])
    assert torch.equal(kv, want)


# ----------------------------------------------------------------------------- CPU path


@pytest.mark.vllm
def test_twin_matches_cpu_backend_path():
    """The twin == attention_cpu's torch recomputation (TreeBatch + masked SDPA) on one step."""
    from vllm.platforms import current_platform

    from treedraft.plugin.attention_cpu import TreeBatch, slot_layout
    from treedraft.plugin.tree_step import TreeRequest

    current_platform.import_kernels()  # the layout is probed through vLLM's cache op
    bs = 32  # a block and head size the CPU kernel has
    trees = list(zip(P6(bs), SHAPES, strict=True))
    s = make_step(trees, layout="vec", g=4, hkv=2, d=32, bs=bs, write_tree_slots=True)
    reqs = []
    for qs, P, par, r in s.trees:  # as tree_step.make_request builds them: ancestors only
        mask = tree_buffers(par).ancestor_mask
        reqs.append(TreeRequest(r, f"r{r}", qs, P, [0] * len(par), par, [], False, mask))
    batch = TreeBatch(reqs, s.block_table, bs)
    k, v = batch.gather(s.kv, slot_layout(s.kv, "vec"))
    q = s.query[batch.q_rows]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=batch.mask,
                                       scale=s.scale, enable_gqa=True)
    cpu = torch.zeros_like(s.query)
    cpu.index_copy_(0, batch.out_rows, o.transpose(1, 2)[batch.row_valid])
    twin = torch.zeros_like(s.query)
    tk.tree_attention(s.query, s.key, s.value, s.k_cache, s.v_cache, s.block_table, s.meta,
                      s.scale, twin, impl="torch")
    torch.testing.assert_close(twin, cpu, atol=1e-5, rtol=0)
    assert batch.out_rows.numel() == s.meta.num_rows


# ----------------------------------------------------------------------------- GPU script


def test_kernel_module_needs_no_vllm():
    """A GPU box without vLLM imports the kernel through the package (and gpu_check by path)."""
    probe = ("import sys; sys.modules['vllm'] = None; "
             "import treedraft.plugin.tree_kernel as tk; assert 'triton' not in sys.modules; "
             "assert not any(m.startswith('vllm.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


def test_gpu_check_cpu_smoke(tmp_path):
    """The GPU check's matrix, timing and end-to-end decode code, on CPU under the
    interpreter, tiny shapes."""
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke",
           "--deadline", "90", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    cases = report["correctness"]
    assert cases and all(c["ok"] for c in cases), [c for c in cases if not c["ok"]]
    assert report["timing"] and (tmp_path / "gpu_check.md").exists()
    # greedy tree decoding through the kernel (reference decoder, paged cache, compaction)
    # reproduces plain greedy decoding, with steps that accepted more than one node
    decode = report["decode"]
    assert decode["ok"] and decode["specs"], decode
    assert all(r["same"] and r["max_accepted"] >= 2 and r["compactions"]
               for r in decode["specs"].values()), decode


def _gpu_check_module(monkeypatch):
    """scripts/gpu_check.py imported by path (as the GPU machine runs it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test",
                                                  ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses resolve through it
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_stops_at_once_where_the_kernel_cannot_run(tmp_path, monkeypatch, capsys):
    """A machine where the kernel raises (e.g. Triton cannot build its launcher) costs the
    preflight's one step, not the deadline: nothing else runs, the reason is in the report."""
    gc = _gpu_check_module(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(gc.tk, "tree_attention", broken)
    with pytest.raises(SystemExit) as stop:
        gc.run(tmp_path, deadline=60.0, smoke=True)
    assert stop.value.code == 2
    assert "cannot run on this machine: RuntimeError: Failed" in capsys.readouterr().err
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "Failed to find C compiler" in report["preflight"]["error"]
    assert report["correctness"] == [] and report["timing"] == [] and not report["all_ok"]
    assert "the kernel FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_matrix_stops_when_its_first_cases_all_raise(tmp_path, monkeypatch):
    """A systematic failure after a good preflight (every case raising) stops the matrix after
    FAIL_FAST cases, says so, and still runs views, decode and timing."""
    gc = _gpu_check_module(monkeypatch)
    real, calls = gc.check_case, []

    def failing_after_preflight(*args, **kwargs):
        calls.append(args[0])
        if len(calls) > 1:
            raise RuntimeError("out of resource: shared memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(gc, "check_case", failing_after_preflight)
    report = gc.run(tmp_path, deadline=60.0, smoke=True)
    assert report["preflight"]["ok"]
    assert len(report["correctness"]) == gc.FAIL_FAST == len(calls) - 1
    assert "shared memory" in report["stopped"] and not report["all_ok"]
    assert report["decode"]["ok"] and report["views"]["ok"] and report["timing"]
    assert "matrix stopped" in (tmp_path / "gpu_check.md").read_text()
