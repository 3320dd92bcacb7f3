"""Medusa draft heads: K small residual heads on the target's final hidden state.

Features
- Head k (k = 1..K) maps the target's final post-norm hidden state at position t to logits for
  token t+1+k (the target's own LM head already gives token t+1).
- Each head: `num_layers` residual blocks x + SiLU(Linear(x)), zero-initialised so an untrained
  head starts as the target's LM head; then the target's LM head (bound, never saved) or, with
  `own_lm_head`, a per-head Linear(H -> V) that is saved.
- `draft_session()`: an Expander whose distribution depends only on a node's depth (root ->
  head 1), not on the parent token; trees deeper than K are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import ConfigMixin, DraftHead, TargetSignature, node_depth, register_head


@dataclass
class MedusaConfig(ConfigMixin):
    hidden_size: int  # must equal target.hidden_size
    vocab_size: int  # must equal target.vocab_size
    num_heads: int  # K
    target: TargetSignature
    num_layers: int = 1  # residual blocks per head
    own_lm_head: bool = False  # True: each head has (and saves) its own [V, H] LM head
    default_tree: str = "static:32"
    acceptance_rates: list[list[float]] | None = None  # [depth][rank], measured after training

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            self.target = TargetSignature.from_dict(self.target)
        for name in ("hidden_size", "vocab_size"):
            if getattr(self, name) != getattr(self.target, name):
                raise ValueError(
                    f"MedusaConfig.{name}={getattr(self, name)} != target "
                    f"{name}={getattr(self.target, name)}"
                )
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self}")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return (self.target.num_hidden_layers,)  # the final post-norm hidden state


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # identity at init (Medusa)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


@register_head("medusa")
class MedusaHeads(DraftHead):
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        if config.own_lm_head:
            self.lm_heads = nn.ModuleList(
                nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )

    @property
    def max_draft_depth(self) -> int:
        """One head per depth below the root."""
        return self.config.num_heads

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (target final hidden at t) -> logits [..., K, V] (tokens t+2..t+1+K)."""
        h = torch.stack([head(hidden) for head in self.heads], dim=-2)  # [..., K, H]
        if self.config.own_lm_head:
            return torch.stack([lm(h[..., k, :]) for k, lm in enumerate(self.lm_heads)], dim=-2)
        return F.linear(h, self._bound("target_lm_head").to(h.dtype))

    def draft_session(self) -> MedusaSession:
        return MedusaSession(self)


class MedusaSession:
    """Expander for heads/tree.py: a depth-d node's children come from head d+1.

    With the last committed target hidden f_{n-1} (root = bonus token x_n at position n), head k
    predicts x_{n+k}; children of a depth-d node are at depth d+1, i.e. token x_{n+d+1}.
    """

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.logprobs: Tensor | None = None  # [K, V] float32, for the last commit

    @torch.no_grad()
    def commit(self, target_hidden: Tensor, tokens: Tensor) -> None:
        """Keep the last target hidden; target_hidden [T, H], tokens [T] (unused by Medusa)."""
        if target_hidden.ndim != 2 or target_hidden.shape[0] < 1:
            raise ValueError(
                f"commit expects target_hidden [T, H], got {list(target_hidden.shape)}"
            )
        p = next(self.heads.parameters(), None)
        last = target_hidden[-1]
        if p is not None:
            last = last.to(p.device, p.dtype)
        self.logprobs = torch.log_softmax(self.heads(last).float(), dim=-1)  # [K, V]

    def rewind(self, length: int) -> None:
        """Medusa drafts from the last committed hidden state only: nothing to roll back."""

    def expand(self, tree, nodes: list[int]) -> Tensor:
        """Log-probs [len(nodes), V] of head depth(node)+1 for each node."""
        if self.logprobs is None:
            raise RuntimeError("commit target hidden states before drafting (nothing committed)")
        K = self.heads.config.num_heads
        parents = [int(x) for x in tree.parents.tolist()]
        depths = [node_depth(parents, n) for n in nodes]
        for n, d in zip(nodes, depths, strict=True):
            if d >= K:
                raise ValueError(
                    f"medusa head has {K} heads; tree depth must be <= {K} (node {n} is at "
                    f"depth {d}, its children would be at depth {d + 1})"
                )
        return self.logprobs[depths]


# vLLM 0.32's own Medusa (model_executor/models/medusa.py, method "medusa"): per head
# `blocks.{k}.layers.{l}` = x + SiLU(Linear(x)) (bias when `medusa_fc_bias`), on the target's
# final post-norm hidden state (the runner's sample_hidden_states), then an LM head: one shared
# `lm_head` loaded from `lm_heads.0.weight` with `original_lm_head`, else `lm_heads.{k}`. The
# same math as MedusaHeads; vLLM drafts the top-1 of each head as a chain.
VLLM_MEDUSA_FORMAT = "vllm-medusa"


def to_vllm_medusa(heads: MedusaHeads) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) of `heads` as vLLM's Medusa loads them."""
    c: MedusaConfig = heads.config
    state: dict[str, Tensor] = {}
    for k, blocks in enumerate(heads.heads):
        for j, block in enumerate(blocks):
            state[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
    if c.own_lm_head:
        for k, lm in enumerate(heads.lm_heads):
            state[f"lm_heads.{k}.weight"] = lm.weight
    else:  # the target's LM head, once (vLLM shares it between the heads)
        state["lm_heads.0.weight"] = heads._bound("target_lm_head")
    config = {
        "architectures": ["MedusaModel"], "model_type": "medusa",
        "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
        "truncated_vocab_size": c.vocab_size,
        # vLLM's MedusaConfig renames every key holding "num" and "heads"/"layers": only these two
        "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": True, "original_lm_head": not c.own_lm_head,
        "treedraft_target": c.target.to_dict(),
    }
    return config, state


def save_vllm_medusa(heads: MedusaHeads, out, *, dtype: torch.dtype | None = None,
                     num_speculative_tokens: int | None = None):
    """Write `heads` as a folder stock vLLM serves with {"method": "medusa", "model": out,
    "num_speculative_tokens": K}; K (checked before anything is written) must be 1..num_heads:
    vLLM drafts one token per head. Returns the folder's Path."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    if getattr(heads, "head_type", None) != "medusa":
        raise ValueError(f"the {VLLM_MEDUSA_FORMAT} format holds Medusa heads; this is a "
                         f"{getattr(heads, 'head_type', type(heads).__name__)!r} head (EAGLE "
                         "heads export with --format speculators)")
    n, k = heads.config.num_heads, num_speculative_tokens
    if k is not None and not 1 <= k <= n:
        raise ValueError(f"--num-speculative-tokens {k}: this Medusa head has {n} heads and vLLM "
                         f"drafts one token per head; give 1..{n}")
    config, state = to_vllm_medusa(heads)
    state = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
             for k, v in state.items()}
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
