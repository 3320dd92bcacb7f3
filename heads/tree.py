"""Token trees for speculative decoding: tree shapes, attention/verification buffers, drafting.

Features:
- Tree specs as strings (`parse_tree_spec`, `TreeSpec.to_string` round-trips): "chain:K",
  a JSON list of paths "[[0],[1],[0,0]]", "static:NODES" (Medusa-style tree built from acceptance
  rates) and "dynamic:NODES,DEPTH[,TOPK]" (EAGLE-2 tree chosen per step from draft scores).
- A tree is data: `paths_to_parents` turns paths into a parent list and `tree_buffers` turns a
  parent list into the buffers tree attention and verification need (depths = position offsets,
  ancestor mask, retrieve indices, sibling ranks), on any `device`. Both validate their input.
- `build_static_paths`: greedy tree maximising the expected accepted length under per-depth,
  per-rank acceptance rates (Medusa's recipe); `expected_acceptance_length` scores any tree.
- `draft_tree`: drafts a token tree with any `Expander` (a draft head session), one batched
  expand call per tree level, never expanding leaves.
- Hybrid specs: any head spec + "+lookup:N" grafts up to N prompt-lookup nodes into the head's
  tree; "lookup:N" is lookup alone, no head (heads/lookup.py drafts and merges).

Conventions: a tree with N drafted nodes has N+1 nodes; node 0 is the root (the last committed
token). Nodes are in topological order (parents[i] < i) and siblings appear in draft order
(rank 0 = most likely under the draft first). A path lists child ranks from the root, root excluded.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from .common import batched

MAX_TREE_DEPTH = 16  # deepest drafted node (root excluded)
MAX_TREE_NODES = 256  # drafted nodes (root excluded)
DEFAULT_TOPK = 8

# Prior P(rank-k candidate accepted at depth d+1 | parent accepted) = 0.6 * 0.5**k * 0.9**d, for a
# head without measurements. Replace it with rates measured on real traffic (training/eval does).
DEFAULT_ACCEPTANCE_RATES: tuple[tuple[float, ...], ...] = tuple(
    tuple(0.6 * 0.5**k * 0.9**d for k in range(DEFAULT_TOPK)) for d in range(MAX_TREE_DEPTH)
)

Device = torch.device | str | None
Path = tuple[int, ...]

_PATHS_HELP = "a tree is a list of paths of child ranks from the root, e.g. [[0], [1], [0, 0]]"
SPEC_FORMS = (
    f"'chain:K' (1 <= K <= {MAX_TREE_DEPTH}), a JSON list of paths such as '[[0],[1],[0,0]]', "
    f"'static:NODES' (1 <= NODES <= {MAX_TREE_NODES}), 'dynamic:NODES,DEPTH[,TOPK]' "
    f"(DEPTH <= {MAX_TREE_DEPTH}, TOPK default {DEFAULT_TOPK}), each optionally followed by "
    f"'+lookup:N' (N prompt-lookup nodes grafted into the tree), or 'lookup:N' alone (no head); "
    f"all nodes together <= {MAX_TREE_NODES}"
)


# ----------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class TreeBuffers:
    parents: Tensor  # [N+1] long, parents[0] = -1
    depths: Tensor  # [N+1] long, node i sits at position root_position + depths[i]
    ancestor_mask: Tensor  # [N+1, N+1] bool; [i, j] True iff j == i or j is an ancestor of i
    retrieve_indices: Tensor  # [num_leaves, max_depth+1] long, root->leaf node ids, -1 padded
    ranks: Tensor  # [N+1] long, rank among siblings (0 for root)


def validate_parents(parents: Sequence[int] | Tensor) -> list[int]:
    """`parents` as a list of ints, after checking it is a topologically ordered tree."""
    if isinstance(parents, Tensor):
        if parents.dim() != 1 or parents.dtype.is_floating_point or parents.dtype == torch.bool:
            shape = tuple(parents.shape)
            raise ValueError(
                f"parents must be a 1-D integer tensor [N+1], got {parents.dtype} {shape}"
            )
        parents = parents.tolist()
    try:
        out = [operator.index(p) for p in parents]
    except TypeError:
        raise ValueError(f"parents must be integers, got {list(parents)!r}") from None
    if not out:
        raise ValueError("parents is empty: a tree needs at least its root, pass [-1]")
    if out[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {out[0]}")
    for i, p in enumerate(out[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p} must be in [0, {i}): nodes must be topologically ordered "
                "(every parent before its children, only node 0 has parent -1); sort nodes by depth"
            )
    return out


def tree_buffers(parents: Sequence[int] | Tensor, device: Device = None) -> TreeBuffers:
    """Tree-attention and verification buffers of the tree `parents` ([N+1], parents[0] = -1)."""
    par = validate_parents(parents)
    n = len(par)
    depths, ranks, num_children = [0] * n, [0] * n, [0] * n
    ancestors: list[list[int]] = [[0]]  # ancestors[i]: root..i node ids
    for i in range(1, n):
        p = par[i]
        depths[i] = depths[p] + 1
        ranks[i] = num_children[p]
        num_children[p] += 1
        ancestors.append(ancestors[p] + [i])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, line in enumerate(ancestors):
        mask[i, line] = True
    width = max(depths) + 1
    leaves = [i for i in range(n) if num_children[i] == 0]  # in node order
    retrieve = [ancestors[i] + [-1] * (width - len(ancestors[i])) for i in leaves]

    def long(x: list) -> Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return TreeBuffers(
        parents=long(par),
        depths=long(depths),
        ancestor_mask=mask.to(device),
        retrieve_indices=long(retrieve),  # [num_leaves, max_depth+1]
        ranks=long(ranks),
    )


def chain_cover(parents: Sequence[int] | Tensor) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """A tree as causal chains: what a causal attention kernel can verify without a tree mask.

    Returns (head, paths). Nodes 0..head-1 form a chain in node order (each node the parent of
    the next), so they attend causally in place. Every other node lies in exactly one path
    (ancestors, new): `new` is a chain of nodes (each the parent of the next), `ancestors` the
    root..parent of new[0] in depth order; a causal sequence laid out as ancestors + new gives
    each node of `new` exactly its ancestors. Paths follow a depth-first walk (children in node
    order), one per leaf not in the head chain.
    """
    par = validate_parents(parents)
    n = len(par)
    head = 1
    while head < n and par[head] == head - 1:
        head += 1
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[par[i]].append(i)
    line = {0: [0]}
    paths: list[tuple[list[int], list[int]]] = []
    stack = [0]
    while stack:  # preorder: a node right after its parent continues the parent's path
        i = stack.pop()
        if i:
            line[i] = line[par[i]] + [i]
        if i >= head:
            if paths and paths[-1][1][-1] == par[i]:
                paths[-1][1].append(i)
            else:
                paths.append((line[par[i]], [i]))
        stack.extend(reversed(children[i]))
    return head, paths


# ----------------------------------------------------------------------------- paths


def canonical_paths(paths: Sequence[Sequence[int]]) -> tuple[Path, ...]:
    """Validated paths sorted by (len, path): topological order, siblings in rank order."""
    if not isinstance(paths, list | tuple):
        raise ValueError(
            f"tree paths must be a list of lists of ints, got {type(paths).__name__}; {_PATHS_HELP}"
        )
    if not paths:
        raise ValueError(f"tree paths are empty; {_PATHS_HELP} ([[0]] drafts a single token)")
    if len(paths) > MAX_TREE_NODES:
        n = len(paths)
        raise ValueError(
            f"tree has {n} nodes > MAX_TREE_NODES = {MAX_TREE_NODES}; drop unlikely paths"
        )
    seen: set[Path] = set()
    for path in paths:
        if not isinstance(path, list | tuple) or not path:
            raise ValueError(
                f"tree path {path!r} must be a non-empty list of child ranks; {_PATHS_HELP}"
            )
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(
                f"tree path {list(path)!r}: ranks must be integers >= 0 (0 = most likely child)"
            )
        if len(path) > MAX_TREE_DEPTH:
            d = len(path)
            raise ValueError(
                f"tree path {list(path)} is {d} deep > MAX_TREE_DEPTH={MAX_TREE_DEPTH}; shorten it"
            )
        if tuple(path) in seen:
            raise ValueError(f"tree path {list(path)} appears twice; list each node once")
        seen.add(tuple(path))
    ordered = tuple(sorted(seen, key=lambda p: (len(p), p)))
    for path in ordered:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(
                f"tree path {list(path)} has no parent: add {list(path[:-1])} "
                "(every prefix of a path must be a path)"
            )
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
            raise ValueError(
                f"tree path {list(path)} skips a sibling: add {list(path[:-1]) + [path[-1] - 1]} "
                "(sibling ranks must be 0..k-1 without gaps)"
            )
    return ordered


def paths_to_parents(paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """(parents incl. root, ranks) of the tree given by `paths`, nodes in (len, path) order."""
    ordered = canonical_paths(paths)
    index = {(): 0} | {path: i + 1 for i, path in enumerate(ordered)}
    parents = [-1] + [index[path[:-1]] for path in ordered]
    ranks = [0] + [path[-1] for path in ordered]
    return parents, ranks


@functools.lru_cache(maxsize=64)
def _cached_parents(paths: tuple[Path, ...]) -> tuple[int, ...]:
    return tuple(paths_to_parents(list(paths))[0])


# ----------------------------------------------------------------------------- specs

TreeKind = Literal["paths", "static", "dynamic", "lookup"]


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f"{lo} <= {name} <= {hi}" if hi is not None else f"{name} >= {lo}"
        raise ValueError(f"{name} = {value!r} is out of range, need an integer with {bound}")


def _check_paths_spec(spec: TreeSpec) -> None:
    if spec.paths is None or spec.num_nodes is not None or spec.depth is not None:
        raise ValueError(
            "a 'paths' tree spec takes `paths` only (num_nodes/depth belong to static/dynamic)"
        )
    object.__setattr__(spec, "paths", canonical_paths(spec.paths))


def _check_static_spec(spec: TreeSpec) -> None:
    if spec.paths is not None or spec.depth is not None:
        raise ValueError(
            "a 'static' tree spec takes `num_nodes` only; its shape comes from acceptance rates"
        )
    _check_int("NODES", spec.num_nodes, 1, MAX_TREE_NODES)


def _check_dynamic_spec(spec: TreeSpec) -> None:
    if spec.paths is not None:
        raise ValueError("a 'dynamic' tree spec takes num_nodes, depth and topk, not paths")
    _check_int("NODES", spec.num_nodes, 1, MAX_TREE_NODES)
    _check_int("DEPTH", spec.depth, 1, MAX_TREE_DEPTH)
    _check_int("TOPK", spec.topk, 1, None)
    if spec.depth > spec.num_nodes:
        n = spec.num_nodes
        raise ValueError(f"DEPTH = {spec.depth} > NODES = {n}: {n} nodes reach depth {n} at most")
    explored = spec.topk + (spec.depth - 1) * spec.topk**2  # candidates EAGLE-2 drafts in total
    if spec.num_nodes > explored:
        raise ValueError(
            f"NODES = {spec.num_nodes} > {explored} candidates explored with DEPTH = {spec.depth}, "
            f"TOPK = {spec.topk}; lower NODES or raise DEPTH/TOPK"
        )


def _format_paths(spec: TreeSpec) -> str:
    if spec.paths == tuple((0,) * d for d in range(1, len(spec.paths) + 1)):
        return f"chain:{len(spec.paths)}"
    return json.dumps([list(p) for p in spec.paths], separators=(",", ":"))


def _format_dynamic(spec: TreeSpec) -> str:
    topk = "" if spec.topk == DEFAULT_TOPK else f",{spec.topk}"
    return f"dynamic:{spec.num_nodes},{spec.depth}{topk}"


def _check_lookup_spec(spec: TreeSpec) -> None:
    if spec.paths is not None or spec.num_nodes is not None or spec.depth is not None:
        raise ValueError("a 'lookup' tree spec takes its lookup budget only (no head tree)")
    if spec.lookup == 0:
        raise ValueError("'lookup:N' needs N >= 1 lookup nodes")


_SPEC_KINDS: dict[str, tuple[Callable[[TreeSpec], None], Callable[[TreeSpec], str]]] = {
    "paths": (_check_paths_spec, _format_paths),
    "static": (_check_static_spec, lambda s: f"static:{s.num_nodes}"),
    "dynamic": (_check_dynamic_spec, _format_dynamic),
    "lookup": (_check_lookup_spec, lambda s: ""),
}


@dataclass(frozen=True)
class TreeSpec:
    """What the user asked for; validated on construction (paths are stored canonically ordered)."""

    kind: TreeKind  # chain:K is kind="paths" with a chain
    paths: tuple[Path, ...] | None = None
    num_nodes: int | None = None  # node budget excluding the root (static/dynamic)
    depth: int | None = None  # depth limit (dynamic)
    topk: int = DEFAULT_TOPK  # branching per expansion (dynamic)
    lookup: int = 0  # prompt-lookup nodes grafted into the tree (kind "lookup": lookup alone)

    def __post_init__(self) -> None:
        if self.kind not in _SPEC_KINDS:
            raise ValueError(
                f"tree spec kind {self.kind!r} unknown, use one of {sorted(_SPEC_KINDS)}"
            )
        _check_int("lookup N", self.lookup, 0, MAX_TREE_NODES)
        _SPEC_KINDS[self.kind][0](self)
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(
                f"{self.head_nodes} head nodes + {self.lookup} lookup nodes = {self.max_nodes} > "
                f"MAX_TREE_NODES = {MAX_TREE_NODES}; lower one of them"
            )

    def to_string(self) -> str:
        """The spec as a string that `parse_tree_spec` turns back into an equal spec."""
        head = _SPEC_KINDS[self.kind][1](self)
        return "+".join(p for p in (head, f"lookup:{self.lookup}" if self.lookup else "") if p)

    @property
    def has_head(self) -> bool:
        """False for 'lookup:N' alone (no draft head runs)."""
        return self.kind != "lookup"

    @property
    def head_spec(self) -> TreeSpec:
        """The head's part (this spec without lookup nodes); only for specs with a head."""
        if not self.has_head:
            raise ValueError(f"tree {self.to_string()!r} has no head part")
        return self if not self.lookup else dataclasses.replace(self, lookup=0)

    @property
    def head_nodes(self) -> int:
        if not self.has_head:
            return 0
        return len(self.paths) if self.kind == "paths" else self.num_nodes

    @property
    def max_nodes(self) -> int:
        """The most nodes (root excluded) a tree drafted from this spec can have."""
        return self.head_nodes + self.lookup

    @property
    def chain_nodes(self) -> int | None:
        """K when every tree drafted from this spec is a chain of K head nodes and no lookup
        nodes (chain:K, dynamic:K,K,1, a one-node static or dynamic tree), else None. Drafts of
        these shapes at T > 0 are drawn from the head's q and verified against q
        (heads.sampling.draft_chains / verify_chain), in chain and in tree mode alike."""
        if self.lookup or not self.has_head:
            return None
        if self.kind == "paths":
            return len(self.paths) if self.is_chain else None
        if self.num_nodes == 1 or (self.kind == "dynamic" and self.topk == 1):
            return self.num_nodes  # dynamic topk 1: DEPTH == NODES (checked), one path
        return None

    @property
    def is_fixed(self) -> bool:
        """A head shape fixed before drafting (paths, static): at T > 0 its nodes are drawn from
        the head's q (heads.sampling.draft_sampled_trees). EAGLE-2 (dynamic) trees choose their
        shape from what they drafted, and draft the top-ranked tokens (one-hot proposals)."""
        return self.kind in ("paths", "static")

    @property
    def is_chain(self) -> bool:
        """True for chain:K (one child per node), which plain chain verification handles.
        Lookup branches make any spec a tree (they may branch off the head's chain)."""
        return (self.kind == "paths" and not self.lookup
                and all(not any(p) for p in self.paths))


def _chain(args: list[int]) -> TreeSpec:
    _check_int("K", args[0], 1, MAX_TREE_DEPTH)
    return TreeSpec("paths", paths=tuple((0,) * d for d in range(1, args[0] + 1)))


def _dynamic(args: list[int]) -> TreeSpec:
    topk = args[2] if len(args) == 3 else DEFAULT_TOPK
    return TreeSpec("dynamic", num_nodes=args[0], depth=args[1], topk=topk)


# name -> (accepted argument counts, builder) for "name:INT[,INT...]" specs
_SPEC_PARSERS: dict[str, tuple[tuple[int, ...], Callable[[list[int]], TreeSpec]]] = {
    "chain": ((1,), _chain),
    "static": ((1,), lambda args: TreeSpec("static", num_nodes=args[0])),
    "dynamic": ((2, 3), _dynamic),
}


def _parse_ints(name: str, rest: str, counts: tuple[int, ...]) -> list[int]:
    try:
        args = [int(a) for a in rest.split(",")]
    except ValueError:
        raise ValueError(f"{rest!r} is not a comma-separated list of integers") from None
    if len(args) not in counts:
        raise ValueError(f"'{name}:' takes {' or '.join(map(str, counts))} integers, got {len(args)}")
    return args


def _parse_lookup(part: str) -> int:
    name, sep, rest = part.strip().partition(":")
    if name != "lookup" or not sep:
        raise ValueError(f"unknown suffix {part!r}: the only suffix is '+lookup:N'")
    (n,) = _parse_ints("lookup", rest, (1,))
    _check_int("lookup N", n, 1, MAX_TREE_NODES)
    return n


def parse_tree_spec(s: str) -> TreeSpec:
    """Parse "chain:K", a JSON list of paths, "static:NODES" or "dynamic:NODES,DEPTH[,TOPK]",
    each optionally followed by "+lookup:N", or "lookup:N" alone."""
    if not isinstance(s, str):
        raise ValueError(
            f"tree spec must be a string, got {type(s).__name__}; accepted forms: {SPEC_FORMS}"
        )
    try:
        head, *suffixes = s.strip().split("+")
        if len(suffixes) > 1:
            raise ValueError("at most one '+lookup:N' suffix")
        lookup = _parse_lookup(suffixes[0]) if suffixes else 0
        if head.strip().startswith("lookup:"):
            if suffixes:
                raise ValueError("'lookup:N' alone takes no suffix")
            return TreeSpec("lookup", lookup=_parse_lookup(head))
        spec = _parse_head_spec(head.strip())
        return dataclasses.replace(spec, lookup=lookup) if lookup else spec
    except ValueError as e:
        raise ValueError(f"bad tree spec {s!r}: {e}; accepted forms: {SPEC_FORMS}") from None


def _parse_head_spec(text: str) -> TreeSpec:
    if text.startswith("["):
        try:
            paths = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON ({e.msg} at char {e.pos})") from None
        return TreeSpec("paths", paths=paths)
    name, sep, rest = text.partition(":")
    if not sep or name not in _SPEC_PARSERS:
        raise ValueError(f"unknown tree kind {name!r}" if sep else "not a known form")
    counts, build = _SPEC_PARSERS[name]
    return build(_parse_ints(name, rest, counts))


# ----------------------------------------------------------------------------- static trees


def _check_rates(rates: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    try:
        table = tuple(tuple(float(r) for r in row) for row in rates)
    except (TypeError, ValueError):
        raise ValueError("acceptance_rates must be a table rates[depth][rank] of floats") from None
    if not table or any(not row for row in table):
        raise ValueError("acceptance_rates must have at least one depth and one rank per depth")
    if any(not 0.0 <= r <= 1.0 for row in table for r in row):
        raise ValueError("acceptance_rates are probabilities: every rate must be in [0, 1]")
    return table


def _path_value(path: Path, rates: tuple[tuple[float, ...], ...]) -> float:
    value = 1.0
    for d, k in enumerate(path):
        if d >= len(rates) or k >= len(rates[d]):
            where = f"depth {d + 1}, rank {k}"
            raise ValueError(
                f"tree path {list(path)} is beyond the rate table ({where}); extend it"
            )
        value *= rates[d][k]
    return value


def expected_acceptance_length(
    paths: Sequence[Sequence[int]], rates: Sequence[Sequence[float]]
) -> float:
    """E[tokens per step] = 1 (the target's bonus token) + sum over nodes of path products.

    A node's product of rates along its path is P(every token on it is accepted), taking the
    per-depth, per-rank acceptance events as independent (the model Medusa's tree search uses).
    """
    table = _check_rates(rates)
    return 1.0 + sum(_path_value(p, table) for p in canonical_paths(paths))


def build_static_paths(
    acceptance_rates: Sequence[Sequence[float]], num_nodes: int
) -> list[list[int]]:
    """Medusa-style greedy tree of `num_nodes` nodes maximising `expected_acceptance_length`.

    acceptance_rates[d][k] = P(rank-k candidate accepted at depth d+1 | parent accepted).
    A candidate is the next free rank under an existing node (rank = its current number of
    children, keeping sibling ranks contiguous); its value is the product of rates along its path.
    Repeatedly add the most valuable candidate (ties -> shorter, then smaller path).
    Why greedy is optimal when rates are <= 1 and non-increasing in rank: a child is worth at most
    its parent and a sibling at most its left neighbour, so the top-`num_nodes` values form a valid
    tree, which is what greedy picks. For other tables it is a good heuristic, not an optimum.
    """
    table = _check_rates(acceptance_rates)
    _check_int("num_nodes", num_nodes, 1, MAX_TREE_NODES)
    value: dict[Path, float] = {(): 1.0}
    heap: list[tuple[float, int, Path]] = []  # (-value, depth, path)

    def push(path: Path) -> None:
        d, k = len(path) - 1, path[-1]
        if d < min(len(table), MAX_TREE_DEPTH) and k < len(table[d]):
            heapq.heappush(heap, (-value[path[:-1]] * table[d][k], len(path), path))

    push((0,))
    chosen: list[Path] = []
    while len(chosen) < num_nodes:
        if not heap:
            n = len(chosen)
            raise ValueError(
                f"the rate table allows only {n} nodes < {num_nodes}; add ranks/depths"
            )
        neg, _, path = heapq.heappop(heap)
        value[path] = -neg
        chosen.append(path)
        push(path + (0,))  # first child
        push(path[:-1] + (path[-1] + 1,))  # next sibling
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


@functools.lru_cache(maxsize=32)
def _static_parents(rates: tuple[tuple[float, ...], ...], num_nodes: int) -> tuple[int, ...]:
    return tuple(paths_to_parents(build_static_paths(rates, num_nodes))[0])


# ----------------------------------------------------------------------------- drafting


@dataclass
class DraftTree:
    tokens: Tensor  # [N+1] long, tokens[0] = root token
    parents: Tensor  # [N+1] long, parents[0] = -1
    logprobs: Tensor  # [N+1] float, draft log-prob of the token given its parent (0 for root)

    def buffers(self) -> TreeBuffers:
        return tree_buffers(self.parents, device=self.parents.device)

    def children(self, i: int) -> list[int]:
        """Children of node i, in draft order."""
        return (self.parents == i).nonzero().flatten().tolist()


class GrowingTree:
    """The tree so far, handed to an expander at each level of drafting: token, parent and
    log-prob lists (what a batched expander reads: `EagleSession` takes `token_list` and
    `parent_list`), DraftTree's tensors built only when read (another expander's `expand`).
    Building three tensors per tree and level cost ~0.1 ms a request in a batch-16 step."""

    def __init__(self, tokens: list[int], parents: list[int], logprobs: list[float],
                 device: Device) -> None:
        self.token_list, self.parent_list, self.logprob_list = tokens, parents, logprobs
        self.device = device

    @functools.cached_property
    def tokens(self) -> Tensor:
        return torch.tensor(self.token_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def parents(self) -> Tensor:
        return torch.tensor(self.parent_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def logprobs(self) -> Tensor:
        return torch.tensor(self.logprob_list, dtype=torch.float32, device=self.device)

    def buffers(self) -> TreeBuffers:
        return tree_buffers(self.parent_list, device=self.device)

    def children(self, i: int) -> list[int]:
        return [j for j, p in enumerate(self.parent_list) if p == i]


class Expander(Protocol):
    def expand(self, tree: DraftTree, nodes: list[int]) -> Tensor:
        """Log-probs [len(nodes), V] of each listed node's next token (its children)."""
        ...

    # Optional: expand_topk(tree, nodes, k) -> (log-probs [N, k], token ids [N, k]), descending,
    # equal to expand(tree, nodes).topk(k); draft_tree uses it when present.


def _make_tree(
    tokens: list[int], parents: list[int], logprobs: list[float], device: Device
) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        logprobs=torch.tensor(logprobs, dtype=torch.float32, device=device),
    )


def _expand_topk(
    expander: Expander, tree: DraftTree, nodes: list[int], k: int
) -> tuple[list, list]:
    """Top-k (log-probs, tokens) per listed node, descending: two [len(nodes), k] lists.

    An expander may offer `expand_topk(tree, nodes, k)` with the same result, computed faster
    (EagleSession: over its reduced draft vocabulary only).
    """
    fast = getattr(expander, "expand_topk", None)
    if fast is not None:
        values, tokens = fast(tree, nodes, k)
        return values.tolist(), tokens.tolist()
    logp = expander.expand(tree, nodes)  # [len(nodes), V]
    if logp.dim() != 2 or logp.shape[0] != len(nodes):
        shape = tuple(logp.shape)
        raise ValueError(f"expander returned {shape}, expected [{len(nodes)}, V]: a row per node")
    if k > logp.shape[1]:
        raise ValueError(f"cannot draft {k} distinct children from a vocabulary of {logp.shape[1]}")
    values, tokens = logp.float().topk(k, dim=-1)
    return values.tolist(), tokens.tolist()


def fixed_parents(spec: TreeSpec, rates: Sequence[Sequence[float]] | None) -> tuple[int, ...]:
    """The shape of a paths or static spec (static: from `rates`, default
    DEFAULT_ACCEPTANCE_RATES): parents, depth-ordered, siblings in rank order."""
    if spec.kind == "paths":
        return _cached_parents(spec.paths)
    table = _check_rates(DEFAULT_ACCEPTANCE_RATES if rates is None else rates)
    return _static_parents(table, spec.num_nodes)


def fixed_steps(root_token: int, parents: Sequence[int], device: Device):
    """Fill a fixed shape level by level: the rank-r child of a node gets entry r of the node's
    answer (top-k: the parent's (r+1)-th most likely token; heads.sampling.draft_sampled_trees:
    its r-th draw without replacement).

    A generator (see `draft_trees`): yields (tree so far, nodes to expand, k), receives their
    top-k (log-probs, tokens) lists, returns the DraftTree."""
    n = len(parents)
    depths, children = [0] * n, [[] for _ in range(n)]
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        children[parents[i]].append(i)  # in rank order: nodes are in (len, path) order
    tokens, logprobs = [root_token] + [-1] * (n - 1), [0.0] * n
    for d in range(max(depths)):
        created = sum(1 for x in depths if x <= d)  # depth-sorted: levels <= d are a prefix
        level = [i for i in range(created) if depths[i] == d and children[i]]  # no leaves
        tree = GrowingTree(tokens[:created], list(parents[:created]), logprobs[:created], device)
        values, toks = yield tree, level, max(len(children[i]) for i in level)
        for row, node in enumerate(level):
            for rank, child in enumerate(children[node]):
                tokens[child], logprobs[child] = toks[row][rank], values[row][rank]
    return _make_tree(tokens, list(parents), logprobs, device)


def _dynamic_steps(root_token: int, spec: TreeSpec, device: Device):
    """EAGLE-2: expand the top-k nodes of each level by cumulative log-prob, keep the best NODES.

    A generator, as `fixed_steps`."""
    k, budget = spec.topk, spec.num_nodes
    tokens, parents, logprobs, scores = [root_token], [-1], [0.0], [0.0]  # pool, creation order
    frontier = [0]
    for level in range(spec.depth):
        tree = GrowingTree(list(tokens), list(parents), list(logprobs), device)
        values, toks = yield tree, frontier, k
        if max(row[0] for row in values) > 1e-3:
            raise ValueError(
                "expander returned log-probs > 0: return log_softmax of the draft logits"
            )
        new = []
        for row, node in enumerate(frontier):
            for v, t in zip(values[row], toks[row], strict=True):
                v = min(v, 0.0)  # log_softmax rounding
                new.append(len(tokens))
                tokens.append(t)
                parents.append(node)
                logprobs.append(v)
                scores.append(scores[node] + v)
        if level + 1 == spec.depth:
            break
        frontier = sorted(new, key=lambda i: (-scores[i], i))[:k]
        # Nodes created later score <= their frontier parent (log-probs <= 0) and lose ties (later
        # index), so once `budget` nodes score >= the best frontier node the selection is final.
        if sum(1 for s in scores[1:] if s >= scores[frontier[0]]) >= budget:
            break
    # Top-budget by (score desc, creation order) is ancestor-closed: a parent scores >= its child
    # and was created before it.
    keep = sorted(sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget])
    path: dict[int, Path] = {0: ()}
    taken = [0] * len(tokens)  # selected children per node; siblings were made in draft order
    for i in keep:
        path[i] = path[parents[i]] + (taken[parents[i]],)
        taken[parents[i]] += 1
    order = [0] + sorted(keep, key=lambda i: (len(path[i]), path[i]))
    new_id = {old: new for new, old in enumerate(order)}
    return _make_tree(
        [tokens[i] for i in order],
        [-1] + [new_id[parents[i]] for i in order[1:]],
        [logprobs[i] for i in order],
        device,
    )


def draft_tree(
    root_token: int,
    expander: Expander,
    spec: TreeSpec,
    acceptance_rates: Sequence[Sequence[float]] | None = None,
    device: Device = None,
) -> DraftTree:
    """Draft a token tree below `root_token` with `expander`, shaped by `spec`.

    paths/static: fixed shape (static from `acceptance_rates`, default DEFAULT_ACCEPTANCE_RATES),
    filled level by level with the top-(rank+1) tokens of each parent's draft distribution.
    dynamic: EAGLE-2 (see `_dynamic_steps`). One `expander.expand` call per level, leaves never
    expanded. The result is topologically ordered with siblings in draft order, on `device`.
    """
    return draft_trees([(root_token, expander)], spec, acceptance_rates, device)[0]


def draft_trees(
    jobs: Sequence[tuple[int, Expander]],
    spec: TreeSpec,
    acceptance_rates: Sequence[Sequence[float]] | None = None,
    device: Device = None,
) -> list[DraftTree]:
    """`draft_tree` for several (root_token, expander) pairs (one per request), in lockstep.

    Each level of every tree is one expansion; when all expanders are of one class that offers
    `topk_lists_many(items)` (EagleSession), a level of ALL trees is one call (one packed head
    forward and one LM-head matmul for every request of a serving step), else one call each.
    The trees are those `draft_tree` makes one by one."""
    steps = []
    for root, _ in jobs:
        root = int(root)
        steps.append(_dynamic_steps(root, spec, device) if spec.kind == "dynamic" else
                     fixed_steps(root, fixed_parents(spec, acceptance_rates), device))
    return in_lockstep(steps, lambda live: _expand_many([(jobs[i][1], *ask) for i, ask in live]))


def in_lockstep(steps: Sequence, answer) -> list:
    """Run drafting generators (`fixed_steps`, `_dynamic_steps`: each yields what it asks for,
    receives the answer, returns its tree) together, one round per tree level: `answer(live)`
    takes the (index, ask) pairs of the generators still running and returns their answers in
    that order (one batched expansion for all of them). The generators' results, in order."""
    out: list = [None] * len(steps)
    asks: list = [None] * len(steps)

    def advance(i: int, reply) -> None:
        try:
            asks[i] = steps[i].send(reply)
        except StopIteration as stop:
            out[i], asks[i] = stop.value, None

    for i in range(len(steps)):
        advance(i, None)
    while live := [(i, ask) for i, ask in enumerate(asks) if ask is not None]:
        for (i, _), reply in zip(live, answer(live), strict=True):
            advance(i, reply)
    return out


def _expand_many(items: list[tuple]) -> list[tuple[list, list]]:
    """Top-k (log-probs, tokens) lists per item (expander, tree, nodes, k)."""
    many = batched([e for e, *_ in items], "topk_lists_many")
    if many is None:
        return [_expand_topk(*item) for item in items]
    return many(items)
