"""Tree metrics in `/metrics` and in vLLM's periodic spec-decode log line (frontend process).

vLLM's scheduler already counts, per interval, the verify steps (`num_drafts`), how many steps
accepted more than i drafts (`num_accepted_tokens_per_pos[i]`) and how many had more than i
draft tokens (`num_draft_tokens_per_pos[i]`). Differencing gives the two tree histograms, so no
new data crosses processes:

- `vllm:treedraft_accepted_depth{depth=d}`: verify steps whose accepted path had d drafts;
- `vllm:treedraft_tree_size{nodes=n}`: verify steps with an n-node tree.

Mean acceptance length is vLLM's (1 + accepted / drafts); the log line of treedraft's engines
gains the depth histogram and the mean tree size. The /metrics counters exist only
for engines whose own speculative config is treedraft's proposer (`is_treedraft`).

One counter needs data only the worker has: which source proposed each accepted node of a tree
(`heads.lookup`: head, lookup, or both). `vllm:treedraft_accepted_tokens_by_source{source}`
(tree mode) and the gauge `vllm:treedraft_live_draft_sessions` (requests the proposer holds
draft state for; a leak check after a load has drained) are fed through a small JSON file named
after the engine's own `VllmConfig.instance_id` (`stats_path`: unique per engine, carried to the
engine-core and worker processes with the config, and not part of the config hash that keys
vLLM's compile cache). The worker (`SourceStats`, TP rank 0) rewrites it atomically after each
verified step and removes it at exit; the frontend's `PrometheusStatLogger` of the same engine
reads it when it observes the step's stats (so it may trail by a step). Nothing goes through
the process environment, so engines in one process never share or re-point each other's file.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
from pathlib import Path

import prometheus_client
from vllm.v1.spec_decode.metrics import SpecDecodingProm

from treedraft.heads.lookup import SOURCES

from .patching import Patch


def stats_path(vllm_config) -> str:
    """The accepted-by-source counts file of the engine `vllm_config` configures."""
    return str(Path(tempfile.gettempdir())
               / f"treedraft-stats-{os.getuid()}-{vllm_config.instance_id}.json")


def read_source_counts(path: str | None) -> dict[str, int]:
    """Accepted draft tokens by source so far ({} before the worker wrote anything)."""
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or mid-replace on another OS
        return {}


LIVE = "live_sessions"  # key in the counts file: requests the proposer holds state for


class SourceStats:
    """Worker side: running totals of accepted draft tokens by source, and the number of
    requests the proposer holds draft state for, rewritten atomically when they change."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.counts = {**dict.fromkeys(SOURCES, 0), LIVE: 0}
        if path:
            atexit.register(_remove, path)

    def set_live(self, n: int) -> None:
        if n != self.counts[LIVE]:
            self.counts[LIVE] = n
            self._write()

    def add(self, counts: dict[str, int]) -> None:
        if not any(counts.values()):
            return
        for k, v in counts.items():
            self.counts[k] += v
        self._write()

    def _write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(self.counts))
        os.replace(tmp, self.path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def exact_counts(total: int, more_than: list[int]) -> list[int]:
    """[#steps with value == v for v in 0..len(more_than)] from #steps with value > i."""
    above = [total, *more_than]
    return [above[v] - (above[v + 1] if v + 1 < len(above) else 0) for v in range(len(above))]


def is_treedraft(speculative_config) -> bool:
    """Whether this engine's drafts are treedraft's (its own config says so, not the process)."""
    from .config import PROPOSER

    return (speculative_config is not None and speculative_config.method == "custom_class"
            and speculative_config.model == PROPOSER)


class TreedraftSpecDecodingProm(SpecDecodingProm):
    _gauge_cls = prometheus_client.Gauge

    def __init__(self, speculative_config, labelnames, per_engine_labelvalues,
                 is_diffusion: bool = False):
        super().__init__(speculative_config, labelnames, per_engine_labelvalues, is_diffusion)
        self.treedraft = (self.spec_decoding_enabled and not is_diffusion
                          and is_treedraft(speculative_config))
        self.source_path: str | None = None  # stats_path(vllm_config): _wrap_prometheus_init
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
        by_source = self._counter_cls(
            name="vllm:treedraft_accepted_tokens_by_source",
            documentation="Accepted draft tokens by the source that proposed them (trees).",
            labelnames=[*labelnames, "source"])
        self.by_source = {idx: {src: by_source.labels(*lv, src) for src in SOURCES}
                          for idx, lv in per_engine_labelvalues.items()}
        self.source_seen = dict.fromkeys(SOURCES, 0)
        live = self._gauge_cls(
            name="vllm:treedraft_live_draft_sessions",
            documentation="Requests the treedraft proposer holds draft state for (trees).",
            labelnames=labelnames, multiprocess_mode="mostrecent")
        self.live = {idx: live.labels(*lv) for idx, lv in per_engine_labelvalues.items()}

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
        totals = read_source_counts(self.source_path)
        if LIVE in totals and engine_idx in self.live:
            self.live[engine_idx].set(totals[LIVE])
        for src, c in self.by_source.get(engine_idx, {}).items():
            new = totals.get(src, 0) - self.source_seen[src]
            if new > 0:
                c.inc(new)
                self.source_seen[src] += new


def _wrap_prometheus_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        prom = getattr(self, "spec_decoding_prom", None)
        if isinstance(prom, TreedraftSpecDecodingProm) and prom.treedraft:
            prom.source_path = stats_path(vllm_config)  # this engine's worker writes there

    return __init__


def _wrap_logging_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        # the log line gains treedraft's histogram in treedraft's engines only
        self.spec_decoding_logging.treedraft = is_treedraft(vllm_config.speculative_config)

    return __init__


def _wrap_log(original):
    def log(self, log_fn=None):
        if getattr(self, "treedraft", False) and self.num_drafts:
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
    Patch("vllm.v1.metrics.loggers:PrometheusStatLogger.__init__", _wrap_prometheus_init,
          "treedraft's counters read the accepted-by-source file of their own engine"),
    Patch("vllm.v1.metrics.loggers:LoggingStatLogger.__init__", _wrap_logging_init,
          "marks the spec-decode log of engines whose drafter is treedraft's"),
    Patch("vllm.v1.spec_decode.metrics:SpecDecodingLogging.log", _wrap_log,
          "spec-decode log line gains the accepted-depth histogram and mean tree size"),
]
