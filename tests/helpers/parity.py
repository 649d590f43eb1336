"""The one-process fp32 reference and the same run on any 3D layout, for parity tests.

``train_gpt(layout)`` trains the built-in GPT (built on the meta device, initialised by the
engine) for a few steps of 4 micro-batches with uneven token counts (right padding ignored
by the loss), gradient clipping on, AdamW built by the engine, and returns every step's loss
and gradient norm. Each data-parallel rank takes its share of the same global batches in the
same micro-batches (as the samplers hand them out), so every layout must reproduce the
one-process numbers, per-micro-batch statistics such as MoE's balancing loss included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from rapidformer.data.samplers import contiguous_share
from rapidformer.distributed.tensors import local_part
from rapidformer.labels import IGNORE_INDEX
from rapidformer.memory import describe
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import TrainState
from rapidformer.step_io import StepFunctions
from rapidformer.testing import MarkovLMDataset, lm_tokens, pad_collate
from tests.helpers.steppers import GradientSizes

GLOBAL_BATCH, MICRO_BATCH, LENGTH = 8, 2, 16
PARITY = 1e-5  # fp32: max |loss difference| over the steps (the bound)

GPT = GPTConfig(
    vocab_size=64,
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=LENGTH,
    dropout=0.0,
)


def batches_of_step(
    step: int, dp_rank: int, dp: int, ragged: bool = False
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of global step ``step``, taken as the samplers
    take them (micro-step k of rank r is one process's micro-step k*dp + r): samples of 3..15
    tokens padded to one length, or with ``ragged`` each micro-batch to its own longest
    sample (as the dynamic-shape iterator does); padding is ignored by the loss either way."""
    data = MarkovLMDataset(
        GLOBAL_BATCH, vocab_size=64, min_length=4, max_length=LENGTH, seed=100 + step
    )
    mine = [data[i] for i in contiguous_share(range(GLOBAL_BATCH), MICRO_BATCH, dp_rank, dp)]
    pad_to = None if ragged else LENGTH
    return [
        pad_collate(mine[i : i + MICRO_BATCH], pad_to) for i in range(0, len(mine), MICRO_BATCH)
    ]


def gpt_loss(logits: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def train_gpt(
    layout: dict[str, Any],
    steps: int = 10,
    *,
    start: int = 0,
    save: tuple[str, int] | None = None,
    load: str | None = None,
    ragged: bool = False,
    before_step: Callable[[TrainState, int], None] | None = None,
) -> dict[str, Any]:
    """Losses and gradient norms of steps ``start`` .. ``steps - 1`` on ``layout`` (config
    overrides: parallel sizes, schedules, sharding, precision ...), plus what this rank holds.
    ``save=(dir, step)`` writes a checkpoint after that many steps; ``load=dir`` resumes from
    the checkpoint there (then ``start`` is its step). ``ragged``: micro-batches of different
    lengths; ``before_step(state, index)`` runs before each step (fault injection)."""
    config = RapidformerConfig.from_dict(
        {
            "micro_batch_size": MICRO_BATCH,
            "global_batch_size": GLOBAL_BATCH,
            "lr": 1e-3,
            "clip_grad": 0.05,  # small enough to clip every step: clipping is exercised
            "seed": 7,
            **layout,
        }
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    state = engine.compose(
        GPTModel.build(GPT, "meta", seed=7),
        lr_scheduler_fn=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: 1.0 / (1.0 + step),  # a moving LR: resume must restore it
        ),
    )
    if load is not None:
        path = find_checkpoint(load)
        assert path is not None
        start = int(load_checkpoint(path, state)["step"])
    step = StepFunctions(
        train_step=lambda b: gpt_loss(state.model(b["input_ids"]), b),
        weight=lm_tokens,
        model_inputs=lambda b: (b["input_ids"],),
        loss=gpt_loss,
    )
    losses, norms, skipped = [], [], []
    dims = engine.dims
    grad_sizes = GradientSizes(state)
    state.stepper = grad_sizes
    for index in range(start, steps):
        if before_step is not None:
            before_step(state, index)
        batches = batches_of_step(index, dims.dp_rank, dims.dp, ragged)
        result = engine.run_step(batches, step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        skipped.append(result.skipped)
        if save is not None and index + 1 == save[1]:
            save_checkpoint(save[0], index + 1, state, {"step": index + 1})
    routing = engine.routing_metrics()  # every rank (it reduces); empty without MoE
    return {
        "routing": routing,
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "weights": _checksum(state),
        "plan": [str(p) for p in state.plan],
        "memory": describe(*state.stepper.expected_bytes(state)),
        "held": held_numels(state, grad_sizes.sizes),
    }


def held_numels(state: TrainState, grad_sizes: dict[int, int]) -> dict[str, list[int]]:
    """name -> [whole numel, numel this rank holds of the parameter, of its gradient, of its
    first optimizer moment], for every parameter this rank holds."""
    optimizer = state.optimizer
    inner = getattr(optimizer, "optim", optimizer)
    held = {}
    for part in state.model_parts:
        for name, param in part.named_parameters():
            moments = inner.state.get(param, {}) if inner is not None else {}
            held[name] = [
                param.numel(),
                local_part(param).numel(),
                grad_sizes.get(id(param), 0),
                local_part(moments["exp_avg"]).numel() if "exp_avg" in moments else 0,
            ]
    return held


def _checksum(state: TrainState) -> float:
    """A number that changes when any parameter this rank holds changes."""
    return float(sum(local_part(p).detach().double().abs().sum() for p in state.parameters))
