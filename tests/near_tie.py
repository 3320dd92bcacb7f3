"""Where a bfloat16 tree may differ from no speculation: at fp near-ties of the target only.

In bfloat16 a tree's rows run in other shapes than no speculation's (several rows per request
through the target's matmuls and the attention kernel's multi-row path), so a greedy tree may
pick another token where the target's top logits are (nearly) tied. `divergences` reports every
divergence with the gap, in no speculation's run, between its top raw logit and the logit of the
token the tree chose, in bf16 ulps; a logic error shows up at a clear gap (tens of ulps and
more).

The ulps are taken at the top logit's magnitude, but never below LOGIT_FLOOR: a logit's bf16
rounding error is absolute (the final hidden state's rounding times an LM-head row), about an
ulp of the model's typical logits (SmolLM2's top logits: 10-32), so at a flat position whose top
logit is small a near-tie is still an ulp of a typical logit wide. Measured, SmolLM2 bf16 on
AMX, 24 MT-bench/HumanEval prompts x 48 tokens: the shipped head's chain=3 (verified by
vLLM's own rejection sampler) diverges from no speculation at 14 of them, at gaps of 0 to
0.125 (one ulp at 16-32); a hybrid tree at 15, gaps 0 to 0.125.
"""

from __future__ import annotations

import math

BF16_ULPS = 4  # bf16 trees may pick a token only this close (ulps) to no-spec's top logit
LOGIT_FLOOR = 16.0  # ulps are counted at max(|top logit|, this)


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) at |x|."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def divergences(base: dict, res: dict) -> list[dict]:
    """Per prompt whose tokens differ: its first divergence (prompt, token index, no-spec's top
    raw logit, gap to the tree's token's logit, the gap in ulps). `base` is a scripts/engine.py
    job result run with logprobs 5 and logprobs_mode raw_logits; a tree token outside no-spec's
    top 5 there fails at once."""
    report = []
    for i, (a, b) in enumerate(zip(base["tokens"], res["tokens"], strict=True)):
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if k is None:
            assert len(a) == len(b), (i, len(a), len(b))
            continue
        pairs = base["top_logprobs"][i][k]  # no speculation's top-5 [token, raw logit] there
        top1 = pairs[0][1]
        assert top1 == base["logprobs"][i][k], "no speculation's own token is its argmax"
        logit = dict((t, v) for t, v in pairs).get(b[k])  # the tree's token, in no-spec's run
        assert logit is not None, (
            f"prompt {i}, token {k}: the bf16 tree chose {b[k]}, outside no speculation's "
            f"top 5 there: {pairs}")
        gap = top1 - logit
        ulp = bf16_ulp(max(abs(top1), LOGIT_FLOOR))
        report.append({"prompt": i, "token": k, "top": round(top1, 3), "gap": round(gap, 4),
                       "ulps": round(gap / ulp, 2)})
    return report
