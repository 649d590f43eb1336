"""Shared pieces of the CUDA tests: a tiny GPT, its batches and an engine loop."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import TrainState
from rapidformer.step_io import StepFunctions

VOCAB, SEQ, BATCH = 256, 64, 4


def tiny_gpt(layers: int = 2, hidden: int = 64) -> GPTModel:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        dropout=0.0,
    )
    return GPTModel.build(config, device="cpu")


def batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=generator)
    return [step.cuda() for step in ids]


def lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def engine_for(**options: Any) -> RapidformerEngine:
    config = RapidformerConfig.from_dict(
        {
            "lr": 1e-3,
            "micro_batch_size": BATCH,
            "seq_length": SEQ,
            "optimizers": "apex_adam",
            "log_interval": 1000,
            **options,
        }
    )
    return RapidformerEngine(config, builds_optimizer=True)


def train(
    options: dict[str, Any], steps: int = 5, model: torch.nn.Module | None = None
) -> tuple[list[torch.Tensor], RapidformerEngine, TrainState]:
    """``steps`` engine steps of the tiny GPT (or ``model``); the losses stay on the device."""
    engine = engine_for(**options)
    state = engine.compose(model if model is not None else tiny_gpt())
    functions = StepFunctions(
        train_step=lambda ids: lm_loss(state.model, ids), weight=lambda ids: ids.shape[0]
    )
    losses = [engine.run_step([ids], functions).loss_tensor for ids in batches(steps)]
    return losses, engine, state


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs()) for x, y in zip(a, b, strict=True))
