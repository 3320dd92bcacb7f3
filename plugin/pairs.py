"""Serving buffers of the head's pending (target features, next token) pairs, per request.

The proposer records every scheduled request's pairs at every step but commits them to the
request's head session only when it drafts (`PendingPairs`); plain decode steps are logged whole
and handed to the requests when read (`PairLog`). Pure torch + numpy, no vLLM (tests/test_pairs.py
runs without an engine); the head's own commit is `heads.common.commit_sessions`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


class PendingPairs:
    """Pairs (target features, next token) a session has not read yet: serving commits them
    only when the request drafts, so a step that drafts nothing for it (`"tree": "auto"`
    choosing 0, a partial prefill) costs no head forward. `add(c, ...)` means what
    `session.rewind(c); session.commit(...)` means; `flush(session)` does both for everything
    pending at once, so a session fed lazily ends where one fed eagerly ends.

    `full` says when `max_rows` pairs wait: the caller then flushes them even though the request
    does not draft (a long prompt's prefill, a request auto keeps at 0 nodes for a long time), so
    memory per request stays bounded and the head never loses context."""

    def __init__(self, max_rows: int = 512) -> None:
        self.max_rows = max_rows
        self.start = 0  # position of the first pending pair
        self.feats: list[Tensor] = []
        self.tokens: list[Tensor] = []
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def add(self, position: int, target_hidden: Tensor, tokens: Tensor) -> None:
        if not self.rows or not self.start <= position <= self.start + self.rows:
            self.start, self.feats, self.tokens, self.rows = position, [], [], 0
        elif position < self.start + self.rows:  # a rollback inside what is pending
            keep = position - self.start
            self.feats = [torch.cat(self.feats)[:keep]]
            self.tokens = [torch.cat(self.tokens)[:keep]]
            self.rows = keep
        self.feats.append(target_hidden)
        self.tokens.append(tokens)
        self.rows += len(tokens)

    @property
    def full(self) -> bool:
        return self.rows >= self.max_rows

    def flush(self, session) -> tuple[Any, Tensor, Tensor] | None:
        """(session, features, tokens) to commit (the session rewound to their start), or None
        when nothing is pending."""
        if not self.rows:
            return None
        session.rewind(self.start)
        item = (session, _joined(self.feats), _joined(self.tokens))
        self.start, self.feats, self.tokens, self.rows = self.start + self.rows, [], [], 0
        return item


class PairLog:
    """Decode steps' pairs (one per request) not yet handed to the requests' `PendingPairs`.

    Serving records every request's pair at every step, drafting or not; handed out one request
    at a time (a view and an `add` each) that was ~0.3 ms of each step at batch 16 on a 2-core
    CPU, where `"tree": "auto"` drafting nothing must cost nothing. A decode step is logged
    instead as one entry (its request ids, positions, features [n, F] and tokens [n]) in O(1),
    and `drain` replays the entries, in step order, into `PendingPairs` when someone reads them
    (a request drafts, a step that is not a plain decode records its pairs) or `max_steps`
    entries wait: each request's consecutive pairs in one `add` of rows gathered from all the
    entries at once. Replaying in order makes the result what adding each step at once makes,
    a rollback (a preempted request recomputed) included."""

    def __init__(self, max_steps: int = 64) -> None:
        self.max_steps = max_steps
        self.entries: list[tuple[Sequence[str], Sequence[int], Tensor, Tensor]] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.max_steps

    def add(self, req_ids: Sequence[str], positions: Sequence[int],
            feats: Tensor | Sequence[Tensor], tokens: Tensor | np.ndarray) -> None:
        """One step: request req_ids[j]'s pair at positions[j] is (feats[j], tokens[j]).

        feats may be the parts of the features, [n, H_k] each, concatenated along the last
        dimension only when drained (a serving step logs views of its layers: no copy, no
        concatenation in the step; every entry of a log then has as many parts), tokens a numpy
        integer array (converted when drained). On a 2-core CPU the step's own concatenation
        and conversion would be ~0.13 ms of a plain decode step at batch 4 (every op right
        after the target's forward runs with cold caches)."""
        self.entries.append((req_ids, positions, feats, tokens))

    def drain(self, pending: dict[str, PendingPairs], live: Container[str] | None = None
              ) -> None:
        """Every logged pair into `pending` (req_id -> PendingPairs, created where missing), in
        step order; pairs of requests not in `live` (finished since) are dropped."""
        if not self.entries:
            return
        entries, self.entries = self.entries, []
        rows: dict[str, list[int]] = {}  # req_id -> its rows in the entries' concatenation
        where: dict[str, list[int]] = {}  # req_id -> the positions of those rows
        base = 0
        for req_ids, positions, *_ in entries:
            for j, (req_id, pos) in enumerate(zip(req_ids, positions, strict=True)):
                if live is not None and req_id not in live:
                    continue
                rows.setdefault(req_id, []).append(base + j)
                where.setdefault(req_id, []).append(pos)
            base += len(req_ids)
        if not rows:
            return
        feats = _cat_feats([e[2] for e in entries])
        tokens = [e[3] for e in entries]
        tokens = (torch.from_numpy(np.concatenate(tokens)).long()
                  if isinstance(tokens[0], np.ndarray) else torch.cat(tokens))
        for req_id, r in rows.items():
            p = pending.get(req_id)
            if p is None:
                p = pending[req_id] = PendingPairs()
            pos = where[req_id]
            if all(b == a + 1 for a, b in zip(pos, pos[1:], strict=False)):
                index = torch.tensor(r)
                p.add(pos[0], feats.index_select(0, index.to(feats.device)),
                      tokens.index_select(0, index.to(tokens.device)))
            else:  # a rollback among them: one pair at a time, as they came
                for k, q in zip(r, pos, strict=True):
                    p.add(q, feats[k : k + 1].clone(), tokens[k : k + 1].clone())


def _joined(parts: list[Tensor]) -> Tensor:
    """The parts concatenated; one part as it is (a serving step's pending pairs are usually one
    view of the step's features: the commit copies them once, with every request's)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cat_feats(feats: list) -> Tensor:
    """Entries' features [sum n, F]: tensors, or parts [n, H_k] joined along the last dim."""
    if isinstance(feats[0], Tensor):
        return torch.cat(feats) if len(feats) > 1 else feats[0]
    parts = [torch.cat(part) if len(feats) > 1 else part[0] for part in zip(*feats, strict=True)]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
