"""plugin/attention_cuda.py and the CUDA side of config.py / kv.py, on CPU (no GPU needed).

Proves:
- `TreeImplMixin.forward` around a stub stock impl: the tree rows of `output` become the tree
  attention (torch twin and interpreted Triton kernel) equal to a dense fp32 SDPA over prefix
  + ancestors; every other row (plain, chain, padding) keeps the stock bytes; `tree_layers`
  counts the layer; a step without trees is the stock call alone; under a (mocked) CUDA stream
  capture a tree step raises;
- a tree-mode impl refuses, when built, a quantized KV cache, ALiBi, sliding window, soft cap,
  sinks, KV sharing and non-decoder attention, naming the reason and "chain";
- with the platform faked as CUDA: `_check_platform` allows branching trees (and refuses them
  without triton or on other platforms), the VllmConfig patch sets cudagraph_mode PIECEWISE in
  tree mode, refuses a quantized KV cache / DCP / DBO, and leaves chain engines and CPU alone;
  `register()` puts the three subclasses in vLLM's registry, and each resolves to a subclass
  of the stock backend whose impl is the mixin;
- KV compaction: the `flash` layout copy (any stride order) equals ordered slot copies, and
  the CPU `vec` path equals copying slot by slot in order, byte for byte;
- `self_test` passes under the Triton interpreter in the LBNHC / LBHNC / vec layouts and
  raises with the numbers on a broken kernel; `treedraft selftest` prints it with the device.
"""

from __future__ import annotations

import json
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treedraft.heads.tree import tree_buffers
from treedraft.plugin import attention_cuda as ac
from treedraft.plugin import tree_kernel as tk
from treedraft.plugin import tree_step

pytest.importorskip("triton")
pytest.importorskip("vllm")

STOCK = 3.0  # what the stub stock backend writes into every row
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class StubImpl:
    """A stock AttentionImpl stand-in: the attributes vLLM's impls have, a constant forward."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type="decoder", kv_sharing_target_layer_name=None, sinks=None):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads, self.alibi_slopes, self.kv_cache_dtype = num_kv_heads, alibi_slopes, \
            kv_cache_dtype
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.logits_soft_cap, self.attn_type, self.sinks = logits_soft_cap, attn_type, sinks
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        self.calls += 1
        return output.fill_(STOCK)


def tree_impl_cls(impl: str):
    return type("TreeStub", (ac.TreeImplMixin, StubImpl), {"tree_impl": impl})


def make_step(hq=8, hkv=2, d=16, bs=16, dtype=torch.float32, seed=0):
    """A step: plain row, tree (random, P=bs+1), chain, star (P=3bs+5), padding row; an LBNHC
    cache with the prefixes' K/V and NaN elsewhere. Returns the pieces and a dense reference."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    reqs = [("plain", None, 5), ("tree", [-1] + [rnd.randrange(i) for i in range(1, 9)], bs + 1),
            ("chain", [-1, 0, 1, 2], 7), ("star", [-1, 0, 0, 0, 0], 3 * bs + 5)]
    nb = 24
    kv = torch.full((nb, bs, hkv, 2 * d), float("nan"), dtype=dtype).transpose(1, 2)
    kc, vc = tk.kv_views(kv, d)
    free = torch.randperm(nb, generator=g).tolist()
    table = torch.zeros(len(reqs), 6, dtype=torch.int32)
    step, qs, prefixes = None, 0, []
    requests = {}
    for i, (name, parents, P) in enumerate(reqs):
        size = 1 if parents is None else len(parents)
        k = -(-(P + size) // bs)
        table[i, :k] = torch.tensor(free[:k])
        free = free[k:]
        pk = torch.randn(P, hkv, d, generator=g).to(dtype)
        pv = torch.randn(P, hkv, d, generator=g).to(dtype)
        slots = torch.arange(P)
        kc[table[i, slots // bs].long(), :, slots % bs] = pk
        vc[table[i, slots // bs].long(), :, slots % bs] = pv
        prefixes.append((pk, pv))
        if parents is not None:
            depths = tree_buffers(parents).depths.tolist()
            requests[i] = tree_step.TreeRequest(i, name, qs, P, [0] * size, parents, depths,
                                                is_chain=name == "chain")
        qs += size
    T = qs + 1  # + a padding row
    step = tree_step.TreeStep(T, requests)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    md = SimpleNamespace(block_table=table, num_actual_tokens=T)
    tree_step.attach({"layer.0": md}, step)
    ref = {}  # tree query row -> [Hq, D] dense fp32 SDPA over prefix + ancestors
    for t in step.trees:
        pk, pv = prefixes[t.req_index]
        rows = slice(t.qs, t.qs + t.size)
        kk = torch.cat([pk, k[rows]]).float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vv = torch.cat([pv, v[rows]]).float().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        mask = torch.cat([torch.ones(t.size, t.root_pos, dtype=torch.bool),
                          tree_buffers(t.parents).ancestor_mask], 1)
        o = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1), kk, vv,
                                           attn_mask=mask, scale=d ** -0.5)
        for i in range(t.size):
            ref[t.qs + i] = o[:, i]
    return SimpleNamespace(q=q, k=k, v=v, kv=kv, md=md, step=step, ref=ref, hq=hq, hkv=hkv,
                           d=d, T=T)


# ----------------------------------------------------------------------------- the wrapper


@pytest.mark.parametrize("impl,dtype", [("torch", torch.float32), ("triton", torch.float32),
                                        ("triton", torch.bfloat16)])
def test_wrapper_overwrites_tree_rows_only(impl, dtype):
    s = make_step(dtype=dtype)
    layer = tree_impl_cls(impl)(s.hq, s.d, s.d ** -0.5, s.hkv)
    out = torch.empty(s.T, s.hq * s.d, dtype=dtype)  # vLLM hands [T, Hq * D]
    layer.forward(None, s.q, s.k, s.v, s.kv, s.md, out)
    assert layer.calls == 1 and s.step.tree_layers == 1
    out = out.view(s.T, s.hq, s.d)
    for row in range(s.T):
        if row in s.ref:
            err = ((out[row].float() - s.ref[row]).abs() / (1 + s.ref[row].abs())).max()
            assert err <= TOL[dtype], (row, float(err))
        else:  # plain, chain and padding rows: the stock bytes
            assert (out[row] == STOCK).all(), row
    assert len(s.ref) == 9 + 5


def test_wrapper_without_trees_is_the_stock_call():
    s = make_step()
    layer = tree_impl_cls("torch")(s.hq, s.d, s.d ** -0.5, s.hkv)
    tree_step.attach({"layer.0": s.md}, None)
    out = torch.empty(s.T, s.hq, s.d)
    layer.forward(None, s.q, s.k, s.v, s.kv, s.md, out)
    assert (out == STOCK).all() and layer.calls == 1 and s.step.tree_layers == 0
    layer.forward(None, s.q, s.k, s.v, s.kv, None, out)  # profiling run: no metadata
    assert layer.calls == 2


def test_wrapper_raises_under_stream_capture(monkeypatch):
    s = make_step()
    layer = tree_impl_cls("torch")(s.hq, s.d, s.d ** -0.5, s.hkv)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    out = torch.empty(s.T, s.hq, s.d)
    with pytest.raises(RuntimeError, match="CUDA-graph capture.*PIECEWISE"):
        layer.forward(None, s.q, s.k, s.v, s.kv, s.md, out)
    assert layer.calls == 0 and s.step.tree_layers == 0
    tree_step.attach({"layer.0": s.md}, None)  # capture of a step without trees: stock
    layer.forward(None, s.q, s.k, s.v, s.kv, s.md, out)
    assert layer.calls == 1


@pytest.mark.parametrize("kwargs,reason", [
    ({"kv_cache_dtype": "fp8_e4m3"}, "quantized KV cache"),
    ({"kv_cache_dtype": "nvfp4"}, "quantized KV cache"),
    ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
    ({"sliding_window": 128}, "sliding-window"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"sinks": torch.zeros(8)}, "sinks"),
    ({"kv_sharing_target_layer_name": "model.layers.0.attn"}, "KV sharing"),
    ({"attn_type": "encoder_decoder"}, "encoder_decoder attention"),
])
def test_tree_mode_impl_refusals(monkeypatch, kwargs, reason):
    monkeypatch.setattr(ac, "_tree_mode_now", lambda: True)
    with pytest.raises(NotImplementedError, match=f"(?s){reason}.*chain"):
        tree_impl_cls("triton")(8, 16, 0.25, 2, **kwargs)


def test_impl_refusals_only_in_tree_mode(monkeypatch):
    cls = tree_impl_cls("triton")
    cls(8, 16, 0.25, 2, sliding_window=128)  # no engine config: not a tree engine
    monkeypatch.setattr(ac, "_tree_mode_now", lambda: True)
    from vllm.v1.attention.backend import AttentionType

    cls(8, 16, 0.25, 2, attn_type=AttentionType.DECODER)  # plain attention is served
    with pytest.raises(NotImplementedError, match="encoder attention"):
        cls(8, 16, 0.25, 2, attn_type=AttentionType.ENCODER)
    assert cls(8, 16, 0.25, 2).fused_output_quant_supported(None) is False


# ----------------------------------------------------------------------------- config on "CUDA"


@pytest.fixture
def fake_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    return current_platform


def spec(s):
    from treedraft.heads.tree import parse_tree_spec

    return parse_tree_spec(s)


def test_check_platform_on_cuda(fake_cuda, monkeypatch):
    import importlib.util

    from treedraft.plugin.config import _check_platform

    _check_platform(spec("[[0], [1], [0, 0]]"))  # branching: allowed on CUDA
    _check_platform(spec("chain:3"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "triton" else real(n, *a))
    with pytest.raises(NotImplementedError, match="triton is not installed"):
        _check_platform(spec("[[0], [1]]"))
    _check_platform(spec("chain:3"))  # chains need no triton
    monkeypatch.setattr(fake_cuda, "is_cuda", lambda: False)  # e.g. ROCm, XPU
    with pytest.raises(NotImplementedError, match="CPU and CUDA backends only"):
        _check_platform(spec("[[0], [1]]"))


def fake_vllm_config(tree="[[0], [1], [0, 0]]", cache_dtype="auto", mode=None, **parallel):
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        additional_config={"treedraft": {"tree": tree}},
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(**parallel),
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE if mode is None else mode))


def run_config_patch(cfg):
    """The patched VllmConfig method, on a stand-in config (the original a no-op)."""
    ac._wrap_cudagraph_mode(lambda self: None)(cfg)
    return cfg.compilation_config.cudagraph_mode


def test_tree_mode_on_cuda_is_piecewise(fake_cuda):
    from vllm.config import CUDAGraphMode as M

    from treedraft.plugin import config, patching

    assert run_config_patch(fake_vllm_config()) == M.PIECEWISE
    assert run_config_patch(fake_vllm_config(mode=M.FULL)) == M.PIECEWISE
    assert run_config_patch(fake_vllm_config(mode=M.FULL_DECODE_ONLY)) == M.NONE
    assert run_config_patch(fake_vllm_config(mode=M.NONE)) == M.NONE
    assert run_config_patch(fake_vllm_config(mode=M.PIECEWISE)) == M.PIECEWISE
    # chains on CUDA: vLLM's own graphs, untouched
    assert run_config_patch(fake_vllm_config(tree="chain:3")) == M.FULL_AND_PIECEWISE
    # the patch is in the frontend list and its target exists in this vLLM
    (p,) = [p for p in config.FRONTEND_PATCHES if p.make is ac._wrap_cudagraph_mode]
    patching._resolve(p.target)


def test_real_engine_config_goes_through_the_patch(fake_cuda, monkeypatch):
    """EngineArgs.create_engine_config (frontend) on "CUDA": the patched VllmConfig hook sees
    PIECEWISE in tree mode (the CPU platform's later hooks then turn graphs off here), keeps
    vLLM's default for a chain, and refuses an fp8 KV cache at start-up."""
    from vllm.config import CUDAGraphMode as M
    from vllm.engine.arg_utils import EngineArgs

    from treedraft.training.models import resolve_model

    seen = []
    real = ac.piecewise_in_tree_mode

    def spy(cfg):
        real(cfg)
        seen.append(cfg.compilation_config.cudagraph_mode)

    monkeypatch.setattr(ac, "piecewise_in_tree_mode", spy)

    def build(spec, **kw):
        return EngineArgs(model=str(resolve_model("smollm2-135m")), speculative_config=spec,
                          dtype="float32", max_model_len=1024, **kw).create_engine_config()

    build({"model": "smollm2-135m-eagle", "tree": "dynamic:8,3,3"})
    build({"model": "smollm2-135m-eagle", "num_speculative_tokens": 3})
    assert seen == [M.PIECEWISE, M.FULL_AND_PIECEWISE]
    with pytest.raises(NotImplementedError, match="trees on CUDA do not support a quantized KV"):
        build({"model": "smollm2-135m-eagle", "tree": "dynamic:8,3,3"}, kv_cache_dtype="fp8")


def test_tree_mode_keeps_attention_out_of_cuda_graphs(fake_cuda, monkeypatch):
    """vLLM picks the graphs' split points after our hook: attention+quant fusion would empty
    them and turn PIECEWISE into FULL (tree rows skipped on replay), so tree mode turns the
    fusion off; splitting_ops that leave attention inside the graphs are refused at start-up.
    Real EngineArgs, platform faked as CUDA."""
    from vllm.engine.arg_utils import EngineArgs

    from treedraft.training.models import resolve_model

    seen = []
    real = ac.piecewise_in_tree_mode

    def spy(cfg):
        real(cfg)
        seen.append(cfg.compilation_config.pass_config.fuse_attn_quant)

    monkeypatch.setattr(ac, "piecewise_in_tree_mode", spy)

    def build(spec, compilation):
        return EngineArgs(model=str(resolve_model("smollm2-135m")), speculative_config=spec,
                          dtype="float32", max_model_len=1024,
                          compilation_config=compilation).create_engine_config()

    tree = {"model": "smollm2-135m-eagle", "tree": "dynamic:8,3,3"}
    build(tree, {"pass_config": {"fuse_attn_quant": True}})
    build({"model": "smollm2-135m-eagle", "num_speculative_tokens": 3},
          {"pass_config": {"fuse_attn_quant": True}})
    assert seen == [False, True]  # turned off for trees only
    with pytest.raises(NotImplementedError, match=r"splitting_ops=\['vllm::some_op'\] leaves "
                                                  r"out the attention ops"):
        build(tree, {"mode": 3, "splitting_ops": ["vllm::some_op"]})
    build(tree, {"mode": 3, "splitting_ops": []})  # no graphs split: vLLM turns PIECEWISE off


def test_tree_mode_config_untouched_on_cpu():
    from vllm.config import CUDAGraphMode as M

    assert run_config_patch(fake_vllm_config()) == M.FULL_AND_PIECEWISE


@pytest.mark.parametrize("kwargs,reason", [
    ({"cache_dtype": "fp8"}, "quantized KV cache"),
    ({"decode_context_parallel_size": 2}, "decode context parallelism"),
    ({"prefill_context_parallel_size": 2}, "prefill context parallelism"),
    ({"enable_dbo": True}, "dual-batch overlap"),
])
def test_cuda_startup_refusals(fake_cuda, kwargs, reason):
    with pytest.raises(NotImplementedError, match=f"(?s){reason}.*chain"):
        run_config_patch(fake_vllm_config(**kwargs))
    run_config_patch(fake_vllm_config(tree="chain:3", **kwargs))  # chains: vLLM's business


def test_register_puts_three_overrides(fake_cuda):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    try:
        ac.register()
        for name, (_, _, ours) in ac.BACKENDS.items():
            assert E[name].get_path() == f"treedraft.plugin.attention_cuda.{ours}"
        assert not E.CPU_ATTN.is_overridden()
    finally:
        for name in ac.BACKENDS:
            E[name].clear_override()


@pytest.mark.parametrize("name", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_backend_subclasses_resolve(name):
    import importlib

    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.backends.registry import register_backend

    module, stock, ours = ac.BACKENDS[name]
    try:
        base = getattr(importlib.import_module(module), stock)
    except ImportError as e:  # e.g. flashinfer not installed in this venv
        pytest.skip(f"{name}: {e}")
    cls = getattr(ac, ours)
    assert issubclass(cls, base) and cls.get_name() == base.get_name()
    assert issubclass(cls.get_impl_cls(), (ac.TreeImplMixin, base.get_impl_cls()))
    assert issubclass(cls.get_impl_cls(), base.get_impl_cls())
    assert issubclass(cls.get_builder_cls(), ac.TreeBuilderMixin)
    for c in (cls, cls.get_impl_cls(), cls.get_builder_cls()):  # pickled by reference
        assert pickle.loads(pickle.dumps(c)) is c
    try:  # what the registry's get_class() does with the registered path
        register_backend(E[name], f"treedraft.plugin.attention_cuda.{ours}")
        assert E[name].get_class() is cls
    finally:
        E[name].clear_override()


def test_module_imports_no_cuda_backend():
    import subprocess
    import sys

    code = ("import sys, treedraft.plugin.attention_cuda; "
            "print([m for m in sys.modules if m.startswith('vllm.v1.attention.backends.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cpu_kernel_backend_is_the_mixin_around_cpu_attn():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from treedraft.plugin.attention_cpu import TreeCPUAttentionBackend

    cls = ac.TreeCPUKernelBackend
    impl = cls.get_impl_cls()
    assert issubclass(cls, TreeCPUAttentionBackend)
    assert impl.__mro__[1:3] == (ac.TreeImplMixin, CPUAttentionBackendImpl)
    assert (impl.tree_impl, impl.kv_layout) == ("torch", "vec")
    assert pickle.loads(pickle.dumps(impl)) is impl


# ----------------------------------------------------------------------------- KV compaction


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
def test_flash_compaction_equals_ordered_copies(order):
    from treedraft.plugin.kv import copy_kv_slots

    nb, hkv, bs, d = 6, 2, 4, 8
    phys = torch.randn(nb, bs, hkv, 2 * d) if order == "LBNHC" else torch.randn(nb, hkv, bs, 2 * d)
    kv = phys.transpose(1, 2) if order == "LBNHC" else phys
    src, dst = [5, 9, 10, 17], [3, 4, 5, 6]  # accepted a_j -> j: a_j >= j, increasing
    want = kv.clone()
    for s_, d_ in zip(src, dst, strict=True):
        want[d_ // bs, :, d_ % bs] = want[s_ // bs, :, s_ % bs]
    copy_kv_slots(kv, src, dst)  # no ISA: the CUDA layout
    assert torch.equal(kv, want)


def _ordered_vec_copies(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """K/V of slots `src` to slots `dst` one slot at a time, in order (vec layout)."""
    kc, vc = tk.kv_views(kv_cache, kv_cache.shape[-1] // 2, "vec")  # [nb, Hkv, bs, D]
    bs = kc.shape[2]
    for s, d in zip(src, dst, strict=True):
        kc[d // bs, :, d % bs] = kc[s // bs, :, s % bs]
        vc[d // bs, :, d % bs] = vc[s // bs, :, s % bs]


def _runner(kv, isa, table, block_size, slot_mapping_cpu):
    """The parts of a V1 runner compaction reads: group 0's block table (host rows, block
    size, and the host half of its slot mapping) and one attention layer's cache."""
    bt = SimpleNamespace(block_table=SimpleNamespace(np=np.asarray(table, dtype=np.int32)),
                         block_size=block_size,
                         slot_mapping=SimpleNamespace(cpu=slot_mapping_cpu))
    return SimpleNamespace(
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[bt])),
        compilation_config=SimpleNamespace(static_forward_context={
            "l0": SimpleNamespace(kv_cache=[kv], isa=isa)}))


def test_vec_compaction_equals_ordered_slot_copies():
    from treedraft.plugin.kv import compact_accepted

    kv = torch.randn(3, 2, 32, 64)  # a shape the CPU kernel has (its layout is probed)
    # request row 1 holds blocks 2, 0, 1; its root at position 30 (slot 2 * 32 + 30 = 94)
    runner = _runner(kv, "vec", [[0, 0, 0], [2, 0, 1]], 32, torch.arange(8) + 93)
    step = tree_step.TreeStep(8, {1: tree_step.TreeRequest(1, "r", 1, 30, [0] * 6,
                                                          [-1, 0, 0, 1, 1, 2], [0] * 6, False)})
    step.accepted = {"r": [2, 5]}  # positions 32, 35 (slots 0, 3) -> 31, 32 (slots 95, 0)
    want = kv.clone()
    _ordered_vec_copies(want, [0, 3], [95, 0])
    assert compact_accepted(runner, step) == 2
    assert torch.equal(kv, want)


def test_flash_compaction_reads_the_block_table_not_the_device_slot_mapping():
    """On CUDA vLLM computes a step's slot mapping on the GPU only (`BlockTable.
    compute_slot_mapping` writes `slot_mapping.gpu`; the CPU runner aliases the two halves, the
    GPU runner does not), so its host half stays zeros: compaction must find each node's slot
    from the request's block table."""
    from treedraft.plugin.kv import compact_accepted

    nb, hkv, bs, d = 5, 2, 4, 8
    kv = torch.randn(nb, bs, hkv, 2 * d).transpose(1, 2)  # FLASH_ATTN's LBNHC order
    # request row 0 holds blocks 3, 1, 4; root at position 5: position p is slot
    # table[p // 4] * 4 + p % 4
    runner = _runner(kv, None, [[3, 1, 4]], bs, torch.zeros(16, dtype=torch.long))
    step = tree_step.TreeStep(7, {0: tree_step.TreeRequest(0, "r", 0, 5, [0] * 7,
                                                          [-1, 0, 0, 2, 2, 4, 5], [0] * 7,
                                                          False)})
    step.accepted = {"r": [2, 4, 6]}  # positions 7, 9, 11 -> 6, 7, 8
    slot = {p: [3, 1, 4][p // bs] * bs + p % bs for p in range(12)}
    want = kv.clone()
    for a, j in ((2, 1), (4, 2), (6, 3)):
        s_, d_ = slot[5 + a], slot[5 + j]
        want[d_ // bs, :, d_ % bs] = want[s_ // bs, :, s_ % bs]
    assert compact_accepted(runner, step) == 3
    assert torch.equal(kv, want)


# ----------------------------------------------------------------------------- self-test


@pytest.mark.parametrize("layout,dtype", [("LBNHC", torch.bfloat16), ("LBHNC", torch.float16),
                                          ("vec", torch.float32)])
def test_self_test_passes_under_interpreter(layout, dtype):
    bs, hkv, d = 16, 2, 32
    if layout == "LBNHC":
        kv = torch.empty(4, bs, hkv, 2 * d, dtype=dtype).transpose(1, 2)
    else:
        kv = torch.empty(4, hkv, bs, 2 * d, dtype=dtype)
    r = ac.self_test(kv, 8, hkv, d, layout="vec" if layout == "vec" else "flash")
    assert r["max_rel_err"] <= r["tol"] and r["plain_rows_untouched"]
    assert r["device"] == "cpu" and r["block_size"] == bs


def test_self_test_refuses_a_broken_kernel(monkeypatch):
    def broken(query, key, value, k_cache, v_cache, block_table, meta, scale, out, **kw):
        tk.tree_attention_torch(query, key, value, k_cache, v_cache, block_table, meta, scale,
                                out)
        out[meta.rows.long()] += 0.25  # every tree row off
        return out

    monkeypatch.setitem(tk.IMPLS, "triton", broken)
    kv = torch.empty(4, 16, 2, 64).transpose(1, 2)
    with pytest.raises(NotImplementedError, match=r"self-test failed.*max_rel_err.*chain"):
        ac.self_test(kv, 4, 2, 32)


def test_wrapper_runs_the_self_test_once(monkeypatch):
    calls = []
    monkeypatch.setattr(ac, "self_test", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(ac, "_self_tested", set())
    s = make_step()
    layer = tree_impl_cls("triton")(s.hq, s.d, s.d ** -0.5, s.hkv)
    for _ in range(2):
        layer.forward(None, s.q, s.k, s.v, s.kv, s.md, torch.empty(s.T, s.hq, s.d))
    assert len(calls) == 1 and s.step.tree_layers == 2


def test_selftest_command(capsys):
    from treedraft.scripts.cli import main

    main(["selftest", "--dtype", "float32", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["ok"] is True


# ----------------------------------------------------------------------------- a real engine


TEXTS = ["The sea is blue and the sky is blue. The sea is",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
         "Paris is the capital of France. Berlin is the capital of"]
KERNEL_TREE = {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3+lookup:6"}


@pytest.fixture(scope="module")
def kernel_runs():
    """TREEDRAFT_TREE_ATTENTION=kernel, four engines in one process (tests/engine_host.py): no
    speculation in float32 and in bfloat16 (where it reports its top-5 raw logits at every
    token), then the hybrid tree in float32 and in bfloat16; each runs the same greedy job."""
    from engine_host import run_engines
    from transformers import AutoTokenizer

    from treedraft.training.models import resolve_model

    target = str(resolve_model("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(target)
    job = {"name": "greedy", "prompts": [tok(t).input_ids for t in TEXTS],
           "params": {"temperature": 0, "max_tokens": 32}}
    bf16 = {"dtype": "bfloat16"}
    with_logits = {**job, "params": {**job["params"], "logprobs": 5}}
    return run_engines({  # engines without speculation first
        "base": {"target": target, "spec": None, "jobs": [job]},
        "base_bf16": {"target": target, "spec": None, "jobs": [with_logits],
                      "llm": {**bf16, "logprobs_mode": "raw_logits"}},
        "tree": {"target": target, "spec": KERNEL_TREE, "jobs": [job]},
        "tree_bf16": {"target": target, "spec": KERNEL_TREE, "jobs": [job], "llm": bf16},
    }, env={ac.ATTENTION_ENV: "kernel"})


@pytest.mark.slow
@pytest.mark.vllm
def test_cpu_engine_through_the_kernel_wrapper_equals_no_speculation(kernel_runs):
    """TREEDRAFT_TREE_ATTENTION=kernel: a vLLM CPU engine runs TreeImplMixin around CPU_ATTN
    (torch twin), with its step metadata and KV compaction: greedy output == no speculation in
    float32."""
    (base, _, _), (tree, log, _) = kernel_runs["base"], kernel_runs["tree"]
    assert "tree attention kernel behind CPU_ATTN" in log
    assert tree["greedy"]["spec"]["accepted"] > 0
    assert tree["greedy"]["tokens"] == base["greedy"]["tokens"]


@pytest.mark.slow
@pytest.mark.vllm
def test_bf16_kernel_path_differs_only_at_near_ties(kernel_runs):
    """The same in bfloat16: the kernel-path tree differs from no speculation only at fp
    near-ties of the target (tests/near_tie.py)."""
    from near_tie import BF16_ULPS, divergences

    base, tree = kernel_runs["base_bf16"][0], kernel_runs["tree_bf16"][0]
    assert "tree attention kernel behind CPU_ATTN" in kernel_runs["tree_bf16"][1]
    assert tree["greedy"]["spec"]["accepted"] > 0
    report = divergences(base["greedy"], tree["greedy"])
    print(f"bf16 kernel-path tree vs no speculation: {report}")
    assert all(r["ulps"] <= BF16_ULPS for r in report), report
