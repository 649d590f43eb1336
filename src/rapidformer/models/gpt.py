"""GPT: the GPT-2 architecture written for parallelism.

Learned token and position embeddings, a stack of pre-LayerNorm blocks (causal self-attention,
GELU-tanh MLP), a final LayerNorm and a language-model head tied to the token embedding.
Numerically it is GPT-2: :mod:`rapidformer.models.convert` maps Hugging Face
``GPT2LMHeadModel`` weights in and out and the logits agree to float rounding. It can be built
on the meta device and cut into pipeline stages (:mod:`rapidformer.models.stages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rapidformer.models.fused_loss import fused_linear_cross_entropy, require_labels
from rapidformer.models.layers import (
    TPStyle,
    TransformerBlock,
    TransformerShape,
    gpt2_residual_std,
)
from rapidformer.models.moe import MoESpec, install_moe
from rapidformer.models.stages import StagedModel


@dataclass(frozen=True)
class GPTConfig(TransformerShape):
    """Shape of a GPT model (the shared fields: :class:`TransformerShape`)."""

    layernorm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    moe: MoESpec | None = None
    """Mixture-of-experts FFNs in the layers it names (``--num-experts``)."""


class GPTModel(StagedModel):
    """GPT-2-style causal language model.

    Build it with :meth:`build` (meta-device construction, then deterministic init: N(0, 0.02)
    weights, GPT-2's N(0, 0.02 / sqrt(2 * layers)) for the residual output projections, zero
    biases, unit LayerNorms); calling the constructor directly leaves PyTorch's default
    initialisation.

    State dict: ``token_embeddings.weight``, ``position_embeddings.weight``,
    ``blocks.{i}.attention_norm.*``, ``blocks.{i}.attention.{q,k,v,out}_proj.*``,
    ``blocks.{i}.ffn_norm.*``, ``blocks.{i}.ffn.fc1.*``, ``blocks.{i}.ffn.fc2.*``,
    ``final_norm.*`` and ``lm_head.weight`` (the same tensor as ``token_embeddings.weight``
    when ``tie_word_embeddings``, unless a pipeline split puts them on different stages).
    """

    embedding_modules = ("token_embeddings", "position_embeddings", "embedding_dropout")
    head_modules = ("final_norm", "lm_head")

    token_embeddings: nn.Embedding | None
    position_embeddings: nn.Embedding | None
    embedding_dropout: nn.Dropout | None
    final_norm: nn.LayerNorm | None
    lm_head: nn.Linear | None

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.token_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict(
            {
                str(layer): TransformerBlock(
                    hidden,
                    config.num_attention_heads,
                    config.ffn_size,
                    config.dropout,
                    config.layernorm_epsilon,
                    approximate="tanh",
                    norm_first=True,
                    causal=True,
                )
                for layer in range(config.num_layers)
            }
        )
        self.final_norm = nn.LayerNorm(hidden, eps=config.layernorm_epsilon)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        install_moe(self.blocks, config.moe, hidden, config.ffn_size, "tanh")
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the LM head (when the config ties them)."""
        tied = self.config.tie_word_embeddings
        if tied and self.lm_head is not None and self.token_embeddings is not None:
            self.lm_head.weight = self.token_embeddings.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        if not self.config.tie_word_embeddings:
            return {}
        return {"lm_head.weight": "token_embeddings.weight"}

    def residual_std(self) -> float:
        return gpt2_residual_std(self.config.num_layers)

    @property
    def tp_plan(self) -> dict[str, TPStyle]:
        """How tensor parallelism splits this model (module-name patterns, ``*`` = any block).

        Q/K/V and ``fc1`` are column-parallel (each rank keeps whole heads / a slice of the
        FFN's hidden features), ``out_proj`` and ``fc2`` row-parallel (their partial sums are
        reduced once per sub-layer), the token embedding is vocab-parallel and the LM head is
        column-parallel over the vocabulary with sharded logits (a vocab-parallel loss). Both of
        the last two shard dim 0 of the same ``[vocab, hidden]`` weight, so tying survives the
        split. LayerNorms and position embeddings stay replicated, or with sequence parallelism
        work on the sequence shard (the ``sequence_*`` and ``position`` entries)."""
        return {
            "token_embeddings": "vocab_parallel",
            "position_embeddings": "position",
            "blocks.*.attention_norm": "sequence_norm",
            "blocks.*.attention": "sequence_input",
            "blocks.*.attention.q_proj": "colwise",
            "blocks.*.attention.k_proj": "colwise",
            "blocks.*.attention.v_proj": "colwise",
            "blocks.*.attention.out_proj": "rowwise",
            "blocks.*.ffn_norm": "sequence_norm",
            "blocks.*.ffn": "sequence_input",
            "blocks.*.ffn.fc1": "colwise",
            "blocks.*.ffn.fc2": "rowwise",
            "final_norm": "sequence_norm",
            "lm_head": "vocab_logits",
        }

    fused_lm_loss = False
    """Set by ``--fused-lm-loss``: in training, with ``labels``, forward returns the mean
    next-token loss computed chunk by chunk (:mod:`rapidformer.accel.lm_loss`), not logits."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]`` (or, under ``fused_lm_loss``
        in training with ``labels`` ``[B, T]``, the 0-dim mean cross-entropy).

        A pipeline stage without the embeddings takes the previous stage's hidden states
        ``[B, T, hidden]`` as ``input_ids``; one without the head returns hidden states.

        ``attention_mask`` (1 = real token) is accepted for right-padded batches and not
        applied: under causal attention a real token never attends to the padding that follows
        it, so real tokens' logits are exactly those of the unpadded sequence, and attention
        keeps SDPA's mask-free causal kernels. Logits at padded positions are meaningless; the
        loss must ignore them. Left padding is not supported (positions would be shifted).

        ``position_ids`` ``[B, T]`` (``--reset-position-ids``) replace ``0..T-1``;
        ``document_mask`` ``[B, 1, T, T]`` (``--reset-attention-mask``, True = may attend)
        replaces the causal mask: each token sees only the earlier tokens of its document.
        Under a pipeline split every stage is given both (the later stages ignore the
        positions) with the previous stage's hidden states in place of ``input_ids``.
        """
        del attention_mask  # right padding only: see the docstring
        x = input_ids
        if self.token_embeddings is not None:
            assert self.position_embeddings is not None and self.embedding_dropout is not None
            length = input_ids.shape[1]
            self.check_length(length)
            positions = torch.arange(length, device=input_ids.device)
            if position_ids is not None:
                positions = position_ids
            x = self.token_embeddings(input_ids) + self.position_embeddings(positions)
            x = self.embedding_dropout(x)
        for block in self.blocks.values():
            x = block(x) if document_mask is None else block(x, attention_mask=document_mask)
        if self.lm_head is None:
            return x
        assert self.final_norm is not None
        x = self.final_norm(x)
        if self.fused_lm_loss and self.training:
            labels = require_labels(self, labels)
            head = self.lm_head
            return fused_linear_cross_entropy(x, head.weight, head.bias, labels)
        return self.lm_head(x)
