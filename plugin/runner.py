"""Worker-side touch points in vLLM's V1 model runner (GPUModelRunner; CPUModelRunner inherits).

Installed when a `TreeDraftProposer` is built (inside the runner's __init__, before load_model),
so they never run in engines without a treedraft head; each wrapper is inert unless the runner's
drafter is a TreeDraftProposer.

- `_setup_eagle3_aux_hidden_state_outputs`: capture the head's target layers (vLLM aux id k is
  HF hidden_states[k]); vLLM would read them from a draft model config, which custom_class lacks.
- `propose_draft_token_ids`: call the proposer with hidden states (custom_class gets none) and
  hand its draft probabilities (sampled chains) to vLLM's rejection sampler.
- `_input_fits_in_drafter`: always true for the treedraft proposer. vLLM skips the drafter for the
  *whole batch* when one request is near `max_model_len` (EAGLE's own KV would overflow) and
  schedules placeholder drafts of token 0 for everyone; our head keeps no KV in vLLM's pool and
  the scheduler already cuts each request's drafts to fit `max_model_len`.
- `sample_tokens`: seeded requests in a partial prefill chunk. vLLM samples a token for them and
  throws it away, then rewinds the request's generator with `set_offset`, which CPU generators
  do not support ("CPU Generator does not use offset": the engine dies). Their generators are
  held out of the step instead (the thrown-away token is drawn from the global generator), so
  the seeded stream is untouched, which is what the rewind means.

Tree mode only (a branching tree spec):
- `_prepare_inputs`: build the step's `TreeStep` (kept on this runner) from the scheduled drafts
  and the proposer's trees; overwrite the tree rows' positions with root_pos + depth. This runs after vLLM computed
  the slot mapping from the sequential positions, so nodes keep distinct sequential slots and
  only RoPE (and the attention mask, plugin/attention_cpu.py) see the tree.
- `_build_attention_metadata`: the runner's step rides in its attention metadata, where the
  attention backend reads it (no module-level state: one process may hold several engines).
- `_sample`: verify every drafted request's tree (plugin/sampler.py), then move the accepted
  path's K/V to sequential slots (plugin/kv.py) before vLLM's bookkeeping.
"""

from __future__ import annotations

import time

import torch

from . import tree_step
from .patching import Patch, apply

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def _ours(runner) -> bool:
    from .proposer import TreeDraftProposer

    return isinstance(getattr(runner, "drafter", None), TreeDraftProposer)


def _wrap_setup_aux(original):
    def _setup_eagle3_aux_hidden_state_outputs(self):
        if not _ours(self):
            return original(self)
        aux = self.drafter.aux_layer_ids
        self.use_aux_hidden_state_outputs = bool(aux)
        if aux:
            self.get_model().set_aux_hidden_state_layers(aux)

    return _setup_eagle3_aux_hidden_state_outputs


def _wrap_propose(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        if not _ours(self):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            *args, **kwargs)
        step = tree_step.of_runner(self)
        accepted = step.accepted if step is not None and self.drafter.tree_mode else None
        drafts = self.drafter.propose_step(self, scheduler_output, sampled_token_ids,
                                           hidden_states, aux_hidden_states, accepted)
        setattr(self, tree_step.STEP_ATTR, None)
        # Sampled chains: q for vLLM's rejection sampler (read back by _get_spec_decode_draft_probs
        # at the next step); None = argmax drafts everywhere, vLLM's one-hot q.
        probs = self.drafter.last_draft_probs
        self._draft_probs = None if probs is None else probs.to(self.device)
        self._draft_prob_req_ids = None if probs is None else list(self.input_batch.req_ids)
        return drafts

    return propose_draft_token_ids


def _wrap_fits(original):
    def _input_fits_in_drafter(self, common_attn_metadata):
        return True if _ours(self) else original(self, common_attn_metadata)

    return _input_fits_in_drafter


def _wrap_sample_tokens(original):
    def sample_tokens(self, grammar_output):
        if not _ours(self):
            return original(self, grammar_output)
        gens = self.input_batch.generators
        n = self.input_batch.num_reqs
        discarded = self.discard_request_mask.np[:n].nonzero()[0].tolist()
        held = {i: gens.pop(i) for i in discarded if i in gens and gens[i].device.type == "cpu"}
        try:
            return original(self, grammar_output)
        finally:
            gens.update(held)

    return sample_tokens


def _scratch(runner) -> range:
    """The KV blocks the scheduler never hands out (plugin/scratch.py), once per runner."""
    blocks = getattr(runner, SCRATCH_ATTR, None)
    if blocks is None:
        from .scratch import scratch_range

        blocks = scratch_range(runner.vllm_config, runner.kv_cache_config.num_blocks)
        setattr(runner, SCRATCH_ATTR, blocks)
    return blocks


SCRATCH_ATTR = "_treedraft_scratch"


def _attention_layers(runner) -> int:
    """The target's attention layers (those with a KV cache in vLLM's forward context), each of
    which must run tree attention on a tree step; counted once per runner."""
    n = getattr(runner, LAYERS_ATTR, None)
    if n is None:
        n = sum(getattr(ctx, "kv_cache", None) is not None
                for ctx in runner.compilation_config.static_forward_context.values())
        setattr(runner, LAYERS_ATTR, n)
    return n


LAYERS_ATTR = "_treedraft_attention_layers"


def build_step(runner, scheduler_output) -> tree_step.TreeStep:
    from .sampler import request_unsupported

    ib = runner.input_batch
    if len(ib.block_table.block_tables) > 1:  # e.g. a layer kind none of config's refusals knew
        raise NotImplementedError(
            f"treedraft branching trees need one KV cache group (one block table for every "
            f"attention layer); this target has {len(ib.block_table.block_tables)}: serve it "
            "with a chain ('chain:K'), verified by vLLM")
    step = tree_step.TreeStep(scheduler_output.total_num_scheduled_tokens)
    step.scratch = _scratch(runner)
    qsl = runner.query_start_loc.np
    for i, req_id in enumerate(ib.req_ids):
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if not drafts:
            continue
        if request_unsupported(runner, req_id):
            drafts = []  # not drafted by us (we give such requests none): vLLM samples the root
        qs, root_pos = int(qsl[i]), int(ib.num_computed_tokens_cpu[i])
        req = tree_step.make_request(i, req_id, qs, root_pos, int(ib.token_ids_cpu[i, root_pos]),
                                     drafts, runner.drafter.trees.get(req_id),
                                     runner.drafter.chain_q.get(req_id))
        step.requests[i] = req
        if not req.is_chain:
            runner.positions[qs : qs + req.size] = root_pos + torch.tensor(req.depths)
    return step


def _wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        if _ours(self) and self.drafter.tree_mode:
            # a step that verifies no drafts has no tree step (its layers skip the tree path)
            setattr(self, tree_step.STEP_ATTR,
                    build_step(self, scheduler_output)
                    if scheduler_output.scheduled_spec_decode_tokens else None)
        return result

    return _prepare_inputs


def _wrap_build_attention_metadata(original):
    def _build_attention_metadata(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _ours(self) and self.drafter.tree_mode:
            tree_step.attach(result[0], tree_step.of_runner(self))
        return result

    return _build_attention_metadata


def _sample_ours(runner, original, logits, spec_decode_metadata):
    """A treedraft engine's sampling: vLLM's for chains, tree verification in tree mode."""
    if spec_decode_metadata is None:
        return original(runner, logits, spec_decode_metadata)
    if not any(spec_decode_metadata.num_draft_tokens):
        # Every draft list was cut to nothing (e.g. at max_tokens): plain sampling of the
        # bonus rows. vLLM's rejection sampler crashes on zero draft rows with top-k
        # (`apply_top_k_only` takes max() of an empty tensor).
        return original(runner, logits, None)
    if not runner.drafter.tree_mode:
        return original(runner, logits, spec_decode_metadata)
    from .kv import compact_accepted
    from .sampler import verify_trees

    step = tree_step.of_runner(runner)
    tree_step.check_attended(step, _attention_layers(runner))
    out = verify_trees(runner, logits, spec_decode_metadata, step)
    if step is not None:
        t = time.perf_counter()
        compact_accepted(runner, step)
        step.compaction_seconds += time.perf_counter() - t
    return out


def _wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        if not _ours(self):
            return original(self, logits, spec_decode_metadata)
        from .sampler import treedraft_sampling

        with treedraft_sampling():  # the CPU sampler fixes apply to this engine only
            return _sample_ours(self, original, logits, spec_decode_metadata)

    return _sample


def _wrap_execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        if _ours(self) and self.drafter.auto is not None:
            self.drafter.auto.step_started()  # "tree": "auto" times the worker's step
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


WORKER_PATCHES = [
    Patch(f"{RUNNER}.execute_model", _wrap_execute_model,
          "\"tree\": \"auto\" measures when each step starts"),
    Patch(f"{RUNNER}._setup_eagle3_aux_hidden_state_outputs", _wrap_setup_aux,
          "capture the treedraft head's target layers as aux hidden states"),
    Patch(f"{RUNNER}.propose_draft_token_ids", _wrap_propose,
          "treedraft proposer receives target hidden states"),
    Patch(f"{RUNNER}._sample", _wrap_sample,
          "tree verification and accepted-path KV compaction; steps without drafts"),
    Patch(f"{RUNNER}._input_fits_in_drafter", _wrap_fits,
          "the treedraft head drafts for every batch (vLLM skipped it near max_model_len)"),
    Patch(f"{RUNNER}.sample_tokens", _wrap_sample_tokens,
          "seeded requests in a partial prefill keep their CPU generator untouched"),
]
TREE_PATCHES = [
    Patch(f"{RUNNER}._prepare_inputs", _wrap_prepare_inputs,
          "tree drafts get positions root + depth (slots stay sequential)"),
    Patch(f"{RUNNER}._build_attention_metadata", _wrap_build_attention_metadata,
          "the runner's tree step travels in its own attention metadata"),
]


def install(tree_mode: bool) -> None:
    apply(WORKER_PATCHES)
    if tree_mode:
        from vllm.platforms import current_platform

        from . import attention_cuda

        # CUDA: the Triton tree kernel behind the stock backends; CPU: the chain cover, or the
        # CUDA path's wrapper with the torch twin under TREEDRAFT_TREE_ATTENTION=kernel
        if current_platform.is_cpu() and not attention_cuda.kernel_mode_on_cpu():
            from .attention_cpu import register  # imports vLLM's CPU backend: CPU only

            register()
        else:
            attention_cuda.register()
        apply(TREE_PATCHES)
        # vLLM caches the backend choice per process: an engine built earlier in this process
        # (VLLM_ENABLE_V1_MULTIPROCESSING=0) must not hand this one the causal-only class.
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
