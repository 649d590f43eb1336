"""Helpers shipped with the package for tests, demos and benchmarks: a tiny transformer, data
it can learn, and a launcher that runs a function on several CPU ranks."""

from rapidformer.testing.launch import run_distributed
from rapidformer.testing.tiny import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate

__all__ = ["MarkovLMDataset", "TinyTransformerLM", "lm_loss", "pad_collate", "run_distributed"]
