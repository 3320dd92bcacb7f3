"""Two vLLM engines in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no speculation, then a
treedraft tree, then the first engine again. Prints ``TREEDRAFT_RESULT [plain, tree, plain again,
tree drafts]`` (greedy token ids per prompt). Run by tests/test_plugin_engine.py."""

from __future__ import annotations

import json
import sys


def _main(request: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from treedraft.scripts.engine import counter_delta, spec_counters

    kw = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "seed": 0,
          "disable_log_stats": False}
    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]

    def run(llm) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]

    plain = LLM(request["target"], **kw)
    first = run(plain)
    tree = LLM(request["target"], speculative_config=request["spec"], **kw)
    before = spec_counters(tree)
    second = run(tree)
    drafts = counter_delta(before, spec_counters(tree))["drafts"]
    print("TREEDRAFT_RESULT " + json.dumps([first, second, run(plain), drafts]), flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
