"""Tree attention on vLLM's CPU backend (CPU_ATTN, registered over the stock class).

The C++ kernel (`cpu_attention_with_kv_cache`) only knows causal masks. A tree's nodes must see
the whole committed prefix and their own ancestors only. Every branching tree of a step is
therefore handed to the kernel as causal sequences (`TreeSeqs`, built once per step): the
request's own entry keeps the root and the chain of nodes 1..h-1 that follows it in node order;
every other root-to-leaf chain (`heads.tree.chain_cover`) becomes one more sequence whose block
table is the request's own for the full prefix blocks, then scratch blocks (plugin/scratch.py)
holding a copy of the prefix's partial last block and the chain's K/V in depth order. Each layer
copies one block and a few slots per chain (never the prefix) and runs the kernel ONCE
for the whole batch with the tree rows permuted so each chain's rows are contiguous. So tree
rows get the kernel's numerics (the same as chains and no-spec rows), the prefix is read by the
kernel as for any sequence, and the cost added by a tree grows with its number of chains and
the block size, not with the prefix length.

On CPU a tree-mode engine runs KV blocks of 32 tokens unless `--block-size` is given
(plugin/scratch.py `TREE_BLOCK_SIZE`), which keeps the copied partial blocks small.

Trees that do not fit in the step's scratch blocks (or when there are none: a cache too small,
`"scratch_blocks": 0` in --speculative-config) are recomputed in torch after the kernel (`TreeBatch`): K/V of the
request's prefix and tree are read back from the paged cache and one masked
`scaled_dot_product_attention` per layer runs for all of them, with the mask [ones(prefix) |
ancestor_mask]. Chains keep the kernel's causal result.

The cache interior depends on the kernel ISA (`vec`: per block and KV head K transposed
[D, block], then V [block, D]; `amx`: both VNNI-packed in 16-slot tiles). Tree mode reads and copies
slots through `SlotLayout`: where each slot's K/V elements sit inside a block, probed once per ISA
from the kernel's own cache write, so every ISA vLLM picks is served with its own kernel (bf16 on
AMX CPUs keeps `amx`). A layout the probe cannot map, or a quantized KV cache, is refused at
startup.

CUDA (designed, not run: CI has no GPU): the same chain sequences work with any causal paged
kernel (FLASH_ATTN, triton_unified_attention): scratch blocks + a permuted query, no mask.
The KV copies in plugin/kv.py and here are layout-specific as well.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from treedraft.heads.tree import chain_cover

from . import tree_step
from .config import tree_mode

CLASS_PATH = "treedraft.plugin.attention_cpu.TreeCPUAttentionBackend"


class SlotLayout:
    """Where the CPU kernel keeps each slot's K and V inside a block: `k_off`, `v_off` [bs, D]
    are the offsets of (slot, dim) in a block's K half and V half of one KV head ([nb, Hkv, bs,
    2D] viewed as [nb, Hkv, 2, bs * D], as CPU_ATTN splits it). Probed once per (ISA, block
    size, head size, dtype) by writing the index of every (slot, dim) through the kernel's own
    `cpu_attn_reshape_and_cache`, one base-16 digit per pass (exact in every float dtype)."""

    def __init__(self, isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> None:
        bs, d, n = block_size, head_size, block_size * head_size
        cache = torch.empty(1, 1, 2 * bs, d, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        index = torch.arange(n).view(bs, 1, d)  # (slot, dim) -> slot * D + dim
        found = torch.zeros(2, n, dtype=torch.long)
        digits = max(1, -(-(n - 1).bit_length() // 4))
        for i in range(digits):
            cache.fill_(-1)
            digit = ((index >> (4 * i)) & 15).to(dtype)
            ops.cpu_attn_reshape_and_cache(digit, digit, key_cache, value_cache,
                                           torch.arange(bs), isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
            got = cache.view(2, n).float()
            if (got < 0).any():  # an element the kernel never wrote
                found[:] = -1
                break
            found += got.long() << (4 * i)
        offs = []
        for part in found:  # part[offset] = slot * D + dim
            off = torch.full((n,), -1, dtype=torch.long)
            if (part >= 0).all() and (part < n).all():
                off[part] = torch.arange(n)
            if (off < 0).any():
                raise NotImplementedError(
                    f"treedraft tree attention cannot map vLLM's CPU KV cache layout for ISA "
                    f"{isa!r} (block size {bs}, head size {d}, {dtype}): its cache write is not "
                    "one element per (slot, dim); use a chain tree ('chain:K')")
            offs.append(off.view(bs, d))
        self.k_off, self.v_off = offs

    @staticmethod
    def views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a cache [nb, Hkv, bs, 2D] as [nb, bs * D, Hkv] views (block interior
        first, KV heads last) that `k_off`/`v_off` index."""
        nb, h, bs, two_d = kv_cache.shape
        flat = kv_cache.view(nb, h, 2, bs * (two_d // 2))
        return flat[:, :, 0].transpose(1, 2), flat[:, :, 1].transpose(1, 2)

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor):
        """K, V [*shape, D, Hkv] of the slots `slots` (offsets in the block) of blocks `blocks`
        (both long, broadcast to one shape)."""
        kc, vc = self.views(kv_cache)
        b = blocks[..., None]
        return kc[b, self.k_off[slots]], vc[b, self.v_off[slots]]

    def elements(self, slots: torch.Tensor, heads: int) -> torch.Tensor:
        """Indices into a contiguous cache [nb, heads, bs, 2D] flattened (`flat(kv_cache)`) of
        every K and V element of `slots` (long, slot = block * bs + offset), every KV head:
        [2 * len(slots) * heads * D]. Computed once per step; a layer's copy is then one
        index_select and one index_copy_ (advanced indexing of the strided `views` cost about
        3x as much per layer on a 2-core CPU)."""
        bs, n = self.k_off.shape
        n *= bs  # elements of a block's K half (and of its V half) per KV head
        row = ((slots // bs)[:, None] * heads + torch.arange(heads)) * (2 * n)  # [s, heads]
        off = slots % bs
        k = row[:, :, None] + self.k_off[off][:, None, :]
        v = row[:, :, None] + (n + self.v_off[off][:, None, :])
        return torch.cat((k.reshape(-1), v.reshape(-1)))


def flat(kv_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as one dimension, the view `SlotLayout.elements` indexes."""
    if not kv_cache.is_contiguous():
        raise NotImplementedError(
            "treedraft tree mode copies K/V slots of a contiguous CPU KV cache per layer; this "
            f"vLLM's cache has strides {tuple(kv_cache.stride())} for shape "
            f"{tuple(kv_cache.shape)}: use a chain tree ('chain:K')")
    return kv_cache.view(-1)


def copy_elements(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Cache elements `src` to `dst` (`SlotLayout.elements`): one gather, then one scatter (see
    tree_kernel.copy_slots for when that equals copying in order)."""
    f = flat(kv_cache)
    f.index_copy_(0, dst, f.index_select(0, src))


class Slots:
    """Cache slots (long, slot = block * block_size + offset) a step reads or writes in every
    layer: their elements (`SlotLayout.elements`) are computed at the first layer of each
    (layout, KV heads) and reused by the others."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self._elements: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def elements(self, layout: SlotLayout, heads: int) -> torch.Tensor:
        key = (id(layout), heads)  # layouts live as long as the process (`_slot_layout`)
        e = self._elements.get(key)
        if e is None:
            e = self._elements[key] = layout.elements(self.slots, heads)
        return e


def copy_slots(kv_cache: torch.Tensor, layout: SlotLayout, src: Slots, dst: Slots) -> None:
    """This layer's K/V of slots `src` to slots `dst`."""
    heads = kv_cache.shape[1]
    copy_elements(kv_cache, src.elements(layout, heads), dst.elements(layout, heads))


@functools.cache
def _slot_layout(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> SlotLayout:
    return SlotLayout(isa, block_size, head_size, dtype)


def slot_layout(kv_cache: torch.Tensor, isa: str) -> SlotLayout:
    """The `SlotLayout` of one layer's cache [nb, Hkv, bs, 2D] written with `isa`."""
    return _slot_layout(isa, kv_cache.shape[2], kv_cache.shape[3] // 2, kv_cache.dtype)


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not tree_mode(vllm_config):
            return
        if self.kv_cache_dtype not in ("auto", None):
            raise NotImplementedError(
                f"treedraft tree attention copies K/V between cache slots, which a quantized "
                f"CPU KV cache (kv_cache_dtype={self.kv_cache_dtype!r}) does not allow; use "
                f"kv_cache_dtype='auto' or a chain tree ('chain:K')")
        if self.force_vec and self.isa != "vec":
            self.isa = "vec"
            self._set_isa_to_layers(layer_names)
        _slot_layout(self.isa, self.block_size, self.head_dim, self.dtype)  # refuses at startup

    force_vec = False  # True: always the `vec` ISA (the torch twin of the CUDA path reads it)


class TreeCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = tree_step.of_metadata(attn_metadata) if attn_metadata is not None else None
        trees = step.trees if step is not None else ()
        if not trees:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if (self.alibi_slopes is not None or self.sliding_window != -1
                or self.logits_soft_cap or self.sinks is not None):
            raise NotImplementedError(
                "treedraft tree attention supports plain causal decoder attention only (no "
                "alibi, sliding window, soft cap or sinks); use a chain tree ('chain:K')"
            )
        t0 = time.perf_counter()
        step.tree_layers += 1
        seqs = step.seqs(attn_metadata, kv_cache.shape[2])
        meta = seqs.metadata(self, layer, query.dtype)
        layout = slot_layout(kv_cache, layer.isa)
        seqs.copy_kv(kv_cache, layout)
        n = attn_metadata.num_actual_tokens
        q, o = query, output
        if seqs.perm is not None:  # each chain's rows contiguous, in depth order
            q, o = query[:n].index_select(0, seqs.perm), torch.empty_like(output[:n])
        step.attention_seconds += time.perf_counter() - t0
        super().forward(layer, q, key, value, kv_cache, meta, o, output_scale, output_block_scale)
        t0 = time.perf_counter()
        if seqs.perm is not None:
            output[:n].index_copy_(0, seqs.perm, o)
        if seqs.leftover:  # no scratch left for these: torch recomputation of their rows
            batch = seqs.batch(attn_metadata.block_table, kv_cache.shape[2])
            k, v = batch.gather(kv_cache, layout)  # [B, Hkv, S, D] every tree's prefix + tree slots
            q = query.reshape(query.shape[0], self.num_heads, self.head_size)[batch.q_rows]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=batch.mask,
                                               scale=self.scale, enable_gqa=True)
            o = o.transpose(1, 2)[batch.row_valid]  # [rows of all trees, Hq, D]
            output.index_copy_(0, batch.out_rows, o.reshape(-1, *output.shape[1:]).to(output.dtype))
        step.attention_seconds += time.perf_counter() - t0
        return output


class TreeSeqs:
    """The step's batch with every branching tree split into causal chains (see the module
    docstring): built once per step from the kernel's metadata, shared by every layer.

    perm: [n] rows of the new query order (None when it is the identity); the kernel's row r is
    the step's row perm[r]. leftover: trees that did not fit in `scratch` (torch path)."""

    def __init__(self, trees, md, block_size: int, scratch: range) -> None:
        bs = block_size
        by_req = {t.req_index: t for t in trees}
        qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        table = md.block_table
        rows, new_qsl, new_lens, perm = [], [0], [], []
        src, dst = [], []  # (block, offset) slot pairs copied into scratch, per layer
        tails = []  # (real block, scratch block): the prefix's partial last block, copied whole
        free = list(scratch)
        self.leftover = []

        def add(row, q_rows, seq_len):
            rows.append(row)
            perm.extend(q_rows)
            new_qsl.append(new_qsl[-1] + len(q_rows))
            new_lens.append(seq_len)

        for i in range(len(lens)):
            q0, q1 = qsl[i], qsl[i + 1]
            t = by_req.get(i)
            head, paths = chain_cover(t.parents) if t is not None else (0, [])
            P = t.root_pos if t is not None else 0
            need = sum(-(-(P % bs + len(a) + len(b)) // bs) for a, b in paths)
            if (t is None or need > len(free) or q0 != t.qs or q1 - q0 != t.size
                    or lens[i] != P + t.size):
                if t is not None:
                    self.leftover.append(t)
                add(table[i], range(q0, q1), lens[i])
                continue
            add(table[i], range(q0, q0 + head), P + head)
            c0 = P // bs
            for anc, new in paths:
                line = anc + new
                nblk = -(-(P % bs + len(line)) // bs)
                blocks, free = free[:nblk], free[nblk:]
                row = table[i].clone()
                row[c0 : c0 + nblk] = torch.tensor(blocks, dtype=row.dtype)
                if P % bs:  # the prefix's partial last block (one contiguous block copy; the
                    # chain then overwrites the slots from P % bs on)
                    tails.append((int(table[i, c0]), blocks[0]))
                for k, node in enumerate(line):  # the chain, in depth order
                    pos, lpos = P + node, P % bs + k
                    src.append((int(table[i, pos // bs]), pos % bs))
                    dst.append((blocks[lpos // bs], lpos % bs))
                add(row, [q0 + j for j in new], P + len(line))
        self.block_table = torch.stack(rows)
        self.query_start_loc = torch.tensor(new_qsl, dtype=md.query_start_loc.dtype)
        self.seq_lens = torch.tensor(new_lens, dtype=md.seq_lens.dtype)
        order = torch.tensor(perm, dtype=torch.long)
        n = md.num_actual_tokens
        self.perm = None if torch.equal(order, torch.arange(n)) else order
        s, d = torch.tensor(src, dtype=torch.long).view(-1, 2), torch.tensor(dst).view(-1, 2)
        self.src, self.dst = Slots(s[:, 0] * bs + s[:, 1]), Slots(d[:, 0] * bs + d[:, 1])
        t = torch.tensor(tails, dtype=torch.long).view(-1, 2)
        self.tail_src, self.tail_dst = t[:, 0], t[:, 1]
        self._md = md
        self._meta = None
        self._batch = None

    def metadata(self, impl, layer, dtype):
        """The kernel's metadata for these sequences (scheduler metadata computed once)."""
        if self._meta is None:
            md = self._md
            sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(self.seq_lens), num_heads=impl.num_heads,
                num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size, seq_lens=self.seq_lens,
                dtype=dtype, query_start_loc=self.query_start_loc, causal=md.causal,
                sliding_window_size=-1, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=None, kv_cache_dtype=impl.kv_cache_dtype)
            diff = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._meta = dataclasses.replace(
                md, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                block_table=self.block_table, scheduler_metadata=sched,
                max_query_len=int(diff.max()), max_seq_len=int(self.seq_lens.max()))
        return self._meta

    def copy_kv(self, kv_cache: torch.Tensor, layout: SlotLayout) -> None:
        """This layer's prefix tails and chains into the scratch blocks."""
        if len(self.tail_src):
            kv_cache.index_copy_(0, self.tail_dst, kv_cache.index_select(0, self.tail_src))
        if len(self.src):
            copy_slots(kv_cache, layout, self.src, self.dst)

    def batch(self, block_table: torch.Tensor, block_size: int):
        """The leftover trees as one torch attention batch (`TreeBatch`), built once."""
        if self._batch is None:
            self._batch = TreeBatch(self.leftover, block_table, block_size)
        return self._batch


class TreeBatch:
    """Every branching tree of a step as one padded batch for ONE attention call per layer
    (instead of a gather, an SDPA and a copy per tree and layer): built once per step, used by
    every layer. B trees, m = the largest tree, S = the longest prefix + tree."""

    def __init__(self, trees, block_table: torch.Tensor, block_size: int) -> None:
        B, m = len(trees), max(t.size for t in trees)
        S = max(t.root_pos + t.size for t in trees)
        nblk = (S + block_size - 1) // block_size
        idx = torch.tensor([t.req_index for t in trees])
        self.blocks = block_table[idx, :nblk].long()  # [B, nblk]; columns past a request's
        # own blocks point anywhere: those slots are masked, and zeroed (garbage may be NaN)
        self.S = S
        self.mask = torch.zeros(B, 1, m, S, dtype=torch.bool)
        self.kv_valid = torch.zeros(B, 1, S, 1, dtype=torch.bool)
        self.q_rows = torch.zeros(B, m, dtype=torch.long)
        self.row_valid = torch.zeros(B, m, dtype=torch.bool)
        for b, t in enumerate(trees):
            n = t.root_pos + t.size
            self.mask[b, 0, : t.size, : t.root_pos] = True  # the committed prefix
            self.mask[b, 0, : t.size, t.root_pos : n] = t.mask  # the tree: ancestors only
            self.mask[b, 0, t.size :, 0] = True  # padding rows: any finite result, dropped
            self.kv_valid[b, 0, :n] = True
            self.q_rows[b] = t.qs + torch.arange(m).clamp(max=t.size - 1)
            self.row_valid[b, : t.size] = True
        self.out_rows = self.q_rows[self.row_valid]  # output rows, in o[row_valid] order
        pos = torch.arange(S)
        self.slots = Slots((self.blocks[:, pos // block_size] * block_size
                            + pos % block_size).reshape(-1))  # [B * S]

    def gather(self, kv_cache: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, S, D] of slots 0..S-1 of each tree's request, zero where a slot is past
        the request's prefix + tree: one index_select of the flattened cache per layer, at
        element indices computed at the step's first layer (`SlotLayout.elements`)."""
        B, S, heads = len(self.blocks), self.S, kv_cache.shape[1]
        kv = flat(kv_cache).index_select(0, self.slots.elements(layout, heads))
        kv = kv.view(2, B, S, heads, -1).transpose(2, 3)
        return kv[0].masked_fill(~self.kv_valid, 0), kv[1].masked_fill(~self.kv_valid, 0)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return TreeCPUAttentionMetadataBuilder


def register() -> None:
    """Make CPU_ATTN resolve to the tree-aware subclass (vLLM's public backend registry)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)
