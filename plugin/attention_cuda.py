"""Tree attention behind vLLM's CUDA backends (FLASH_ATTN, TRITON_ATTN, FLASHINFER).

`TreeImplMixin.forward` runs the stock backend's forward for the whole step, then overwrites
the tree rows of `output` with `tree_kernel.tree_attention` (the Triton kernel; its torch twin
under ``TREEDRAFT_TREE_ATTENTION=kernel`` on CPU) over strided K/V views of the layer's cache
(`tree_kernel.kv_views`). Plain rows and chains keep the stock result. The step's `TreeMeta`
is built once, by the first layer, and shared (`TreeStep.kernel_meta`).

The per-backend subclasses (backend, metadata builder, impl) are made on first access
(`tree_backend`, module `__getattr__`), so importing this module imports no CUDA backend; the
builder stashes the batch's block table on its metadata (FlashInfer's metadata keeps none).
`register()` puts them over the stock enums in vLLM's backend registry (runner.install, tree
mode on CUDA).

Refused (NotImplementedError, "use a chain"): at engine start-up in the frontend
(`CONFIG_PATCHES`, on the VllmConfig of a CUDA tree-mode engine) a quantized KV cache and
DCP / PCP / DBO; when a layer's impl is built in a tree-mode engine, whatever
`impl_refusals` lists (alibi, sliding window, soft cap, sinks, KV sharing, non-decoder
attention, a quantized cache). The same frontend patch sets ``cudagraph_mode`` to PIECEWISE:
a batch of full trees is a uniform decode batch, and a FULL graph replay would run the stock
kernel alone (siblings attending to each other, silently); `forward` raises if it is ever
reached during stream capture.

`self_test` runs one synthetic tree step in the layer's cache layout and dtype through the
Triton kernel and the torch twin and refuses tree mode on a mismatch; `forward` runs it once
per (device, dtype, layout, head shape) before the first tree step, `treedraft selftest` on
demand.
"""

from __future__ import annotations

import functools
import importlib
import os
import random
from typing import Any

import torch

from . import tree_kernel as tk
from . import tree_step
from .patching import Patch

ATTENTION_ENV = "TREEDRAFT_TREE_ATTENTION"  # "kernel": CPU engines run this mixin (torch impl)
BLOCK_TABLE_ATTR = "treedraft_block_table"  # metadata attribute: the batch's block table
# enum name -> (module, stock backend class, our subclass's name)
BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend",
                   "TreeFlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend",
                    "TreeTritonAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend",
                   "TreeFlashInferBackend"),
}
# |triton - torch| <= tol * (1 + |torch|): a few output ulps; fp32 runs tf32 dots on the GPU
SELF_TEST_TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_self_tested: set[tuple] = set()  # configurations whose self-test passed in this process


def _tree_mode_now() -> bool:
    """Whether the engine being built (vLLM's current config) verifies branching trees."""
    from vllm.config import get_current_vllm_config_or_none

    from .config import tree_mode

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and tree_mode(cfg)


def impl_refusals(impl) -> list[str]:
    """What of this attention impl the tree kernel does not compute (empty: nothing)."""
    from vllm.utils.torch_utils import is_quantized_kv_cache

    window = getattr(impl, "sliding_window", None)
    dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    attn_type = getattr(impl, "attn_type", "decoder")  # vLLM's AttentionType is a str enum
    checks = {
        f"a quantized KV cache (kv_cache_dtype={dtype!r})":
            dtype.startswith(("fp8", "nvfp4", "int")) or is_quantized_kv_cache(dtype),
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        f"sliding-window attention ({window})": window not in (None, -1, (-1, -1)),
        "logit soft-capping": bool(getattr(impl, "logits_soft_cap", None)),
        "attention sinks": getattr(impl, "sinks", None) is not None
        or getattr(impl, "_sinks_source", None) is not None,
        "KV sharing across layers": getattr(impl, "kv_sharing_target_layer_name", None)
        is not None,
        f"{getattr(attn_type, 'value', attn_type)} attention": attn_type != "decoder",
        "decode / prefill context parallelism": getattr(impl, "dcp_world_size", 1) > 1
        or getattr(impl, "pcp_world_size", 1) > 1,
        "chunked local attention": getattr(impl, "chunk_lookback", -1) not in (-1, None),
    }
    return [k for k, v in checks.items() if v]


class TreeImplMixin:
    """Put before a stock AttentionImpl: its result for every row, then the tree rows again."""

    tree_impl = "triton"  # tree_kernel.IMPLS key
    kv_layout = "flash"  # tree_kernel.kv_views layout of the cache this impl receives

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if _tree_mode_now():
            bad = impl_refusals(self)
            if bad:
                raise NotImplementedError(
                    f"treedraft tree attention on {type(self).__mro__[2].__name__} does not "
                    f"support {'; '.join(bad)}; use a chain ('chain:K'), verified by vLLM")

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # tree rows are written in the output dtype, never quantized

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = tree_step.of_metadata(attn_metadata) if attn_metadata is not None else None
        if step is None or not step.trees:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "treedraft: a step with branching trees reached attention during CUDA-graph "
                "capture; a graph replay would skip the tree rows. Tree mode needs "
                "cudagraph_mode=PIECEWISE (set at start-up): please report this configuration")
        if key is None or value is None:  # KV sharing / cross-attention: refused at build
            raise NotImplementedError("treedraft tree attention needs this step's key and value "
                                      "rows; use a chain ('chain:K')")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("treedraft tree attention does not fuse output "
                                      "quantization; use a chain ('chain:K')")
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        self._tree_rows(step, query, key, value, kv_cache, attn_metadata, output)
        return result

    def _tree_rows(self, step, query, key, value, kv_cache, attn_metadata, output) -> None:
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_size
        q = query.view(-1, Hq, D)
        k, v = key.view(-1, Hkv, D), value.view(-1, Hkv, D)
        out = output.view(-1, Hq, D)  # shares memory: tree rows land in `output`
        if self.tree_impl == "triton":
            _self_test_once(kv_cache, Hq, Hkv, D, self.kv_layout)
        table = getattr(attn_metadata, BLOCK_TABLE_ATTR, None)
        if table is None:
            table = attn_metadata.block_table
        kc, vc = tk.kv_views(kv_cache, D, self.kv_layout)
        n = min(q.shape[0], k.shape[0])  # rows past the real tokens may be padding
        tk.tree_attention(q[:n], k[:n], v[:n], kc, vc, table, step.kernel_meta(q.device),
                          self.scale, out[:n], impl=self.tree_impl)
        step.tree_layers += 1


class TreeBuilderMixin:
    """Put before a stock metadata builder: the batch's block table rides on its metadata."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        setattr(md, BLOCK_TABLE_ATTR, common_attn_metadata.block_table_tensor)
        return md


def subclass_backend(base: type, name: str, impl_attrs: dict | None = None) -> type:
    """`base` (a vLLM AttentionBackend) with our impl and builder mixins, named `name`."""
    impl_base, builder_base = base.get_impl_cls(), base.get_builder_cls()
    # qualnames that pickle can resolve: module.<name>.tree_impl_cls (module __getattr__)
    impl = type(f"Tree{impl_base.__name__}", (TreeImplMixin, impl_base),
                {"__module__": __name__, "__qualname__": f"{name}.tree_impl_cls",
                 **(impl_attrs or {})})
    builder = type(f"Tree{builder_base.__name__}", (TreeBuilderMixin, builder_base),
                   {"__module__": __name__, "__qualname__": f"{name}.tree_builder_cls"})
    return type(name, (base,), {
        "__module__": __name__,
        "tree_impl_cls": impl,
        "tree_builder_cls": builder,
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder),
    })


@functools.cache
def tree_backend(enum_name: str) -> type:
    """Our subclass of the stock backend behind `enum_name` (imports that backend)."""
    module, cls, name = BACKENDS[enum_name]
    return subclass_backend(getattr(importlib.import_module(module), cls), name)


def __getattr__(name: str) -> Any:  # the registry resolves "treedraft.plugin.attention_cuda.X"
    for enum_name, (_, _, ours) in BACKENDS.items():
        if name == ours:
            return tree_backend(enum_name)
    if name == "TreeCPUKernelBackend":
        return cpu_kernel_backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def cpu_kernel_backend() -> type:
    """CPU_ATTN's tree subclass with this mixin instead of its chain cover, running the torch
    twin on the `vec` layout (its builder forces that ISA): CPU engines exercise the CUDA path's
    wrapper."""
    from .attention_cpu import TreeCPUAttentionBackend

    base = TreeCPUAttentionBackend.get_impl_cls().__mro__[1]  # the stock CPU impl
    impl = type("TreeKernelCPUAttentionImpl", (TreeImplMixin, base),
                {"__module__": __name__, "__qualname__": "TreeCPUKernelBackend.tree_impl_cls",
                 "tree_impl": "torch", "kv_layout": "vec"})
    builder = type("TreeKernelCPUMetadataBuilder", (TreeCPUAttentionBackend.get_builder_cls(),),
                   {"__module__": __name__, "force_vec": True,
                    "__qualname__": "TreeCPUKernelBackend.tree_builder_cls"})
    return type("TreeCPUKernelBackend", (TreeCPUAttentionBackend,), {
        "__module__": __name__, "tree_impl_cls": impl, "tree_builder_cls": builder,
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder)})


def kernel_mode_on_cpu() -> bool:
    return os.environ.get(ATTENTION_ENV, "") == "kernel"


def register() -> None:
    """Our subclasses over FLASH_ATTN, TRITON_ATTN and FLASHINFER (CPU_ATTN in kernel mode) in
    vLLM's backend registry; clears vLLM's per-process backend choice cache."""
    from vllm.logger import init_logger
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    ours = {"CPU_ATTN": "TreeCPUKernelBackend"} if current_platform.is_cpu() else \
        {name: cls for name, (_, _, cls) in BACKENDS.items()}
    for enum_name, cls in ours.items():
        register_backend(AttentionBackendEnum[enum_name], f"{__name__}.{cls}")
    _cached_get_attn_backend.cache_clear()
    init_logger("vllm.treedraft").info("treedraft tree attention kernel behind %s",
                                       ", ".join(ours))


# ----------------------------------------------------------------------------- start-up config


def cuda_config_refusals(vllm_config) -> list[str]:
    """What of a CUDA engine's configuration tree attention cannot serve (empty: nothing)."""
    cache, par = vllm_config.cache_config, vllm_config.parallel_config
    dtype = str(cache.cache_dtype)
    checks = {
        f"a quantized KV cache (kv_cache_dtype={dtype!r})": dtype not in (
            "auto", "bfloat16", "float16", "half", "float32", "float"),
        "decode context parallelism": getattr(par, "decode_context_parallel_size", 1) > 1,
        "prefill context parallelism": getattr(par, "prefill_context_parallel_size", 1) > 1,
        "dual-batch overlap (enable_dbo)": bool(getattr(par, "enable_dbo", False)),
    }
    return [k for k, v in checks.items() if v]


def piecewise_in_tree_mode(vllm_config) -> None:
    """A CUDA tree-mode engine: refuse what the kernel cannot serve, and no FULL CUDA graphs."""
    from vllm.config import CUDAGraphMode
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    from .config import tree_mode

    if not current_platform.is_cuda() or not tree_mode(vllm_config):
        return
    bad = cuda_config_refusals(vllm_config)
    if bad:
        raise NotImplementedError(
            f"treedraft branching trees on CUDA do not support {'; '.join(bad)}; use a chain "
            "('chain:K' or num_speculative_tokens without 'tree'), verified by vLLM")
    cc = vllm_config.compilation_config
    log = init_logger("vllm.treedraft")
    mode = cc.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        new = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() or \
            mode == CUDAGraphMode.FULL else CUDAGraphMode.NONE
        log.warning("treedraft tree mode: cudagraph_mode %s -> %s (a FULL graph replay would "
                    "skip the tree attention of the tree rows)", mode.name, new.name)
        cc.cudagraph_mode = new
    # vLLM decides the graphs' split points later (CompilationConfig.set_splitting_ops_for_v1):
    # attention+quant fusion empties them and turns PIECEWISE into FULL, and splitting_ops
    # without the attention ops capture attention inside the piecewise graphs
    passes = getattr(cc, "pass_config", None)
    if getattr(passes, "fuse_attn_quant", False):
        log.warning("treedraft tree mode: pass_config.fuse_attn_quant -> False (it captures "
                    "attention in FULL CUDA graphs; tree rows are never quantized anyway)")
        passes.fuse_attn_quant = False
    ops = getattr(cc, "splitting_ops", None)
    if ops and not cc.splitting_ops_contain_attention() and \
            not getattr(cc, "use_inductor_graph_partition", False):
        raise NotImplementedError(
            f"treedraft branching trees on CUDA need attention outside the CUDA graphs: "
            f"compilation_config.splitting_ops={ops} leaves out the attention ops "
            f"{list(cc._attention_ops)}; add them, leave splitting_ops unset, or use a chain "
            "('chain:K' or num_speculative_tokens without 'tree'), verified by vLLM")


def _wrap_cudagraph_mode(original):
    def _maybe_override_dynamic_sd_cudagraph_mode(self):
        original(self)
        piecewise_in_tree_mode(self)

    return _maybe_override_dynamic_sd_cudagraph_mode


CONFIG_PATCHES = [
    Patch("vllm.config.vllm:VllmConfig._maybe_override_dynamic_sd_cudagraph_mode",
          _wrap_cudagraph_mode,
          "CUDA tree mode: PIECEWISE CUDA graphs, refusals of what tree attention cannot serve"),
]


# ----------------------------------------------------------------------------- self-test


def cache_like(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A fresh [num_blocks, Hkv, bs, 2D] cache with `kv_cache`'s dtype, device and physical
    dimension order (outermost = largest stride)."""
    order = sorted(range(4), key=lambda i: -kv_cache.stride(i))
    shape = [num_blocks if i == 0 else kv_cache.shape[i] for i in order]
    phys = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    return phys.permute([order.index(i) for i in range(4)])


def self_test(kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
              layout: str = "flash", impl: str = "triton", seed: int = 0) -> dict:
    """One synthetic tree step (three trees and two plain rows, random prefixes and block
    table, NaN in unused blocks) in `kv_cache`'s layout and dtype through `impl`, once as
    `choose_segments` picks and once split in 3 segments over the prefix (split-KV and its
    reduce: batch 1 on long prompts), against the torch twin. Returns the numbers; raises
    NotImplementedError with them on a mismatch."""
    dev, dtype, bs = kv_cache.device, kv_cache.dtype, kv_cache.shape[2]
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    trees = [[-1] + [rnd.randrange(i) for i in range(1, 11)], [-1, 0, 0, 1, 1], [-1, 0, 1]]
    prefixes = [bs + 3, 2 * bs + 1, 200]  # 200: each of 3 segments reads tiles of keys
    nblk = [-(-(p + len(t)) // bs) for p, t in zip(prefixes, trees, strict=True)]
    nb = sum(nblk) + 3  # + unused blocks, NaN-filled
    kv = (cache_like(kv_cache, nb) if layout == "flash"
          else torch.empty(nb, *kv_cache.shape[1:], dtype=dtype, device=dev))
    kv.fill_(float("nan"))
    perm = torch.randperm(nb, generator=gen)[: sum(nblk)].tolist()
    table = torch.zeros(len(trees), max(nblk), dtype=torch.int32)
    specs, qs, used = [], 2, 0  # rows 0, 1: plain rows, never written
    for r, (parents, p, k) in enumerate(zip(trees, prefixes, nblk, strict=True)):
        table[r, :k] = torch.tensor(perm[used:used + k])
        used += k
        specs.append((qs, p, parents, r))
        qs += len(parents)
    kc, vc = tk.kv_views(kv, head_size, layout)
    for r, p in enumerate(prefixes):  # the committed prefixes' K/V in the paged cache
        for cache in (kc, vc):
            vals = torch.randn(p, num_kv_heads, head_size, generator=gen).to(dtype)
            slots = torch.arange(p)
            cache[table[r, slots // bs].long(), :, slots % bs] = vals.to(dev)
    T = qs

    def rand(h):
        return torch.randn(T, h, head_size, generator=gen).to(dtype).to(dev)

    q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    meta = tk.TreeMeta.build(specs, dev)
    table, scale = table.to(dev), head_size ** -0.5
    outs = {}
    for name, segments in ((impl, None), ("split", 3), ("torch", None)):
        out = torch.full_like(q, 7.0)
        outs[name] = tk.tree_attention(q, k, v, kc, vc, table, meta, scale, out,
                                       impl="torch" if name == "torch" else impl,
                                       num_segments=segments)
    ref = outs["torch"].float()
    err = max(((outs[name].float() - ref).abs() / (1 + ref.abs())).max().item()
              for name in (impl, "split"))
    tol = SELF_TEST_TOL.get(dtype, 3e-2)
    plain_ok = all(bool((outs[name][:2] == 7.0).all()) for name in (impl, "split"))
    result = {"device": str(dev), "dtype": str(dtype).removeprefix("torch."), "layout": layout,
              "heads": [num_heads, num_kv_heads, head_size], "block_size": bs,
              "impl": impl, "max_rel_err": err, "tol": tol, "plain_rows_untouched": plain_ok}
    if not (err <= tol and plain_ok):  # NaN fails too
        raise NotImplementedError(
            f"treedraft tree-attention self-test failed: {result}. The {impl} kernel disagrees "
            "with its torch twin on this GPU / layout, so tree mode is refused; use a chain "
            "('chain:K') and please report the numbers")
    return result


def _self_test_once(kv_cache: torch.Tensor, Hq: int, Hkv: int, D: int, layout: str) -> None:
    key = (str(kv_cache.device), kv_cache.dtype, tuple(kv_cache.shape[1:]),
           tuple(sorted(range(4), key=lambda i: -kv_cache.stride(i))), Hq, Hkv, D, layout)
    if key not in _self_tested:
        self_test(kv_cache, Hq, Hkv, D, layout)
        _self_tested.add(key)
