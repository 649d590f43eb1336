"""BERT: the original BERT architecture with its pre-training heads, written for parallelism.

Word + position + token-type embeddings followed by LayerNorm and dropout; a stack of
post-LayerNorm blocks (bidirectional self-attention with a padding mask, erf-GELU MLP); a
pooler (dense + tanh on the first, ``[CLS]``, token); an MLM head (dense + GELU + LayerNorm,
then a decoder tied to the word embeddings plus its own bias) and a 2-way sentence-order /
next-sentence head on the pooled output. Numerically it is Hugging Face's
``BertForPreTraining``; :mod:`rapidformer.models.convert` maps the weights in and out. It can be
built on the meta device and cut into pipeline stages (:mod:`rapidformer.models.stages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rapidformer.models.fused_loss import fused_linear_cross_entropy, require_labels
from rapidformer.models.layers import TPStyle, TransformerBlock, TransformerShape
from rapidformer.models.moe import MoESpec, install_moe
from rapidformer.models.stages import StagedModel


@dataclass(frozen=True)
class BertConfig(TransformerShape):
    """Shape of a BERT model (the shared fields: :class:`TransformerShape`)."""

    type_vocab_size: int = 2
    layernorm_epsilon: float = 1e-12
    moe: MoESpec | None = None
    """Mixture-of-experts FFNs in the layers it names (``--num-experts``)."""


class BertModel(StagedModel):
    """BERT encoder with the MLM and sentence-order (NSP) pre-training heads.

    Build it with :meth:`build` (N(0, 0.02) weights, zero biases, the MLM output bias too,
    unit LayerNorms); the constructor alone leaves PyTorch's default init.

    State dict: ``token_embeddings``, ``position_embeddings``, ``token_type_embeddings``,
    ``embedding_norm``; ``blocks.{i}.attention.{q,k,v,out}_proj``, ``blocks.{i}.attention_norm``,
    ``blocks.{i}.ffn.fc1``, ``blocks.{i}.ffn.fc2``, ``blocks.{i}.ffn_norm``; ``pooler``;
    ``mlm_transform``, ``mlm_norm``, ``lm_head`` (weight = ``token_embeddings.weight``, plus
    its own bias); ``sop_head``. Each entry ends in ``.weight`` / ``.bias``.
    """

    embedding_modules = (
        "token_embeddings",
        "position_embeddings",
        "token_type_embeddings",
        "embedding_norm",
        "embedding_dropout",
    )
    head_modules = ("pooler", "mlm_transform", "mlm_activation", "mlm_norm", "lm_head", "sop_head")

    token_embeddings: nn.Embedding | None
    position_embeddings: nn.Embedding | None
    token_type_embeddings: nn.Embedding | None
    embedding_norm: nn.LayerNorm | None
    embedding_dropout: nn.Dropout | None
    pooler: nn.Linear | None
    mlm_transform: nn.Linear | None
    mlm_activation: nn.GELU | None
    mlm_norm: nn.LayerNorm | None
    lm_head: nn.Linear | None
    sop_head: nn.Linear | None

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        eps = config.layernorm_epsilon
        self.token_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict(
            {
                str(layer): TransformerBlock(
                    hidden,
                    config.num_attention_heads,
                    config.ffn_size,
                    config.dropout,
                    eps,
                    approximate="none",
                    norm_first=False,
                    causal=False,
                )
                for layer in range(config.num_layers)
            }
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.mlm_transform = nn.Linear(hidden, hidden)
        self.mlm_activation = nn.GELU()
        self.mlm_norm = nn.LayerNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size)
        self.sop_head = nn.Linear(hidden, 2)
        install_moe(self.blocks, config.moe, hidden, config.ffn_size, "none")
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the word embedding with the MLM decoder (BERT always ties them)."""
        if self.lm_head is not None and self.token_embeddings is not None:
            self.lm_head.weight = self.token_embeddings.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "token_embeddings.weight"}

    @property
    def tp_plan(self) -> dict[str, TPStyle]:
        """How tensor parallelism splits this model (see :attr:`GPTModel.tp_plan`): Q/K/V and
        ``fc1`` column-parallel, ``out_proj`` and ``fc2`` row-parallel, the word embedding
        vocab-parallel and the tied MLM decoder column-parallel over the vocabulary (weight and
        bias) with sharded logits (a vocab-parallel MLM loss). Position / token-type
        embeddings, LayerNorms, the pooler, the MLM transform and the 2-way head are small and
        stay replicated. No sequence parallelism: the post-LayerNorm blocks and the pooler's
        first-token read would need a different layout."""
        return {
            "token_embeddings": "vocab_parallel",
            "blocks.*.attention.q_proj": "colwise",
            "blocks.*.attention.k_proj": "colwise",
            "blocks.*.attention.v_proj": "colwise",
            "blocks.*.attention.out_proj": "rowwise",
            "blocks.*.ffn.fc1": "colwise",
            "blocks.*.ffn.fc2": "rowwise",
            "lm_head": "vocab_logits",
        }

    fused_lm_loss = False
    """Set by ``--fused-lm-loss``: see :meth:`forward`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mlm_labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """``(mlm_logits [B, T, vocab], sop_logits [B, 2])`` for ``input_ids`` ``[B, T]`` (under
        ``fused_lm_loss`` in training with ``mlm_labels``: the 0-dim mean MLM loss, computed
        chunk by chunk, in place of the logits).

        ``token_type_ids`` default to 0 (segment A). ``attention_mask`` ``[B, T]`` is 1 for real
        tokens and 0 for padding (anywhere in the sequence); no token attends to padding. Every
        row needs at least one real token.

        A pipeline stage without the embeddings takes what the previous stage returned,
        ``(hidden_states [B, T, hidden], attention_mask)`` (positionally: the mask arrives in
        the second slot); one without the heads returns hidden states, with the mask beside
        them when there is one, so that the padding mask crosses every stage.
        """
        x = input_ids
        if self.token_embeddings is not None:
            x = self._embed(input_ids, token_type_ids)
        elif attention_mask is None:
            attention_mask = token_type_ids  # a later stage: (hidden states, mask)
        mask = None
        if attention_mask is not None:
            # [B, T] -> [B, 1, 1, T]: every query (and head) sees the same real keys.
            mask = attention_mask[:, None, None, :].to(torch.bool)
        for block in self.blocks.values():
            x = block(x, mask)
        if self.lm_head is None:
            return x if attention_mask is None else (x, attention_mask)
        assert self.pooler and self.mlm_transform and self.mlm_activation and self.mlm_norm
        assert self.sop_head is not None
        pooled = torch.tanh(self.pooler(x[:, 0]))
        hidden = self.mlm_norm(self.mlm_activation(self.mlm_transform(x)))
        if self.fused_lm_loss and self.training:
            mlm_labels = require_labels(self, mlm_labels)
            head = self.lm_head
            mlm = fused_linear_cross_entropy(hidden, head.weight, head.bias, mlm_labels)
            return mlm, self.sop_head(pooled)
        return self.lm_head(hidden), self.sop_head(pooled)

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        assert self.token_embeddings is not None and self.position_embeddings is not None
        assert self.token_type_embeddings is not None and self.embedding_norm is not None
        assert self.embedding_dropout is not None
        length = input_ids.shape[1]
        self.check_length(length)
        positions = torch.arange(length, device=input_ids.device)
        x = self.token_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = x + self.token_type_embeddings(token_type_ids)
        return self.embedding_dropout(self.embedding_norm(x))
