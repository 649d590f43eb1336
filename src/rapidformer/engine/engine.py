"""RapidformerEngine: validates the config, joins the process group, builds the device mesh,
composes the accelerations and runs each optimizer step.

The three ways into rapidformer (CLI, templates, a hand-written loop) all end here::

    engine = RapidformerEngine(config)
    state = engine.compose(model, train_dataloader=loader)
    for batches in steps_of(state.train_dataloader, engine.accumulation_steps):  # engine.loops
        result = engine.run_step(batches, StepFunctions(train_step=loss_of, weight=units_of))

A step counts before it computes: ``weight(batch)`` gives each micro-batch's units (samples or
tokens) from the batch alone, the counts are summed over the data-parallel ranks, and every
micro-batch's mean loss is scaled by ``units x dp / units of the global batch`` before its
backward (the ``dp`` undoes the mean the data-parallel reduction takes). The gradients are then
exactly those of one big batch, however unevenly the micro-batches are padded, with no
rescaling afterwards, which a pipeline schedule (all micro-batches inside one call) requires.
Who runs forward and backward, and who applies the gradients, are the train state's two slots
(:mod:`rapidformer.state`): the engine never asks which backend fills them.

Hand-written loops may also call ``backward(loss, weight=...)`` per micro-batch and ``step()``
(see :meth:`RapidformerEngine.backward`), which learn the weights only after the forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.accel.eager import EagerForwardBackward
from rapidformer.accel.stepper import TorchStepper
from rapidformer.config.env import LaunchEnv
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.engine.order import CANONICAL_ORDER
from rapidformer.engine.validation import validate
from rapidformer.errors import Violation
from rapidformer.flops import MfuMeter, mfu_meter
from rapidformer.hardware import Peak, device_peak, precision_support
from rapidformer.logging import log, setup_console_logging
from rapidformer.memory import describe
from rapidformer.reliability.guard import StepGuard
from rapidformer.reliability.signals import StopSignals
from rapidformer.state import StepFunctions, StepOutcome, TrainState


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    The loss, gradient norm and weight stay on the engine's device as 0-dim tensors
    (``*_tensor``): reading one to the host waits for the device to finish the step, so the
    engine never does it and the loop reads them only when it logs. The float properties
    (``loss``, ``grad_norm``, ``weight``) read on access, for loops that want a number now.
    ``skipped`` and ``stop_requested`` are the step's agreed decision, already on the host.
    """

    loss_tensor: torch.Tensor
    """Loss of the global batch: the count-weighted mean over all its micro-batches and ranks."""
    grad_norm_tensor: torch.Tensor
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step)."""
    lr: float
    """Learning rate the step used."""
    skipped: bool
    """True when the update was skipped: a non-finite loss or gradient on some rank (or an
    fp16 overflow the loss scaler found); ``skip_reason`` says which."""
    weight_tensor: torch.Tensor
    """Units (samples or tokens) in the global batch."""
    stop_requested: bool = False
    """Every rank agreed to stop after this step: a stop signal arrived (``Trainer.fit``
    saves a checkpoint and ends the run)."""
    skip_reason: str = ""

    @property
    def loss(self) -> float:
        """:attr:`loss_tensor` read to the host (waits for the step)."""
        return float(self.loss_tensor)

    @property
    def grad_norm(self) -> float:
        """:attr:`grad_norm_tensor` read to the host (waits for the step)."""
        return float(self.grad_norm_tensor)

    @property
    def weight(self) -> float:
        """:attr:`weight_tensor` read to the host (waits for the step)."""
        return float(self.weight_tensor)


class _LateWeights:
    """Accumulation bookkeeping of a hand-written loop's ``backward(loss, weight)`` calls."""

    def __init__(self, device: torch.device) -> None:
        self.micro_steps = 0
        self.ready = False
        self.last_armed = False
        self.reference = torch.ones((), device=device)
        self.totals = torch.zeros(2, device=device)  # [weight, weight x loss] so far
        self.step_totals = self.totals  # the same, summed over ranks, once the step is ready

    def reset(self) -> None:
        self.micro_steps = 0
        self.ready = False
        self.totals = torch.zeros_like(self.totals)


class RapidformerEngine:
    """Applies the accelerations the config enables; see the module docstring."""

    def __init__(
        self,
        config: RapidformerConfig,
        *,
        builds_optimizer: bool = False,
        runs_loop: bool = False,
        extra_violations: Iterable[Violation] = (),
    ) -> None:
        """``builds_optimizer``/``runs_loop``: whether compose() will build the optimizer and
        whether rapidformer's loop decides the run length (both True for the templates); they
        make ``--lr`` and ``--train-iters``/``--epochs`` required. ``extra_violations``: a
        template's own rule violations, reported with the general ones."""
        env = LaunchEnv.read()
        # Validation first: a bad combination must fail before any process group exists.
        self.dims = validate(
            config,
            env.world_size,
            rank=env.rank,
            builds_optimizer=builds_optimizer,
            runs_loop=runs_loop,
            extra=extra_violations,
        )
        self.config = config
        self.env = env
        if env.rank == 0:
            setup_console_logging()  # only rank 0 speaks; the plan is logged at compose()
        self.device = process_group.pick_device(env)
        self._owns_process_group = process_group.init_process_group(
            env, self.device, config.parallel.distributed_timeout_minutes
        )
        self.mesh = ParallelMesh.build(self.dims, self.device.type)
        self.guard = StepGuard(
            config.training.max_skipped_steps, self.mesh.group("world"), self.device
        )
        """Skips non-finite steps and shares stop requests (:mod:`rapidformer.reliability`)."""
        data = config.data
        self.accumulation_steps = self.dims.accumulation_steps(
            data.micro_batch_size, data.global_batch_size
        )
        self.state: TrainState | None = None
        self.mfu: MfuMeter | None = None
        """FLOPs per token and the peak, once compose() has the model (MFU in the logs)."""
        self.peak = Peak(None, "not measured on this rank (rank 0 logs)")
        self._late = _LateWeights(self.device)
        self._late.last_armed = self.accumulation_steps == 1

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    def compose(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        train_dataloader: DataLoader | None = None,
        eval_dataloader: DataLoader | None = None,
        lr_scheduler_fn: Callable[[Optimizer], LRScheduler] | None = None,
        *,
        optimizer_fn: Callable[[nn.Module], Optimizer | None] | None = None,
    ) -> TrainState:
        """Accelerate the given objects in the canonical order and log the plan.

        Without an optimizer, ``optimizer_fn(model)`` builds one once the model is parallelised
        and materialised (returning None, or no ``optimizer_fn``: the one ``--optimizers``
        names, which needs ``--lr``). ``lr_scheduler_fn`` receives the final optimizer and
        returns its scheduler. A model on the meta device is materialised after
        parallelisation (it needs an ``init_weights()``, as the built-in models have).
        """
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(self.device)
        state = TrainState(
            model=model,
            unwrapped_model=model,
            device=self.device,
            mesh=self.mesh,
            forward_backward=EagerForwardBackward(),
            stepper=TorchStepper(self.config.training.clip_grad),
            optimizer=optimizer,
            optimizer_fn=optimizer_fn,
            train_dataloader=train_dataloader,
            eval_dataloader=eval_dataloader,
            step_guard=self.guard,
        )
        for apply in CANONICAL_ORDER:
            state = apply(state, self.config, self.mesh)
        # Before the user's hooks run again (the scheduler): a CPU's peak probe is set-up.
        self.mfu = self._mfu_meter(state)
        if lr_scheduler_fn is not None and state.optimizer is not None:
            state.lr_scheduler = lr_scheduler_fn(state.optimizer)
        # The parameters as the accelerations left them (FSDP2 registered sharded ones).
        state.parameters = [p for part in state.model_parts for p in part.parameters()]
        if state.moe is not None:
            state.moe.begin_step()
        self.state = state
        self._late.reset()
        self._arm(self.accumulation_steps == 1)
        self.log_plan()
        return state

    def _mfu_meter(self, state: TrainState) -> MfuMeter:
        """FLOPs per token of the composed model and this device's peak (only rank 0 logs, so
        only rank 0 probes a CPU's matrix rate)."""
        config = self.config
        precision = config.precision.resolved
        peak = None
        if self.is_main_process:
            self.peak = device_peak(self.device, precision, config.logging.peak_tflops)
            peak = self.peak.tflops
        model = state.unwrapped_model
        shape_config = getattr(model, "config", None)
        seq = config.model.seq_length or _first_int(
            shape_config, "max_position_embeddings", "n_positions"
        )
        return mfu_meter(
            model, seq, config.memory.checkpoint_activations, peak, self.env.world_size
        )

    def log_plan(self) -> None:
        state = self._require_state()
        if not self.is_main_process:
            return
        lines = [f"  {i}. {step}" for i, step in enumerate(state.plan, 1)] or ["  (none)"]
        log.info(
            "rapidformer plan on %s, %s; forward-backward: %s, step: %s\n%s",
            self.device,
            self.mesh.describe(),
            state.forward_backward.name,
            state.stepper.name,
            "\n".join(lines),
        )
        held, ddp = state.stepper.expected_bytes(state)
        log.info("model state on rank 0: %s", describe(held, ddp))
        precision = self.config.precision.resolved
        support, hint = precision_support(self.device, precision)
        peak = self.peak
        peak_text = f"{peak.tflops:.3g} TFLOP/s per device" if peak.tflops else "unknown"
        meter = self.mfu if self.mfu is not None else self._mfu_meter(state)
        per_token = meter.per_token
        recompute = (
            f", {per_token.hardware:.3g} with the recomputed forward" if meter.recompute else ""
        )
        log.info(
            "hardware: %s; %s peak %s (%s); model FLOPs per token %.3g%s (%s)",
            support,
            precision,
            peak_text,
            peak.source,
            per_token.model,
            recompute,
            meter.basis,
        )
        if hint:
            log.warning("precision: %s", hint)

    # ---- one optimizer step, counted before it is computed --------------------------------
    def run_step(self, batches: Sequence[Any], step: StepFunctions) -> StepResult:
        """Forward, backward and optimizer step for the micro-batches of one step (this rank's
        share of the global batch); see the module docstring for the weighting."""
        state = self._require_state()
        if self._late.micro_steps:
            raise RuntimeError("finish the step begun with engine.backward() (engine.step())")
        dp_group = self.mesh.group("dp")
        weights = torch.stack(
            [
                torch.as_tensor(step.weight(b), dtype=torch.float32, device=self.device)
                for b in batches
            ]
        )
        total = process_group.all_reduce_sum(weights.sum(), dp_group).clamp(min=1e-12)
        scales = weights * (self.dims.dp / total)
        if state.moe is not None:  # auxiliary losses weigh like their micro-batch's loss
            state.moe.begin_step(scales)
        losses = state.forward_backward.run(state, batches, step, scales)
        self.guard.observe_loss(losses)
        loss_sum = process_group.all_reduce_sum((losses * weights).sum(), dp_group)
        outcome = self._apply(state)
        return _result(outcome, loss_sum, total)

    # ---- hand-written loops: weights known only after each forward ------------------------
    def begin_micro_step(self, *, last: bool) -> None:
        """Declare, before its forward, whether the next micro-batch ends the optimizer step.

        Only needed when a step has fewer micro-batches than ``accumulation_steps`` (the last
        step of an epoch); otherwise the engine counts. DDP decides in the *forward* whether the
        following backward all-reduces, which is why this cannot wait for ``backward``.
        """
        self._arm(last)

    def backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's mean loss, in a loop that calls ``step()`` after it.

        ``weight`` is the number of samples or tokens the loss averages over (default: every
        micro-batch counts the same); the step's gradient is the weight-averaged one. The
        step's total is known only at its last micro-batch: earlier backwards are scaled by
        ``weight / (reference x accumulation steps)`` with a reference common to the ranks,
        and when the total differs from what that assumed, the gradients accumulated so far
        are rescaled once before the last backward (``run_step`` never needs this; DeepSpeed
        cannot, and says so).
        """
        state = self._require_state()
        late, forward_backward = self._late, state.forward_backward
        dp_group, dp, steps = self.mesh.group("dp"), self.dims.dp, self.accumulation_steps
        count = torch.as_tensor(
            1.0 if weight is None else weight, dtype=torch.float32, device=self.device
        )
        late.micro_steps += 1
        late.totals += torch.stack([count, loss.detach().float() * count])
        if late.micro_steps == 1:
            common = process_group.all_reduce_sum(count.clone(), dp_group) / dp
            late.reference = common.clamp(min=1.0)
        if not late.last_armed:
            factor = count / (late.reference * steps)
            if state.moe is not None:
                state.moe.set_current_scale(factor)
            forward_backward.backward(state, loss * factor)
            self._arm(late.micro_steps + 1 == steps)
            return
        totals = process_group.all_reduce_sum(late.totals.clone(), dp_group)
        total = totals[0].clamp(min=1e-12)
        if late.micro_steps > 1:
            forward_backward.rescale_gradients(state, late.reference * steps * dp / total)
        if state.moe is not None:
            state.moe.set_current_scale(count * dp / total)
        forward_backward.backward(state, loss * (count * dp / total))
        late.step_totals = totals
        late.ready = True

    def step(self) -> StepResult | None:
        """Apply the gradients once a step's micro-batches are done (after ``backward``).

        Returns None (and does nothing) in the middle of an accumulation.
        """
        state = self._require_state()
        if not self._late.ready:
            return None
        self.guard.observe_loss(self._late.totals[1])
        outcome = self._apply(state)
        weight, loss_sum = self._late.step_totals.unbind()
        self._late.reset()
        return _result(outcome, loss_sum, weight)

    def _apply(self, state: TrainState) -> StepOutcome:
        """The stepper's update (or agreed skip) and the bookkeeping after it."""
        outcome = state.stepper.step(state)
        if state.moe is not None:
            state.moe.after_step(applied=not outcome.skipped)
        self._arm(self.accumulation_steps == 1)
        if outcome.skipped and self.is_main_process:
            log.warning("step %d skipped: %s", self.guard.steps + 1, outcome.reason)
        self.guard.count(outcome.skipped, outcome.reason)
        return outcome

    def watch_signals(self) -> StopSignals:
        """A context in which SIGTERM, SIGINT and SIGUSR1 become a stop request that every
        rank agrees on at the next step (``StepResult.stop_requested``), instead of killing
        the process. ``Trainer.fit`` enters it when the run has ``--save``."""
        signals = StopSignals()
        self.guard.signals = signals
        return signals

    def routing_metrics(self) -> dict[str, Any]:
        """MoE routing statistics since the last call (auxiliary losses, load imbalance,
        dropped fraction); empty without MoE. Every rank must call it (it reduces over dp)."""
        state = self._require_state()
        return state.moe.metrics() if state.moe is not None else {}

    def close(self) -> None:
        """Release what the forward-backward slot holds and leave the process group if this
        engine created it."""
        if self.state is not None:
            self.state.forward_backward.close()
        if self._owns_process_group:
            process_group.destroy_process_group()
            self._owns_process_group = False

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError("call engine.compose(model, ...) before running steps")
        return self.state

    def _arm(self, last: bool) -> None:
        """Whether the coming micro-step is the step's last (DDP and DeepSpeed reduce the
        gradients only then)."""
        self._late.last_armed = last
        if self.state is not None:
            self.state.forward_backward.arm(self.state, last)


def _first_int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


def _result(outcome: StepOutcome, loss_sum: torch.Tensor, weight: torch.Tensor) -> StepResult:
    """The step's numbers as device tensors (no host read)."""
    grad_norm = torch.as_tensor(outcome.grad_norm, dtype=torch.float32)
    return StepResult(
        loss_tensor=loss_sum.detach().float() / weight.clamp(min=1e-12),
        grad_norm_tensor=grad_norm.detach(),
        lr=outcome.lr,
        skipped=outcome.skipped,
        weight_tensor=weight.detach(),
        stop_requested=outcome.stop,
        skip_reason=outcome.reason,
    )
