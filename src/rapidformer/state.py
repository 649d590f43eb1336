"""What compose() builds: the train state, its slots, and the records accelerations write.

:class:`TrainState` holds the accelerated model, optimizer and data of a run, one
implementation of each **slot**, and **records** that one acceleration writes and the step
reads (:class:`MixedPrecision`, :class:`ExpertParallel`, :class:`GradientSync`). The slots
say who does the work that several engines can do, so that the loop has one shape whatever
runs it:

* ``forward_backward`` (:class:`ForwardBackward`): runs forward and backward of a step's
  micro-batches. Eager torch autograd (:mod:`rapidformer.step.forward_backward`, with DDP or
  FSDP2 around the model, tensor and expert parallelism), a pipeline schedule, DeepSpeed's
  engine and ONNX Runtime implement it.
* ``stepper`` (:class:`Stepper`): turns the accumulated gradients into an update: unscale,
  found-inf, gradient norm and clipping, then (after every rank agreed whether to skip) the
  optimizer and schedule step. The torch optimizer (:mod:`rapidformer.step.optimizer_step`)
  and DeepSpeed's engine implement it.
* ``checkpoint_format`` (:class:`CheckpointFormat`): how model and optimizer state are written
  and read. None means rapidformer's native choice (see :mod:`rapidformer.checkpoint`).
* ``moe`` (:class:`RoutingControl`): the MoE layers' bookkeeping around each step; a model
  without them gets :class:`NoRouting`, whose calls do nothing, so the engine never branches.
* ``monitors`` (:class:`StepMonitor`): watchers the engine calls after every step.

What a step takes in and gives out is :mod:`rapidformer.step_io`.

This module sits below ``step/``, ``accel/`` and ``engine/``: accelerations fill the slots and
write the records, the engine and templates call them, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.step_io import FinishedGradients, StepFunctions, StepResult

if TYPE_CHECKING:
    from rapidformer.memory import StateBytes
    from rapidformer.reliability.guard import Decision


Tensors = Mapping[str, torch.Tensor]
"""Tensors by name (a state dict, or part of one)."""


@dataclass(frozen=True)
class PlanStep:
    """One acceleration compose() applied: what, through which engine, with which details."""

    name: str
    engine: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.engine}" + (f" ({self.detail})" if self.detail else "")


class ForwardBackward(Protocol):
    """Runs forward and backward of a step's micro-batches; see the module docstring. What
    other accelerations need from it (which modules' forwards run, whether DDP may wrap the
    model, whether this rank holds the whole model) it says here, so that none of them asks
    which implementation fills the slot."""

    name: str
    averaged_by: str
    """Who averages gradients over the data-parallel ranks: ``"ddp"`` (a DDP wrapper, or
    FSDP2's reduce-scatter, may be put around the model), ``"stepper"`` (the stages of a
    pipeline, which DDP cannot follow: the stepper averages once per step) or ``"self"``
    (the slot does it, e.g. ONNX Runtime or DeepSpeed's engine)."""
    holds_whole_model: bool
    """False where ``model_parts`` are some stages of a pipeline: checkpoints then name each
    stage's tensors by the whole model's names."""

    def forward_modules(self, state: TrainState) -> list[nn.Module]:
        """The modules whose forward this slot calls (mixed precision wraps them)."""
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

    def close(self) -> None:
        """Release what it holds (graphs, files); a later step may build them again."""
        ...


@runtime_checkable
class MicroStepBackward(Protocol):
    """What a forward-backward slot adds for hand-written loops, whose backward of each
    micro-batch the user calls (:mod:`rapidformer.engine.late_weights`). A slot that runs
    whole steps only (a pipeline schedule) does not implement it."""

    def arm(self, state: TrainState, last: bool) -> None:
        """Whether the coming micro-batch ends the optimizer step (before its forward)."""
        ...

    def backward(self, state: TrainState, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already weighted) loss."""
        ...

    def rescale_gradients(self, state: TrainState, factor: torch.Tensor) -> None:
        """Multiply the gradients accumulated so far, before the last backward of a step
        whose weights were only known after the forwards."""
        ...


class RoutingControl(Protocol):
    """What the engine calls around each step of a model with MoE layers
    (:class:`rapidformer.accel.moe.control.MoEControl`)."""

    def begin_step(self, scales: torch.Tensor | None = None) -> None:
        """A step begins; ``scales`` are its micro-batches' loss weights when known."""
        ...

    def set_current_scale(self, value: torch.Tensor) -> None:
        """Hand-written loops: the weight of the micro-batch whose forward ran last."""
        ...

    def count_step(self, state: TrainState, batches: Sequence[Any], step: StepFunctions) -> None:
        """Before a step's first forward-backward: what must be known of the whole step
        first (global_aux_loss's routing counts)."""
        ...

    def after_step(self, applied: bool | torch.Tensor = True) -> None:
        """The step ended; ``applied`` is False (or a device 0.0) for a skipped one (nothing
        may move)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Routing statistics since the last call; every rank calls it (collectives)."""
        ...


class NoRouting:
    """The MoE slot of a model without MoE layers: every call does nothing."""

    def begin_step(self, scales: torch.Tensor | None = None) -> None:
        """Nothing to hand over."""

    def set_current_scale(self, value: torch.Tensor) -> None:
        """Nothing to hand over."""

    def count_step(self, state: TrainState, batches: Sequence[Any], step: StepFunctions) -> None:
        """Nothing to count."""

    def after_step(self, applied: bool | torch.Tensor = True) -> None:
        """Nothing to update."""

    def metrics(self) -> dict[str, Any]:
        return {}


class StepMonitor(Protocol):
    """Something that watches the run step by step (e.g. how many graphs compile made): the
    engine calls it after every step and merges its metrics into the logged ones."""

    def after_step(self, step: int, main_process: bool) -> None:
        """Step ``step`` (1-based) ended; only the main process logs."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Figures for the next log line."""
        ...

    def close(self) -> None:
        """Stop watching."""
        ...


class Stepper(Protocol):
    """Applies one step's gradients; see the module docstring. The engine calls it in two
    halves, with every rank's agreement on skipping the step between them."""

    name: str
    skips_on_device: bool
    """Whether :meth:`update` takes the skip as a device tensor; otherwise the engine reads
    the decision to the host first (one read per step)."""

    def prepare(self, state: TrainState) -> PlanStep | None:
        """Called once compose() has the optimizer and the LR schedule: set up what the
        steps need and return a plan line (e.g. where a skip is decided), or None."""
        ...

    def finish_gradients(self, state: TrainState) -> FinishedGradients:
        """Make the step's gradients ready for the update (reductions, unscale, clipping)."""
        ...

    def update(
        self, state: TrainState, gradients: FinishedGradients, decision: Decision, totals: Tensor
    ) -> StepResult:
        """Apply the update, or skip it where ``decision`` says so; the result carries the
        step's loss from ``totals`` (see :meth:`StepResult.of`)."""
        ...

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


@dataclass(frozen=True)
class MixedPrecision:
    """What the step needs of the run's precision. Written by ``apply_precision`` alone."""

    autocast_dtype: torch.dtype | None = None
    """The autocast dtype of the training forward (None: fp32)."""
    grad_scaler: torch.amp.GradScaler | None = None
    """fp16's dynamic loss scaler (None: no loss scaling)."""


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism (``--expert-model-parallel-size`` > 1). Written by
    ``apply_expert_parallel`` alone."""

    modules: tuple[nn.Module, ...]
    """Each MoE layer's experts module this rank holds (its E / ep experts)."""
    group: Any
    """The expert-data-parallel ranks: those holding the same experts."""
    degree: int
    """The ep degree."""

    def parameter_ids(self) -> frozenset[int]:
        """Ids of the expert parameters as the modules hold them now (FSDP2 replaces them by
        sharded ones when it shards the experts)."""
        return frozenset(id(p) for module in self.modules for p in module.parameters())


@dataclass(frozen=True)
class GradientSync:
    """What the stepper does to average a step's gradients over the data-parallel ranks, once
    DDP or FSDP2 did their part. Written by ``apply_data_parallel`` alone, after sharding
    decided what FSDP2 reduces; the default (nothing to do) serves one rank, DDP without
    experts, and slots that average themselves (DeepSpeed, ONNX Runtime)."""

    average_group: Any = None
    """Dense local gradients are averaged over this group once per step, where no DDP wrapper
    does it (tensor-parallel or pipelined data parallelism); None otherwise."""
    in_buckets: bool = False
    """Whether the gradients are views of DDP's buckets: the step then zeroes them in place
    instead of dropping them (a dropped view comes back as a fresh tensor, a second copy
    beside the bucket, in the next step's first backward)."""
    expert_ids: frozenset[int] = frozenset()
    """Expert-parallel parameters (ids), whose gradients are reduced apart from the dense ones:
    they already hold the contributions of the whole ep group's tokens."""
    expert_group: Any = None
    """Expert gradients are averaged over it (the edp ranks; None where FSDP2 did it) ..."""
    expert_divisor: int = 1
    """... and then divided by it (the ep degree)."""


class BaseAdditions(Protocol):
    """What code that knows only a model's base asks of the parameters a feature added onto
    its layers (adapters). Tensor parallelism, materialising a
    meta-device model, ``--pretrained-checkpoint`` and the Finetuner's final save reach them
    through it, never by importing the feature."""

    def owns(self, name: str) -> bool:
        """Whether the state-dict key ``name`` is an added parameter's (no base holds one)."""
        ...

    def base_only(self, module: nn.Module) -> AbstractContextManager[object]:
        """Within the block ``module`` holds its base alone: code that splits or initialises
        the base sees no added parameter. They are put back after."""
        ...

    def follow_split(self, module: nn.Module) -> None:
        """Lay the added parameters out as the base layers were just split (tensor
        parallelism, which ran under :meth:`base_only`)."""
        ...

    def start(self, module: nn.Module) -> None:
        """Give the added parameters their first values, on the base now in place."""
        ...

    def save(self, base: FrozenBase, full_state: Tensors, out_dir: Path) -> Path:
        """Write what the run trained, as the feature's own directory (rank 0; ``full_state``
        is the gathered model state)."""
        ...


class FrozenBaseExport(Protocol):
    """How ``python -m rapidformer.export`` writes a checkpoint whose model is a frozen base
    with added parameters: the additions alone in their own format, or merged into the base
    with the feature's merge flag (:data:`rapidformer.engine.order.FROZEN_BASE_EXPORT`)."""

    @property
    def merge_flag(self) -> str:
        """The export's flag that merges the additions into the base."""
        ...

    @property
    def merge_help(self) -> str:
        """What ``--help`` says of it."""
        ...

    def write(
        self, record: Mapping[str, Any], trained: Tensors, out_dir: Path, merge: bool
    ) -> Path:
        """Write the checkpoint's additions (``trained``: its model state; ``record``: its
        ``frozen_base`` record), merged into the base they name where ``merge``."""
        ...

    def merge_into(self, model: nn.Module, record: Mapping[str, Any], trained: Tensors) -> None:
        """Fold the additions into ``model``, which holds the base they were trained on."""
        ...


@dataclass(frozen=True)
class FrozenBase:
    """A run that trains parameters added onto a frozen base (adapters). Written by the
    feature that adds them, and by ``--pretrained-checkpoint`` where the base comes from (a
    model built on the meta device has its base only then); checkpoints write only
    ``trainable`` and record the base by its fingerprint."""

    trainable: frozenset[str]
    """Names of the parameters that train (the added ones and modules trained in full)."""
    fingerprint: str
    """SHA-256 of the base's parameters before the additions ("" in a dry run, and until
    ``--pretrained-checkpoint`` is read)."""
    source: str
    """Where the base came from (its directory, else its class)."""
    additions: BaseAdditions
    """The feature's side of it (see :class:`BaseAdditions`)."""
    adapter_config: dict[str, Any] = field(default_factory=dict)
    """The additions as their own format says them (PEFT's ``adapter_config.json`` for
    adapters): written beside their tensors and into each checkpoint's record."""
    defining_keys: tuple[str, ...] = ()
    """The keys of ``adapter_config`` that decide what the additions compute: a resume must
    agree on each."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The Hugging Face config the run's model had (labels, ``is_decoder``, a pad id the run
    set), {} for another model: a merged export is built with it."""


def base_alone(state: TrainState, module: nn.Module) -> AbstractContextManager[object]:
    """``module`` with its base alone while the block runs (see :class:`BaseAdditions`); a
    run without additions changes nothing."""
    base = state.frozen_base
    return base.additions.base_only(module) if base is not None else nullcontext()


@dataclass
class TrainState:
    """The model, optimizer, data and numerics of a run after compose().

    The model has two views, both kept by the accelerations: ``model``, the handle forward is
    called on (it may be wrapped, e.g. by DDP or DeepSpeed's engine, or be the stages of a
    pipeline callable as one model), and ``model_parts``, the modules this rank holds (one, or
    a pipeline's stages). :attr:`unwrapped_model` and :attr:`parameters` are derived from them.

    What several accelerations decide and the step reads comes as records, each written by one
    acceleration: ``precision``, ``experts``, ``gradient_sync``.
    """

    model: nn.Module
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
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    loss_parallel: bool = False
    """Whether losses read vocabulary-sharded logits (tensor parallelism sets it): they and
    their backward then run under ``loss_parallel()`` (:func:`loss_context`)."""
    experts: ExpertParallel | None = None
    gradient_sync: GradientSync = field(default_factory=GradientSync)
    checkpoint_format: CheckpointFormat | None = None
    frozen_base: FrozenBase | None = None
    """Parameters added onto a frozen base (adapters): what checkpoints write and check."""
    plan: list[PlanStep] = field(default_factory=list)
    model_parts: list[nn.Module] = field(default_factory=list)
    moe: RoutingControl = field(default_factory=NoRouting)
    """The MoE layers' step bookkeeping (loss scales, expert bias, statistics); does nothing
    without --num-experts."""
    monitors: list[StepMonitor] = field(default_factory=list)
    """Watchers the engine calls after every step (compile's graph count and fallbacks)."""
    _settled_parameters: list[nn.Parameter] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.model_parts:
            self.model_parts = [self.model]

    @property
    def unwrapped_model(self) -> nn.Module:
        """``model`` without its data-parallel wrapper: the module whose state_dict keys are
        the model's own (the user's model, or a pipeline's stages callable as one)."""
        inner = getattr(self.model, "module", None)
        # DDP and DeepSpeed's engine keep the model they wrap as ``.module``; a user's model
        # may have a child of that name, which is never the part this rank holds.
        return inner if inner is self.model_parts[0] else self.model

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters of ``model_parts`` as the accelerations left them: what gradients
        accumulate on, clipping reads and checkpoints inspect. While compose() runs they are
        read afresh (each step may replace them); :meth:`settle_parameters` then keeps them,
        because FSDP2 swaps unsharded copies into the modules for a forward (and, without
        resharding after forward, leaves them there until the next backward)."""
        if self._settled_parameters is not None:
            return self._settled_parameters
        return [p for part in self.model_parts for p in part.parameters()]

    def settle_parameters(self) -> None:
        """Keep the parameters as they are now (compose() calls it once every acceleration
        is applied)."""
        self._settled_parameters = [p for part in self.model_parts for p in part.parameters()]


def loss_context(state: TrainState) -> AbstractContextManager[Any]:
    """``loss_parallel()`` for vocabulary-sharded logits (a loss and its backward run in it)."""
    if not state.loss_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel  # loaded: logits are sharded

    return loss_parallel()


@contextmanager
def evaluation_context(state: TrainState) -> Iterator[None]:
    """No gradients, the training precision and the loss context, for forwards of the
    unwrapped model (outside the autocast that wraps the training forward)."""
    with torch.no_grad(), loss_context(state):
        dtype = state.precision.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=state.device.type, dtype=dtype):
            yield
