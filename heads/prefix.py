"""The head's context across the target's prefix cache: K/V of finished sessions, by tokens.

A serving engine with prefix caching computes no target features for the tokens it found in
its cache, so a head that builds its own context from those features (EAGLE: one K/V pair per
position) would start such a request with none of it: for a repeated system prompt or the
next turn of a chat, the drafts of the first steps see only the tokens after the hit. Pair p's
K/V depend only on tokens 0..p+1, so any session of the same head that committed pairs 0..n-1
for the same n + 1 tokens holds them: a live one (another request with the same prompt), or a
finished one kept here. `PrefixStore` keeps the pairs of finished sessions (float32 K/V on the
CPU, `EagleSession.cached_prefix`), at most `max_tokens` pairs in all, least recently used
first out; `find` returns the K/V of pairs 0..n-1 for a request whose tokens 0..n match an
entry's, which `EagleSession.seed` takes.

Pure python + torch (no vLLM).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor


class PrefixStore:
    def __init__(self, max_tokens: int = 1 << 15) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, tuple[list[int], Tensor, Tensor]] = OrderedDict()
        self._next = 0
        self.tokens = 0  # pairs held, over every entry

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Keep pairs 0..n-1 (K, V [Hkv, n, D]) computed for `tokens` (n + 1 ids, or more: the
        rest is ignored). An entry whose tokens this one extends is replaced; one that extends
        this one makes it redundant."""
        n = k.shape[1]
        if not 0 < n <= self.max_tokens or len(tokens) < n + 1:
            return
        ids = list(tokens[: n + 1])
        for key, (old, ok, _) in list(self._entries.items()):
            m = ok.shape[1]
            if m >= n and _starts_with(old, ids):
                self._entries.move_to_end(key)
                return
            if m < n and _starts_with(ids, old):
                del self._entries[key]
                self.tokens -= m
        self._entries[self._next] = (ids, k.cpu(), v.cpu())
        self._next += 1
        self.tokens += n
        while self.tokens > self.max_tokens:
            _, (_, old, _) = self._entries.popitem(last=False)
            self.tokens -= old.shape[1]

    def find(self, tokens: Sequence[int]) -> tuple[Tensor, Tensor] | None:
        """K, V [Hkv, n, D] of pairs 0..n-1 for `tokens` (n + 1 ids) from an entry that holds
        them, or None."""
        n = len(tokens) - 1
        if n < 1:
            return None
        ids = list(tokens)
        for key, (old, k, v) in reversed(self._entries.items()):  # most recent first
            if k.shape[1] >= n and _starts_with(old, ids):
                self._entries.move_to_end(key)
                return k[:, :n], v[:, :n]
        return None


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    """ids[:len(prefix)] == prefix, its last token compared first (entries share system
    prompts: most differ after them)."""
    n = len(prefix)
    return len(ids) >= n and ids[n - 1] == prefix[-1] and ids[:n] == prefix
