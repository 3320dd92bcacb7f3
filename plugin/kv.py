"""KV bookkeeping after tree verification: the accepted path moves to the first slots.

vLLM's scheduler assumes accepted tokens are a prefix of the scheduled drafts: it keeps
`root_pos + 1 + k` computed tokens and rolls back the rest. So after verification the K/V of the
accepted nodes a_1 < ... < a_k (written at slots of positions root_pos + a_j) must sit at the
slots of positions root_pos + j. Node a_j is at depth j and saw only the prefix and its
ancestors at position root_pos + j, so its K/V are exactly what a chain over the path computes.
Copying in increasing j is hazard-free: a_j >= j, and later sources a_m > a_j > j are never
overwritten. Rejected slots need no release: they lie beyond the rolled-back length and are
rewritten by later steps, as with vLLM's own rejected drafts.

Every layout is copied by one gather and one scatter per layer, equal to the ordered copies by
the hazard argument above: vLLM's CUDA cache (`flash`, any physical stride order) on its K/V
views (`tree_kernel.copy_slots`), the CPU cache in the layout of the ISA its layer was given
(`attention_cpu.SlotLayout`: `vec`, `amx`, ...).
"""

from __future__ import annotations

import torch

from . import tree_kernel


def attention_caches(runner) -> list[tuple[torch.Tensor, str | None]]:
    """(KV cache, CPU attention ISA or None) of the target's attention layers, one per cache
    tensor (deduplicated)."""
    seen, out = set(), []
    for ctx in runner.compilation_config.static_forward_context.values():
        kv = getattr(ctx, "kv_cache", None)
        if isinstance(kv, list | tuple):
            kv = kv[0] if kv else None
        if isinstance(kv, torch.Tensor) and kv.numel() and kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            out.append((kv, getattr(ctx, "isa", None)))
    return out


def compact_accepted(runner, step) -> int:
    """Move each tree request's accepted K/V to sequential slots; returns slots copied.

    A node's row wrote its K/V at the slot of its sequential position (root_pos + node: the
    step's slot mapping is computed before tree positions replace the positions), which the
    request's row of the block table gives on the host: `slot_mapping`'s host half is not it
    on CUDA, where vLLM computes the mapping on the GPU only."""
    moves_src, moves_dst = [], []
    bt = runner.input_batch.block_table.block_tables[0]
    table, bs = bt.block_table.np, bt.block_size
    for req in step.requests.values():
        nodes = step.accepted.get(req.req_id, [])
        row = table[req.req_index]
        for j, a in enumerate(nodes, start=1):
            if a != j:
                src, dst = req.root_pos + a, req.root_pos + j
                moves_src.append(int(row[src // bs]) * bs + src % bs)
                moves_dst.append(int(row[dst // bs]) * bs + dst % bs)
    if moves_src:
        src = torch.tensor(moves_src, dtype=torch.long)
        dst = torch.tensor(moves_dst, dtype=torch.long)
        cpu = None  # CPU layers: (src, dst) as attention_cpu.Slots, their elements shared
        on = {}  # CUDA layers: (src, dst) on the cache's device, one copy for every layer
        for kv, isa in attention_caches(runner):
            if isa is not None and cpu is None:
                from .attention_cpu import Slots  # imports vLLM's CPU backend: CPU only

                cpu = Slots(src), Slots(dst)
            if isa is None and kv.device not in on:
                on[kv.device] = src.to(kv.device), dst.to(kv.device)
            copy_kv_slots(kv, *(cpu if isa is not None else on[kv.device]), isa)
    return len(moves_src)


def copy_kv_slots(kv_cache: torch.Tensor, src, dst, isa: str | None = None) -> None:
    """K/V of slots `src` to slots `dst` in one layer's cache [nb, Hkv, bs, 2D]: a CPU cache in
    the layout vLLM's CPU kernel writes for its layer's `isa`; isa None (CUDA layers have none)
    vLLM's CUDA (`flash`) layout. src, dst: slot lists or long tensors; on CPU also
    `attention_cpu.Slots`, whose cache elements are then computed once for every layer."""
    if isa is not None:
        from .attention_cpu import Slots, copy_slots, slot_layout  # imports vLLM's CPU backend

        if not isinstance(src, Slots):
            src = Slots(torch.as_tensor(src, dtype=torch.long))
            dst = Slots(torch.as_tensor(dst, dtype=torch.long))
        if len(src):
            copy_slots(kv_cache, slot_layout(kv_cache, isa), src, dst)
        return
    k, v = tree_kernel.kv_views(kv_cache, kv_cache.shape[-1] // 2, "flash")
    tree_kernel.copy_slots(k, v, src, dst)
