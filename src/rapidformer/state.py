"""What compose() builds and the slots that accelerations fill.

:class:`TrainState` holds the accelerated model, optimizer and data of a run. Three slots say
who does the work that several engines can do, so that the loop has one shape whatever runs it:

* ``forward_backward`` (:class:`ForwardBackward`): runs forward and backward of a step's
  micro-batches. Eager torch autograd (with DDP or FSDP2 around the model; tensor and expert
  parallelism later), DeepSpeed's engine and ONNX Runtime implement it; a pipeline schedule is
  one more implementation.
* ``stepper`` (:class:`Stepper`): turns the accumulated gradients into an update: unscale,
  found-inf, gradient norm and clipping, the optimizer and schedule step. The torch optimizer
  and DeepSpeed's engine implement it.
* ``checkpoint_format`` (:class:`CheckpointFormat`): how model and optimizer state are written
  and read. None means rapidformer's native choice (see :mod:`rapidformer.checkpoint`).

This module sits below both ``accel/`` and ``engine/``: accelerations fill the slots, the engine
and templates call them, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.distributed.mesh import ParallelMesh

if TYPE_CHECKING:
    from rapidformer.memory import StateBytes
    from rapidformer.reliability.guard import StepGuard


@dataclass(frozen=True)
class PlanStep:
    """One acceleration compose() applied: what, through which engine, with which details."""

    name: str
    engine: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.engine}" + (f" ({self.detail})" if self.detail else "")


ModelInputs = tuple[Any, ...] | Mapping[str, Any]
"""What a model's forward is called with: positional arguments, or keyword arguments."""


def call_model(model: Callable[..., Any], inputs: ModelInputs) -> Any:
    """``model(*inputs)`` or ``model(**inputs)``."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


@dataclass(frozen=True)
class StepFunctions:
    """The user's micro-step, as the forward-backward slot calls it.

    ``train_step(batch)`` returns the micro-batch's loss: the mean over its units (samples or
    tokens). ``weight(batch)`` returns how many units that is, from the batch alone, so that a
    step's weights are known before any forward. The split form, ``model_inputs(batch)`` (what
    the model's forward takes: positional or keyword arguments) and ``loss(outputs, batch)``, is
    what a pipeline needs: its first stage sees only the inputs, its last computes the loss.
    """

    train_step: Callable[[Any], torch.Tensor]
    weight: Callable[[Any], int | torch.Tensor]
    model_inputs: Callable[[Any], ModelInputs] | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a replicated DTensor (a vocab-parallel loss) becomes this
    rank's copy, still in the autograd graph."""
    if isinstance(loss, DTensor):
        if not all(p.is_replicate() for p in loss.placements):
            loss = loss.redistribute(placements=[Replicate()] * len(loss.placements))
        return loss.to_local()
    return loss


def whole(tensor: Any) -> Any:
    """A DTensor gathered into a plain tensor (e.g. vocabulary-sharded logits for a metric);
    anything else unchanged."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class StepOutcome:
    """What the stepper did with one step's gradients."""

    grad_norm: float | torch.Tensor
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step); a 0-dim
    device tensor where the stepper computed it (reading it would wait for the device)."""
    lr: float
    """Learning rate the step used."""
    skipped: bool
    """True when the step was not applied (a non-finite loss or gradient, or an fp16
    overflow)."""
    stop: bool = False
    """True when every rank agreed to stop after this step (a stop signal arrived)."""
    reason: str = ""
    """Why the step was skipped, for the log."""


class ForwardBackward(Protocol):
    """Runs forward and backward of micro-batches; see the module docstring."""

    name: str
    reduces_gradients: bool
    """Whether it reduces gradients over the data-parallel ranks itself (then no DDP)."""
    loss_parallel: bool
    """Whether losses read vocabulary-sharded logits (tensor parallelism sets it)."""

    def loss_context(self) -> AbstractContextManager[Any]:
        """The context a loss and its backward run in (``loss_parallel()``, or nothing)."""
        ...

    def forward_is_collective(self, state: TrainState) -> bool:
        """Whether a forward of ``state.unwrapped_model`` communicates (it gathers parameters):
        evaluation must then run as many forwards on every rank."""
        ...

    def norm_skips(self, state: TrainState) -> frozenset[int]:
        """Ids of parameters whose gradient another rank's norm already counts (a pipeline's
        second copy of a tied weight): the global gradient norm leaves them out."""
        ...

    def run(
        self, state: TrainState, batches: Sequence[Any], step: StepFunctions, scales: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; micro-batch ``i``'s
        loss is multiplied by ``scales[i]`` before its backward. Returns the micro-batches'
        losses (detached, unscaled), one per micro-batch."""
        ...

    def arm(self, state: TrainState, last: bool) -> None:
        """Hand-written loops: whether the coming micro-batch ends the optimizer step."""
        ...

    def backward(self, state: TrainState, loss: torch.Tensor) -> None:
        """Hand-written loops: backward of one micro-batch's (already weighted) loss."""
        ...

    def rescale_gradients(self, state: TrainState, factor: torch.Tensor) -> None:
        """Hand-written loops: multiply the gradients accumulated so far, before the last
        backward of a step whose weights were only known after the forwards."""
        ...

    def close(self) -> None:
        """Release what it holds (graphs, files); a later step may build them again."""
        ...


class RoutingControl(Protocol):
    """What the engine calls around each step of a model with MoE layers
    (:class:`rapidformer.accel.moe.MoEControl`)."""

    def begin_step(self, scales: torch.Tensor | None = None) -> None:
        """A step begins; ``scales`` are its micro-batches' loss weights when known."""
        ...

    def set_current_scale(self, value: torch.Tensor) -> None:
        """Hand-written loops: the weight of the micro-batch whose forward ran last."""
        ...

    def after_step(self, applied: bool = True) -> None:
        """The step ended; ``applied`` is False for a skipped one (nothing may move)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Routing statistics since the last call; every rank calls it (collectives)."""
        ...


class Stepper(Protocol):
    """Applies one step's gradients; see the module docstring."""

    name: str

    def step(self, state: TrainState) -> StepOutcome: ...

    def expected_bytes(self, state: TrainState) -> tuple[StateBytes, StateBytes]:
        """(this rank once training, plain DDP) model-state bytes, before the first step."""
        ...


class CheckpointFormat(Protocol):
    """Writes and reads model and optimizer state; see :mod:`rapidformer.checkpoint`."""

    name: str

    def save(self, state: TrainState, directory: Path) -> None:
        """Every rank calls it; ``directory`` exists and is shared by the ranks."""
        ...

    def load(self, state: TrainState, directory: Path, record: dict[str, Any]) -> None:
        """Restore ``state`` from ``directory``, whose progress record is ``record``; refuse
        (CheckpointError) what this run cannot read, before touching the model."""
        ...

    def record(self, state: TrainState) -> dict[str, Any]:
        """Fields this format adds to the checkpoint's progress record."""
        ...

    def gather_model(self, state: TrainState) -> dict[str, Any] | None:
        """The whole model state dict on rank 0 (None elsewhere); every rank calls it."""
        ...


@dataclass
class TrainState:
    """The model, optimizer, data and numerics of a run after compose().

    ``model`` is what forward is called on (it may be wrapped, e.g. by DDP or DeepSpeed);
    ``unwrapped_model`` is the user's module, whose state_dict keys never change;
    ``model_parts`` are the modules this rank holds (one, or a pipeline's stages).
    """

    model: nn.Module
    unwrapped_model: nn.Module
    device: torch.device
    mesh: ParallelMesh
    forward_backward: ForwardBackward
    stepper: Stepper
    optimizer: Optimizer | None = None
    optimizer_fn: Callable[[nn.Module], Optimizer | None] | None = None
    """Builds the optimizer over the parallelised model, where none was given (the templates'
    ``build_optimizer``); None from it means the one ``--optimizers`` names."""
    lr_scheduler: LRScheduler | None = None
    train_dataloader: DataLoader | None = None
    eval_dataloader: DataLoader | None = None
    grad_scaler: torch.amp.GradScaler | None = None
    autocast_dtype: torch.dtype | None = None
    checkpoint_format: CheckpointFormat | None = None
    plan: list[PlanStep] = field(default_factory=list)
    model_parts: list[nn.Module] = field(default_factory=list)
    gradient_average_group: Any = None
    """The process group the stepper averages local gradients over before the update, where
    no DDP wrapper does it (tensor-parallel or pipelined data parallelism); None otherwise."""
    step_guard: StepGuard | None = None
    """Every rank's per-step agreement to skip (non-finite values) or stop (a signal); the
    stepper asks it before applying a step. Set by the engine."""
    moe: RoutingControl | None = None
    """The MoE layers' step bookkeeping (loss scales, expert bias, statistics); None without
    --num-experts."""
    expert_gradient_ids: frozenset[int] = frozenset()
    """Expert-parallel parameters (ids): their gradients are averaged over
    ``expert_average_group`` and divided by the ep degree instead of averaged over dp."""
    expert_average_group: Any = None
    expert_parallel_size: int = 1
    parameters: list[nn.Parameter] = field(default_factory=list)
    """The parameters of ``model_parts`` as compose() left them: what gradients accumulate on
    and clipping reads (FSDP2 swaps unsharded copies into the module during forward and
    backward)."""

    def __post_init__(self) -> None:
        if not self.model_parts:
            self.model_parts = [self.unwrapped_model]
        if not self.parameters:
            self.parameters = [p for part in self.model_parts for p in part.parameters()]
