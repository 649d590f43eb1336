"""RapidformerEngine: validates the config, joins the process group, composes accelerations and
runs backward / step with loss scaling, gradient accumulation and clipping.

The three ways into rapidformer (CLI, templates, a hand-written loop) all end here::

    engine = RapidformerEngine(config)
    state = engine.compose(model, train_dataloader=loader)
    for batch in state.train_dataloader:
        loss = loss_fn(state.model(batch))
        engine.backward(loss)
        engine.step()          # steps the optimizer once every accumulation boundary

Gradient accumulation is exact: each micro-batch's loss is weighted by its sample (or token)
count, and the gradients are divided by the total count of the whole global batch over all
ranks, so micro 2 x 4 accumulation steps gives the gradients of one batch of 8 even when the
micro-batches hold different numbers of tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.accel.checkpointing import apply_activation_checkpointing
from rapidformer.accel.compile import apply_compile
from rapidformer.accel.data import apply_data
from rapidformer.accel.data_parallel import apply_data_parallel
from rapidformer.accel.deepspeed import (
    apply_deepspeed,
    expected_state_bytes,
    is_deepspeed,
    rescale_gradients,
)
from rapidformer.accel.optimizers import apply_optimizer
from rapidformer.accel.precision import apply_precision
from rapidformer.accel.sharding import apply_optimizer_sharding, apply_sharding, is_fsdp
from rapidformer.config.env import LaunchEnv
from rapidformer.config.schema import RapidformerConfig
from rapidformer.config.validate import validate
from rapidformer.distributed import process_group
from rapidformer.engine.state import TrainState
from rapidformer.errors import Violation
from rapidformer.logging import log, setup_console_logging
from rapidformer.memory import describe, expected_bytes

# The canonical order. Each step's position is deliberate:
CANONICAL_ORDER = (
    # Checkpointing patches the user's blocks, before anything wraps them.
    apply_activation_checkpointing,
    # Compile traces the checkpointed blocks (checkpoint becomes a recompute region in the
    # graph); DDP / FSDP then wrap the compiled blocks, whose parameters are unchanged.
    apply_compile,
    # Sharding (FSDP2 for ZeRO-2/3) takes DDP's place: it too must see the final parameters
    # and forward (blocks already checkpointed), and it replaces DDP, which then steps aside.
    apply_sharding,
    # DDP wraps the finished module; it must see the final parameters and forward.
    apply_data_parallel,
    # The optimizer is built on the unwrapped module's parameters, after wrapping decided them.
    apply_optimizer,
    # ZeRO-1/OSS re-partitions the optimizer just built (or supplied) over the ranks.
    apply_optimizer_sharding,
    # Autocast wraps the outermost forward so DDP's hooks and the blocks all run under it.
    apply_precision,
    # Data comes last: the sampler needs the final data-parallel degree.
    apply_data,
)

DEEPSPEED_ORDER = (
    apply_activation_checkpointing,
    # The torch optimizer is built first and handed to DeepSpeed, which shards it and takes
    # over data parallelism, sharding and precision (no DDP, FSDP2 or autocast of ours).
    apply_optimizer,
    apply_deepspeed,
    apply_data,
)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    loss: float
    """Loss of the global batch: the count-weighted mean over all its micro-batches and ranks."""
    grad_norm: float
    """Global gradient norm before clipping (inf or NaN on an fp16 overflow step)."""
    lr: float
    """Learning rate the step used."""
    skipped: bool
    """True when the loss scaler found inf/NaN gradients and skipped the update."""
    weight: float
    """Samples (or tokens, when the step reported them) in the global batch."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
        # DeepSpeed needs a process group even on one rank.
        self._owns_process_group = process_group.init_process_group(
            env, self.device, always=is_deepspeed(config)
        )
        self.accumulation_steps = self.dims.accumulation_steps(config)
        self.state: TrainState | None = None
        self._parameters: list[nn.Parameter] = []
        # Per-step accumulation state (reset after every optimizer step):
        self._micro_steps = 0
        self._ready = False
        self._one = torch.ones((), device=self.device)
        self._reference = self._one
        self._totals = torch.zeros(2, device=self.device)  # [weight, weight x loss] so far
        self._step_totals = self._totals  # the same, summed over ranks, once the step is ready
        self._last_armed = self.accumulation_steps == 1
        self._sharded_grads = False  # FSDP2: gradients reduce-scattered every micro-step

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
    ) -> TrainState:
        """Accelerate the given objects in the canonical order and log the plan.

        Without an optimizer, the one ``--optimizers`` names is built (needs ``--lr``).
        ``lr_scheduler_fn`` receives the final optimizer and returns its scheduler.
        """
        model = model.to(self.device)
        state = TrainState(
            model=model,
            unwrapped_model=model,
            device=self.device,
            optimizer=optimizer,
            train_dataloader=train_dataloader,
            eval_dataloader=eval_dataloader,
        )
        order = DEEPSPEED_ORDER if is_deepspeed(self.config) else CANONICAL_ORDER
        for apply in order:
            state = apply(state, self.config, self.dims)
        if lr_scheduler_fn is not None and state.optimizer is not None:
            state.lr_scheduler = lr_scheduler_fn(state.optimizer)
        self.state = state
        self._parameters = list(state.model.parameters())  # clipped every step
        self._sharded_grads = is_fsdp(state.model)
        self._arm(self.accumulation_steps == 1)
        self.log_plan()
        return state

    def log_plan(self) -> None:
        assert self.state is not None
        if not self.is_main_process:
            return
        lines = [f"  {i}. {step}" for i, step in enumerate(self.state.plan, 1)]
        if not self.state.plan:
            lines = ["  (none)"]
        log.info(
            "rapidformer plan on %s, world size %d:\n%s",
            self.device,
            self.dims.world_size,
            "\n".join(lines),
        )
        if self.state.deepspeed is not None:
            held, ddp = expected_state_bytes(self.state.deepspeed)
        else:
            held, ddp = expected_bytes(self.state.model, self.state.optimizer)
        log.info("model state on rank 0: %s", describe(held, ddp))

    def begin_micro_step(self, *, last: bool) -> None:
        """Declare, before its forward, whether the next micro-batch ends the optimizer step.

        Only needed when a step has fewer micro-batches than ``accumulation_steps`` (the last
        step of an epoch); otherwise the engine counts. DDP decides in the *forward* whether the
        following backward all-reduces, which is why this cannot wait for ``backward``.
        """
        self._arm(last)

    def backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's mean loss.

        ``weight`` is the number of samples or tokens the loss averages over (default: every
        micro-batch counts the same); the step's gradient is the weight-averaged one.
        """
        state = self._require_state()
        count = torch.as_tensor(
            1.0 if weight is None else weight, dtype=torch.float32, device=self.device
        )
        self._micro_steps += 1
        self._totals += torch.stack([count, loss.detach().float() * count])
        if state.deepspeed is not None:
            self._deepspeed_backward(state.deepspeed, loss, count)
            return
        if not self._last_armed:
            if self._micro_steps == 1:
                # Any constant common to the step keeps the scaled losses near 1. FSDP2 sums
                # gradients over ranks at every micro-step, so there it must be common to
                # the ranks too (their mean count).
                reference = count
                if self._sharded_grads:
                    reference = process_group.all_reduce_sum(count.clone()) / self.dims.dp
                self._reference = reference.clamp(min=1.0)
            self._scaled(state, loss * (count / self._reference)).backward()
            self._arm(self._micro_steps + 1 == self.accumulation_steps)
            return
        # Last micro-step: only now is the global count known, so rescale what accumulated
        # locally to a common denominator before DDP sums gradients over ranks.
        totals = process_group.all_reduce_sum(self._totals.clone())
        total_count = totals[0].clamp(min=1e-12)
        dp = float(self.dims.dp)
        if self._micro_steps > 1:
            # The parameters as compose() saw them: FSDP2 swaps unsharded ones into the module
            # between forward and backward, but gradients accumulate on the sharded ones.
            grads = [_local(p.grad) for p in self._parameters if p.grad is not None]
            torch._foreach_mul_(grads, self._reference * dp / total_count)
        self._scaled(state, loss * (count * dp / total_count)).backward()
        self._step_totals = totals
        self._ready = True

    def step(self) -> StepResult | None:
        """Unscale, clip and apply the gradients once a step's micro-batches are done.

        Returns None (and does nothing) in the middle of an accumulation.
        """
        state = self._require_state()
        if not self._ready:
            return None
        if state.deepspeed is not None:
            return self._deepspeed_step(state)
        optimizer = state.optimizer
        assert optimizer is not None, "compose() built no optimizer"
        scaler = state.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
            if self._sharded_grads:
                # Each rank checked only its own gradient shards for inf/NaN: all must agree
                # to skip, or the ranks' parameters diverge.
                for found_inf in scaler._found_inf_per_device(optimizer).values():
                    process_group.all_reduce_sum(found_inf)
        clip = self.config.training.clip_grad
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self._parameters, clip if clip > 0 else float("inf")
        )
        if isinstance(grad_norm, DTensor):  # FSDP2: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        lr = optimizer.param_groups[0]["lr"]
        skipped = False
        if scaler is not None:
            found_inf = sum(scaler._found_inf_per_device(optimizer).values())
            skipped = bool(found_inf)
            # Skipped here rather than left to scaler.step: a fused optimizer over FSDP2's
            # DTensors was seen to step anyway (tests/accel/test_sharding.py, fp16 overflow).
            if not skipped:
                scaler.step(optimizer)
            scaler.update()  # halves the scale after an overflow, from the same found-inf
        else:
            optimizer.step()
        # A skipped step does not advance the schedule (as in Megatron).
        if state.lr_scheduler is not None and not skipped:
            state.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return self._finish_step(float(grad_norm), lr, skipped)

    def _finish_step(self, grad_norm: float, lr: float, skipped: bool) -> StepResult:
        totals = self._step_totals
        self._reset_accumulation()
        self._arm(self.accumulation_steps == 1)
        weight, loss_sum = totals.tolist()
        return StepResult(
            loss=loss_sum / max(weight, 1e-12),
            grad_norm=grad_norm,
            lr=lr,
            skipped=skipped,
            weight=weight,
        )

    def _deepspeed_backward(self, ds: Any, loss: torch.Tensor, count: torch.Tensor) -> None:
        """DeepSpeed averages gradients over the ranks and (unless told not to) over the
        accumulation steps; we scale each micro-batch by count / (reference x steps), which is
        exact when all micro-batches carry the same count, and fix the rest at the boundary."""
        if self._micro_steps == 1:
            mean = process_group.all_reduce_sum(count.clone()) / self.dims.dp
            self._reference = mean.clamp(min=1.0)
        steps = self.accumulation_steps
        last = self._last_armed
        ds.set_gradient_accumulation_boundary(last)
        ds.backward(loss * (count / (self._reference * steps)), scale_wrt_gas=False)
        if not last:
            self._arm(self._micro_steps + 1 == steps)
            return
        totals = process_group.all_reduce_sum(self._totals.clone())
        # What was applied: sum(count x grad) / (reference x steps x dp); what is wanted:
        # sum(count x grad) / total count.
        factor = float(self._reference * steps * self.dims.dp / totals[0].clamp(min=1e-12))
        if abs(factor - 1.0) > 1e-12:
            rescale_gradients(ds, factor)
        self._step_totals = totals
        self._ready = True

    def _deepspeed_step(self, state: TrainState) -> StepResult:
        """DeepSpeed clips (--clip-grad is in its config), steps and zeroes the gradients."""
        ds = state.deepspeed
        assert state.optimizer is not None
        lr = state.optimizer.param_groups[0]["lr"]
        ds.step()
        skipped = not ds.was_step_applied()  # an fp16 overflow step
        if state.lr_scheduler is not None and not skipped:
            state.lr_scheduler.step()
        norm = ds.get_global_grad_norm()
        return self._finish_step(float(norm) if norm is not None else float("nan"), lr, skipped)

    def close(self) -> None:
        """Leave the process group if this engine created it."""
        if self._owns_process_group:
            torch.distributed.destroy_process_group()
            self._owns_process_group = False

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError("call engine.compose(model, ...) before backward() or step()")
        return self.state

    def _reset_accumulation(self) -> None:
        self._micro_steps = 0
        self._ready = False
        self._reference = self._one
        self._totals.zero_()  # safe: the step's totals were all-reduced into a copy

    def _scaled(self, state: TrainState, loss: torch.Tensor) -> torch.Tensor:
        return state.grad_scaler.scale(loss) if state.grad_scaler is not None else loss

    def _arm(self, last: bool) -> None:
        """Whether the coming micro-step is the step's last; under DDP, only that one's
        backward all-reduces (what ``DDP.no_sync()`` toggles, set here because the forward
        and backward of a micro-step happen in the user's code, not inside one context)."""
        self._last_armed = last
        model = self.state.model if self.state is not None else None
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = last
