"""`TreeDraftProposer`: a treedraft head drafting inside vLLM's V1 runner (worker process).

vLLM builds it as a `custom_class` proposer (plugin/config.py rewrites the user's
`--speculative-config`). It is a thin adapter: the head, its per-request draft session and the
tree drafting are `treedraft.heads` code, unchanged; this class only maps vLLM's per-step batch
(scheduled rows, hidden states, sampled tokens) onto one session per request.

Per request and step (rows are this step's scheduled tokens, starting at position c):
- collect the pairs (target features of row j, token at position c+j+1) for every row whose
  next token is now known: all rows of a prefill chunk, root + accepted drafts of a decode step;
  they wait in the request's `pairs.PendingPairs` until it drafts (a step that drafts
  nothing for a request, e.g. `"tree": "auto"` choosing 0, runs no head forward for it);
- draft a tree (or chain) below the last sampled token and return its tokens in node order.
Both run batched across the step's drafting requests: their commits in one packed head
forward, each tree level of all requests in one more (`EagleSession.commit_many`/`expand_topk_many` through
`heads.common.commit_sessions` and `heads.lookup.draft_hybrids`); attention stays per request,
against that request's own in-place head KV cache.
  Chains of requests that sample (T > 0) draw each token from the head's distribution q under
  the request's temperature/top-k/top-p (`heads.sampling.draft_chains`, one head forward per
  level for all of them, over the draft vocabulary): in chain mode q goes to vLLM's rejection
  sampler as draft probabilities (`last_draft_probs`); in tree mode, where a step's spec drafts
  chains (`TreeSpec.chain_nodes`: "auto" at a budget of one node, dynamic:K,K,1), and under
  "auto" for every sampled request that grafts no lookup (its n head nodes as one chain), q stays
  with the chain (`chain_q`) and plugin/sampler.verify_trees verifies it against q. Greedy
  requests and branching trees draft the top-ranked tokens (q one-hot, vLLM's default).

Trees with lookup nodes ('+lookup:N'; 'lookup:N' alone runs no head) keep one incremental
`heads.lookup.LookupIndex` per request over its token history (prompt + output, vLLM's
`token_ids_cpu`), and graft its proposals into the head's tree (`heads.lookup.draft_hybrid`).
Under `"tree": "auto"` with lookup nodes (the default when only the head is named), each request
grafts its lookup proposal or not as `heads.cost.BudgetPolicy.graft` says from what proposals of
its match length earned, on the head's tree of the step's budget or alone (budget 0: no head
forward at all).

vLLM's `num_speculative_tokens_per_batch_size` schedule (scheduler_output.
num_spec_tokens_to_schedule) is the node budget of the step: chains are drafted that deep, other
trees are cut to their first nodes (a prefix of a topologically ordered tree is a tree), and at 0
nothing is drafted (the head still reads the step's hidden states, so it keeps its context).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict, deque

import numpy as np
import torch
from vllm.logger import init_logger

from treedraft.heads.common import commit_sessions
from treedraft.heads.lookup import (
    DEFAULT_MAX_N,
    DEFAULT_MIN_N,
    HEAD,
    LOOKUP,
    SOURCES,
    HybridTree,
    LookupIndex,
    accepted_by_source,
    draft_hybrids,
)
from treedraft.heads.sampling import draft_chains
from treedraft.heads.tree import MAX_TREE_DEPTH, DraftTree, parse_tree_spec

from .config import KEY
from .pairs import PairLog, PendingPairs
from .sampler import request_unsupported

logger = init_logger("vllm.treedraft")
# "tree": "auto": positions a step's catch-up commits test the head on, teacher-forced, shared
# by its requests (one draft-LM-head row each, at least one per request): a steadier acceptance
# estimate than the few steps it explores, at a bounded cost (32 checks of each of 32 requests
# were ~100 ms per exploration at batch 32)
TEACHER_CHECKS = 32
LOOKUP_MATCHES = range(DEFAULT_MIN_N, DEFAULT_MAX_N + 1)  # a LookupIndex's match lengths


def target_weights(model, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head [V, H] (vLLM pads vocab rows: sliced to V)."""
    inner = getattr(model, "model", None)
    embed = getattr(getattr(inner, "embed_tokens", None), "weight", None)
    lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
    if embed is None or lm_head is None:
        raise RuntimeError(
            f"treedraft cannot find the embeddings (model.embed_tokens) and LM head (lm_head) of "
            f"{type(model).__name__}; only decoder LMs laid out like vLLM's Llama are supported"
        )
    return embed[:vocab_size], lm_head[:vocab_size]


class AutoBudget:
    """`"tree": "auto"` inside the engine: `heads.cost.BudgetPolicy` (each step's node budget
    from the engine's measured step cost and the head's observed acceptance) fed with this
    engine's steps: their wall time, rows by kind (scheduler_output) and what the drafts of the
    step before earned. Logs its choices (rank 0, at most every 10 s while they change)."""

    # budgets up to this many head nodes draft a chain of the head's top tokens, larger ones
    # the head's tree: on a 2-core CPU a branching tree's rows cost more than they earn at small
    # budgets (batch 1, T=0, MT-bench x 256, with lookup:4: dynamic:3,3,3 0.864x and chain:3
    # 0.978x of chain:2; dynamic:2,2,2 0.961x; `treedraft bench`), and `auto` chose 3-4-node trees
    # most of the time. Sampled requests draw chains from q at any budget (`auto_chain_depth`).
    CHAIN_MAX = 4

    def __init__(self, spec, chain_max: int = CHAIN_MAX) -> None:
        from treedraft.heads.cost import BudgetPolicy

        self.spec = spec
        self.chain_max = chain_max  # a head that drafts shallower (Medusa) lowers it
        self.policy = BudgetPolicy({0: 1.0, spec.head_nodes: 1.0}, lookup=bool(spec.lookup))
        self._start: float | None = None  # when this step's execute_model began
        self._last_drafting = 0.0  # seconds of the last step's drafting phase
        self._last_prefill = False  # the last step scheduled prefill rows
        self._last_end: float | None = None
        self._gaps: deque[float] = deque(maxlen=32)
        self._drafted: dict[str, int] = {}  # req_id -> head nodes drafted for it last step
        # req_id -> (match length, lookup-only nodes) of the lookup it grafted last step
        self._grafted: dict[str, tuple[int, int]] = {}
        self._sampling: set[str] = set()  # requests of last step that sample (T > 0)
        self._chain = True  # the head's drafts of last step were a chain
        self._logged: tuple[int, int] | None = None
        self._log_at = 0.0
        self._fitted = False
        self.explorations = 0
        # the step `choose` planned last explores: its requests graft no lookup, so the head is
        # observed at positions with a lookup match too (else only where none matched, the
        # harder text: at T=1 a run's first 14 explorations accepted 2 nodes where steady
        # drafting accepted 0.42 a node, and held it at 0 head nodes for 98 % of its steps)
        self.exploring = False
        self.teacher_checks = 0  # positions the head was tested on, teacher-forced
        # what auto did, per kind of step (`tally`): "plain" (nothing drafted), "head" (head
        # nodes), "lookup" (grafted lookup alone), "explore"; steps and seconds (the worker's
        # step, catch-up included, by what it decided to draft for the next)
        self.steps: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.nodes: dict[int, int] = defaultdict(int)  # "head" steps by head nodes per request
        self.beside_steps = 0  # "head" steps in which some request grafted lookup beside it
        # the outcome guard (heads.cost.OutcomeGuard): the key and arm (True: the policy chose)
        # of this step's drafting (None: no decision, nothing could draft), last step's, and
        # the tokens the step being finished gave (`observe`)
        self._arm: tuple | None = None
        self._last_arm: tuple | None = None
        self._tokens = 0
        self.held = 0  # steps the guard held plain (nothing drafted where the policy might have)

    def set_rates(self, rates) -> None:
        from treedraft.heads.cost import BudgetPolicy, expected_lengths
        from treedraft.heads.tree import DEFAULT_ACCEPTANCE_RATES

        rates = rates or DEFAULT_ACCEPTANCE_RATES
        chain = self.spec.head_spec.is_chain
        table = expected_lengths(rates, self.spec.head_nodes, chain=chain)
        if not chain:  # budgets up to chain_max draft chains (`TreeDraftProposer.spec_for`)
            short = expected_lengths(rates, min(self.chain_max, self.spec.head_nodes), chain=True)
            table.update({n: e for n, e in short.items() if n <= self.chain_max})
        self.policy = BudgetPolicy(table, lookup=bool(self.spec.lookup))

    def observe(self, sampled: dict[str, int], accepted: dict | None = None,
                sources: dict | None = None) -> None:
        """sampled: req_id -> tokens this step gave the request (1 + accepted drafts);
        accepted / sources (tree mode): the accepted node ids and the HEAD/LOOKUP bits of the
        trees verified this step, which split what the head earned from what lookup did.

        The head's acceptance is observed on requests that grafted no lookup: where lookup was
        grafted, the head's nodes it agreed with would have been accepted without them, and
        counted for the head they made more head nodes look worth drafting (SmolLM2 at batch
        1: two nodes measured x1.32 of the table where one measured x0.80)."""
        self._tokens = sum(sampled.values())
        table = self.policy.table
        # (temperature class: greedy / sampled, budget of the head's table) -> extra tokens
        expected, observed = defaultdict(float), defaultdict(float)
        shorter = defaultdict(lambda: [0.0, 0.0])  # budget -> [expected, observed] extra tokens
        for req_id in {*self._drafted, *self._grafted}:
            if sampled.get(req_id, 0) < 1:
                continue
            got, cls = sampled[req_id] - 1, req_id in self._sampling
            if req_id in self._grafted:  # lookup: the tokens its lookup-only nodes gave
                path, src = (accepted or {}).get(req_id), (sources or {}).get(req_id)
                bits = [int(src[a]) for a in path] if path is not None and src is not None else []
                match, nodes = self._grafted[req_id]
                self.policy.observe_lookup(match, nodes, bits.count(LOOKUP), sampled=cls)
                drafted = self._drafted.get(req_id, 0)
                if (path is not None and src is not None and not cls and self._chain
                        and drafted <= self.chain_max):
                    # greedy, a head chain (or none) beside the lookup: what each head budget up
                    # to the one drafted would have given here (heads.cost.HeadBesideLookup)
                    self.policy.observe_beside(drafted, sum(1 for b in bits if b & HEAD),
                                               sum(1 for b in bits if b & LOOKUP))
            elif n := self._drafted.get(req_id, 0):  # the head alone drafted its tree
                key = (cls, max(b for b in table if b <= n))
                expected[key] += table[key[1]] - 1.0
                observed[key] += got
                if cls:  # a sampled request's chain, drawn from q: per depth (ChainRates)
                    self.policy.observe_chain(n, got)
                if not cls and self._chain and n <= self.chain_max:  # a greedy chain: m < n
                    for m in table:  # nodes are its prefix and would have got min(got, m)
                        if 1 <= m < key[1]:
                            shorter[m][0] += table[m] - 1.0
                            shorter[m][1] += min(got, m)
        for (cls, budget), e in expected.items():
            self.policy.observe(e, observed[(cls, budget)], sampled=cls, budget=budget)
        for budget, (e, o) in shorter.items():  # budgets compared on the same steps (at batch 1
            # the factors of budgets 1-4, each read on the steps that drafted it, came out as
            # 1 x0.98, 2 x0.57, 3 x0.52, 4 x0.83: a 4-node chain, measured elsewhere in the
            # replies, looked better than 3)
            self.policy.observe(e, o, budget=budget, drafted=False)

    @property
    def drafted(self) -> dict[str, int]:
        """req_id -> nodes drafted for it last step (requests that drafted)."""
        return self._drafted

    def observe_teacher(self, hits: int, checked: int) -> None:
        """`checked` positions of greedy requests where the head's first draft, teacher-forced,
        would have been the target's token `hits` times: observed as that many one-node drafts
        (a sampled request accepts a draft with the target's probability of it, which an argmax
        hit does not measure: its class learns from its verified drafts only)."""
        if checked and 1 in self.policy.table:
            self.policy.observe(checked * (self.policy.table[1] - 1.0), float(hits), budget=1)
            self.teacher_checks += checked

    def allows(self, batch: int, sampled: int = 0) -> bool:
        """Whether the policy chooses this step's drafts (`choose`, grafts) for `batch` drafting
        requests, `sampled` of them sampling; False: the outcome guard holds the step plain
        (heads.cost.OutcomeGuard), nothing is drafted."""
        key = (batch, 2 * sampled > batch)
        arm = self.policy.guard.allows(key)
        self._arm = (key, arm)
        self.held += not arm
        return arm

    def choose(self, batch: int, sampled: int = 0, held: bool = False
               ) -> tuple[int, int | None]:
        """(head node budget, how many of the `batch` requests draft: None for all; an
        exploration from drafting nothing drafts for `BudgetPolicy.EXPLORE_REQUESTS` of them),
        `sampled` of the requests sampling (T > 0); then `policy.graft(match length, sampled)`
        per request: whether its lookup nodes are grafted. `held`: `allows` said no; the step
        drafts only where the policy explores (`BudgetPolicy.choose`), and such a step is no
        arm's for the outcome guard."""
        n, explored = self.policy.choose(batch, sampled, held=held)
        self.explorations += explored
        self.exploring = bool(explored)
        if held and explored:
            self._arm = None
        now = time.monotonic()
        fitted = self.policy.model.knows_drafting and self.policy.model.fit() is not None
        # the first choice from measured drafting cost is logged at the first step that does
        # not explore (when the model first knew drafting at an exploration, the line was lost)
        first = fitted and not self._fitted
        if not explored and not held and (first or ((batch, n) != self._logged
                                                    and now - self._log_at > 10)) and _tp_rank0():
            self._fitted |= fitted
            coef = self.policy.model.coefficients
            logger.info(
                "treedraft auto: %d drafting requests (%d sampling) -> %d nodes each%s (expected "
                "%.2f tokens per request-step, acceptance x%.2f of the head's table (greedy "
                "x%.2f, sampled x%.2f; per nodes drafted: greedy %s, sampled %s); step ~ %.1f "
                "ms + %.2f ms/decode row + %.2f ms/prefill row + %.2f ms/verified draft + %.2f "
                "ms/drafted node + %.2f ms/verifying request; %d steps measured, %d explored, "
                "%d positions checked teacher-forced; step ms measured at this batch by head "
                "nodes: %s, beside lookup: %s (a lookup row %.2f ms); so far: %s)",
                batch, sampled, n, self._lookup_said(), self.policy.lengths()[n],
                self.policy.kappa(), *(a.kappa for a in self.policy.acceptance),
                *(a.said() for a in self.policy.acceptance),
                *(1e3 * c for c in coef), len(self.policy.model.samples), self.explorations,
                self.teacher_checks, " ".join(
                    f"{k}:{1e3 * v:.1f}" for k, v in sorted(self.policy.measured(batch).items())
                ) or "-", " ".join(
                    f"{k}:{1e3 * c[0]:.1f}" for k in sorted(self.policy.table)
                    if (c := self.policy.beside_cost(batch, k)) is not None) or "-",
                1e3 * self.policy.lookup_row_price(batch), self.tally())
            self._logged, self._log_at = (batch, n), now
        return n, self.policy.explorers(batch, explored)

    def _lookup_said(self) -> str:
        from treedraft.heads.cost import GREEDY, SAMPLED

        lookup = self.policy.lookup
        return "" if lookup is None else (f" (+ lookup where it pays: greedy "
                                          f"{lookup[GREEDY].said()}; sampled "
                                          f"{lookup[SAMPLED].said()}; greedy tokens beside it "
                                          f"by head nodes {self.policy.beside.said()})")

    def tally(self) -> str:
        """What auto did so far, e.g. 'plain 812 steps (61.2 ms), head 40 steps (70.1 ms, by
        nodes 1:30 3:10, 25 with lookup grafted), ...; 12 explorations; ...' (ms: a step's
        mean)."""
        parts = [f"{k} {self.steps[k]} steps ({1e3 * self.seconds[k] / self.steps[k]:.1f} ms"
                 + (f", by nodes {' '.join(f'{n}:{c}' for n, c in sorted(self.nodes.items()))}"
                    f", {self.beside_steps} with lookup grafted" if k == "head" else "") + ")"
                 for k in ("plain", "head", "lookup", "explore") if self.steps.get(k)]
        return ((", ".join(parts) or "no steps") + f"; {self.explorations} explorations; "
                f"{self.held} steps held plain by the outcome guard, which measured "
                f"{self.policy.guard.said()}")

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:  # scheduler and frontend time between worker steps
            self._gaps.append(now - self._last_end)
        self._start = now

    def step_done(self, scheduler_output, drafted: dict[str, int], catch_up: float = 0.0,
                  drafting: float | None = None,
                  grafted: dict[str, tuple[int, int]] | None = None,
                  sampling: set[str] | None = None, chain: bool = True) -> None:
        """The step that ends now: the worker's time since `step_started` plus the median gap
        between steps (idle time between requests never counts), less `catch_up` (seconds its
        head commits spent on pairs of earlier steps: the lazy commits a request's first drafting
        step makes up for, a whole prompt or every step auto drafted nothing; charged to this
        step they would price drafting at many times its steady cost), its rows by kind (and
        how many requests had drafts verified), and the head nodes drafted per request;
        `drafting`: the seconds of this step's drafting phase (catch-up excluded), fitted on
        their own (heads/cost.py); `grafted`: requests that grafted lookup this step -> (match
        length, lookup-only nodes); `sampling`: the requests of this step that sample (T > 0);
        `chain`: the head's drafts were a chain (not a tree cut to a few nodes)."""
        now = time.perf_counter()
        kind = ("explore" if self.exploring else "head" if drafted else
                "lookup" if grafted else "plain")
        self.steps[kind] += 1
        if kind == "head":
            self.nodes[max(drafted.values())] += 1
            self.beside_steps += bool(grafted)
        if self._start is not None:
            self.seconds[kind] += now - self._start
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode = prefill = verified = verifying = 0
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            v = len(spec.get(req_id, ()))
            verified += v
            verifying += v > 0
            if n - v == 1:
                decode += 1
            else:
                prefill += n - v
        if self._start is not None:
            gap = statistics.median(self._gaps) if self._gaps else 0.0
            seconds = now - self._start + gap - catch_up
            if (self._arm is not None and self._arm == self._last_arm and not prefill
                    and not self._last_prefill):
                # drafted and verified under one arm: what the step realized (catch-up in)
                self.policy.guard.record(self._arm[0], self._tokens, seconds + catch_up,
                                         self._arm[1])
            self.policy.step_done(seconds, decode, prefill, verified,
                                  sum(drafted.values()), drafting if drafted else None,
                                  len(drafted), verifying)
            # Measured costs (never right after a prefill step: its drafting phase committed a
            # whole prompt chunk), each with its own drafting phase swapped for last step's (an
            # exploration's next step drafts another budget), and only where vLLM scheduled
            # every node drafted (it may cut drafts to fit its token budget or max_model_len):
            prev = self._drafted  # head nodes drafted last step, by request
            lookup_only = {r: nodes for r, (_, nodes) in self._grafted.items()}
            cycle = seconds - (drafting or 0.0) + self._last_drafting
            budgets = set(prev.values())
            if prefill or self._last_prefill:
                pass  # a prefill step, or the step after one
            elif not prev and not verified and not lookup_only:
                # a plain step (nothing verified): what drafting nothing costs at this batch
                self.policy.measured_step(decode, 0, cycle)
            elif (not prev and lookup_only and verified == sum(lookup_only.values())
                  and all(len(spec.get(r, ())) == k for r, k in lookup_only.items())
                  and (plain := self.policy.plain_seconds(decode)) is not None):
                # only lookup-only grafts verified: what a graft adds to a plain step here
                self.policy.measured_graft(decode, max(cycle - plain, 0.0), len(lookup_only))
            elif (len(budgets) == 1 and len(prev) == decode
                  and prev.keys() == scheduler_output.num_scheduled_tokens.keys()
                  and all(len(spec.get(r, ())) == n + lookup_only.get(r, 0)
                          for r, n in prev.items())):
                # every request verified the same head budget n: what a step at n costs (with
                # last step's lookup-only rows: under their own key)
                self.policy.measured_step(decode, budgets.pop(), cycle,
                                          lookup_rows=sum(lookup_only.values()))
        self._last_drafting, self._last_prefill = drafting or 0.0, prefill > 0
        self._last_arm, self._arm = self._arm, None
        self._start, self._last_end = None, now
        self._drafted, self._grafted = drafted, grafted or {}
        self._sampling = sampling or set()
        self._chain = chain
        self.exploring = False  # until `choose` plans the next exploration


def auto_chain_depth(n: int, budget: int, spec, head) -> int:
    """Under "auto", the depth of the chain a sampled request draws from q for a step of `n`
    head nodes: n, within the step's scheduled `budget`, the depth of the head's tree (its
    `dynamic` depth, else MAX_TREE_DEPTH) and what the head can draft (a Medusa head has one
    head per depth: `num_heads`)."""
    cap = min(spec.head_spec.depth or MAX_TREE_DEPTH, head.max_draft_depth or MAX_TREE_DEPTH)
    return max(0, min(n, budget, cap))


def _tp_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class TreeDraftProposer:
    def __init__(self, vllm_config) -> None:
        td = (vllm_config.additional_config or {}).get(KEY)
        if not td:
            raise RuntimeError(
                "TreeDraftProposer is configured by treedraft's plugin: pass the head folder as "
                "--speculative-config '{\"model\": \"HEAD_DIR\"}' instead of naming this class"
            )
        self.head_dir = td.get("head_dir")  # None: 'lookup:N' alone, no head
        self.spec = parse_tree_spec(td["tree"])
        self._smaller: dict = {}  # budget -> smaller spec (spec_for); (n, lookup) -> auto_spec
        self.auto = AutoBudget(self.spec) if td.get("auto") else None  # "tree": "auto"
        self.tree_mode = not self.spec.is_chain  # chains: vLLM's rejection sampler verifies
        self.num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        self.head = None
        self._where: tuple[int, ...] | None = None  # `features`: where each head layer is
        self.rates = None  # the head's acceptance_rates (static trees), set in load_model
        self.sessions: dict[str, object] = {}
        self.pending: dict[str, PendingPairs] = {}  # per request, pairs its session has not read
        self.log = PairLog()  # plain decode steps' pairs, not yet handed to `pending`
        self.trees: dict[str, DraftTree] = {}  # drafted this step, verified next step (tree mode)
        self.chain_q: dict[str, torch.Tensor] = {}  # q [K, V] of the sampled chains in `trees`
        self.lookups: dict[str, LookupIndex] = {}  # per request, its token history indexed
        self._info: dict[str, tuple] = {}  # per request: (its SamplingParams, *_request_info)
        self._known: set[str] = set()  # requests any of the per-request dicts may hold
        self.sources: dict[str, torch.Tensor] = {}  # per request, HEAD/LOOKUP bits of its tree
        self.source_stats = None  # accepted tokens by source -> the frontend (tree mode)
        if self.tree_mode and _tp_rank0():
            from .metrics import SourceStats, stats_path

            self.source_stats = SourceStats(stats_path(vllm_config))
        self.last_draft_probs: torch.Tensor | None = None  # [num_reqs, K, V] of the last step
        from . import runner

        runner.install(self.tree_mode)  # worker-side patches; idempotent

    # -------------------------------------------------------------- vLLM's custom_class contract
    def load_model(self, target_model) -> None:
        if self.head_dir is None:  # lookup alone: nothing to load
            return
        from treedraft.heads.common import load_head

        head = load_head(self.head_dir)
        embed, lm_head = target_weights(target_model, head.config.target.vocab_size)
        head = head.to(device=embed.device, dtype=embed.dtype).eval()
        head.bind_target(embed, lm_head)  # checks both are [vocab_size, hidden_size]
        from .cpu_gemm import use_vllm_gemm

        use_vllm_gemm(head)  # CPU: vLLM's GEMM kernels (oneDNN/AMX) for the head's linears
        self.head = head
        self._where = None  # `features` reads the loaded head's layers
        self.rates = head.tree_rates()
        if self.auto is not None:
            self.auto.chain_max = min(self.auto.chain_max, head.max_draft_depth or MAX_TREE_DEPTH)
            self.auto.set_rates(self.rates)

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "treedraft's runner patch did not run: TreeDraftProposer.propose_step must be called "
            "by the patched GPUModelRunner.propose_draft_token_ids"
        )

    # -------------------------------------------------------------- hidden states
    @property
    def layer_ids(self) -> tuple[int, ...]:
        """HF hidden_states indices the head reads, in head order (num_layers = final output)."""
        return tuple(self.head.config.target_layer_ids) if self.head is not None else ()

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """vLLM aux ids to capture: aux id k == HF hidden_states[k] for k < num_layers."""
        return tuple(sorted({i for i in self.layer_ids if i < self.num_layers}))

    def layers(self, hidden_states, aux_hidden_states, rows) -> tuple[torch.Tensor, ...]:
        """The head's layers of the given scheduled rows (an index tensor or a slice: views),
        [len(rows), H] each, in head order."""
        where = self._where
        if where is None:  # per layer the head reads: its index in aux_hidden_states, or -1
            aux = self.aux_layer_ids
            where = self._where = tuple(-1 if i == self.num_layers else aux.index(i)
                                        for i in self.layer_ids)
        aux = aux_hidden_states or ()
        return tuple(hidden_states[rows] if k < 0 else aux[k][rows] for k in where)

    def features(self, hidden_states, aux_hidden_states, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), n*H]: the head's layers of the given scheduled rows, in head order."""
        return torch.cat(self.layers(hidden_states, aux_hidden_states, rows), dim=-1)

    def spec_for(self, budget: int):
        """The spec to draft with when at most `budget` nodes will be scheduled: chains are
        drafted that deep; other trees are drafted whole and cut to their first nodes, except
        under "auto", which drafts a smaller tree of the same kind (no lookup part), or a chain
        of the head's top tokens where the budget is at most `AutoBudget.chain_max`."""
        s = self.spec
        m = min(budget, s.head_nodes)
        chain = self.auto is not None and 0 < m <= self.auto.chain_max
        if not chain and (budget >= s.max_nodes or not (s.is_chain or self.auto is not None)):
            return s
        if budget not in self._smaller:
            text = (f"chain:{m}" if chain
                    else f"dynamic:{m},{min(s.depth, m)},{min(s.topk, m)}" if s.kind == "dynamic"
                    else f"chain:{min(m, MAX_TREE_DEPTH)}" if s.head_spec.is_chain
                    else f"static:{m}")
            self._smaller[budget] = parse_tree_spec(text)
        return self._smaller[budget]

    def _lookup_index(self, ib, i: int, req_id: str) -> LookupIndex:
        """The request's lookup index, synced with its token history (a view: O(new tokens))."""
        index = self.lookups.get(req_id)
        if index is None:
            index = self.lookups[req_id] = LookupIndex()
            self._known.add(req_id)
        index.sync(ib.token_ids_cpu[i, : ib.num_tokens_no_spec[i]])
        return index

    def auto_spec(self, n: int, lookup: int):
        """`"tree": "auto"`'s tree for a step: the head's tree of `n` nodes (spec_for) with the
        spec's `lookup` nodes grafted (lookup alone at n = 0)."""
        key = (n, lookup)
        if key not in self._smaller:
            if not n:
                spec = parse_tree_spec(f"lookup:{lookup}")
            else:
                spec = self.spec_for(n)
                spec = dataclasses.replace(spec.head_spec, lookup=lookup) if lookup else (
                    spec.head_spec)
            self._smaller[key] = spec
        return self._smaller[key]

    # -------------------------------------------------------------- one step
    @torch.no_grad()
    def propose_step(self, runner, scheduler_output, sampled_token_ids: list[list[int]],
                     hidden_states, aux_hidden_states, accepted: dict | None = None
                     ) -> list[list[int]]:
        """Draft token lists in `runner.input_batch.req_ids` order (empty: no draft).

        accepted: req_id -> accepted node ids of this step's tree (tree mode), else chains.
        """
        ib = runner.input_batch
        # vLLM's runner keeps a request's state while it lives (running, left out of a step by
        # the token budget, or preempted) and drops it when it finishes: so do we. A request
        # left out of this batch keeps its session and tree; a preempted one rewinds its session
        # to what vLLM recomputes (`_record_pairs`), so its head context is rebuilt, not lost.
        if accepted and self.source_stats is not None:
            self._count_sources(accepted)
        for gone in self._known - runner.requests.keys():
            self._known.discard(gone)
            self.sessions.pop(gone, None)  # finished
            self.lookups.pop(gone, None)
            self.trees.pop(gone, None)
            self.chain_q.pop(gone, None)
            self.sources.pop(gone, None)
            self.pending.pop(gone, None)
            self._info.pop(gone, None)
        if self.source_stats is not None:  # draft sessions held now (leak check: /metrics)
            self.source_stats.set_live(len({*self.sessions, *self.lookups, *self.trees}))
        budget = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        budget = self.spec.max_nodes if budget is None else min(budget, self.spec.max_nodes)
        # 1. every request's known pairs wait for its head session (PendingPairs); the sessions
        # of the requests that draft this step read theirs in one packed head forward (below)
        work = []  # work: (i, req_id, sampled, session) of scheduled requests
        scheduled = scheduler_output.num_scheduled_tokens
        sessions = self.sessions
        for i, req_id in enumerate(ib.req_ids):
            n = scheduled.get(req_id, 0)
            if n == 0:
                continue
            session = None
            if self.head is not None:
                session = sessions.get(req_id)
                if session is None:
                    session = sessions[req_id] = self.head.draft_session()
                    self._known.add(req_id)
            work.append((i, req_id, sampled_token_ids[i], session))
        # req_id -> pairs this step adds (the rest of a commit catches up)
        own = (self._record_pairs(runner, scheduler_output, work, accepted, hidden_states,
                                  aux_hidden_states) if self.head is not None and work else {})
        # 2. drafts: sampled chains of all requests in lockstep (heads.sampling.draft_chains);
        # trees (and greedy chains) of all requests together, a tree level of every request in
        # one head forward (heads.lookup.draft_hybrids)
        drafts: list[list[int]] = [[] for _ in ib.req_ids]
        probs = {}  # row -> q [K, V] of sampled chains
        # no draft: partial prefill chunk, params trees cannot honour, or no budget (vLLM's
        # schedule, or auto's choice)
        eligible = [(i, req_id, sampled, session) for i, req_id, sampled, session in work
                    if sampled and not (self.tree_mode and self._request_info(runner, req_id)[0])]
        spec = None  # the tree of this step (auto), else spec_for(budget) below
        if self.auto is not None:
            self.auto.observe({req_id: len(sampled) for _, req_id, sampled, _ in work},
                              accepted, self.sources)
        grafts: dict[str, int] = {}  # auto: req_id -> match length of the lookup it grafts
        # auto: the step's requests that sample (T > 0); their estimates are kept apart
        sampling = {req_id for _, req_id, *_ in work
                    if self._sampled_params(runner, req_id) is not None} if self.auto else set()
        n = 0  # auto: the step's head nodes per drafting request
        if self.auto is not None and eligible and budget:
            n_sampling = sum(req_id in sampling for _, req_id, *_ in eligible)
            held = not self.auto.allows(len(eligible), n_sampling)
            n, few = self.auto.choose(len(eligible), n_sampling, held=held)
            if held and not self.auto.exploring:
                budget = 0  # the outcome guard holds this step plain (it still explores)
        if self.auto is not None and eligible and budget:
            if few is not None:  # explore with the requests that have the least to catch up
                # (pending pairs; the logged ones are about as many for every decoding request,
                # and draining them here would land in the step's time, not the drafting's)
                eligible = sorted(eligible, key=lambda e: len(self.pending.get(e[1], ())))[:few]
            if self.spec.lookup and not self.auto.exploring:  # per request: graft its lookup
                # proposal where that pays (an exploration measures the head alone)
                # (a class of requests for which no match length can pay this step skips
                # finding its matches: each index catches up when next read)
                may = {cls: self.auto.policy.may_graft(LOOKUP_MATCHES, cls, n)
                       for cls in {req_id in sampling for _, req_id, *_ in eligible}}
                said = {}  # (match, class) -> graft's answer: one per step for each
                for i, req_id, _, _ in eligible:
                    cls = req_id in sampling
                    if not may[cls]:
                        continue
                    match = self._lookup_index(ib, i, req_id).match_length()
                    yes = said.get((match, cls))
                    if yes is None:
                        yes = said[(match, cls)] = self.auto.policy.graft(match, cls, n)
                    if yes:
                        grafts[req_id] = match
                if not n:  # lookup alone: only the requests that graft draft, and only where
                    # together they pay what a step verifying any graft costs once
                    if grafts and not self.auto.policy.grafts_pay(
                            [(m, r in sampling) for r, m in grafts.items()]):
                        grafts = {}
                    eligible = [e for e in eligible if e[1] in grafts]
                elif (len(grafts) == len(eligible)
                      and not any(r in sampling for r in grafts)):
                    # every request grafts (greedy): the head budget worth drafting beside the
                    # lookup, which may be smaller than the head alone's (0: the lookup alone,
                    # no head forward), and a chain (at most chain_max nodes: a head tree's
                    # extra nodes are mostly redundant there)
                    n = self.auto.policy.graft_budget(len(eligible), n,
                                                      len(grafts) * self.spec.lookup,
                                                      cap=self.auto.chain_max)
            lookup = self.spec.lookup if grafts else 0
            budget = min(budget, n + lookup)
            spec = self.auto_spec(n, lookup) if budget else None
        if not budget:
            eligible = []
        spec = spec or (self.spec_for(budget) if budget else self.spec)
        # the requests whose head drafts (lookup alone reads no head session)
        drafting = {req_id for _, req_id, *_ in eligible} if spec.has_head else set()
        catch_up = 0.0  # seconds of this step's commits spent on pairs of earlier steps
        t_drafting = time.perf_counter()  # auto: the drafting phase is timed, not fitted
        # the drafting requests' sessions read what is pending (and so does any session with
        # `full` pending pairs: bounded memory, no lost context); nothing to do in a step that
        # drafts nothing and only logged its pairs (the pending pairs are as the last step left)
        if self.head is not None and (drafting or self.log.full or not self.log):
            self.log.drain(self.pending, self._known)
            flushed, generated = [], []  # generated: its last pairs whose token the target
            for _, req_id, _, session in work:  # generated (the rest are prompt tokens)
                pending = self.pending.get(req_id)
                if pending is None or (req_id not in drafting and not pending.full):
                    continue
                end, first = pending.start + len(pending), runner.requests[
                    req_id].num_prompt_tokens - 1  # the pair at position c predicts token c+1
                if (item := pending.flush(session)) is not None:
                    flushed.append((req_id, item))
                    generated.append(max(0, min(len(item[2]), end - first)))
            # auto: test the head, teacher-forced, on pairs of steps that drafted nothing for
            # the request (what drafting one node would have earned there; drafted steps are
            # observed from their accepted drafts instead), on the target's own tokens only:
            # the prompt's (the user's text) are harder to guess, and were half the checks
            # of a short request's first catch-up (acceptance estimated at x0.54-0.78 of the
            # head's table where chain=1 accepted x~1)
            need = [self.auto is not None and req_id not in self.auto.drafted and g > 0
                    and req_id not in sampling  # greedy only (observe_teacher)
                    for (req_id, _), g in zip(flushed, generated, strict=True)]
            share = max(1, TEACHER_CHECKS // max(sum(need), 1))  # ~TEACHER_CHECKS rows a step
            check = [min(share, g) if k else 0 for k, g in zip(need, generated, strict=True)]
            found = commit_sessions([item for _, item in flushed], check)
            if found:
                self.auto.observe_teacher(sum(h for h, _ in found), sum(n for _, n in found))
            if flushed:
                total = sum(len(item[2]) for _, item in flushed)
                mine = sum(own[req_id] for req_id, _ in flushed)
                catch_up = (time.perf_counter() - t_drafting) * max(total - mine, 0) / total
        if self.trees or self.chain_q or self.sources:
            drafted_now = {req_id for _, req_id, *_ in eligible}
            for _, req_id, *_ in work:
                self.chain_q.pop(req_id, None)  # drafted again below, or not at all
                if req_id not in drafted_now:
                    self.trees.pop(req_id, None)
                    self.sources.pop(req_id, None)
        # sampled requests draft chains from q where this step's trees are chains, and under
        # auto wherever they graft no lookup: n nodes as one chain drawn from q (as deep as the
        # head's tree at most) accept more at T > 0 than the head's n-node top-k tree (bench,
        # batch 1, T=1: chain=3 1.28x no-spec where auto's trees gave 1.04x)
        chain_depth = min(spec.chain_nodes or 0, budget)
        q_depth = chain_depth or (auto_chain_depth(n, budget, self.spec, self.head)
                                  if n and self.auto is not None and spec.has_head else 0)
        jobs = []  # (i, req_id, root, session, lookup index)
        chains = []  # (i, (root, session, params, generator)) of sampled chains
        for i, req_id, sampled, session in eligible:
            params = (self._sampled_params(runner, req_id)
                      if chain_depth or (q_depth and req_id not in grafts) else None)
            if params is not None:
                # a seeded request draws its drafts from its own generator (reproducible)
                chains.append((i, (sampled[-1], session, params, ib.generators.get(i))))
                continue
            index = None
            if spec.lookup and (self.auto is None or req_id in grafts):
                index = self._lookup_index(ib, i, req_id)
            jobs.append((i, req_id, sampled[-1], session, index))
        drawn = draft_chains([job for _, job in chains], q_depth) if chains else []
        for (i, _), (chain, q) in zip(chains, drawn, strict=True):
            drafts[i] = chain.tokens[1:].tolist()
            if not self.tree_mode:
                probs[i] = q  # -> vLLM's rejection sampler
                continue
            req_id = ib.req_ids[i]  # -> plugin/sampler.verify_trees, with the chain
            self.trees[req_id], self.chain_q[req_id] = chain, q
            self.sources[req_id] = HybridTree.of_head(chain).sources
        hybrids = draft_hybrids([(root, session, index) for _, _, root, session, index in jobs],
                                spec, self.rates, device=hidden_states.device) if jobs else []
        for (i, req_id, *_), hybrid in zip(jobs, hybrids, strict=True):
            self.trees[req_id], self.sources[req_id] = hybrid.tree, hybrid.sources
            drafts[i] = hybrid.tree.tokens[1 : budget + 1].tolist()  # make_request keeps these
        if self.auto is not None:
            heads, grafted = {}, {}
            for i, d in enumerate(drafts):
                if not d:  # drafts nothing (a graft has lookup nodes: drafts)
                    continue
                req_id = ib.req_ids[i]
                src = self.sources.get(req_id)
                bits = src[1 : len(d) + 1] if src is not None else None
                head = len(d) if bits is None else int(((bits & HEAD) != 0).sum())
                if head:
                    heads[req_id] = head
                if req_id in grafts:
                    grafted[req_id] = (grafts[req_id], len(d) - head)
            self.auto.step_done(scheduler_output, heads, catch_up,
                                time.perf_counter() - t_drafting - catch_up, grafted, sampling,
                                chain=not spec.has_head or spec.head_spec.is_chain)
        self.last_draft_probs = self._draft_probs(runner, drafts, probs) if probs else None
        if probs:
            logger.info_once(
                "treedraft: chains of sampling requests draw drafts from the head's q and pass "
                "q to vLLM's rejection sampler as draft probabilities")
        return drafts

    def _count_sources(self, accepted: dict[str, list[int]]) -> None:
        """Accepted nodes of the trees verified this step, by the source that proposed them."""
        total = dict.fromkeys(SOURCES, 0)
        for req_id, nodes in accepted.items():
            src = self.sources.get(req_id)
            if not nodes or src is None:
                continue
            for k, v in accepted_by_source(src, nodes).items():
                total[k] += v
        self.source_stats.add(total)

    def _record_pairs(self, runner, scheduler_output, work, accepted, hidden_states,
                      aux_hidden_states) -> dict[str, int]:
        """Every scheduled request's known pairs (features of a scheduled row, the token after
        it) from vLLM's computed tokens on, for its pending pairs; returns req_id -> pairs
        added. Rows of a request: root + accepted nodes of its tree (tree step), else its first
        n - drafts - 1 + sampled rows (all of a prefill chunk; root + accepted drafts of a
        chain). One gather of the features and one of the tokens for the whole step, row
        indices computed with numpy. A decode step that verified nothing (one pair each: the
        step `"tree": "auto"` takes where it drafts nothing) is logged whole (`PairLog`: O(1)
        in requests; per request it was ~0.3 ms of such a step at batch 16 on a 2-core CPU);
        any other step drains the log first, then hands each request its part: views of the
        step's tensor on decode steps, copies on a step with a prefill chunk, so that a long
        chunk is not kept alive by the one-row views of the requests decoding beside it."""
        ib = runner.input_batch
        idx = np.fromiter((i for i, *_ in work), dtype=np.int64, count=len(work))
        c = ib.num_computed_tokens_cpu[idx].astype(np.int64)
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        trees = accepted or {}
        ids = ib.token_ids_cpu  # [max_num_reqs, max_model_len]
        # the pair at position c predicts token c+1; a pair at the last position of
        # max_model_len has no next token: the request ends there
        last = ids.shape[1] - 1
        if not (spec or trees) and scheduler_output.total_num_scheduled_tokens == len(work):
            # one row per request: the rows are 0..n-1. Logged as views of the step's layers on
            # CPU (joined when drained, `PairLog.add`); copies elsewhere, where vLLM may replay
            # a captured graph into the same output buffers at the next step
            req_ids = [r for _, r, *_ in work]
            n = len(work)
            # (layer 0 copied: the input embeddings, which vLLM may keep in a persistent buffer
            # for prompt-embeds and multimodal models)
            feats = (tuple(f.clone() if i == 0 else f for f, i in zip(
                         self.layers(hidden_states, aux_hidden_states, slice(0, n)),
                         self.layer_ids, strict=True))
                     if hidden_states.device.type == "cpu" else
                     self.features(hidden_states, aux_hidden_states, slice(0, n)))
            self.log.add(req_ids, c.tolist(), feats, ids[idx, np.minimum(c + 1, last)])
            return dict.fromkeys(req_ids, 1)
        self.log.drain(self.pending, self._known)  # in step order, before this step's pairs
        qs = runner.query_start_loc.np[idx].astype(np.int64)
        if spec or trees:
            m = np.fromiter(
                (len(trees[r]) + 1 if r in trees else
                 scheduled[r] - len(spec.get(r, ())) - 1 + len(s) if s else scheduled[r]
                 for _, r, s, _ in work), dtype=np.int64, count=len(work))
        else:  # no drafts scheduled: every row of every request
            m = np.fromiter((scheduled[r] for _, r, *_ in work), dtype=np.int64, count=len(work))
        total, counts = int(m.sum()), m.tolist()
        first = np.cumsum(m) - m  # each request's first pair in the flat order
        offset = np.arange(total) - np.repeat(first, m)  # a pair's index within its request
        rows = np.repeat(qs, m) + offset
        if trees:  # tree steps: root + the accepted nodes' rows, not the first rows
            for j, (_, r, *_) in enumerate(work):
                if r in trees:
                    rows[first[j] + 1 : first[j] + m[j]] = qs[j] + np.asarray(trees[r])
        feats = self._features_of(hidden_states, aux_hidden_states, rows)
        cols = np.minimum(np.repeat(c + 1, m) + offset, last)
        tokens = torch.from_numpy(ids[np.repeat(idx, m), cols]).long()
        copy = total > 2 * len(work)  # a prefill chunk in this step
        own, pending = {}, self.pending
        for (_, req_id, *_), pos, f, t, k in zip(work, c.tolist(), feats.split(counts),
                                                 tokens.split(counts), counts, strict=True):
            p = pending.get(req_id)
            if p is None:
                p = pending[req_id] = PendingPairs()
            p.add(pos, f.clone() if copy else f, t.clone() if copy else t)
            own[req_id] = k
        return own

    def _features_of(self, hidden_states, aux_hidden_states, rows: np.ndarray) -> torch.Tensor:
        """`features` of the scheduled rows `rows` (numpy), a slice where they are 0..n-1."""
        n = len(rows)
        if n and rows[0] == 0 and rows[-1] == n - 1 and (
                n == 1 or bool((np.diff(rows) == 1).all())):
            return self.features(hidden_states, aux_hidden_states, slice(0, n))
        return self.features(hidden_states, aux_hidden_states,
                             torch.from_numpy(rows).to(hidden_states.device))

    def _request_info(self, runner, req_id: str) -> tuple[bool, object]:
        """(trees cannot honour its parameters, its heads SamplingParams when it samples (T > 0)
        else None), computed once per sampling-parameters object: vLLM replaces a request's
        parameters under the same id (a streaming-input session's next chunk; an id aborted
        and resubmitted), and a stale answer would draft for a request trees cannot honour."""
        sp = runner.requests[req_id].sampling_params
        info = self._info.get(req_id)
        if info is None or info[0] is not sp:
            from .sampler import heads_params

            params = heads_params(sp)
            self._known.add(req_id)
            info = self._info[req_id] = (sp, bool(request_unsupported(runner, req_id)),
                                         None if params.greedy else params)
        return info[1:]

    def _sampled_params(self, runner, req_id: str):
        """heads SamplingParams of a request that samples (T > 0), else None (greedy)."""
        return self._request_info(runner, req_id)[1]

    @staticmethod
    def _draft_probs(runner, drafts: list[list[int]], probs: dict) -> torch.Tensor:
        """[num_reqs, K, V] float32 draft probabilities in input-batch order for vLLM's
        rejection sampler: q of sampled chains, one-hot rows for argmax drafts (vLLM's default
        q), zeros where a request has no drafts (vLLM reads only the scheduled prefix)."""
        K = max(len(d) for d in drafts)
        V = runner.input_batch.vocab_size
        out = torch.zeros(len(drafts), K, V, dtype=torch.float32)
        for i, d in enumerate(drafts):
            if i in probs:
                q = probs[i]
                out[i, : len(d), : q.shape[-1]] = q
            elif d:
                out[i, torch.arange(len(d)), torch.tensor(d)] = 1.0
        return out
