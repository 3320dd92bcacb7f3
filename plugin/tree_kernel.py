"""Tree attention for the tree rows of a verification step: a Triton kernel and its torch twin.

Imports torch only; triton is imported on the first Triton launch. Nothing here imports vLLM,
so a GPU machine with torch + triton runs this file as it is (scripts/gpu_check.py).

Shapes (T = tokens of the step, Hq = g * Hkv query heads, D = head size):
- query [T, Hq, D], key / value [T, Hkv, D]: the post-RoPE rows vLLM's `impl.forward` receives,
  any strides. Query head h reads KV head h // g.
- k_cache / v_cache [num_blocks, Hkv, block_size, D]: strided views of the paged cache
  (`kv_views`: vLLM's CUDA cache in any physical order, or the CPU `vec` layout).
- block_table [num_reqs, max_blocks] int32; out [T, Hq, D].
- `TreeMeta` (one per step): per tree its first query row qs, node count n (root included),
  committed prefix length P, block-table row req, first tree row ao; packed ancestor bits
  anc [R, ceil(max n / 32)] int32 over the step's R tree rows (TensorRT-LLM's packed mask).

Masking rule. Node i of a tree is query row qs + i and tree row ao + i. It attends to
- stage 1: every committed prefix position 0..P-1, read from the cache through
  block_table[req] (no mask);
- stage 2: tree node j, read from key / value row qs + j, iff bit j of anc[ao + i] is set
  (j is i or an ancestor of i).
out[qs + i] = softmax(scale * q K^T) V over those keys, one online softmax over both stages
(no LSE merge). Rows of `out` outside the trees are not written. The tree's own cache slots
(positions P..P+n-1) are never read, so the kernel does not depend on the cache write.

Kernel. One program per (q-tile, KV head, segment). A q-tile is BLOCK_Q consecutive nodes of
one tree times the g query heads of the KV head (BLOCK_M = BLOCK_Q * next_pow2(g) rows, node
major), so GQA reads each K/V tile once per group; trees longer than BLOCK_Q nodes span
several tiles, and a tile's stage 2 stops at its last node (nodes are topological: ancestors
come first). fp32 accumulation; DOT_F32 upcasts the dot operands (the interpreter's bf16
tl.dot is wrong; it is on for CPU tensors only). fp32 inputs get triton's default tf32 dots on
the GPU, as vLLM's own Triton attention does.

Split-KV. With few trees (batch 1) the grid is tiles x Hkv programs, far fewer than the SMs.
`num_segments` > 1 cuts each tree's prefix into that many BLOCK_N-aligned segments, one
program each; every program writes its unnormalised (acc, max, sum) in fp32, the last
segment also runs stage 2, and `_tree_attn_reduce` merges the segments per (tree row, head)
(vLLM unified attention's 3D mode). `choose_segments` picks the count from the SM count, the
longest prefix and a cap on the partials' traffic (at most 1/4 of the K/V bytes).

The torch twin (`tree_attention_torch`) is the same contract in fp32 SDPA: the CPU path and
the test oracle.

Use, once per step and then per layer:
    meta = TreeMeta.build([(t.qs, t.root_pos, t.parents, t.req_index) for t in trees], device)
    k4, v4 = kv_views(kv_cache, head_size, "flash")  # "vec" on vLLM's CPU backend
    tree_attention(query, key, value, k4, v4, block_table, meta, scale, output)

Interpreter. CPU tensors run the same kernels under Triton's interpreter: triton fixes
interpreted vs compiled when `triton.jit` runs, so `_kernels` decorates the plain functions
below once per mode, and their bodies call only triton builtins and `tl.reduce` with triton's
stock combine functions (its @jit helpers tl.max / tl.sum / tl.zeros were fixed to one mode
when triton was first imported, e.g. by vLLM). Tested under the interpreter and compiled for
sm_90 on CPU (tests/test_tree_kernel.py); the GPU run is scripts/gpu_check.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

# Bound by _kernels() on the first Triton launch; the kernel bodies below resolve them from
# this module's globals (a machine without triton still runs the torch twin).
tl: Any = None
triton: Any = None

_LOG2E = 1.4426950408889634
MIN_SEGMENT = 256  # fewest prefix positions per split-KV segment
MAX_SEGMENTS = 64


# ----------------------------------------------------------------------------- metadata


@dataclasses.dataclass
class TreeMeta:
    """The step's trees on the device: built once per step (`build`), read by every layer."""

    qs: list[int]  # per tree: first query row (the root)
    n: list[int]  # nodes incl. the root
    P: list[int]  # committed prefix length
    req: list[int]  # block-table row
    q_tile: int  # nodes per kernel q-tile (a power of 2)
    trees: torch.Tensor  # [num_trees, 5] int32: qs, n, P, req, ao (first tree row)
    tiles: torch.Tensor  # [num_tiles, 2] int32: tree, first node of the tile
    rows: torch.Tensor  # [R] int32: query row of each tree row
    anc: torch.Tensor  # [R, W] int32: bit j of anc[ao + i, j // 32] <=> j ancestor-or-self of i

    @property
    def num_trees(self) -> int:
        return len(self.n)

    @property
    def num_rows(self) -> int:
        return sum(self.n)

    @property
    def max_n(self) -> int:
        return max(self.n, default=0)

    @property
    def max_prefix(self) -> int:
        return max(self.P, default=0)

    @classmethod
    def build(cls, trees: Sequence[tuple[int, int, Sequence[int], int]],
              device: torch.device | str | None = None, q_tile: int = 16) -> TreeMeta:
        """From (qs, P, parents, req_index) per tree; parents[0] = -1, parents[i] < i.

        Everything goes to `device` in one host-to-device copy."""
        if q_tile < 1 or q_tile & (q_tile - 1):
            raise ValueError(f"q_tile must be a power of 2, got {q_tile}")
        qs, n, P, req, ancs = [], [], [], [], []
        for t, (q0, p, parents, r) in enumerate(trees):
            ancs.append(_ancestor_bits(parents, t))
            qs.append(int(q0))
            n.append(len(parents))
            P.append(int(p))
            req.append(int(r))
            if q0 < 0 or p < 0 or r < 0:
                raise ValueError(f"tree {t}: qs={q0}, P={p}, req={r} must be >= 0")
        words = max(1, -(-max(n, default=1) // 32))
        ao = list(itertools.accumulate(n, initial=0))[:-1]  # first tree row of each tree
        table = [[q, k, p, r, a] for q, k, p, r, a in zip(qs, n, P, req, ao, strict=True)]
        tiles = [[t, i] for t, k in enumerate(n) for i in range(0, k, q_tile)]
        rows = [q + i for q, k in zip(qs, n, strict=True) for i in range(k)]
        anc = [[_int32((a >> (32 * w)) & 0xFFFFFFFF) for w in range(words)]
               for bits in ancs for a in bits]
        sizes = (5 * len(table), 2 * len(tiles), len(rows), words * len(anc))
        flat = [x for row in table for x in row] + [x for row in tiles for x in row] + rows
        flat += [x for row in anc for x in row]
        host = torch.tensor(flat, dtype=torch.int32)
        device = torch.device(device) if device is not None else host.device
        if device.type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        a, b, c, d = torch.split(packed, sizes)
        return cls(qs, n, P, req, q_tile, a.view(-1, 5), b.view(-1, 2), c, d.view(-1, words))


def _ancestor_bits(parents: Sequence[int], t: int) -> list[int]:
    """Per node, the ancestor-or-self set as a Python int bitmask (bit j <=> node j)."""
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1:
        raise ValueError(f"tree {t}: parents[0] must be -1 (node 0 is the root), got {parents}")
    bits = [1]
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"tree {t}: parents[{i}] = {p} must be in [0, {i}) (topological)")
        bits.append(bits[p] | (1 << i))
    return bits


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


# ----------------------------------------------------------------------------- cache views


def kv_views(kv_cache: torch.Tensor, head_size: int,
             layout: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [num_blocks, Hkv, block_size, D] of one layer's cache [nb, Hkv, bs, 2D].

    flash: vLLM's CUDA cache (any physical stride order): K = [..., :D], V = [..., D:].
    vec: the CPU cache, per block and head K transposed [D, bs] then V [bs, D] (contiguous)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"KV cache {tuple(kv_cache.shape)} is not [num_blocks, num_kv_heads, "
                         f"block_size, 2 * {head_size}]")
    if layout == "flash":
        return kv_cache[..., :head_size], kv_cache[..., head_size:]
    if layout == "vec":
        nb, h, bs, _ = kv_cache.shape
        flat = kv_cache.view(nb, h, 2, bs * head_size)
        return (flat[:, :, 0].view(nb, h, head_size, bs).transpose(2, 3),
                flat[:, :, 1].view(nb, h, bs, head_size))
    raise ValueError(f"unknown KV cache layout {layout!r}; use 'flash' (CUDA) or 'vec' (CPU)")


def copy_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, src, dst) -> None:
    """K/V of slots `src` to slots `dst` (slot = block * block_size + offset) on 4-D views.

    One gather, then one scatter: equal to copying in order when no copy reads a slot that an
    earlier one wrote (dst_i != src_j for i < j) and `dst` has no repeats. KV compaction
    satisfies it: a request's moves go from positions P + a_j to P + j with a_j >= j and the
    a_j increasing, so dst_i < dst_j <= src_j; requests own disjoint blocks."""
    dev = k_cache.device
    src = torch.as_tensor(src, dtype=torch.long, device=dev)
    dst = torch.as_tensor(dst, dtype=torch.long, device=dev)
    if not src.numel():
        return
    bs = k_cache.shape[2]
    for cache in (k_cache, v_cache):
        cache[dst // bs, :, dst % bs] = cache[src // bs, :, src % bs]  # [m, Hkv, D]


# ----------------------------------------------------------------------------- entry point


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   meta: TreeMeta, scale: float, out: torch.Tensor, impl: str = "triton",
                   num_segments: int | None = None, num_sms: int | None = None) -> torch.Tensor:
    """Writes the tree rows of `out` (see the module docstring); returns `out`.

    impl: "triton" (the kernel; interpreted for CPU tensors) or "torch" (the twin).
    num_segments: split-KV segments (None: `choose_segments`); num_sms: the SM count that
    choice assumes (None: the device's; 1 on CPU, i.e. no split unless forced)."""
    _check(query, key, value, k_cache, v_cache, out)
    if meta.trees.device != query.device or block_table.device != query.device:
        raise ValueError(f"TreeMeta on {meta.trees.device}, block table on "
                         f"{block_table.device}, query on {query.device}: build the metadata "
                         "with TreeMeta.build(..., device=query.device)")
    if impl not in IMPLS:
        raise ValueError(f"unknown tree attention impl {impl!r}; use one of {sorted(IMPLS)}")
    if not meta.num_trees:
        return out
    return IMPLS[impl](query, key, value, k_cache, v_cache, block_table, meta, scale, out,
                       num_segments=num_segments, num_sms=num_sms)


def _check(query, key, value, k_cache, v_cache, out) -> None:
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if Hq % Hkv or key.shape != value.shape or key.shape[0] != T or key.shape[2] != D:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}: expected [T, g * Hkv, D], [T, Hkv, D] twice")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} are not "
                         f"[num_blocks, {Hkv}, block_size, {D}] (use kv_views)")
    if k_cache.dtype != query.dtype:
        raise ValueError(f"KV cache dtype {k_cache.dtype} != query dtype {query.dtype}: tree "
                         "attention reads an unquantized cache (no fp8 KV cache)")
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")


def choose_segments(meta: TreeMeta, num_kv_heads: int, groups: int, num_sms: int) -> int:
    """Split-KV segments per tree prefix: enough programs for two waves of `num_sms`, at least
    MIN_SEGMENT positions per segment, and the fp32 partials (written and read back, 8 bytes
    per segment, row, head and dim) at most 1/4 of the prefix K/V bytes (>= 4 per position,
    KV head and dim): segments <= sum(P) / (8 * g * sum(n))."""
    base = meta.tiles.shape[0] * num_kv_heads
    if base >= num_sms or meta.max_prefix < 2 * MIN_SEGMENT:
        return 1
    want = -(-2 * num_sms // base)
    by_traffic = sum(meta.P) // (8 * groups * meta.num_rows)
    return max(1, min(want, meta.max_prefix // MIN_SEGMENT, by_traffic, MAX_SEGMENTS))


# ----------------------------------------------------------------------------- torch twin


def tree_attention_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, meta: TreeMeta, scale: float,
                         out: torch.Tensor, **_: Any) -> torch.Tensor:
    """The contract in plain torch: all trees as one padded fp32 SDPA with a boolean mask."""
    if not meta.num_trees:
        return out
    dev = query.device
    B, m, Pm = meta.num_trees, meta.max_n, meta.max_prefix
    _, Hq, D = query.shape
    Hkv, bs = key.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    qs, n, P, req, ao = meta.trees.to(dev, torch.long).unbind(1)  # [B] each
    node = torch.minimum(torch.arange(m, device=dev)[None], n[:, None] - 1)  # [B, m]; padding
    qrow = qs[:, None] + node  # rows repeat the last node: finite, dropped
    # prefix K/V [B, Hkv, Pm, D] through the block table; columns past a request's own
    # blocks read block 0 and every slot >= P is zeroed (it may hold anything, NaN included)
    nblk = -(-Pm // bs)
    col = torch.arange(nblk, device=dev)
    blocks = block_table[req][:, :nblk].long()
    blocks = torch.where(col[None] * bs < P[:, None], blocks, 0)  # [B, nblk]
    in_prefix = torch.arange(Pm, device=dev)[None] < P[:, None]  # [B, Pm]

    def prefix(cache):
        kv = cache[blocks].transpose(1, 2).reshape(B, Hkv, nblk * bs, D)[:, :, :Pm]
        return kv.float().masked_fill(~in_prefix[:, None, :, None], 0)

    def tree(x):  # this step's rows of the tree nodes: [B, Hkv, m, D]
        return x[qrow].transpose(1, 2).float()

    k = torch.cat([prefix(k_cache), tree(key)], 2)  # [B, Hkv, Pm + m, D]
    v = torch.cat([prefix(v_cache), tree(value)], 2)
    j = torch.arange(m, device=dev)
    words = meta.anc.to(dev)[(ao[:, None] + node)].long()  # [B, m, W]
    bits = (words[..., j // 32] >> (j % 32)) & 1 != 0  # [B, m, m] ancestor-or-self
    mask = torch.cat([in_prefix[:, None].expand(B, m, Pm), bits], -1)  # [B, m, Pm + m]
    # GQA: the g query heads of a KV head become g * m rows (head-major) of one SDPA row block
    q = query[qrow].float().view(B, m, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * m, D)
    mask = mask[:, None, None].expand(B, 1, g, m, Pm + m).reshape(B, 1, g * m, Pm + m)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.view(B, Hkv, g, m, D).permute(0, 3, 1, 2, 4).reshape(B, m, Hq, D)
    valid = torch.arange(m, device=dev)[None] < n[:, None]
    out.index_copy_(0, qrow[valid], o[valid].to(out.dtype))
    return out


# ----------------------------------------------------------------------------- Triton


def tree_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, meta: TreeMeta, scale: float,
                          out: torch.Tensor, num_segments: int | None = None,
                          num_sms: int | None = None) -> torch.Tensor:
    """The kernel launch (and the split-KV reduce when more than one segment)."""
    _, Hq, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    on_gpu = query.device.type == "cuda"
    fwd, reduce = _kernels(interpret=not on_gpu)
    if num_segments is None:
        num_segments = choose_segments(meta, Hkv, g, num_sms or sm_count(query.device))
    gp = triton.next_power_of_2(g)
    block_m = max(16, meta.q_tile * gp)
    block_d = max(16, triton.next_power_of_2(D))
    wide = D * query.element_size() > 256  # fp32 D=128, bf16 D=256: halve the K/V tiles
    block_n = (32 if wide else 64) if on_gpu else 32
    split = num_segments > 1
    R = meta.num_rows
    if split:  # fp32 partials per (tree row, query head, segment)
        acc = torch.empty(R, Hq, num_segments, D, dtype=torch.float32, device=query.device)
        mx = torch.empty(R, Hq, num_segments, dtype=torch.float32, device=query.device)
        sm = torch.empty_like(mx)
    else:
        acc = mx = sm = out  # unused
    grid = (meta.tiles.shape[0], Hkv, num_segments)
    fwd[grid](
        query, key, value, k_cache, v_cache, block_table, meta.trees, meta.tiles, meta.anc,
        out, acc, mx, sm,
        *query.stride(), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0), meta.anc.stride(0), *out.stride(),
        scale * _LOG2E, num_segments,
        G=g, GP=gp, BLOCK_Q=meta.q_tile, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HEAD_D=D, PAGE=k_cache.shape[2], NUM_HQ=Hq, SPLIT=split, DOT_F32=not on_gpu,
        num_warps=4 if block_m <= 64 else 8, num_stages=2 if wide else 3,
    )
    if split:
        reduce[(R, Hq)](
            acc, mx, sm, meta.rows, out, *out.stride(), num_segments,
            NUM_HQ=Hq, SEG_P=triton.next_power_of_2(num_segments), BLOCK_D=block_d, HEAD_D=D,
            num_warps=4,
        )
    return out


IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "triton": tree_attention_triton,
    "torch": tree_attention_torch,
}


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: no split-KV by default)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernels(interpret: bool):
    """(forward, reduce) JIT functions. triton decides interpreted vs compiled when `jit` runs
    (it reads TRITON_INTERPRET then), so each mode decorates the same Python functions itself:
    CPU tensors get the interpreter in any process, whatever imported triton first."""
    global tl, triton
    import triton as _triton
    import triton.language as _tl

    tl, triton = _tl, _triton
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(_tree_attn_fwd), triton.jit(_tree_attn_reduce)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _tree_attn_fwd(
    Q, K, V, KC, VC, BT, TREES, TILES, ANC, OUT, ACC, MAX, SUM,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
    skc_b, skc_h, skc_s, skc_d, svc_b, svc_h, svc_s, svc_d,
    s_bt, s_anc, so_t, so_h, so_d,
    scale_log2, num_segments,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr,
    PAGE: tl.constexpr, NUM_HQ: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)  # offsets in int64: a cache's head stride can be large
    seg = tl.program_id(2)
    t = tl.load(TILES + 2 * tile)
    q0 = tl.load(TILES + 2 * tile + 1)
    qs = tl.load(TREES + 5 * t).to(tl.int64)
    n = tl.load(TREES + 5 * t + 1)
    P = tl.load(TREES + 5 * t + 2)
    req = tl.load(TREES + 5 * t + 3)
    ao = tl.load(TREES + 5 * t + 4).to(tl.int64)

    # rows of the tile: BLOCK_Q nodes x GP heads, node major
    r = tl.arange(0, BLOCK_M)
    node = q0 + r // GP
    head = kvh * G + r % GP
    row_ok = (r // GP < BLOCK_Q) & (node < n) & (r % GP < G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    q = tl.load(Q + (qs + node)[:, None] * sq_t + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile adds 0, no NaN
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    # stage 1: prefix positions [lo, hi) of this segment, from the paged cache, no mask
    lo = 0
    hi = P
    if SPLIT:
        seg_len = ((P + num_segments - 1) // num_segments + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = seg * seg_len
        hi = tl.minimum(lo + seg_len, P)
    for s in range(lo, hi, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        ok = pos < hi
        blk = tl.load(BT + req * s_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = pos % PAGE
        kt = tl.load(KC + blk[None, :] * skc_b + kvh * skc_h + slot[None, :] * skc_s
                     + d[:, None] * skc_d, mask=d_ok[:, None] & ok[None, :], other=0.0)
        v = tl.load(VC + blk[:, None] * svc_b + kvh * svc_h + slot[:, None] * svc_s
                    + d[None, :] * svc_d, mask=ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt) * scale_log2  # [BLOCK_M, BLOCK_N]
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # stage 2 (last segment): the tree's nodes up to the tile's last, under the ancestor bits
    if seg == num_segments - 1:
        hi_t = tl.minimum(n, q0 + BLOCK_Q)
        for j0 in range(0, hi_t, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            ok = j < hi_t
            kt = tl.load(K + (qs + j)[None, :] * sk_t + kvh * sk_h + d[:, None] * sk_d,
                         mask=d_ok[:, None] & ok[None, :], other=0.0)
            v = tl.load(V + (qs + j)[:, None] * sv_t + kvh * sv_h + d[None, :] * sv_d,
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            word = tl.load(ANC + (ao + node)[:, None] * s_anc + (j // 32)[None, :],
                           mask=row_ok[:, None] & ok[None, :], other=0)
            seen = ((word >> (j % 32)[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
            if DOT_F32:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, kt) * scale_log2
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

    if SPLIT:  # unnormalised partials of this segment, indexed by (tree row, head, segment)
        idx = ((ao + node) * NUM_HQ + head) * num_segments + seg
        tl.store(ACC + idx[:, None] * HEAD_D + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(MAX + idx, m_i, mask=row_ok)
        tl.store(SUM + idx, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + (qs + node)[:, None] * so_t + head[:, None] * so_h + d[None, :] * so_d,
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tree_attn_reduce(
    ACC, MAX, SUM, ROWS, OUT, so_t, so_h, so_d, num_segments,
    NUM_HQ: tl.constexpr, SEG_P: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s (log2 domain)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SEG_P)
    s_ok = s < num_segments
    base = (row * NUM_HQ + h) * num_segments
    m = tl.load(MAX + base + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(SUM + base + s, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.reduce(m, 0, tl.standard._elementwise_max))
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    acc = tl.load(ACC + (base + s)[:, None] * HEAD_D + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = (tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine)
         / tl.reduce(l_s * w, 0, tl.standard._sum_combine))
    orow = tl.load(ROWS + row).to(tl.int64)
    tl.store(OUT + orow * so_t + h * so_h + d * so_d, o.to(OUT.dtype.element_ty), mask=d_ok)

