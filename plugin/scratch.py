"""Scratch KV blocks for tree attention: the last few blocks of the KV cache, kept from the
scheduler.

Tree rows attend through vLLM's own causal kernel (plugin/attention_cpu.py): every root-to-leaf
chain of a tree becomes one more causal sequence of the step, whose last block(s) hold a copy of
the prefix's partial last block followed by the chain's K/V. Those copies need blocks nobody else
owns, so the scheduler's view of the cache is a few blocks shorter than the worker's
tensors: the scheduler never hands out block ids in `scratch_range(...)`, and each step may
overwrite them. How many: `SCRATCH_SLOTS` tokens' worth of blocks, or the `scratch_blocks` key of
`--speculative-config` (carried in the engine's `additional_config["treedraft"]`; 0 = every tree
row recomputed in torch). The count is a function of the cache size both sides know (the scheduler's
`KVCacheConfig.num_blocks` before the cut, the worker's `kv_cache_config.num_blocks`), so they
agree without talking. Trees that do not fit in the scratch of a step fall back to the torch
recomputation (exact too, slower).

On CPU, a tree-mode engine whose `--block-size` is not given runs KV blocks of `TREE_BLOCK_SIZE`
(32) tokens instead of vLLM's CPU default of 128: each branch of a tree copies its prefix's partial
last block into scratch in every layer (plugin/attention_cpu.py), so that copy shrinks 4x, and the
same scratch memory holds 4x as many blocks. Plain and chain steps ran as fast on either size
with the `vec` ISA (scripts/BENCHMARKS.md, "The tree step: KV block size and slot copies"; `amx`
not measured on 32).

The tree kernel (CUDA; `TREEDRAFT_TREE_ATTENTION=kernel` on CPU) reads trees in place and keeps
no scratch (`scratch_used`).

Touch points (vLLM 0.32), tree mode only: `Scheduler.__init__`; on CPU
`CpuPlatform.check_and_update_config`.
"""

from __future__ import annotations

import copy

from .config import KEY, tree_mode
from .patching import Patch

TREE_BLOCK_SIZE = 32  # tree mode's KV block size on CPU: the smallest the CPU kernels take
CPU_DEFAULT_BLOCK_SIZE = 128  # what vLLM 0.32's CpuPlatform picks when --block-size is not given
SCRATCH_SLOTS = 4096  # tokens of scratch by default: 32 blocks of 128, 128 blocks of 32; one
# chain needs 1-2 blocks, so ~16 chains per step at 128 tokens a block, ~64 at 32
MAX_FRACTION = 8  # never more than 1/8 of the cache


def scratch_count(num_blocks: int, block_size: int, max_model_len: int,
                  want: int | None = None) -> int:
    """Blocks kept for tree scratch out of a cache of `num_blocks`: `want` (default
    SCRATCH_SLOTS tokens' worth), but at most 1/8 of the cache, and 0 when the cache is too small
    (what remains must still hold one request of max_model_len, plus vLLM's null block)."""
    if want is None:
        want = SCRATCH_SLOTS // block_size
    spare = num_blocks - 1 - -(-max_model_len // block_size)
    return max(0, min(want, num_blocks // MAX_FRACTION, spare))


def scratch_used() -> bool:
    """Whether this platform's tree attention runs through scratch blocks: vLLM's CPU kernel over
    causal chains (plugin/attention_cpu.py). The tree kernel (CUDA, or its torch twin on CPU
    under ``TREEDRAFT_TREE_ATTENTION=kernel``) reads trees in place: no blocks kept from the
    scheduler there."""
    from vllm.platforms import current_platform

    from .attention_cuda import kernel_mode_on_cpu

    return current_platform.is_cpu() and not kernel_mode_on_cpu()


def scratch_range(vllm_config, num_blocks: int) -> range:
    """Block ids of the scratch in a worker cache of `num_blocks` blocks (empty unless tree mode
    on a platform that uses scratch)."""
    if not tree_mode(vllm_config) or not scratch_used():
        return range(0)
    want = vllm_config.additional_config[KEY].get("scratch_blocks")
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


def small_blocks_in_tree_mode(vllm_config) -> None:
    """A tree-mode engine whose block size vLLM chose (no --block-size) gets `TREE_BLOCK_SIZE`."""
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    if (not tree_mode(vllm_config) or cc.user_specified_block_size
            or cc.block_size != CPU_DEFAULT_BLOCK_SIZE or mc is None or mc.is_hybrid):
        return
    cc.block_size = TREE_BLOCK_SIZE
    from vllm.logger import init_logger

    init_logger("vllm.treedraft").info(
        "treedraft tree mode: KV blocks of %d tokens (vLLM's CPU default is %d; each tree branch "
        "copies its prefix's partial last block per layer); --block-size overrides",
        TREE_BLOCK_SIZE, CPU_DEFAULT_BLOCK_SIZE)


def _wrap_check_and_update_config(original):
    def check_and_update_config(cls, vllm_config) -> None:
        original(vllm_config)
        small_blocks_in_tree_mode(vllm_config)

    return classmethod(check_and_update_config)


CPU_CONFIG_PATCHES = [
    Patch("vllm.platforms.cpu:CpuPlatform.check_and_update_config",
          _wrap_check_and_update_config,
          "CPU tree mode: KV blocks of 32 tokens unless --block-size is given"),
]


SCHEDULER_PATCHES = [
    Patch("vllm.v1.core.sched.scheduler:Scheduler.__init__", _wrap_scheduler_init,
          "tree mode: the last KV blocks are tree-attention scratch, never scheduled"),
]
