"""The tiny built-in model shape the model tests share, and what each tensor-parallel style
of a model's plan applies to."""

from __future__ import annotations

from torch import nn

MODEL_SHAPE = {
    # The tiny built-in GPT/BERT shape the model tests share.
    "vocab_size": 100,
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
}

TP_STYLE_KINDS: dict[str, type[nn.Module]] = {
    "vocab_parallel": nn.Embedding,
    "position": nn.Embedding,
    "colwise": nn.Linear,
    "rowwise": nn.Linear,
    "vocab_logits": nn.Linear,
    "sequence_norm": nn.LayerNorm,
    "sequence_input": nn.Module,  # the attention and FFN sub-layers
}
"""The module kind each style of a ``tp_plan`` may match."""
