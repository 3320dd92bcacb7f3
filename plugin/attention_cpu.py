"""Tree attention on vLLM's CPU backend (CPU_ATTN, registered over the stock class).

The C++ kernel (`cpu_attention_with_kv_cache`) only knows causal masks. A tree's nodes must see
the whole committed prefix and their own ancestors only, so after the kernel has run for the
whole batch, the rows of each branching tree are recomputed in torch: K/V of the request's
prefix and tree are read back from the paged cache (written before attention runs, at
sequential slots root_pos..root_pos+n) and `scaled_dot_product_attention` runs with the mask
[ones(prefix) | ancestor_mask]. All trees of a step run as ONE padded batch per layer
(`TreeBatch`, built once per step): one gather, one SDPA and one scatter per layer, whatever
the number of requests. Chains keep the kernel's causal result.

The cache interior depends on the kernel ISA; only the `vec` layout is read here (per block and
KV head: K transposed [D, block], then V [block, D]), so tree mode forces `vec` where vLLM
would pick `amx` (bf16 on AMX CPUs) and refuses other layouts at startup.

CUDA (designed, not run: CI has no GPU): per-request trees need a per-sequence mask, i.e.
FLEX_ATTENTION with `logical_mask_mod = kv < P[b] | anc[b, q, kv - P[b]]`, or a vendored copy of
`triton_unified_attention` whose `qq_bias` gets a per-sequence stride (0.20's TREE_ATTN passed
one bias shared by the whole batch). The KV copy in plugin/kv.py is layout-specific as well.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from . import tree_step
from .config import KEY

CLASS_PATH = "treedraft.plugin.attention_cpu.TreeCPUAttentionBackend"


def tree_mode(vllm_config) -> bool:
    from treedraft.heads.tree import parse_tree_spec

    td = (vllm_config.additional_config or {}).get(KEY)
    return bool(td) and not parse_tree_spec(td["tree"]).is_chain


def vec_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K [nb, Hkv, D, bs] and V [nb, Hkv, bs, D] views of a vec-layout cache [nb, Hkv, bs, 2D]."""
    nb, h, bs, two_d = kv_cache.shape
    flat = kv_cache.view(nb, h, 2, bs * (two_d // 2))
    return flat[:, :, 0].view(nb, h, two_d // 2, bs), flat[:, :, 1].view(nb, h, bs, two_d // 2)


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int):
    """K, V [B, Hkv, length, D] of slots 0..length-1 of B requests whose block-table rows
    are `blocks` [B, nblk] (vec layout)."""
    kc, vc = vec_views(kv_cache)  # [nb, Hkv, D, bs], [nb, Hkv, bs, D]
    B, nblk = blocks.shape
    h, d, bs = kc.shape[1], kc.shape[2], kc.shape[3]
    k = kc[blocks].permute(0, 2, 1, 4, 3).reshape(B, h, nblk * bs, d)[:, :, :length]
    v = vc[blocks].permute(0, 2, 1, 3, 4).reshape(B, h, nblk * bs, d)[:, :, :length]
    return k, v


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, length: int):
    """K, V [Hkv, length, D] of positions 0..length-1 of one request (vec layout)."""
    bs = kv_cache.shape[2]
    k, v = gather_blocks(kv_cache, block_row[None, : (length + bs - 1) // bs].long(), length)
    return k[0], v[0]


def copy_slots(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Copy K/V from slots `src` to slots `dst` in order (vec layout; slot = block*bs + offset)."""
    kc, vc = vec_views(kv_cache)
    bs = kc.shape[-1]
    for s, d in zip(src, dst, strict=True):
        kc[d // bs, :, :, d % bs] = kc[s // bs, :, :, s % bs]
        vc[d // bs, :, d % bs, :] = vc[s // bs, :, s % bs, :]


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not tree_mode(vllm_config):
            return
        if self.isa == "amx":  # packed layout; vec is what tree attention can read back
            self.isa = "vec"
            self._set_isa_to_layers(layer_names)
        if self.isa != "vec" or self.kv_cache_dtype not in ("auto", None):
            raise NotImplementedError(
                f"treedraft tree attention reads the CPU KV cache in the 'vec' layout, but this "
                f"model uses ISA {self.isa!r} with kv_cache_dtype={self.kv_cache_dtype!r} (head "
                f"size {self.head_dim}); use a chain tree ('chain:K') or kv_cache_dtype='auto'"
            )


class TreeCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        if attn_metadata is None:
            return out
        step = tree_step.of_metadata(attn_metadata)  # set by this engine's runner
        trees = step.trees if step is not None else ()
        if trees and (self.alibi_slopes is not None or self.sliding_window != -1
                      or self.logits_soft_cap or self.sinks is not None):
            raise NotImplementedError(
                "treedraft tree attention supports plain causal decoder attention only (no "
                "alibi, sliding window, soft cap or sinks); use a chain tree ('chain:K')"
            )
        if not trees:
            return out
        t0 = time.perf_counter()
        batch = step.batch(attn_metadata.block_table, kv_cache.shape[2])
        k, v = batch.gather(kv_cache)  # [B, Hkv, S, D] every tree's prefix + tree slots
        q = query.reshape(query.shape[0], self.num_heads, self.head_size)[batch.q_rows]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=batch.mask,
                                           scale=self.scale, enable_gqa=True)  # [B, Hq, m, D]
        o = o.transpose(1, 2)[batch.row_valid]  # [rows of all trees, Hq, D]
        output.index_copy_(0, batch.out_rows, o.reshape(-1, *output.shape[1:]).to(output.dtype))
        step.attention_seconds += time.perf_counter() - t0
        return out


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
            self.mask[b, 0, : t.size, :n] = t.mask
            self.mask[b, 0, t.size :, 0] = True  # padding rows: any finite result, dropped
            self.kv_valid[b, 0, :n] = True
            self.q_rows[b] = t.qs + torch.arange(m).clamp(max=t.size - 1)
            self.row_valid[b, : t.size] = True
        self.out_rows = self.q_rows[self.row_valid]  # output rows, in o[row_valid] order

    def gather(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, S, D] of slots 0..S-1 of each tree's request (vec layout), zero where
        a slot is past the request's prefix + tree."""
        k, v = gather_blocks(kv_cache, self.blocks, self.S)
        return k.masked_fill(~self.kv_valid, 0), v.masked_fill(~self.kv_valid, 0)


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
