"""Scratch KV blocks for tree attention: the last few blocks of the KV cache, kept from the
scheduler.

Tree rows attend through vLLM's own causal kernel (plugin/attention_cpu.py): every root-to-leaf
chain of a tree becomes one more causal sequence of the step, whose last block(s) hold a copy of
the prefix's partial last block followed by the chain's K/V. Those copies need blocks nobody else
owns, so the scheduler's view of the cache is `SCRATCH_BLOCKS` blocks shorter than the worker's
tensors: the scheduler never hands out block ids in `scratch_range(...)`, and each step may
overwrite them. How many: `SCRATCH_BLOCKS`, or the `scratch_blocks` key of
`--speculative-config` (carried in the engine's `additional_config["treedraft"]`; 0 = every tree
row recomputed in torch). The count is a function of the cache size both sides know (the scheduler's
`KVCacheConfig.num_blocks` before the cut, the worker's `kv_cache_config.num_blocks`), so they
agree without talking. Trees that do not fit in the scratch of a step fall back to the torch
recomputation (exact too, slower).

Touch point: `Scheduler.__init__` (vLLM 0.32), tree mode only.
"""

from __future__ import annotations

import copy

from .config import KEY, tree_mode
from .patching import Patch

SCRATCH_BLOCKS = 32  # one chain needs 1-2 blocks: ~16 chains per step by default
MAX_FRACTION = 8  # never more than 1/8 of the cache


def scratch_count(num_blocks: int, block_size: int, max_model_len: int,
                  want: int = SCRATCH_BLOCKS) -> int:
    """Blocks kept for tree scratch out of a cache of `num_blocks`: `want`, but at most 1/8 of
    the cache, and 0 when the cache is too small (what remains must still hold one request of
    max_model_len, plus vLLM's null block)."""
    spare = num_blocks - 1 - -(-max_model_len // block_size)
    return max(0, min(want, num_blocks // MAX_FRACTION, spare))


def scratch_range(vllm_config, num_blocks: int) -> range:
    """Block ids of the scratch in a worker cache of `num_blocks` blocks (empty unless tree mode)."""
    if not tree_mode(vllm_config):
        return range(0)
    want = vllm_config.additional_config[KEY].get("scratch_blocks", SCRATCH_BLOCKS)
    n = scratch_count(num_blocks, vllm_config.cache_config.block_size,
                      vllm_config.model_config.max_model_len, want)
    return range(num_blocks - n, num_blocks)


def _wrap_scheduler_init(original):
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        scratch = scratch_range(vllm_config, kv_cache_config.num_blocks)
        if scratch:
            kv_cache_config = copy.copy(kv_cache_config)
            kv_cache_config.num_blocks -= len(scratch)
            from vllm.logger import init_logger

            init_logger("vllm.treedraft").info(
                "treedraft keeps %d of %d KV blocks as tree-attention scratch", len(scratch),
                kv_cache_config.num_blocks + len(scratch))
        original(self, vllm_config, kv_cache_config, *args, **kwargs)

    return __init__


SCHEDULER_PATCHES = [
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__", _wrap_scheduler_init,
          "tree mode: the last KV blocks are tree-attention scratch, never scheduled"),
]
