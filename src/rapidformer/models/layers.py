"""Building blocks shared by the built-in GPT and BERT: attention, feed-forward, block, init.

Everything here is written so that later parallelism can cut it without rewriting it:

* only plain ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` hold parameters, so DTensor's
  ``ColwiseParallel`` / ``RowwiseParallel`` apply to them directly;
* the query, key and value projections are three separate ``nn.Linear``. A column-wise split
  shards a weight's output dimension into contiguous slices; for a separate ``q_proj`` that
  slice is a contiguous group of whole heads, and ``k_proj`` / ``v_proj`` give the same heads
  on the same rank. A fused ``[3 * hidden, hidden]`` projection split the same way would hand
  rank 0 all of Q and part of K (unless its rows were re-interleaved per head, which breaks
  the Hugging Face layout), so it is not used;
* heads are recovered with ``view(batch, length, -1, head_dim)``: a tensor-parallel shard holds
  fewer heads and the same code runs on it;
* ``TransformerBlock.ffn`` is a self-contained ``[B, T, H] -> [B, T, H]`` module (``fc1``,
  ``activation``, ``fc2``) that a mixture-of-experts layer can replace;
* models keep their blocks in one ``nn.ModuleDict`` named ``blocks``, keyed by layer index
  (activation checkpointing and pipeline stages cut there, and a stage's layers keep their
  names) and have no buffers, so they can be created on the meta device and materialised and
  initialised after parallelisation (:mod:`rapidformer.models.stages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

TPStyle = Literal[
    "colwise",
    "rowwise",
    "vocab_parallel",
    "vocab_logits",
    "position",
    "sequence_norm",
    "sequence_input",
]
"""How a tensor-parallel plan splits a module: ``colwise`` shards a Linear's output features
(weight dim 0, and its bias), ``rowwise`` shards its input features (weight dim 1; the partial
outputs are summed), ``vocab_parallel`` shards an Embedding's rows (the vocabulary; the
partial lookups are summed), ``vocab_logits`` is a column-parallel LM head whose logits stay
sharded on the vocabulary for a vocab-parallel loss. The last three only act under sequence
parallelism: ``position`` looks position embeddings up sequence-sharded, ``sequence_norm``
runs a LayerNorm on the sequence shard, ``sequence_input`` all-gathers the sequence shard a
module's first argument arrives as. :mod:`rapidformer.accel.tensor_parallel` maps them onto
``torch.distributed.tensor.parallel``'s styles."""


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate Q/K/V projections and SDPA.

    ``causal=True`` uses SDPA's causal mask (and no explicit mask, which keeps the fused
    kernels available); otherwise an optional boolean ``attention_mask`` broadcastable to
    ``[B, heads, T, T]`` (True = may attend) is applied. A causal layer given a mask applies it
    instead of its own: a document mask (``--reset-attention-mask``), causal within each
    document.
    """

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by {num_heads} heads")
        self.head_dim = hidden_size // num_heads
        self.dropout = dropout
        self.causal = causal
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        # [B, T, heads, head_dim] -> [B, heads, T, head_dim]; -1 heads so a TP shard works.
        q = self.q_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and attention_mask is None,
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    """The MLP of a block: ``fc2(activation(fc1(x)))``. GELU with ``approximate="tanh"`` is
    GPT-2's ("gelu_new"), ``"none"`` is BERT's erf GELU."""

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, approximate: Literal["none", "tanh"]
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.activation = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class TransformerBlock(nn.Module):
    """One transformer layer: self-attention then the feed-forward network, each with a
    residual connection, dropout on the sub-layer output, and a LayerNorm.

    ``norm_first=True`` is pre-LayerNorm (GPT-2): ``x + drop(sub(norm(x)))``.
    ``norm_first=False`` is post-LayerNorm (original BERT): ``norm(x + drop(sub(x)))``.
    ``attention_norm`` / ``ffn_norm`` are the LayerNorms that belong to each sub-layer.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_hidden_size: int,
        dropout: float,
        layernorm_epsilon: float,
        approximate: Literal["none", "tanh"],
        norm_first: bool,
        causal: bool,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attention_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.attention = SelfAttention(hidden_size, num_heads, dropout, causal)
        self.ffn_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.ffn = FeedForward(hidden_size, ffn_hidden_size, approximate)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.norm_first:
            # The mask goes by keyword: tensor parallelism re-lays-out the first argument only.
            h = self.attention(self.attention_norm(x), attention_mask=attention_mask)
            x = x + self.dropout(h)
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        x = self.attention_norm(x + self.dropout(self.attention(x, attention_mask=attention_mask)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


def gpt2_residual_std(num_layers: int, std: float = 0.02) -> float:
    """GPT-2's init for the residual output projections: std / sqrt(2 * layers) (two residual
    additions per block)."""
    return std / math.sqrt(2 * num_layers)


@dataclass(frozen=True)
class TransformerShape:
    """What the built-in models' configs share: their size, its checks and the FFN width.
    ``ffn_hidden_size=None`` means ``4 * hidden_size``; ``dropout`` applies to the embeddings,
    the attention probabilities and both residual branches."""

    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None
    dropout: float = 0.1

    def __post_init__(self) -> None:
        """Reject shapes no model can be built with."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        if hidden <= 0 or heads <= 0 or self.num_layers <= 0:
            raise ValueError("hidden_size, num_attention_heads and num_layers must be positive")
        if hidden % heads:
            raise ValueError(
                f"hidden_size {hidden} is not divisible by num_attention_heads {heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn_size(self) -> int:
        """The FFN's hidden width: ``ffn_hidden_size``, or ``4 * hidden_size`` when that is None.
        (The field keeps None, so ``dataclasses.replace(config, hidden_size=...)`` rescales
        it.)"""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size
