"""Helpers shipped with the package for tests, demos and benchmarks: a tiny transformer, data
it can learn, a launcher that runs a function on several CPU ranks, and tiny Hugging Face
models (BERT, GPT-2, T5) with fine-tuning datasets they can learn, all built offline."""

from rapidformer.testing.finetune import task_dataset, tiny_model
from rapidformer.testing.launch import run_distributed
from rapidformer.testing.tiny import (
    MarkovLMDataset,
    TinyTransformerLM,
    lm_loss,
    lm_tokens,
    pad_collate,
)

__all__ = [
    "MarkovLMDataset",
    "TinyTransformerLM",
    "lm_loss",
    "lm_tokens",
    "pad_collate",
    "run_distributed",
    "task_dataset",
    "tiny_model",
]
