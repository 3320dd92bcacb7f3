"""Tree metrics in `/metrics` and in vLLM's periodic spec-decode log line (frontend process).

vLLM's scheduler already counts, per interval, the verify steps (`num_drafts`), how many steps
accepted more than i drafts (`num_accepted_tokens_per_pos[i]`) and how many had more than i
draft tokens (`num_draft_tokens_per_pos[i]`). Differencing gives the two tree histograms, so no
new data crosses processes:

- `vllm:treedraft_accepted_depth{depth=d}`: verify steps whose accepted path had d drafts;
- `vllm:treedraft_tree_size{nodes=n}`: verify steps with an n-node tree.

Mean acceptance length is vLLM's (1 + accepted / drafts); the log line gains the depth
histogram and the mean tree size. Active only when a treedraft head is configured.
"""

from __future__ import annotations

from vllm.v1.spec_decode.metrics import SpecDecodingProm

from .patching import Patch

ACTIVE = False  # set by plugin/config.py when --speculative-config names a treedraft head


def exact_counts(total: int, more_than: list[int]) -> list[int]:
    """[#steps with value == v for v in 0..len(more_than)] from #steps with value > i."""
    above = [total, *more_than]
    return [above[v] - (above[v + 1] if v + 1 < len(above) else 0) for v in range(len(above))]


class TreedraftSpecDecodingProm(SpecDecodingProm):
    def __init__(self, speculative_config, labelnames, per_engine_labelvalues,
                 is_diffusion: bool = False):
        super().__init__(speculative_config, labelnames, per_engine_labelvalues, is_diffusion)
        self.treedraft = ACTIVE and self.spec_decoding_enabled and not is_diffusion
        if not self.treedraft:
            return
        n = speculative_config.num_speculative_tokens

        def per_value(name: str, doc: str, label: str):
            base = self._counter_cls(name=name, documentation=doc,
                                     labelnames=[*labelnames, label])
            return {idx: [base.labels(*lv, str(v)) for v in range(n + 1)]
                    for idx, lv in per_engine_labelvalues.items()}

        self.depth = per_value("vllm:treedraft_accepted_depth",
                               "Verify steps by number of accepted draft tokens.", "depth")
        self.size = per_value("vllm:treedraft_tree_size",
                              "Verify steps by number of draft tokens (tree nodes).", "nodes")

    def observe(self, spec_decoding_stats, engine_idx: int = 0):
        super().observe(spec_decoding_stats, engine_idx)
        if not self.treedraft or not spec_decoding_stats.num_drafts:
            return
        s = spec_decoding_stats
        for counters, more in ((self.depth, s.num_accepted_tokens_per_pos),
                               (self.size, s.num_draft_tokens_per_pos)):
            for c, k in zip(counters.get(engine_idx, ()), exact_counts(s.num_drafts, more),
                            strict=False):
                if k:
                    c.inc(k)


def _wrap_log(original):
    def log(self, log_fn=None):
        if ACTIVE and self.num_drafts:
            import numpy as np

            drafts = int(np.sum(self.num_drafts))
            per_pos = np.sum(np.array(self.accepted_tokens_per_pos_lists), axis=0).tolist()
            hist = exact_counts(drafts, [int(x) for x in per_pos])
            last = max((d for d, k in enumerate(hist) if k), default=0)
            (log_fn or _logger().info)(
                "treedraft: mean tree size %.1f, accepted depth histogram %s",
                float(np.sum(self.num_draft_tokens)) / drafts, hist[: last + 1])
        return original(self) if log_fn is None else original(self, log_fn)

    return log


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.treedraft")


FRONTEND_PATCHES = [
    Patch("vllm.v1.metrics.loggers:PrometheusStatLogger._spec_decoding_cls",
          lambda original: TreedraftSpecDecodingProm,
          "/metrics gains treedraft accepted-depth and tree-size counters"),
    Patch("vllm.v1.spec_decode.metrics:SpecDecodingLogging.log", _wrap_log,
          "spec-decode log line gains the accepted-depth histogram and mean tree size"),
]
