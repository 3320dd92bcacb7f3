"""GPU check of plugin/tree_kernel.py: correctness at real model shapes, tree decoding end to
end, then timing. torch and triton only (no vLLM, no transformers): the kernel file is loaded
by its path, treedraft's heads (pure torch) from this checkout when no package is installed.

On a GPU machine (one run < 8 min; internal deadline 420 s from the process's start):
    python scripts/gpu_check.py --out /tmp/gpu_check
CPU dry run (the same code under Triton's interpreter, tiny shapes, about a minute):
    python scripts/gpu_check.py --cpu-smoke --out /tmp/gpu_check_cpu

Writes DIR/gpu_check.json and DIR/gpu_check.md; exits 1 if any case failed, 2 if the kernel
cannot run here at all (the preflight below), so that a broken machine costs seconds, not the
deadline.
- preflight: what Triton's first launch needs on a GPU (a C compiler, Python's headers; Triton
  builds its CUDA launcher with them) and one small tree step through the kernel against the
  torch twin. If that step raises, nothing else runs. The matrix also stops once its first
  `FAIL_FAST` cases all raised (a systematic failure: a compile or launch error), recorded as
  `stopped`; views, decode and timing still run.
- correctness: a shuffled matrix (bf16/fp16/fp32; Hq/Hkv/D of Llama-3.1-8B, Qwen2.5-7B,
  Qwen3-8B/14B, SmolLM2-135M and a 64/8/128 model; block sizes 16/32/64; LBNHC and LBHNC
  caches; prefixes up to 16k; 1-8 trees of 1-64 nodes; split-KV auto or forced) against the
  torch twin in fp32, with NaN in every cache slot the kernel must not read and the bytes of
  the rows outside the trees compared; it stops at the deadline. fp32 runs tf32 dots.
- views: kv_views == FlashAttention's split of the cache, copy_slots == slot-by-slot copies.
- decode: greedy tree decoding end to end through the kernel, without vLLM: treedraft's
  reference decoder (heads/reference.py) drives a small random Llama (`PagedLlama`, fp32)
  whose every attention call writes and reads a NaN-filled paged cache through a shuffled
  block table and `tree_attention`, and whose accepted nodes move with `copy_slots` (the
  slots they leave go back to NaN). The drafts come from `OracleHead`: at a node whose path
  follows the model's own greedy continuation the true next token gets rank 0, 1 or 2, so
  steps accept several nodes, not always down the first branch, and their K/V move to the
  slots after the prefix (`compactions`: steps that moved any, which must not be 0). The
  speculative output must equal plain greedy decoding of the same model token for token (both
  through the kernel: they differ only in how rows are batched); plain decoding through the
  torch twin is reported beside it (fp32 inputs get tf32 dots on the GPU, so a near-tie may go
  either way). On the GPU the prompt is 520 tokens, so one-row steps split the prefix
  (split-KV and its reduce, `plain_split_forwards`). SmolLM2 itself cannot travel to the GPU
  machine (its weights exceed one transfer).
- timing: (B, P, n) as in the design notes, Llama-3.1-8B heads, bf16, block 16, LBNHC:
  kernel ms (CUDA graph replay, and per Python call), K/V bytes read, GB/s against the card's
  peak, the ratio to the dense-attention memory bound, torch SDPA on contiguous dense K/V of
  the same size, and split-KV on vs off at batch 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

T0 = time.perf_counter()  # the deadline counts from the process's start (torch's import too)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

KERNEL_PATH = Path(__file__).resolve().parents[1] / "plugin" / "tree_kernel.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# |o - ref| <= tol * (1 + |ref|): output rounding, bf16/fp16 P@V operands (fp32: tf32 dots)
TOL = {"bf16": 1.6e-2, "fp16": 4e-3, "fp32": 4e-3}
CPU_TOL = {"bf16": 8e-3, "fp16": 1e-3, "fp32": 1e-6}  # interpreter: fp32 dots
HEADS = {  # name: (Hq, Hkv, D)
    "llama3.1-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "qwen3-8b": (32, 8, 128),
    "qwen3-14b": (40, 8, 128), "smollm2-135m": (9, 3, 64), "64/8/128": (64, 8, 128),
}
SMOKE_HEADS = {"4/2/16": (4, 2, 16), "7/1/16": (7, 1, 16), "9/3/32": (9, 3, 32)}
TIMING = [(1, 1024, 16), (1, 8192, 64), (8, 4096, 16), (8, 4096, 64), (32, 2048, 32),
          (32, 8192, 16), (64, 4096, 8)]
SMOKE_TIMING = [(1, 96, 4), (2, 64, 8)]
FAIL_FAST = 3  # the matrix stops when its first cases all raised
PEAK_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0), ("L40S", 864.0)]


def load_kernel():
    """plugin/tree_kernel.py as a module, without the treedraft package (or vLLM)."""
    spec = importlib.util.spec_from_file_location("treedraft_tree_kernel", KERNEL_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


tk = load_kernel()


# ----------------------------------------------------------------------------- steps


@dataclass
class Spec:
    dtype: str
    heads: str
    hqkd: tuple  # (Hq, Hkv, D)
    bs: int
    layout: str  # LBNHC | LBHNC
    trees: list  # (P, n, shape)
    nseg: int | None  # None: choose_segments
    seed: int


def parents_of(shape: str, n: int, rng: random.Random) -> list[int]:
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def build_step(spec: Spec, device: torch.device) -> dict:
    """Query/key/value as views of one qkv tensor, a NaN-filled paged cache with each tree's
    prefix written through a shuffled block table, filler rows around the trees."""
    rng = random.Random(spec.seed)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    hq, hkv, d = spec.hqkd
    bs = spec.bs
    need = [-(-(P + n) // bs) for P, n, _ in spec.trees]
    nb = 1 + sum(need) + 2  # block 0 = table padding, 2 unused: all NaN
    perm = (torch.randperm(nb - 1) + 1).tolist()
    table = torch.zeros(len(spec.trees) + 1, max(need) + 1, dtype=torch.int32)
    placed, qs = [], 2
    for t, (P, n, shape) in enumerate(spec.trees):
        table[t + 1, : need[t]] = torch.tensor(perm[: need[t]], dtype=torch.int32)
        perm = perm[need[t]:]
        placed.append((qs, P, parents_of(shape, n, rng), t + 1))
        qs += n + rng.randrange(3)
    T = qs + 1
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], 1)
    if spec.layout == "LBNHC":
        kv = torch.full((nb, bs, hkv, 2 * d), float("nan"), dtype=dtype, device=device)
        kv = kv.transpose(1, 2)
    else:
        kv = torch.full((nb, hkv, bs, 2 * d), float("nan"), dtype=dtype, device=device)
    kc, vc = tk.kv_views(kv, d, "flash")
    table = table.to(device)
    for _, P, _, r in placed:
        pos = torch.arange(P, device=device)
        blk = table[r].long()[pos // bs]
        kc[blk, :, pos % bs] = torch.randn(P, hkv, d, generator=gen, device=device).to(dtype)
        vc[blk, :, pos % bs] = torch.randn(P, hkv, d, generator=gen, device=device).to(dtype)
    meta = tk.TreeMeta.build(placed, device=device)
    return dict(query=q.view(T, hq, d), key=k.view(T, hkv, d), value=v.view(T, hkv, d),
                k_cache=kc, v_cache=vc, block_table=table, meta=meta, scale=d**-0.5)


def call(step: dict, out: torch.Tensor, impl: str, **kw) -> torch.Tensor:
    s = step
    return tk.tree_attention(s["query"], s["key"], s["value"], s["k_cache"], s["v_cache"],
                             s["block_table"], s["meta"], s["scale"], out, impl=impl, **kw)


def check_case(spec: Spec, device: torch.device, tol: dict) -> dict:
    t0 = time.perf_counter()
    step = build_step(spec, device)
    meta = step["meta"]
    hq, hkv, _ = spec.hqkd
    nseg = spec.nseg or tk.choose_segments(meta, hkv, hq // hkv, tk.sm_count(device))
    before = torch.randn(step["query"].shape, device=device).to(step["query"].dtype)
    out = call(step, before.clone(), "triton", num_segments=nseg)
    ref = call(step, torch.zeros_like(out, dtype=torch.float32), "torch")
    tree = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    tree[meta.rows.long()] = True
    diff = (out[tree].float() - ref[tree]).abs()
    err = diff.max().item()
    scaled = (diff / (1 + ref[tree].abs())).max().item()  # |o - ref| <= tol * (1 + |ref|)
    untouched = torch.equal(out[~tree].view(torch.uint8), before[~tree].view(torch.uint8))
    ok = untouched and math.isfinite(scaled) and scaled <= tol[spec.dtype]
    res = asdict(spec) | dict(nseg=nseg, err=err, err_scaled=scaled, tol=tol[spec.dtype],
                              untouched=untouched, ok=ok,
                              seconds=round(time.perf_counter() - t0, 3))
    res["trees"] = [list(t) for t in spec.trees]
    return res


def matrix(smoke: bool, seed: int = 0) -> list[Spec]:
    """A shuffled covering matrix (every head config x dtype x block size appears)."""
    rng = random.Random(seed)
    heads = SMOKE_HEADS if smoke else HEADS
    specs = []
    for i in range(24 if smoke else 400):
        dtype = ["bf16", "fp16", "bf16", "fp32"][i % 4] if smoke else rng.choice(
            ["bf16"] * 4 + ["fp16"] * 3 + ["fp32"])
        name = list(heads)[i % len(heads)]
        bs = rng.choice([16, 32] if smoke else [16, 32, 64])
        max_p = 3 * bs + 5 if smoke else 16384
        trees = []
        for _ in range(rng.choice([1, 1, 2, 3] if smoke else [1, 1, 2, 4, 8])):
            P = rng.choice([0, 1, bs - 1, bs, bs + 1, rng.randrange(max_p + 1), max_p])
            n = rng.choice([1, 2, 5, 12, rng.randrange(1, 40)] if smoke
                           else [1, 2, 4, 8, 16, 32, 64, rng.randrange(1, 65)])
            trees.append((P, n, rng.choice(["chain", "star", "random", "random"])))
        specs.append(Spec(dtype, name, heads[name], bs, rng.choice(["LBNHC", "LBHNC"]), trees,
                          rng.choice([None, None, 1, 3] if smoke else [None, None, 1, 4]),
                          seed * 1000 + i))
    rng.shuffle(specs)
    return specs


# ----------------------------------------------------------------------------- views


def check_views(device: torch.device) -> dict:
    """kv_views == FlashAttention's split (vllm flash_attn.py) and copy_slots == sequential."""
    nb, hkv, bs, d = 6, 4, 16, 64
    res = {}
    for layout in ("LBNHC", "LBHNC"):
        kv = torch.randn(nb, bs, hkv, 2 * d, device=device).transpose(1, 2) \
            if layout == "LBNHC" else torch.randn(nb, hkv, bs, 2 * d, device=device)
        k, v = tk.kv_views(kv, d, "flash")
        fk, fv = kv.transpose(1, 2).split(d, dim=-1)
        same = torch.equal(k, fk.transpose(1, 2)) and torch.equal(v, fv.transpose(1, 2))
        src, dst = [18, 21, 40, 70], [17, 18, 19, 66]  # dst_j <= src_j, increasing
        want = kv.clone()
        wk, wv = tk.kv_views(want, d, "flash")
        for s, t in zip(src, dst, strict=True):
            wk[t // bs, :, t % bs] = wk[s // bs, :, s % bs]
            wv[t // bs, :, t % bs] = wv[s // bs, :, s % bs]
        tk.copy_slots(k, v, src, dst)
        res[layout] = dict(views=same, copy_slots=torch.equal(kv, want))
    res["ok"] = all(all(r.values()) for r in res.values())
    return res


# ----------------------------------------------------------------------------- end to end

# the GPU's prompt is past 2 * MIN_SEGMENT positions, so one-row steps split the prefix
DECODE = dict(vocab=512, hidden=256, layers=4, heads=(8, 2, 32), block=16, prompt=520, new=160,
              specs=("static:16", "dynamic:24,5,4"))
SMOKE_DECODE = dict(vocab=64, hidden=32, layers=2, heads=(4, 2, 8), block=16, prompt=20,
                    new=36, specs=("static:8",))


def load_heads():
    """treedraft.heads.reference, .tree and .eagle: from the installed package, else from this
    checkout by path (a GPU machine has the files, not the package)."""
    try:
        import treedraft.heads.reference as reference
    except ImportError:
        import types

        pkg = types.ModuleType("treedraft")
        pkg.__path__ = [str(KERNEL_PATH.parents[1])]
        sys.modules["treedraft"] = pkg
        import treedraft.heads.reference as reference
    import treedraft.heads.eagle as eagle
    import treedraft.heads.tree as tree

    return reference, tree, eagle


def parents_from_mask(mask: torch.Tensor) -> list[int]:
    """The parents of a topologically ordered tree from its ancestor-or-self mask [T, T] (a
    causal mask is a chain); refuses a mask that is not one."""
    m = mask.tolist()
    T = len(m)
    parents = [-1] + [max((j for j in range(i) if m[i][j]), default=-2) for i in range(1, T)]
    bits = tk._ancestor_bits(parents, 0) if min(parents[1:], default=0) >= 0 else None
    want = [sum(1 << j for j in range(T) if m[i][j]) for i in range(T)]
    if bits != want:
        raise ValueError("the decoder's mask is not a tree's ancestor-or-self mask")
    return parents


class PagedLlama:
    """A small random Llama as the reference decoder's `Target`: fp32, seeded, its K/V in a
    NaN-filled paged cache [blocks, Hkv, block, 2D] behind a shuffled block table; every call's
    rows go through `tree_attention` as one tree over the cached prefix (`impl`: "triton", the
    kernel, or "torch", its twin); `keep` compacts with `copy_slots` and NaN-fills what it
    drops, so a kernel reading past the prefix would show."""

    def __init__(self, cfg: dict, impl: str, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        V, H, L, bs = cfg["vocab"], cfg["hidden"], cfg["layers"], cfg["block"]
        hq, hkv, d = cfg["heads"]
        self.hq, self.hkv, self.d, self.bs, self.impl, self.device = hq, hkv, d, bs, impl, device

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.embed = w(V, H, scale=1.0)
        self.layers = [dict(qkv=w((hq + 2 * hkv) * d, H, scale=H ** -0.5),
                            o=w(H, hq * d, scale=(hq * d) ** -0.5),
                            up=w(4 * H, H, scale=H ** -0.5), down=w(H, 2 * H, scale=(2 * H) ** -0.5))
                       for _ in range(L)]
        self.lm_head = w(V, H, scale=4 * H ** -0.5)  # logits of std ~4: decisive greedy picks
        self.eagle = load_heads()[2]  # the head's RoPE: rope_inv_freq, rope_cos_sin, apply_rope
        self.inv_freq = self.eagle.rope_inv_freq(d, 10000.0, None, device)
        blocks = -(-(cfg["prompt"] + cfg["new"] + 64) // bs)
        nb = blocks + 3  # block 0 pads the table; two never used
        self.table = ((torch.randperm(nb - 1, generator=g)[:blocks] + 1).to(torch.int32)
                      .view(1, -1).to(device))
        self.caches = [torch.full((nb, hkv, bs, 2 * d), float("nan"), device=device)
                       for _ in range(L)]
        self.length = 0
        self.compactions = 0  # keep() calls that moved accepted nodes to other slots
        self.splits = 0  # forwards whose kernel calls split the prefix (split-KV, GPU)

    def reset(self) -> None:
        for c in self.caches:
            c.fill_(float("nan"))
        self.length = 0

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        pos = pos.to(self.device)
        return self.table[0].long()[pos // self.bs] * self.bs + pos % self.bs

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], eps=1e-6)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        T, P, dev = tokens.numel(), self.length, self.device
        hq, hkv, d, bs = self.hq, self.hkv, self.d, self.bs
        meta = tk.TreeMeta.build([(0, P, parents_from_mask(mask), 0)], device=dev)
        if self.impl == "triton":
            self.splits += tk.choose_segments(meta, hkv, hq // hkv, tk.sm_count(dev)) > 1
        slots = self._slots(torch.arange(P, P + T))
        cos, sin = self.eagle.rope_cos_sin(positions.to(dev), self.inv_freq)  # [T, 1, D]
        x = self.embed[tokens.to(dev)]
        for layer, cache in zip(self.layers, self.caches, strict=True):
            q, k, v = (self._norm(x) @ layer["qkv"].T).split([hq * d, hkv * d, hkv * d], -1)
            q = self.eagle.apply_rope(q.view(T, hq, d), cos, sin)
            k = self.eagle.apply_rope(k.view(T, hkv, d), cos, sin)
            v = v.view(T, hkv, d)
            kc, vc = tk.kv_views(cache, d, "flash")
            kc[slots // bs, :, slots % bs] = k  # the step's rows, as vLLM writes them first
            vc[slots // bs, :, slots % bs] = v
            out = torch.full_like(q, float("nan"))
            tk.tree_attention(q, k, v, kc, vc, self.table, meta, d ** -0.5, out, impl=self.impl)
            x = x + out.reshape(T, hq * d) @ layer["o"].T
            a, b = (self._norm(x) @ layer["up"].T).chunk(2, -1)
            x = x + (F.silu(a) * b) @ layer["down"].T
        x = self._norm(x)
        self.length += T
        return (x @ self.lm_head.T).float().cpu(), x.cpu()

    def keep(self, start: int, nodes: torch.Tensor) -> None:
        nodes = [int(n) for n in nodes]
        end = self.length
        moves = [(start + n, start + i) for i, n in enumerate(nodes) if n != i]
        self.compactions += bool(moves)
        self.length = start + len(nodes)
        dropped = self._slots(torch.arange(self.length, end))
        for cache in self.caches:
            kc, vc = tk.kv_views(cache, self.d, "flash")
            if moves:
                src, dst = zip(*moves, strict=True)
                tk.copy_slots(kc, vc, self._slots(torch.tensor(src)),
                              self._slots(torch.tensor(dst)))
            kc[dropped // self.bs, :, dropped % self.bs] = float("nan")
            vc[dropped // self.bs, :, dropped % self.bs] = float("nan")


class OracleHead:
    """A stand-in draft head that knows the answer: `truth` is the prompt plus the model's plain
    greedy continuation. At a node whose path follows it, the true next token gets rank 0, 1 or
    2 (probabilities 0.55 / 0.3 / 0.15, seeded by position and depth) among random tokens;
    elsewhere every rank is random. Implements heads/tree.py's Expander through its session."""

    def __init__(self, truth: list[int], vocab: int, seed: int = 0) -> None:
        self.truth, self.vocab, self.seed = truth, vocab, seed

    def draft_session(self):
        return _OracleSession(self)


class _OracleSession:
    def __init__(self, head: OracleHead) -> None:
        self.head = head
        self.seen = 1  # tokens of the sequence so far: prompt[0] + every committed token

    def commit(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.seen += tokens.numel()

    def expand(self, tree, nodes: list[int]) -> torch.Tensor:
        h, V = self.head, self.head.vocab
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        rows = []
        for n in nodes:
            path = []
            a = n
            while a > 0:
                path.insert(0, tokens[a])
                a = parents[a]
            at = self.seen + len(path)  # index in truth of the node's next token
            g = torch.Generator().manual_seed(h.seed * 1_000_003 + at * 101 + len(path))
            order = torch.randperm(V, generator=g).tolist()
            if h.truth[self.seen : at] == path and at < len(h.truth):
                true = h.truth[at]
                order.remove(true)
                rank = int(torch.multinomial(torch.tensor([0.55, 0.3, 0.15]), 1, generator=g))
                order.insert(rank, true)
            logp = torch.empty(V)
            logp[torch.tensor(order)] = torch.linspace(0.0, -12.0, V)
            rows.append(torch.log_softmax(logp, -1))
        return torch.stack(rows)


def check_decode(device: torch.device, smoke: bool) -> dict:
    """Greedy tree decoding through the kernel == plain greedy decoding (see the docstring)."""
    t0 = time.perf_counter()
    reference, tree, _ = load_heads()
    cfg = SMOKE_DECODE if smoke else DECODE
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg["vocab"], (cfg["prompt"],), generator=g).tolist()
    kernel = PagedLlama(cfg, "triton", device)
    plain = reference.plain_generate(kernel, prompt, cfg["new"]).tokens
    split = kernel.splits
    twin = reference.plain_generate(PagedLlama(cfg, "torch", device), prompt, cfg["new"]).tokens
    agree = next((i for i, (a, b) in enumerate(zip(plain, twin, strict=True)) if a != b),
                 len(plain))
    hq, hkv, d = cfg["heads"]
    res = dict(model=f"Llama ({cfg['layers']} layers, hidden {cfg['hidden']}, heads "
                     f"{hq}/{hkv}/{d}, vocab {cfg['vocab']}, fp32, blocks of {cfg['block']})",
               tokens=len(plain), prompt=len(prompt), plain_split_forwards=split,
               twin_agrees_for=agree, specs={}, ok=True)
    head = OracleHead(prompt + plain, cfg["vocab"])
    for name in cfg["specs"]:
        kernel.compactions = 0
        r = reference.speculative_generate(kernel, head, prompt, cfg["new"],
                                           tree.parse_tree_spec(name))
        first = next((i for i, (a, b) in enumerate(zip(r.tokens, plain, strict=True))
                      if a != b), None)
        same = first is None and len(r.tokens) == len(plain)
        res["specs"][name] = dict(
            same=same, first_difference=first, steps=r.num_verify_steps,
            accepted_per_step=sum(r.accepted) / max(r.num_verify_steps, 1),
            max_accepted=max(r.accepted, default=0), compactions=kernel.compactions,
            mean_tree=sum(r.tree_sizes) / max(len(r.tree_sizes), 1))
        res["ok"] = res["ok"] and same and max(r.accepted, default=0) >= 2 and kernel.compactions > 0
    res["seconds"] = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- timing


def peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_GBPS if key in name), None)


def bench(fn, device: torch.device, graph: bool) -> float:
    """Milliseconds per call: triton's do_bench (CUDA graph replay when `graph`, else per
    Python call); one timed call on CPU."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=50)
        except RuntimeError as e:  # capture refused: the per-call time stands in (printed)
            print(f"CUDA graph timing failed: {e}", flush=True)
            return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def time_config(B: int, P: int, n: int, device: torch.device, smoke: bool) -> dict:
    hq, hkv, d = (4, 2, 16) if smoke else HEADS["llama3.1-8b"]
    spec = Spec("bf16", "timing", (hq, hkv, d), 16, "LBNHC", [(P, n, "random")] * B, None, 7)
    step = build_step(spec, device)
    out = torch.empty_like(step["query"])
    meta = step["meta"]
    nseg = tk.choose_segments(meta, hkv, hq // hkv, tk.sm_count(device))
    elt = 2
    kv_bytes = B * (P + n) * hkv * d * 2 * elt
    bytes_min = kv_bytes + 2 * B * n * hq * d * elt  # + q read, out written
    res = dict(B=B, P=P, n=n, heads=f"{hq}/{hkv}/{d}", nseg=nseg, kv_bytes=kv_bytes,
               kernel_ms=bench(lambda: call(step, out, "triton"), device, graph=True),
               call_ms=bench(lambda: call(step, out, "triton"), device, graph=False))
    if B == 1:
        res["nosplit_ms"] = bench(lambda: call(step, out, "triton", num_segments=1), device,
                                  graph=True)
    q = torch.randn(B, hq, n, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, hkv, P + n, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    res["sdpa_dense_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, enable_gqa=True), device, graph=False)
    peak = peak_gbps(device)
    ms = res["kernel_ms"] if math.isfinite(res["kernel_ms"]) else res["call_ms"]
    res["gbps"] = bytes_min / ms / 1e6
    res["peak_gbps"] = peak
    res["bound_ms"] = bytes_min / peak / 1e6 if peak else None
    res["x_bound"] = ms / res["bound_ms"] if peak else None
    return res


# ----------------------------------------------------------------------------- report


def summary(cases: list[dict]) -> list[dict]:
    rows = {}
    for c in cases:
        r = rows.setdefault((c["dtype"], c["heads"]), dict(dtype=c["dtype"], heads=c["heads"],
                                                           cases=0, passed=0, max_err=0.0,
                                                           max_scaled=0.0))
        r["cases"] += 1
        r["passed"] += c["ok"]
        for key, src in (("max_err", "err"), ("max_scaled", "err_scaled")):
            if math.isfinite(c.get(src, math.nan)):  # failed records carry an error instead
                r[key] = max(r[key], c[src])
    return sorted(rows.values(), key=lambda r: (r["dtype"], r["heads"]))


def markdown(report: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    lines = [f"# tree_kernel GPU check: {report['device']}", "",
             f"torch {report['torch']}, triton {report['triton']}; "
             f"{report['elapsed_s']:.0f} s; all ok: {report['all_ok']}", ""]
    pre = report.get("preflight") or {}
    if pre:
        lines += [f"preflight: C compiler {pre.get('cc')}, Python.h {pre.get('python_h')}; "
                  + (f"the kernel FAILED: {pre['error']}" if "error" in pre else
                     f"a 5-node tree step {'ok' if pre.get('ok') else 'WRONG'} "
                     f"(err {pre.get('err', float('nan')):.2e})"), ""]
    if report.get("stopped"):
        lines += [f"matrix stopped: {report['stopped']}", ""]
    lines += ["| dtype | heads | cases | passed | max abs err | max err / (1 + abs ref) |",
             "|---|---|---|---|---|---|"]
    for r in report["summary"]:
        lines.append(f"| {r['dtype']} | {r['heads']} | {r['cases']} | {r['passed']} | "
                     f"{r['max_err']:.2e} | {r['max_scaled']:.2e} |")
    lines += ["", "| B | P | n | nseg | kernel ms | per call ms | no split ms | GB/s | "
              "x bound | SDPA dense ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in report["timing"]:
        if "error" in t:
            lines.append(f"| {t['B']} | {t['P']} | {t['n']} | {t['error']} |")
            continue
        lines.append(f"| {t['B']} | {t['P']} | {t['n']} | {t['nseg']} | {f(t['kernel_ms'])} | "
                     f"{f(t['call_ms'])} | {f(t.get('nosplit_ms'))} | {f(t['gbps'], '.0f')} | "
                     f"{f(t['x_bound'], '.2f')} | {f(t['sdpa_dense_ms'])} |")
    lines += ["", f"views: {report['views']}", ""]
    dec = report.get("decode") or {}
    if "specs" in dec:
        lines += [f"decode: {dec['tokens']} greedy tokens after a {dec['prompt']}-token prompt "
                  f"of a random {dec['model']}; {dec['plain_split_forwards']} plain decoding "
                  f"steps split the prefix (split-KV); plain decoding through the torch twin "
                  f"agrees for {dec['twin_agrees_for']}; ok: {dec['ok']}", "",
                  "| tree | same tokens as plain | steps | accepted per step | max accepted | "
                  "steps that moved KV | mean tree |", "|---|---|---|---|---|---|---|"]
        for name, r in dec["specs"].items():
            lines.append(f"| `{name}` | {r['same']} | {r['steps']} | "
                         f"{r['accepted_per_step']:.2f} | {r['max_accepted']} | "
                         f"{r['compactions']} | {r['mean_tree']:.1f} |")
        lines.append("")
    elif dec:
        lines += [f"decode: {dec}", ""]
    return "\n".join(lines)


def guarded(fn, *args, **info) -> dict:
    """fn(*args), or a failed record with the error: one broken case or compile must not cost
    the run its other results."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded in the report, never hidden
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return info | dict(ok=False, err=float("nan"), error=f"{type(e).__name__}: {e}"[:500])


def toolchain() -> dict:
    """What Triton's first launch on a GPU needs from the machine: a C compiler (it builds its
    CUDA launcher) and Python's headers."""
    cc = os.environ.get("CC") or next(
        (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    include = sysconfig.get_paths().get("include", "")
    return dict(cc=shutil.which(cc) if cc else None,
                python_h=os.path.exists(os.path.join(include, "Python.h")))


def preflight(device: torch.device, tol: dict) -> dict:
    """One small tree step (SmolLM2's heads, bf16, a 5-node tree over a 37-token prefix)
    through the kernel against the torch twin, and the toolchain: the run goes on only where
    this step computes."""
    hq, hkv, d = HEADS["smollm2-135m"]
    spec = Spec("bf16", "smollm2-135m", (hq, hkv, d), 16, "LBNHC", [(37, 5, "random")], None,
                12345)
    return toolchain() | guarded(check_case, spec, device, tol, **asdict(spec))


def run(out_dir: Path, deadline: float, smoke: bool, t0: float = T0) -> dict:
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the CPU dry run")
    import triton

    tol = CPU_TOL if smoke else TOL
    specs = matrix(smoke)
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu (Triton interpreter)", torch=torch.__version__, triton=triton.__version__,
        cpu_smoke=smoke, deadline_s=deadline, elapsed_s=0.0, all_ok=False, summary=[],
        preflight={}, stopped=None, timing=[], views={}, decode={}, correctness=[],
        not_run=len(specs))
    cases, timing = report["correctness"], report["timing"]

    def save() -> None:  # after every phase: a killed run still leaves its results
        report.update(elapsed_s=time.perf_counter() - t0, summary=summary(cases),
                      not_run=len(specs),
                      all_ok=report["preflight"].get("ok", False) and bool(cases)
                      and all(c["ok"] for c in cases)
                      and report["views"].get("ok", False) and report["decode"].get("ok", False))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
        (out_dir / "gpu_check.md").write_text(markdown(report))

    def correctness(until: float) -> None:
        while specs and time.perf_counter() - t0 < until and report["stopped"] is None:
            spec = specs.pop()
            c = guarded(check_case, spec, device, tol, **asdict(spec))
            cases.append(c)
            print(f"[{time.perf_counter() - t0:6.1f}s] {c['dtype']} {c['heads']} bs{c['bs']} "
                  f"{c['layout']} trees={c['trees']} nseg={c.get('nseg')} err={c['err']:.2e} "
                  f"{'ok' if c['ok'] else 'FAIL ' + c.get('error', '')}", flush=True)
            if len(cases) == FAIL_FAST and all("error" in c for c in cases):
                report["stopped"] = (f"the first {FAIL_FAST} cases all raised (a systematic "
                                     f"failure), e.g. {cases[0]['error']}")
                print(f"matrix stopped: {report['stopped']}", flush=True)

    pre = report["preflight"] = preflight(device, tol)
    print(f"[{time.perf_counter() - t0:6.1f}s] preflight {pre}", flush=True)
    if "error" in pre:
        save()
        print(markdown(report))
        print(f"the kernel cannot run on this machine: {pre['error']} (C compiler: "
              f"{pre['cc']}, Python.h: {pre['python_h']}); nothing else was run",
              file=sys.stderr, flush=True)
        raise SystemExit(2)
    correctness(0.55 * deadline)
    report["views"] = guarded(check_views, device)
    report["decode"] = guarded(check_decode, device, smoke)
    print(f"[{time.perf_counter() - t0:6.1f}s] decode {report['decode']}", flush=True)
    save()
    last = 0.0  # seconds the last timing config took: the next one starts only if it fits
    for B, P, n in SMOKE_TIMING if smoke else TIMING:
        if time.perf_counter() - t0 + last > 0.95 * deadline:
            break
        started = time.perf_counter()
        timing.append(guarded(time_config, B, P, n, device, smoke, B=B, P=P, n=n))
        last = time.perf_counter() - started
        print(f"[{time.perf_counter() - t0:6.1f}s] timing {timing[-1]}", flush=True)
        save()
    correctness(deadline)
    save()
    print(markdown(report))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the process's start before the matrix stops "
                         "(default 420 on GPU, 60 on CPU)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU dry run: the interpreter on tiny shapes")
    args = ap.parse_args()
    deadline = args.deadline or (60.0 if args.cpu_smoke else 420.0)
    report = run(args.out, deadline, args.cpu_smoke)
    sys.exit(0 if report["all_ok"] else 1)


if __name__ == "__main__":
    main()
