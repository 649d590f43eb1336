"""One evaluation pass over this rank's share of the validation set, in lockstep where the
model's forward is a collective.

Ranks may hold different numbers of batches. When the forward gathers parameters (FSDP2,
DeepSpeed ZeRO-3) every rank must run as many forwards: a rank that runs out repeats forwards
on a filler batch and discards their outputs, until it has run as many as the rank with the
most.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from rapidformer.distributed import process_group
from rapidformer.state import TrainState, evaluation_context
from rapidformer.step_io import local_loss
from rapidformer.templates.batches import StepOutput, filler_batch, loss_of, move_to_device


def evaluation_pass(
    state: TrainState,
    eval_step: Callable[[Any], StepOutput],
    batch_weight: Callable[[Any], int | torch.Tensor],
    limit: int | None,
) -> tuple[float, list[Mapping[str, Any]]]:
    """The mean eval loss (weighted by ``batch_weight``, summed over the data-parallel ranks)
    and this rank's ``eval_step`` outputs, over at most ``limit`` batches; the model is in
    eval mode for the pass and in train mode after it."""
    loader = state.eval_dataloader
    assert loader is not None
    device, dp_group = state.device, state.mesh.group("dp")
    count = len(loader) if limit is None else min(len(loader), limit)
    if state.forward_backward.forward_is_collective(state):
        count = process_group.all_reduce_max(count, dp_group, device)
    totals = torch.zeros(2, device=device)
    outputs: list[Mapping[str, Any]] = []
    state.unwrapped_model.eval()
    try:
        with evaluation_context(state):
            batches = iter(loader)
            for _ in range(count):
                batch = next(batches, None)
                if batch is None:  # lockstep only: this rank's share is done
                    eval_step(move_to_device(filler_batch(loader), device))
                    continue
                batch = move_to_device(batch, device)
                output = eval_step(batch)
                weight = torch.as_tensor(batch_weight(batch), dtype=torch.float32, device=device)
                loss = local_loss(loss_of(output, "eval_step")).detach().float()
                totals += torch.stack([weight, loss * weight])
                outputs.append(output if isinstance(output, Mapping) else {"loss": output})
    finally:
        state.model.train()
    process_group.all_reduce_sum(totals, dp_group)
    weight_sum, loss_sum = totals.tolist()
    return loss_sum / max(weight_sum, 1e-12), outputs
