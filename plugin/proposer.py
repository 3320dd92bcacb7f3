"""`TreeDraftProposer`: a treedraft head drafting inside vLLM's V1 runner (worker process).

vLLM builds it as a `custom_class` proposer (plugin/config.py rewrites the user's
`--speculative-config`). It is a thin adapter: the head, its per-request draft session and the
tree drafting are `treedraft.heads` code, unchanged; this class only maps vLLM's per-step batch
(scheduled rows, hidden states, sampled tokens) onto one session per request.

Per request and step (rows are this step's scheduled tokens, starting at position c):
- collect the pairs (target features of row j, token at position c+j+1) for every row whose
  next token is now known: all rows of a prefill chunk, root + accepted drafts of a decode step;
  they wait in the request's `pairs.PendingPairs` until it drafts (a step that drafts
  nothing for a request, e.g. `"tree": "auto"` drafting nothing, runs no head forward for it);
- draft a tree (or chain) below the last sampled token and return its tokens in node order.
Both run batched across the step's drafting requests: their commits in one packed head
forward, each tree level of all requests in one more (`EagleSession.commit_many`/`topk_lists_many` through
`heads.common.commit_sessions` and `heads.lookup.draft_hybrids`); attention stays per request,
against that request's own in-place head KV cache.
  Chains of requests that sample (T > 0) draw each token from the head's distribution q under
  the request's temperature/top-k/top-p (`heads.sampling.draft_chains`, one head forward per
  level for all of them, over the draft vocabulary): in chain mode q goes to vLLM's rejection
  sampler as draft probabilities (`last_draft_probs`); in tree mode, where the head's part of a
  step's spec is a chain (`TreeSpec.chain_nodes` of its `head_spec`: chain:K, dynamic:K,K,1,
  chain:K+lookup:N, `"auto"`'s arms for a batch that mostly samples), q stays with the chain's
  nodes (`chain_q`), lookup nodes are grafted after them (`heads.lookup.graft_lookup`), and
  plugin/sampler.verify_trees verifies each chain node against q. Head trees of a fixed shape
  (static:N, paths; `"auto"`'s tree arms for a sampling batch) draw each node's children
  without replacement from its q (`heads.sampling.draft_sampled_trees`), verified against it
  the same way. Greedy requests and EAGLE-2 (dynamic) trees, whose shape depends on what they
  drafted, draft the top-ranked tokens (q one-hot, vLLM's default).

Trees with lookup nodes ('+lookup:N'; 'lookup:N' alone runs no head) keep one incremental
`heads.lookup.LookupIndex` per request over its token history (prompt + output, vLLM's
`token_ids_cpu`), and graft its proposals into the head's tree (`heads.lookup.draft_hybrid`).

`"tree": "auto"` (`AutoArms`, the policy in heads/policy.py) picks each step's spec among a few
fixed ones (nothing, chains of 1-4 head nodes, the head's trees up to the spec's size: static
ones, drawn from q, for a batch that mostly samples) from the tokens per second each realized in
this engine; the step then drafts exactly as an engine
configured with that spec would.

vLLM's `num_speculative_tokens_per_batch_size` schedule (scheduler_output.
num_spec_tokens_to_schedule) is the node budget of the step: chains are drafted that deep, other
trees are cut to their first nodes (a prefix of a topologically ordered tree is a tree), and at 0
nothing is drafted (the head still reads the step's hidden states, so it keeps its context).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict, deque

import numpy as np
import torch
from vllm.logger import init_logger

from treedraft.heads.common import commit_sessions
from treedraft.heads.lookup import (
    SOURCES,
    LookupIndex,
    accepted_by_source,
    draft_hybrids,
    graft_lookup,
)
from treedraft.heads.prefix import PrefixStore
from treedraft.heads.sampling import draft_chains, draft_sampled_trees
from treedraft.heads.tree import MAX_TREE_DEPTH, DraftTree, fixed_parents, parse_tree_spec

from .config import KEY
from .pairs import PairLog, PendingPairs
from .sampler import request_unsupported

logger = init_logger("vllm.treedraft")


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


class AutoArms:
    """`"tree": "auto"` inside the engine: `heads.policy.ArmBandit` (which fixed draft
    configuration each step runs, from the tokens per second each realized here) fed with this
    engine's steps: their wall time (the worker's step plus the median gap between steps, the
    scheduler's and frontend's share), the tokens they gave, and whether they prefilled. Logs its
    choice (rank 0) per context: when it measured one more arm, and when its best changes (at
    most every 10 s)."""

    def __init__(self, spec, max_depth: int | None) -> None:
        from treedraft.heads.policy import NONE, ArmBandit, arms_for

        h = spec.head_spec

        def tree_of(n: int) -> str:  # the head's own kind of tree, n nodes
            if h.kind == "dynamic":
                return f"dynamic:{n},{min(h.depth, n)},{min(h.topk, n)}"
            return f"static:{n}"

        def sampled_tree_of(n: int) -> str:  # a fixed shape: drawn from q at T > 0
            return f"static:{n}"

        arms = {s: arms_for(spec.head_nodes, max_depth, spec.lookup, s,
                            None if h.is_chain else sampled_tree_of if s else tree_of)
                for s in (False, True)}
        self.bandit = ArmBandit(arms)
        self.specs = {a: None if a == NONE else parse_tree_spec(a)
                      for names in arms.values() for a in names}
        self._start: float | None = None
        self._last_end: float | None = None
        self._gaps: deque[float] = deque(maxlen=32)
        self._arm: str | None = None  # the arm this step runs (None: it planned none)
        self._logged: dict = {}  # per context: (best, arms measured) last logged, and when

        self.steps: dict[tuple, int] = defaultdict(int)  # steps per (context, arm)
        # per arm, over contexts and every step it was played: seconds, tokens per request
        self.spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def plan(self, batch: int, sampled: int = 0):
        """This step's TreeSpec for `batch` drafting requests (`sampled` of them T > 0), or
        None: draft nothing."""
        arm = self.bandit.plan(batch, sampled)
        self._arm = arm
        ctx = self.bandit.ctx
        self.steps[ctx, arm] += 1
        rates = self.bandit.rates(ctx)
        best = max(rates, key=rates.get) if rates else None
        now = time.monotonic()
        (said, n), at = self._logged.get(ctx, ((None, 0), -math.inf))
        if best is not None and (len(rates) != n or best != said and now - at > 10) \
                and _tp_rank0():
            logger.info("treedraft auto: batch <= %d, %s: best %s; tokens/s per request by arm: "
                        "%s; steps so far by arm: %s", ctx[0],
                        "sampled" if ctx[1] else "greedy", best,
                        ", ".join(f"{a} {r:.1f}" for a, r in rates.items()),
                        ", ".join(f"{a} {n}" for a, n in self.steps_in(ctx).items()))
            self._logged[ctx] = ((best, len(rates)), now)
        return self.specs[arm]

    def steps_in(self, ctx: tuple[int, bool]) -> dict[str, int]:
        """Steps per arm played in one context (what its log line reports)."""
        return {a: n for (c, a), n in self.steps.items() if c == ctx}

    def tally(self) -> str:
        """What auto did so far: steps per arm, the time it played each arm and the tokens per
        request those steps gave per second (every step of the arm, measured or not: where its
        time went), and per context the arm it found best, e.g. 'steps by arm: none 40,
        chain:3+lookup:4 812; time by arm: none 1.2 s (33.1 tokens/s per request), ...; best:
        batch <= 1 greedy chain:3+lookup:4 (31.2 tokens/s per request)'."""
        best = [f"batch <= {c[0]} {'sampled' if c[1] else 'greedy'} {a} "
                f"({self.bandit.rates(c)[a]:.1f} tokens/s per request)"
                for c in sorted(self.bandit.stats) if (a := self.bandit.best(c)) is not None]
        steps: dict[str, int] = defaultdict(int)  # over every context
        for (_, a), n in self.steps.items():
            steps[a] += n
        return ("steps by arm: " + ", ".join(f"{a} {n}" for a, n in steps.items())
                + "; time by arm: " + ", ".join(
                    f"{a} {sec:.1f} s ({tok / sec if sec else 0.0:.1f} tokens/s per request)"
                    for a, (sec, tok) in self.spent.items())
                + "; best: " + ("; ".join(best) or "-"))

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:  # scheduler and frontend time between worker steps
            self._gaps.append(now - self._last_end)
        self._start = now

    def step_done(self, scheduler_output, tokens: int, requests: int) -> None:
        """The step that ends now gave `tokens` (1 + accepted drafts each) to `requests`."""
        now = time.perf_counter()
        if self._arm is None:
            self.bandit.idle()
        elif self._start is not None:
            spec = scheduler_output.scheduled_spec_decode_tokens
            prefill = any(n - len(spec.get(r, ())) > 1
                          for r, n in scheduler_output.num_scheduled_tokens.items())
            gap = statistics.median(self._gaps) if self._gaps else 0.0
            seconds = now - self._start + gap
            self.bandit.observe(tokens, seconds, usable=not prefill, requests=requests)
            spent = self.spent[self._arm]
            spent[0] += seconds
            spent[1] += tokens / max(requests, 1)
        self._arm = None
        self._start, self._last_end = None, now


def live_prefix(sessions: dict, requests: dict, tokens: list[int], exclude=None):
    """K, V of pairs 0..n-1 (n = len(tokens) - 1) from a live session (req_id -> session, its
    vLLM request state in `requests`) that starts at 0, holds n pairs and whose request's first
    n + 1 tokens are `tokens`; None if there is none."""
    n = len(tokens) - 1
    for req_id, s in sessions.items():
        state = requests.get(req_id)
        if (s is not exclude and state is not None and s.start == 0 and s.length >= n
                and _token(state, n) == tokens[-1] and _token(state, n // 2) == tokens[n // 2]
                and _tokens(state, n + 1) == tokens):  # cheap checks first
            return s.cached_prefix(n)
    return None


def _token(state, i: int) -> int | None:
    """Token i of a vLLM request state (prompt, then output), or None."""
    prompt = state.prompt_token_ids
    if prompt is None:
        return None
    if i < len(prompt):
        return prompt[i]
    out = state.output_token_ids
    return out[i - len(prompt)] if i - len(prompt) < len(out) else None


def _tokens(state, n: int) -> list[int]:
    """Up to the first n token ids of a vLLM request state (prompt, then output), ending before
    a placeholder (-1: async scheduling's tokens not sampled yet); none for a prompt given as
    embeddings."""
    prompt = state.prompt_token_ids
    if prompt is None:
        return []
    ids = list(prompt[:n]) + list(state.output_token_ids[: max(n - len(prompt), 0)])
    return ids[: ids.index(-1)] if -1 in ids else ids


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
        self._smaller: dict = {}  # budget -> smaller spec (spec_for)
        self._auto = bool(td.get("auto"))
        self.auto: AutoArms | None = None  # "tree": "auto" (load_model: needs the head)
        self.tree_mode = not self.spec.is_chain  # chains: vLLM's rejection sampler verifies
        self.num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        self.head = None
        self._where: tuple[int, ...] | None = None  # `features`: where each head layer is
        self.rates = None  # the head's acceptance_rates (static trees), set in load_model
        self.sessions: dict[str, object] = {}
        # the head's context across the target's prefix cache (heads/prefix.py): finished
        # sessions' K/V by tokens, and the vLLM request state of each session (its tokens)
        self.prefixes = (PrefixStore() if getattr(vllm_config.cache_config,
                                                  "enable_prefix_caching", False) else None)
        self._requests: dict[str, object] = {}
        self.seeded = 0  # sessions that started with another session's pairs
        self.pending: dict[str, PendingPairs] = {}  # per request, pairs its session has not read
        self.log = PairLog()  # plain decode steps' pairs, not yet handed to `pending`
        self.trees: dict[str, DraftTree] = {}  # drafted this step, verified next step (tree mode)
        # per request: (q rows [P, V], the ids in its `trees` entry of the nodes drawn from them,
        # the row of each): a sampled head chain or fixed-shape tree (tree_step.make_request)
        self.chain_q: dict[str, tuple[torch.Tensor, list[int], list[int]]] = {}
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
        from .cpu_kernels import use_vllm_gemm, use_vllm_rms_norm

        if hasattr(head, "fuse_projections"):  # q/k/v, gate/up: one GEMM each
            head.fuse_projections()
        use_vllm_gemm(head)  # CPU: vLLM's GEMM kernels (oneDNN/AMX) for the head's linears
        use_vllm_rms_norm(head)  # and its rms_norm kernel for the head's norms
        self.head = head
        self._where = None  # `features` reads the loaded head's layers
        self.rates = head.tree_rates()
        if self._auto:
            self.auto = AutoArms(self.spec, head.max_draft_depth)

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
        drafted that deep; other trees are drafted whole and cut to their first nodes."""
        s = self.spec
        if budget >= s.max_nodes or not s.is_chain:
            return s
        if budget not in self._smaller:
            self._smaller[budget] = parse_tree_spec(f"chain:{min(budget, MAX_TREE_DEPTH)}")
        return self._smaller[budget]

    def _lookup_index(self, ib, i: int, req_id: str) -> LookupIndex:
        """The request's lookup index, synced with its token history (a view: O(new tokens))."""
        index = self.lookups.get(req_id)
        if index is None:
            index = self.lookups[req_id] = LookupIndex()
            self._known.add(req_id)
        index.sync(ib.token_ids_cpu[i, : ib.num_tokens_no_spec[i]])
        return index

    # -------------------------------------------------------------- one step
    @torch.no_grad()
    def propose_step(self, runner, scheduler_output, sampled_token_ids: list[list[int]],
                     hidden_states, aux_hidden_states, accepted: dict | None = None
                     ) -> list[list[int]]:
        """Draft token lists in `runner.input_batch.req_ids` order (empty: no draft).

        accepted: req_id -> accepted node ids of this step's tree (tree mode), else chains.
        One step, top to bottom: forget the requests vLLM dropped; log the pairs of every
        scheduled request; choose the step's spec and node budget (the policy, for `"auto"`);
        the drafting requests' sessions read their pending pairs; draft; the policy observes.
        """
        if accepted and self.source_stats is not None:
            self._count_sources(accepted)
        self._forget(runner.requests.keys())
        work = self._scheduled(runner, scheduler_output, sampled_token_ids)
        if self.head is not None and work:
            self._record_pairs(runner, scheduler_output, work, accepted, hidden_states,
                               aux_hidden_states)
        eligible, spec, budget = self._plan(runner, scheduler_output, work)
        self._read_pending(work, eligible, spec)
        drafts, probs = self._draft(runner, work, eligible, spec, budget, hidden_states.device)
        if self.auto is not None:
            self.auto.step_done(scheduler_output, sum(len(s) for _, _, s, _ in work), len(work))
        self.last_draft_probs = self._draft_probs(runner, drafts, probs) if probs else None
        if probs:
            logger.info_once(
                "treedraft: chains of sampling requests draw drafts from the head's q and pass "
                "q to vLLM's rejection sampler as draft probabilities")
        return drafts

    def _forget(self, alive) -> None:
        """Drop what is kept for requests vLLM no longer holds. vLLM's runner keeps a request's
        state while it lives (running, left out of a step by the token budget, or preempted)
        and drops it when it finishes: so do we. A request left out of this batch keeps its
        session and tree; a preempted one rewinds its session to what vLLM recomputes
        (`_record_pairs`), so its head context is rebuilt, not lost."""
        for gone in self._known - alive:
            self._known.discard(gone)
            self._keep_prefix(self.sessions.pop(gone, None), self._requests.pop(gone, None))
            self.lookups.pop(gone, None)
            self.trees.pop(gone, None)
            self.chain_q.pop(gone, None)
            self.sources.pop(gone, None)
            self.pending.pop(gone, None)
            self._info.pop(gone, None)
        if self.source_stats is not None:  # draft sessions held now (leak check: /metrics)
            self.source_stats.set_live(len({*self.sessions, *self.lookups, *self.trees}))

    def _scheduled(self, runner, scheduler_output, sampled_token_ids) -> list[tuple]:
        """(i, req_id, sampled tokens, head session) of each request scheduled this step; a
        request new to the head gets its session here (seeded from the prefix cache's)."""
        ib = runner.input_batch
        scheduled = scheduler_output.num_scheduled_tokens
        sessions = self.sessions
        work = []
        for i, req_id in enumerate(ib.req_ids):
            if scheduled.get(req_id, 0) == 0:
                continue
            session = None
            if self.head is not None:
                session = sessions.get(req_id)
                if session is None:
                    session = sessions[req_id] = self.head.draft_session()
                    self._known.add(req_id)
                    self._seed(runner, req_id, int(ib.num_computed_tokens_cpu[i]), session)
            work.append((i, req_id, sampled_token_ids[i], session))
        return work

    def _plan(self, runner, scheduler_output, work) -> tuple[list[tuple], object, int]:
        """(the requests that draft, the step's spec, its node budget). The budget is vLLM's
        schedule (`num_spec_tokens_to_schedule`) capped by the spec; `"auto"` picks the spec
        (its arm for this batch) and may draft nothing. A request drafts when it sampled a
        token (not a partial prefill chunk) and, in tree mode, trees can honour its params."""
        budget = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        budget = self.spec.max_nodes if budget is None else min(budget, self.spec.max_nodes)
        eligible = [(i, req_id, sampled, session) for i, req_id, sampled, session in work
                    if sampled and not (self.tree_mode and self._request_info(runner, req_id)[0])]
        spec = None
        if self.auto is not None:
            if eligible and budget:
                n_sampling = sum(self._sampled_params(runner, r) is not None
                                 for _, r, *_ in eligible)
                spec = self.auto.plan(len(eligible), n_sampling)
            budget = min(budget, spec.max_nodes) if spec is not None else 0
        if not budget:
            eligible = []
        return eligible, spec or (self.spec_for(budget) if budget else self.spec), budget

    def _read_pending(self, work, eligible, spec) -> None:
        """The drafting requests' sessions read their pending pairs in one packed head forward
        (`heads.common.commit_sessions`), and so does any session whose pending pairs are
        `full` (bounded memory, no lost context). A step that drafts nothing and only logged
        its pairs has nothing to do (the pending pairs are as the last step left them)."""
        if self.head is None:
            return
        # the requests whose head drafts (lookup alone reads no head session)
        drafting = {req_id for _, req_id, *_ in eligible} if spec.has_head else set()
        if not (drafting or self.log.full or not self.log):
            return
        self.log.drain(self.pending, self._known)
        flushed = []
        for _, req_id, _, session in work:
            pending = self.pending.get(req_id)
            if pending is None or (req_id not in drafting and not pending.full):
                continue
            if (item := pending.flush(session)) is not None:
                flushed.append(item)
        commit_sessions(flushed)

    def _draft(self, runner, work, eligible, spec, budget, device
               ) -> tuple[list[list[int]], dict]:
        """(drafts per batch row, q per row of the sampled chains that go to vLLM's rejection
        sampler). Sampled requests draw from q where the head's part of the step's spec is a
        chain (auto's chain arms) or another fixed shape (static, paths: each node's children
        drawn without replacement), lookup nodes grafted after them
        (`heads.sampling.draft_chains` / `draft_sampled_trees`, all of them in lockstep); the
        others draft their trees (and greedy chains) together, a tree level of every request
        in one head forward (`heads.lookup.draft_hybrids`)."""
        ib = runner.input_batch
        drafts: list[list[int]] = [[] for _ in ib.req_ids]
        probs = {}  # row -> q [K, V] of sampled chains (chain mode)
        if self.trees or self.chain_q or self.sources:  # last step's trees are verified
            drafted_now = {req_id for _, req_id, *_ in eligible}
            for _, req_id, *_ in work:
                self.chain_q.pop(req_id, None)  # drafted again below, or not at all
                if req_id not in drafted_now:
                    self.trees.pop(req_id, None)
                    self.sources.pop(req_id, None)
        chain_depth = min((spec.head_spec.chain_nodes or 0) if spec.has_head else 0, budget)
        shape = (fixed_parents(spec.head_spec, self.rates) if self.tree_mode and spec.has_head
                 and not chain_depth and spec.head_spec.is_fixed else None)
        jobs = []  # (i, req_id, root, session, lookup index)
        drawing = []  # (i, (root, session, params, generator)) of sampled chains or trees
        for i, req_id, sampled, session in eligible:
            params = (self._sampled_params(runner, req_id)
                      if chain_depth or shape is not None else None)
            if params is not None:
                # a seeded request draws its drafts from its own generator (reproducible)
                drawing.append((i, (sampled[-1], session, params, ib.generators.get(i))))
                continue
            index = self._lookup_index(ib, i, req_id) if spec.lookup else None
            jobs.append((i, req_id, sampled[-1], session, index))
        drawn = []  # per drawing request: (head tree, q rows, drawn node ids, row of each)
        if drawing and chain_depth:
            drawn = [(chain, q, list(range(1, chain_depth + 1)), list(range(chain_depth)))
                     for chain, q in draft_chains([job for _, job in drawing], chain_depth)]
        elif drawing:
            drawn = draft_sampled_trees([job for _, job in drawing], shape, device=device)
        for (i, _), (tree, q, nodes, rows) in zip(drawing, drawn, strict=True):
            drafts[i] = tree.tokens[1:].tolist()
            if not self.tree_mode:
                probs[i] = q  # -> vLLM's rejection sampler
                continue
            req_id = ib.req_ids[i]  # -> plugin/sampler.verify_trees, with the nodes' q
            index = self._lookup_index(ib, i, req_id) if spec.lookup else None
            hybrid, ids = graft_lookup(tree, index, spec.lookup, device=device)
            drafts[i] = hybrid.tree.tokens[1 : budget + 1].tolist()
            self.trees[req_id] = hybrid.tree
            self.chain_q[req_id] = (q, [ids[n - 1] for n in nodes], rows)
            self.sources[req_id] = hybrid.sources
        hybrids = draft_hybrids([(root, session, index) for _, _, root, session, index in jobs],
                                spec, self.rates, device=device) if jobs else []
        for (i, req_id, *_), hybrid in zip(jobs, hybrids, strict=True):
            self.trees[req_id], self.sources[req_id] = hybrid.tree, hybrid.sources
            drafts[i] = hybrid.tree.tokens[1 : budget + 1].tolist()  # make_request keeps these
        return drafts, probs

    def _seed(self, runner, req_id: str, computed: int, session) -> None:
        """A new session of a request whose first `computed` tokens the target took from its
        prefix cache: seeded with pairs 0..computed-1 of a live session of the same tokens, or
        of a finished one (`prefixes`); else it starts at `computed` with no context."""
        state = runner.requests.get(req_id)
        if self.prefixes is None or state is None or not hasattr(session, "seed"):
            return
        self._requests[req_id] = state
        if computed <= 0:
            return
        tokens = _tokens(state, computed + 1)
        if len(tokens) != computed + 1:
            return
        kv = live_prefix(self.sessions, self._requests, tokens, session)
        if kv is None:
            kv = self.prefixes.find(tokens)
        if kv is not None:
            session.seed(*kv)
            self.seeded += 1
            if self.seeded == 1 and _tp_rank0():
                logger.info("treedraft: a request that started after a prefix-cache hit (%d "
                            "tokens) took the head's context there from another request's "
                            "draft session", computed)

    def _keep_prefix(self, session, state) -> None:
        """A finished request's committed pairs into `prefixes` (a later request with the same
        first tokens, e.g. the next turn of a chat, starts with them)."""
        if (self.prefixes is None or session is None or state is None or session.start != 0
                or not session.length):
            return
        tokens = _tokens(state, session.length + 1)
        if len(tokens) > 1:
            self.prefixes.put(tokens, *session.cached_prefix(len(tokens) - 1))

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
