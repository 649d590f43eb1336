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

Hand-written loops may also call ``backward(loss, weight=...)`` per micro-batch and ``step()``,
which learn the weights only after the forwards: a thin adapter over the same slots
(:mod:`rapidformer.engine.late_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer import safe_load
from rapidformer.accel.compile import compiled_loss
from rapidformer.config.env import LaunchEnv, launch_violations
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import local_part
from rapidformer.engine.late_weights import LateWeights
from rapidformer.engine.order import backend
from rapidformer.engine.plan_log import log_plan, measure_peak, model_mfu_meter, trust_steps
from rapidformer.engine.validation import validate
from rapidformer.errors import Violation
from rapidformer.fatal import report_uncaught, set_debug
from rapidformer.flops import MfuMeter
from rapidformer.hardware import Peak
from rapidformer.log import setup_console_logging
from rapidformer.quiet import quiet_third_parties
from rapidformer.reliability.guard import StepGuard
from rapidformer.reliability.signals import StopSignals
from rapidformer.seeding import seed_everything
from rapidformer.state import TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step.optimizer_step import TorchStepper
from rapidformer.step_io import StepFunctions, StepResult
from rapidformer.threads import choose_threads

__all__ = ["RapidformerEngine", "StepResult", "engines_built"]

_built = [0]  # engines constructed in this process (a list: module state without `global`)


def engines_built() -> int:
    """How many engines this process has constructed: ``--user-script`` tells by it whether a
    script trained itself (every template and hand-written loop builds one)."""
    return _built[0]


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
        _built[0] += 1
        report_uncaught()  # in a script, an error that ends the run is one message, as the CLI's
        set_debug(config.logging.debug)
        quiet_third_parties(config.logging.verbose)
        env = LaunchEnv.read()
        # Validation first: a bad combination must fail before any process group exists.
        self.dims = validate(
            config,
            env.world_size,
            rank=env.rank,
            builds_optimizer=builds_optimizer,
            runs_loop=runs_loop,
            extra=[*extra_violations, *launch_violations(env)],
        )
        self.config = config
        self.env = env
        if env.rank == 0:
            setup_console_logging()  # only rank 0 speaks; the plan is logged at compose()
        # Before anything loads: whether checkpoint files are scanned (--trust-checkpoint);
        # close() clears it, so that nothing loaded later in this process inherits it.
        safe_load.set_trust(config.checkpoint.trust_checkpoint, warn=env.rank == 0)
        self.device = process_group.pick_device(env)
        self.threads = choose_threads(env)
        """The CPU threads this rank runs with, and why (:mod:`rapidformer.threads`)."""
        self._owns_process_group = process_group.init_process_group(
            env, self.device, config.parallel.distributed_timeout_minutes
        )
        self.mesh = ParallelMesh.build(self.dims, self.device.type)
        self._dp, self._dp_group = self.dims.dp, self.mesh.group("dp")  # each step's counts
        self.guard = StepGuard(
            config.training.max_skipped_steps,
            self.mesh.group("world"),
            self.device,
            read_interval=config.logging.log_interval,
        )
        """Skips non-finite steps and shares stop requests (:mod:`rapidformer.reliability`);
        the host reads its flags every --log-interval steps."""
        data = config.data
        self.accumulation_steps = self.dims.accumulation_steps(
            data.micro_batch_size, data.global_batch_size
        )
        self.state: TrainState | None = None
        self.mfu: MfuMeter | None = None
        """FLOPs per token and the peak, once compose() has the model (MFU in the logs)."""
        self.peak = Peak(None, "not measured on this rank (rank 0 logs)")
        self._late: LateWeights | None = None
        # --seed is every generator's seed, a hand-written loop's dropout included: two engines
        # of one seed draw the same masks whatever ran before them (the templates seed again
        # at the start of fit(), to the same state).
        seed_everything(config.training.seed)

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
            device=self.device,
            mesh=self.mesh,
            forward_backward=EagerForwardBackward(),
            stepper=TorchStepper(self.config.training.clip_grad),
            optimizer=optimizer,
            optimizer_fn=optimizer_fn,
            train_dataloader=train_dataloader,
            eval_dataloader=eval_dataloader,
        )
        for step in backend(self.config).order:
            state = step.apply(state, self.config, self.mesh)
        # Served: the optimizer exists. Kept, a template's bound method would tie the template
        # to its own engine in a cycle that outlives `del trainer` (its model with it).
        state.optimizer_fn = None
        state.plan.extend(trust_steps(self.config))
        state.settle_parameters()
        # Before the user's hooks run again (the scheduler): a CPU's peak probe is set-up.
        if self.is_main_process:
            self.peak = measure_peak(self.device, self.config)
        self.mfu = model_mfu_meter(state, self.config, self.peak, self.env.world_size)
        if lr_scheduler_fn is not None and state.optimizer is not None:
            state.lr_scheduler = lr_scheduler_fn(state.optimizer)
        decision = state.stepper.prepare(state)  # where a non-finite step is skipped
        if decision is not None:
            state.plan.append(decision)
        state.moe.begin_step()
        self.state = state
        self._late = LateWeights(state, self.dims.dp, self.accumulation_steps)
        self.log_plan()
        return state

    def compiled_loss(self, loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A template's ``compute_loss`` as this run compiles it: compiled with the model under
        ``--torch-compile-scope model``, else unchanged."""
        return compiled_loss(self.config, loss)

    def log_plan(self) -> None:
        """Log the plan compose() applied (rank 0)."""
        state = self._require_state()
        if self.is_main_process:
            assert self.mfu is not None
            log_plan(state, self.config, self.device, self.mesh, self.peak, self.mfu, self.threads)

    # ---- one optimizer step, counted before it is computed --------------------------------
    def run_step(self, batches: Sequence[Any], step: StepFunctions) -> StepResult:
        """Forward, backward and optimizer step for the micro-batches of one step (this rank's
        share of the global batch); see the module docstring for the weighting."""
        state = self._require_state()
        if self._late is not None and self._late.micro_steps:
            raise RuntimeError("finish the step begun with engine.backward() (engine.step())")
        dp_group = self._dp_group
        weights = torch.stack(
            [
                torch.as_tensor(step.weight(b), dtype=torch.float32, device=self.device)
                for b in batches
            ]
        )
        total = process_group.all_reduce_sum(weights.sum(), dp_group).clamp(min=1e-12)
        scales = weights * (self._dp / total)
        state.moe.begin_step(scales)  # auxiliary losses weigh like their micro-batch's loss
        state.moe.count_step(state, batches, step)  # global_aux_loss: the step's routing first
        losses = state.forward_backward.run(state, batches, step, scales)
        self.guard.observe_loss(losses)
        loss_sum = process_group.all_reduce_sum((losses * weights).sum(), dp_group)
        return self._apply(state, torch.stack([total, loss_sum]))

    # ---- hand-written loops: weights known only after each forward ------------------------
    def begin_micro_step(self, *, last: bool) -> None:
        """Declare, before its forward, whether the next micro-batch ends the optimizer step.

        Only needed when a step has fewer micro-batches than ``accumulation_steps`` (the last
        step of an epoch); otherwise the engine counts. DDP decides in the *forward* whether the
        following backward all-reduces, which is why this cannot wait for ``backward``.
        """
        self._require_late().arm(last)

    def backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's mean loss, in a loop that calls ``step()`` after it.

        ``weight`` is the number of samples or tokens the loss averages over (default: every
        micro-batch counts the same); the step's gradient is the weight-averaged one (see
        :mod:`rapidformer.engine.late_weights`; DeepSpeed cannot rescale gradients it holds,
        and says so when the weights differ from what the first micro-batch implied).
        """
        self._require_late().backward(loss, 1.0 if weight is None else weight)

    def step(self) -> StepResult | None:
        """Apply the gradients once a step's micro-batches are done (after ``backward``).

        Returns None (and does nothing) in the middle of an accumulation.
        """
        late = self._require_late()
        if not late.ready:
            return None
        self.guard.observe_loss(late.totals[1])
        result = self._apply(late.state, late.finish())
        late.arm()  # a new step begins: DDP syncs only at its last micro-batch
        return result

    def _apply(self, state: TrainState, totals: torch.Tensor) -> StepResult:
        """The stepper's update, or the skip every rank agreed on, and the bookkeeping after.

        The guard sits between the stepper's two halves: the gradients are made ready (and
        their norm known), every rank reports, and the update reads the agreed decision, on
        the device where the stepper can take it there, else read to the host now."""
        stepper = state.stepper
        gradients = stepper.finish_gradients(state)
        decision = self.guard.decide(gradients.norm, gradients.overflow)
        if not stepper.skips_on_device:
            decision = self.guard.read_now(decision)
        result = stepper.update(state, gradients, decision, totals)
        if decision.report is not None:
            assert result.skipped_on_host is not None, "a host decision gives a host skip"
            self.guard.judge_read(decision, skipped=result.skipped_on_host)
        state.moe.after_step(applied=result.applied)
        self.guard.step_done()  # every --log-interval steps: log the skipped ones
        for monitor in state.monitors:
            monitor.after_step(self.guard.steps, self.is_main_process)
        return result

    # ---- what a loop asks of the guard ----------------------------------------------------
    def resume_at(self, step: int) -> None:
        """A run resumed at ``step``: steps are numbered on from there (logs, skip counts)."""
        self.guard.steps = step

    @property
    def steps_done(self) -> int:
        """Optimizer steps run so far (a resumed run counts on from the step it resumed at)."""
        return self.guard.steps

    def judge_skipped_steps(self, final: bool = False) -> None:
        """Read the flags of the steps not yet judged, log the skipped ones, and stop
        (:class:`~rapidformer.errors.NonFiniteError`) after --max-skipped-steps in a row, or
        at the end of a run (``final``) whose every step was skipped. Every rank calls it at
        the same step: before a checkpoint (so that none is written after a run of skips) and
        at the end of a run."""
        self.guard.judge_pending()
        if final:
            self.guard.refuse_if_nothing_applied(self._why_nothing_applied())

    def _why_nothing_applied(self) -> str:
        """The cause to name when no step was applied: a weight that is not finite (a frozen
        base's too), else the loss or gradients the data and --lr gave."""
        state = self._require_state()
        for name, parameter in state.unwrapped_model.named_parameters():
            local = local_part(parameter.detach())
            plain = type(local) is torch.Tensor and local.is_floating_point()  # not NF4 codes
            if plain and local.numel() and not bool(torch.isfinite(local).all()):
                frozen = "frozen " if not parameter.requires_grad else ""
                return (
                    f"the model's {frozen}weight {name} holds a NaN or an infinity (where the "
                    "model or --pretrained-checkpoint was read from). Fix: start from finite "
                    "weights"
                )
        return (
            "every step's loss or gradients were not finite. Fix: lower --lr, check the data "
            "for bad samples, or use bf16 instead of fp16"
        )

    def request_stop(self) -> None:
        """Ask every rank to stop after the same step, as a stop signal does (callable from
        any thread: a failed background checkpoint write does). ``StepResult.stop_requested``
        then says so on every rank."""
        self.guard.request_stop()

    @property
    def stop_signal(self) -> str | None:
        """The stop signal this rank received, if any (another rank's arrives through
        ``StepResult.stop_requested``)."""
        signals = self.guard.signals
        return signals.received if signals is not None else None

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
        return self._require_state().moe.metrics()

    def step_metrics(self) -> dict[str, Any]:
        """What the log line adds to loss and speed: the MoE routing statistics and every
        monitor's figures (compile's graphs and fallbacks). Every rank must call it."""
        state = self._require_state()
        metrics = state.moe.metrics()
        for monitor in state.monitors:
            metrics.update(monitor.metrics())
        return metrics

    def close(self) -> None:
        """Release what the forward-backward slot holds and leave the process group if this
        engine created it."""
        if self.state is not None:
            self.state.forward_backward.close()
            for monitor in self.state.monitors:
                monitor.close()
        if self._owns_process_group:
            process_group.destroy_process_group()
            self._owns_process_group = False
        safe_load.set_trust(False)

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError("call engine.compose(model, ...) before running steps")
        return self.state

    def _require_late(self) -> LateWeights:
        self._require_state()
        assert self._late is not None
        return self._late
