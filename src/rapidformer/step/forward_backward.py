"""Eager forward and backward: torch autograd on the module this rank holds.

The default implementation of the forward-backward slot (:class:`rapidformer.state.
ForwardBackward`). Each micro-batch's loss arrives as the mean over its units and is multiplied
by the engine's scale, ``units x dp / units of the whole global batch``, before its backward, so
the gradients summed over micro-batches and averaged over the data-parallel ranks are those of
one big batch: accumulation is exact and no gradient is rescaled afterwards.

Who reduces the gradients over the data-parallel ranks:

* DDP, in the step's last backward only. DDP decides in the *forward* whether the backward that
  follows all-reduces (``require_backward_grad_sync``, what ``no_sync()`` toggles), so
  :meth:`EagerForwardBackward.arm` sets it before every micro-batch's forward;
* FSDP2, in every backward (reduce-scatter): holding whole unsharded gradients through an
  accumulation would cost the memory ZeRO-2/3 exist to save.

Under tensor parallelism with a vocab-parallel head (``state.loss_parallel``), each micro-batch's
loss and backward run inside ``torch.distributed.tensor.parallel.loss_parallel()``, so the
cross-entropy reads the sharded logits where they are; the loss comes back as a replicated
DTensor and continues as this rank's (identical) local value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rapidformer.distributed.tensors import local_part
from rapidformer.loaded import instance_of
from rapidformer.state import TrainState, loss_context
from rapidformer.step_io import StepFunctions, local_loss


class EagerForwardBackward:
    """torch autograd, under DDP or FSDP2 or on one process; see the module docstring. It
    also serves hand-written loops (:class:`rapidformer.state.MicroStepBackward`)."""

    name = "eager"
    averaged_by = "ddp"
    holds_whole_model = True

    def forward_modules(self, state: TrainState) -> list[nn.Module]:
        return [state.model]

    def forward_is_collective(self, state: TrainState) -> bool:
        # FSDP2 all-gathers each unit's parameters in its forward.
        return (
            instance_of(state.unwrapped_model, "torch.distributed.fsdp", "FSDPModule")
            and state.mesh.dims.dp > 1
        )

    def norm_skips(self, state: TrainState) -> frozenset[int]:
        """No parameter's gradient is counted elsewhere."""
        return frozenset()

    def run(
        self, state: TrainState, batches: Sequence[Any], step: StepFunctions, scales: torch.Tensor
    ) -> torch.Tensor:
        losses = []
        for index, batch in enumerate(batches):
            self.arm(state, last=index == len(batches) - 1)
            with loss_context(state):
                loss = local_loss(step.train_step(batch))
                self.backward(state, loss * scales[index])
            losses.append(loss.detach().float())
        return torch.stack(losses)

    def arm(self, state: TrainState, last: bool) -> None:
        if isinstance(state.model, DistributedDataParallel):
            state.model.require_backward_grad_sync = last

    def backward(self, state: TrainState, loss: torch.Tensor) -> None:
        scaler = state.precision.grad_scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def rescale_gradients(self, state: TrainState, factor: torch.Tensor) -> None:
        # The parameters as compose() left them: FSDP2 swaps unsharded ones into the module
        # for forward and backward, but gradients accumulate on the sharded ones.
        grads = [local_part(p.grad) for p in state.parameters if p.grad is not None]
        torch._foreach_mul_(grads, factor)

    def close(self) -> None:
        """Nothing to release."""
