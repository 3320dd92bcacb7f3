"""treedraft.heads: the math of treedraft, in pure torch (never imports vllm or transformers).

- ``eagle``: EAGLE-style head (one decoder layer over target features + next-token embedding;
  optional EAGLE-3 fusion of low/mid/high target layers; optional reduced draft vocabulary).
- ``medusa``: Medusa-style parallel residual heads.
- ``common``: configs, target signatures, checkpoints (config.json + model.safetensors).
- ``tree``: token trees as data (paths -> buffers), static / dynamic (EAGLE-2) drafting.
- ``sampling``: target logits processing and exact tree verification (greedy and sampled).
- ``reference``: the reference tree decoder, ground truth for the vLLM plugin.
- ``prefix``: finished draft sessions' K/V by tokens (serving across the target's prefix cache).
- ``shipped``: the heads shipped under ``zoo/`` by short name, and treedraft's cache folder.
- ``machine``: this CPU's ISA flags and the dtype picked from them (serving and training).
"""

from .common import DraftHead, TargetSignature, load_head
from .sampling import SamplingParams, process_logits, verify_tree
from .tree import DraftTree, TreeSpec, draft_tree, parse_tree_spec, tree_buffers

__all__ = [
    "DraftHead", "DraftTree", "SamplingParams", "TargetSignature", "TreeSpec", "draft_tree",
    "load_head", "parse_tree_spec", "process_logits", "tree_buffers", "verify_tree",
]
