"""Checks a training run makes from the target's config alone, before any weights load.

Features
- `check_architecture`: a head that reads target layers other than the final one (every EAGLE-3
  head: `layout: eagle3`, or `target_layer_ids` below L) needs vLLM to hand out the target's
  auxiliary hidden states, which vLLM 0.32 does only for the architectures whose model class
  implements `SupportsEagle3` (`EAGLE3_ARCHITECTURES`; tests/test_recipes.py checks the list
  against the installed vLLM). Any other target is refused at the start of the run, not after
  hours of training a head nothing could serve.
- `estimate_memory`: bytes per process of one training step, from the config only:

      target weights   P_target x bytes(target_dtype)           (meta-device count of P_target)
      head state       P_head x 16                               (fp32 weights, grads, Adam m, v)
      target forward   (L + 1) x B x T x H x bytes(target_dtype)  (every hidden state is kept)
                       + 3 x B x T x I x bytes(target_dtype)     (one layer's MLP in flight)
      soft labels      3 x N x V x 4 + V x H x 4                 (fp32 logits, log-softmax, copy;
                                                                 the fp32 LM head they read)
      head, per unroll step (D of them, kept for backward):
                       B x T x (16 H + 3 I_head) x 4 + 3 x N x Vd x 4

  with B = batch_size, T = max_seq_len (every sequence as long as allowed: an upper end),
  N = B x min(T, gen_max_new_tokens) label rows (replies only) and Vd the draft vocabulary.
  `check_memory` prints it and refuses a run that would not fit the device's memory (the GPU's,
  or the RAM on a CPU), naming the knobs that shrink it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import TrainConfig

# vLLM 0.32's text-generation architectures whose model class implements SupportsEagle3 (it can
# return auxiliary hidden states): `ModelRegistry` classes with `supports_eagle3(cls)` true.
EAGLE3_ARCHITECTURES = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Gemma4ForCausalLM",
    "GptOssForCausalLM", "GraniteForCausalLM", "GraniteSWAForCausalLM", "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM", "K2HorizonForCausalLM", "LLaMAForCausalLM", "LagunaForCausalLM",
    "Llama4ForCausalLM", "LlamaForCausalLM", "MiMoForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "Phi3ForCausalLM", "Plamo3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "SarvamMLAForCausalLM", "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM",
    "TeleFLMForCausalLM",
})


def check_architecture(cfg: TrainConfig, hf_config, head: dict) -> None:
    """Refuse an EAGLE head that reads auxiliary target layers of an architecture vLLM 0.32
    cannot take them from (`head`: the resolved head overrides)."""
    if cfg.head_type != "eagle":
        return
    L = hf_config.num_hidden_layers
    ids = head.get("target_layer_ids") or [L]
    aux = [i for i in ids if i % (L + 1) != L]
    if head.get("layout") != "eagle3" and not aux:
        return
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch in EAGLE3_ARCHITECTURES:
        return
    raise ValueError(
        f"target {cfg.target!r} is a {arch}, and vLLM 0.32 returns auxiliary hidden states "
        f"(SupportsEagle3) for none of its layers, so a head with layout="
        f"{head.get('layout', 'eagle1')!r} and target_layer_ids={list(ids)} could be served "
        "neither by stock vLLM (EAGLE-3 export) nor by treedraft. Train a head on the final "
        f"layer only (--head.layout=eagle1 --head.target-layer-ids=[{L}]; treedraft serves it, "
        "it does not export) or a Medusa head (--head-type=medusa --head={}), or pick a target "
        f"vLLM supports for EAGLE-3 ({', '.join(sorted(EAGLE3_ARCHITECTURES)[:6])}, ...)")


@dataclass
class MemoryEstimate:
    target_weights: int
    head_state: int
    target_forward: int
    labels: int
    head_activations: int
    capacity: int  # the device's memory (GPU total, or physical RAM on a CPU)
    where: str

    @property
    def total(self) -> int:
        return (self.target_weights + self.head_state + self.target_forward + self.labels
                + self.head_activations)

    def summary(self) -> str:
        gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
        return (f"about {gib(self.total)} GiB per process (target weights {gib(self.target_weights)}"
                f" + head and optimizer {gib(self.head_state)} + target forward "
                f"{gib(self.target_forward)} + soft labels {gib(self.labels)} + head activations "
                f"{gib(self.head_activations)}) of {gib(self.capacity)} GiB on {self.where}")


def count_params(hf_config) -> int:
    """Parameters of the target (tied embeddings once), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def device_capacity(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"{props.name} ({device})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def estimate_memory(cfg: TrainConfig, hf_config, head, device: torch.device,
                    target_params: int | None = None) -> MemoryEstimate:
    """The module docstring's arithmetic for one training step of `head` on this target."""
    tbytes = torch.empty((), dtype=cfg.target_torch_dtype(device)).element_size()
    P = count_params(hf_config) if target_params is None else target_params
    B, T, H = cfg.batch_size, cfg.max_seq_len, hf_config.hidden_size
    L, V = hf_config.num_hidden_layers, hf_config.vocab_size
    N = B * min(T, cfg.gen_max_new_tokens) if cfg.regenerate else B * T
    I_t = getattr(hf_config, "intermediate_size", 4 * H)
    hc = head.config
    if head.head_type == "eagle":
        Vd = hc.draft_vocab_size or V
        steps, per_step = cfg.unroll_steps, B * T * (16 * H + 3 * hc.intermediate_size) * 4
    else:
        Vd, steps, per_step = V, hc.num_heads, B * T * 4 * H * 4
    capacity, where = device_capacity(device)
    return MemoryEstimate(
        target_weights=P * tbytes,
        head_state=sum(p.numel() for p in head.parameters() if p.requires_grad) * 16,
        target_forward=(L + 1) * B * T * H * tbytes + 3 * B * T * I_t * tbytes,
        labels=3 * N * V * 4 + V * H * 4,
        head_activations=steps * (per_step + 3 * N * Vd * 4),
        capacity=capacity, where=where)


def check_memory(cfg: TrainConfig, est: MemoryEstimate, main: bool = True) -> None:
    """Print the estimate; refuse a run whose estimate exceeds the device's memory."""
    if main:
        print(f"[treedraft] memory estimate: {est.summary()}", flush=True)
    if cfg.memory_check and est.total > est.capacity:
        raise ValueError(
            f"this run would not fit: {est.summary()}. Lower batch_size (with grad_accum to keep "
            "the step), max_seq_len or unroll_steps, set head.draft_vocab_size, load the target "
            "in bfloat16 (--target-dtype=bfloat16), or, where the estimate is too pessimistic "
            "for your data, --memory-check=false")
