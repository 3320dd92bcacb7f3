"""Tree attention on vLLM's CPU backend (CPU_ATTN, registered over the stock class).

The C++ kernel (`cpu_attention_with_kv_cache`) only knows causal masks. A tree's nodes must see
the whole committed prefix and their own ancestors only, so after the kernel has run for the
whole batch, the rows of each branching tree are recomputed in torch: K/V of the request's
prefix and tree are read back from the paged cache (written before attention runs, at
sequential slots root_pos..root_pos+n) and `scaled_dot_product_attention` runs with the mask
[ones(prefix) | ancestor_mask]. Chains keep the kernel's causal result.

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


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, length: int):
    """K, V [Hkv, length, D] of positions 0..length-1 of one request (vec layout)."""
    kc, vc = vec_views(kv_cache)
    bs = kc.shape[-1]
    blocks = block_row[: (length + bs - 1) // bs].long()
    k = kc[blocks].permute(1, 0, 3, 2).reshape(kc.shape[1], -1, kc.shape[2])[:, :length]
    v = vc[blocks].permute(1, 0, 2, 3).reshape(vc.shape[1], -1, vc.shape[3])[:, :length]
    return k, v


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
        t0 = time.perf_counter()
        for t in trees:
            # query/output rows t.qs .. t.qs+size-1 are the tree; keys: prefix + tree slots
            k, v = gather_kv(kv_cache, attn_metadata.block_table[t.req_index],
                             t.root_pos + t.size)
            q = query[t.qs : t.qs + t.size].reshape(t.size, self.num_heads, self.head_size)
            q = q.transpose(0, 1)  # [Hq, m, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=t.mask, scale=self.scale,
                                               enable_gqa=True)  # [Hq, m, D]
            rows = output[t.qs : t.qs + t.size]
            rows.copy_(o.transpose(0, 1).reshape(rows.shape))
        if trees:
            step.attention_seconds += time.perf_counter() - t0
        return out


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
