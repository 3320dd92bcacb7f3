"""A random 2-layer Llama saved with SmolLM2's tokenizer: the tiny target of the training tests."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(root: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treedraft.training.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      initializer_range=0.3, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    return root
