"""White-box training with the Trainer template: a tiny GPT-style model on a synthetic corpus.

    python examples/train_tiny_transformer.py --save runs/tiny          # defaults below
    python examples/train_tiny_transformer.py --mixed-precision --checkpoint-activations
    torchrun --nproc_per_node 2 examples/train_tiny_transformer.py --global-batch-size 32
    rapidformer --user-script examples/train_tiny_transformer.py --train-iters 50 --lr 1e-3

The hooks below are all a user writes; every acceleration comes from flags.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from rapidformer import DataBundle, Trainer
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, lm_tokens, pad_collate

DEFAULTS = [
    "--train-iters",
    "300",
    "--micro-batch-size",
    "16",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "20",
    "--lr-decay-style",
    "cosine",
    "--log-interval",
    "25",
    "--eval-interval",
    "100",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "64",
]


class DemoTrainer(Trainer):
    vocab_size = 64
    dropout = 0.1
    train_samples, valid_samples = 2048, 256

    def build_model(self) -> nn.Module:
        model = self.config.model
        return TinyTransformerLM(
            vocab_size=self.vocab_size,
            hidden=model.hidden_size or 64,
            layers=model.num_layers or 2,
            heads=model.num_attention_heads or 4,
            max_positions=model.max_position_embeddings or 64,
            dropout=self.dropout,
        )

    def build_data(self) -> DataBundle:
        length = self.config.model.seq_length or 32
        return DataBundle(
            train=MarkovLMDataset(self.train_samples, self.vocab_size, length // 4, length, seed=1),
            valid=MarkovLMDataset(self.valid_samples, self.vocab_size, length // 4, length, seed=2),
            collate_fn=pad_collate,
        )

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        return lm_loss(self.model, batch)["loss"]  # the mean loss over the real tokens

    def batch_weight(self, batch: Any) -> torch.Tensor:
        # The loss averages over the real (unpadded) tokens: counting them before the forward
        # lets gradient accumulation weight every micro-batch exactly.
        return lm_tokens(batch)


if __name__ == "__main__":
    trainer = DemoTrainer(argv=DEFAULTS + sys.argv[1:])
    metrics = trainer.fit()
    trainer.engine.close()
    if trainer.engine.is_main_process:
        print(
            f"final: train loss {metrics['train_loss']:.3f}, eval loss {metrics['eval_loss']:.3f}"
        )
