"""Per-step tree context shared by the worker-side touch points (positions, attention, sampler).

`runner._prepare_inputs` builds a `TreeStep` for the step being executed and keeps it on the
runner that owns the step (`STEP_ATTR`); the runner hands it to its own attention metadata
(`attach`), from which the attention backend reads the ancestor masks; the sampler verifies with
its parents and records the accepted nodes, and the proposer commits those nodes' hidden states.
Nothing is module-global, so two engines in one process never see each other's steps;
`num_tokens` guards against using a step in any other forward (profiling and warm-up runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treedraft.heads.tree import tree_buffers


@dataclass
class TreeRequest:
    req_index: int  # row in input_batch
    req_id: str
    qs: int  # first scheduled row (the root) in this step's flattened tokens
    root_pos: int  # position of the root = committed tokens before this step
    tokens: list[int]  # [n+1] root + scheduled drafts (valid ones only)
    parents: list[int]  # [n+1], parents[0] = -1, topological
    depths: list[int]  # [n+1]
    is_chain: bool
    mask: torch.Tensor | None = None  # [n+1, n+1] bool: ancestors (trees; the prefix is all seen)
    q: torch.Tensor | None = None  # [k, V] rows of the head's q that nodes `q_nodes` were drawn
    q_nodes: list[int] | None = None  # from (a sampled head chain or fixed-shape tree; drawn
    # nodes come first among their siblings, siblings drawn without replacement)

    @property
    def size(self) -> int:
        return len(self.parents)


@dataclass
class TreeStep:
    num_tokens: int  # total scheduled tokens of the step
    requests: dict[int, TreeRequest] = field(default_factory=dict)  # req_index -> request
    accepted: dict[str, list[int]] = field(default_factory=dict)  # req_id -> accepted node ids
    attention_seconds: float = 0.0  # what trees add to attention this step, all layers (profile)
    compaction_seconds: float = 0.0  # accepted-path K/V moves of this step (profile)
    scratch: range = range(0)  # KV block ids this step may overwrite (plugin/scratch.py)
    tree_layers: int = 0  # attention layers that ran tree attention on this step's trees

    _seqs: tuple | None = field(default=None, repr=False)  # (metadata, TreeSeqs)
    _kernel_meta: object | None = field(default=None, repr=False)  # tree_kernel.TreeMeta

    @property
    def trees(self) -> list[TreeRequest]:
        """Requests whose drafts branch (need the ancestor mask and tree positions)."""
        return [r for r in self.requests.values() if not r.is_chain]

    def seqs(self, attn_metadata, block_size: int):
        """The step's batch with its trees as causal chains (plugin/attention_cpu.TreeSeqs),
        built by the first layer and shared by the others (same metadata object)."""
        if self._seqs is None or self._seqs[0] is not attn_metadata:
            from treedraft.plugin.attention_cpu import TreeSeqs

            self._seqs = (attn_metadata, TreeSeqs(self.trees, attn_metadata, block_size,
                                                  self.scratch))
        return self._seqs[1]

    def kernel_meta(self, device):
        """The trees as `tree_kernel.TreeMeta` on `device` (plugin/attention_cuda.py), built by
        the first layer and shared by the others: one host-to-device copy per step."""
        if self._kernel_meta is None:
            from treedraft.plugin.tree_kernel import TreeMeta

            self._kernel_meta = TreeMeta.build(
                [(t.qs, t.root_pos, t.parents, t.req_index) for t in self.trees], device)
        return self._kernel_meta


def check_attended(step: TreeStep | None, layers: int = 1) -> None:
    """Raise if the step has branching trees but fewer than `layers` attention layers (the
    target's) ran tree attention on them (its metadata never reached a backend, e.g. a forward
    whose token count differs from the step's: `attach`; or a layer whose backend is not
    treedraft's). Verifying such a step would accept drafts computed, in some layer, with
    causal attention among siblings and sequential positions: never silently."""
    if step is not None and step.trees and step.tree_layers < max(layers, 1):
        raise RuntimeError(
            f"treedraft: this step drafted {len(step.trees)} branching tree(s) but only "
            f"{step.tree_layers} of the target's {max(layers, 1)} attention layers ran tree "
            f"attention on its {step.num_tokens} tokens (the attention backend did not receive "
            "the step); refusing to verify them. Please report this with the engine "
            "configuration; serve with a chain ('chain:K') meanwhile")


STEP_ATTR = "_treedraft_step"  # runner attribute: the TreeStep being executed, or None
META_ATTR = "treedraft_tree_step"  # attention metadata attribute: the same step


def of_runner(runner) -> TreeStep | None:
    return getattr(runner, STEP_ATTR, None)


def attach(attn_metadata, step: TreeStep | None) -> None:
    """Give this forward's attention metadata (vLLM's per-layer dict, or a list of them per
    micro-batch) the step whose tokens it describes; any other forward gets None."""
    groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for per_layer in groups:
        for md in (per_layer or {}).values():
            n = getattr(md, "num_actual_tokens", None)
            setattr(md, META_ATTR, step if step is not None and step.num_tokens == n else None)


def of_metadata(attn_metadata) -> TreeStep | None:
    return getattr(attn_metadata, META_ATTR, None)


def make_request(req_index: int, req_id: str, qs: int, root_pos: int, root: int,
                 drafts: list[int], tree, q: torch.Tensor | None = None) -> TreeRequest:
    """Scheduled drafts -> the tree they are (or a chain, when they are not the drafted tree).

    The scheduler may keep only a prefix of the drafts; a prefix of a topologically ordered tree
    is a tree. Placeholders (-1, for resumed requests) and anything else we did not draft are
    verified as a chain, which is exact too; the valid part ends at the first -1.
    q: (the head's draft distributions [P, V], the ids in `tree` of the nodes drawn from them,
    the row of each) when the head's part of `tree` was drawn from q: a chain
    (`heads.sampling.draft_chains`, row d - 1 for the node at depth d) or a fixed-shape tree
    (`draft_sampled_trees`, one row per expanded node), lookup nodes grafted after them
    (`heads.lookup.graft_lookup`); kept for the scheduled nodes, only when the drafts are that
    tree: `TreeRequest.q` holds one row per kept node.
    """
    n = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
    drafts = list(drafts[:n])
    ours = (tree is not None and tree.tokens[1:n + 1].tolist() == drafts
            and int(tree.tokens[0]) == root)
    if ours:
        parents = tree.parents[: n + 1].tolist()
    else:
        parents = [-1] + list(range(n))
    buf = tree_buffers(parents)
    depths = buf.depths.tolist()
    is_chain = depths == list(range(n + 1))
    mask = None if is_chain else buf.ancestor_mask
    q_rows, q_nodes = None, None
    if ours and q is not None and n:
        kept = [(row, node) for node, row in zip(q[1], q[2], strict=True) if node <= n]
        if kept:
            q_rows = q[0][[row for row, _ in kept]]
            q_nodes = [node for _, node in kept]
    return TreeRequest(req_index, req_id, qs, root_pos, [root] + drafts, parents, depths,
                       is_chain, mask, q_rows, q_nodes)
