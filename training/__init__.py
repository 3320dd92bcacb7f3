"""treedraft.training: target models, prompt data, distillation of draft heads, evaluation.

Imports heads/ and transformers/datasets; never vllm (a vLLM generation engine, where used,
lives in treedraft.plugin and is imported lazily by name).
"""
