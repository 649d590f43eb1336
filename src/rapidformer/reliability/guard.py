"""The per-step agreement of every rank: skip this step? stop after it?, decided on the device.

Before the optimizer applies a step, each rank reports whether its own loss was finite, whether
the step's gradients were (after the reductions every layout runs, the gradient norm covers
every shard of every parameter), whether fp16's loss scaler found an overflow, and whether it
received a stop signal. One all-reduce over the whole job sums the reports (:class:`Flags`),
so every rank takes the same decision:

* **skip** when any loss or gradient anywhere is inf or NaN. The decision stays a 0-dim device
  tensor (:attr:`Decision.skip`): the optimizer reads it as its ``found_inf`` and the schedule
  as "not applied" (:mod:`rapidformer.step.optimizer_step`), so no parameter, optimizer state,
  learning-rate step or expert bias moves, the batch is consumed (as Megatron does), and the
  host never waits for the device inside a step.
* **stop** when any rank received a stop signal (:mod:`.signals`). One rank knows at once. On
  several ranks the agreed flags are copied to the host without waiting (a pinned buffer and an
  event on CUDA) and read at the *next* step, when the device has long finished them: a stop
  takes effect one step later than it arrived, at a step boundary, on every rank alike.

The host learns which steps were skipped when it reads the flags anyway: every
``--log-interval`` steps (:meth:`StepGuard.step_done`), before a checkpoint and at the end of
the run (:meth:`StepGuard.judge_pending`), or at once where the stepper cannot take the
decision on the device (:meth:`StepGuard.read_now`: an optimizer without a ``found_inf`` input,
DeepSpeed). Then each skipped step is logged with the ranks whose loss was non-finite, and after
``--max-skipped-steps`` consecutive skips the run stops with
:class:`~rapidformer.errors.NonFiniteError`: none of those steps moved anything, so the
parameters and the checkpoints are intact.

Only the engine drives the guard (:mod:`rapidformer.engine.engine`): a stepper is handed the
decision, a template asks the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import NonFiniteError
from rapidformer.log import log
from rapidformer.reliability.signals import StopSignals


@dataclass(frozen=True)
class Flags:
    """The layout of the agreed flag vector of a job of ``world`` ranks: one non-finite-loss
    count per rank, then the non-finite-gradient count, the fp16-overflow count and the stop
    count. After the all-reduce every entry is a sum over the ranks."""

    world: int

    @property
    def gradients(self) -> int:
        return self.world

    @property
    def overflow(self) -> int:
        return self.world + 1

    @property
    def stop(self) -> int:
        return self.world + 2

    def pack(
        self,
        rank: int,
        loss: torch.Tensor,
        gradients: torch.Tensor,
        overflow: torch.Tensor,
        stop: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's report: each argument a 0-dim 0.0/1.0 tensor on the flags' device."""
        losses = torch.zeros(self.world, device=loss.device)
        losses[rank] = 1.0  # a host scalar fill: no read
        return torch.cat([losses * loss, torch.stack([gradients, overflow, stop])])

    def skip(self, flags: torch.Tensor) -> torch.Tensor:
        """1.0 where any rank's loss, any gradient or fp16's scaler found a non-finite value."""
        return (flags[: self.stop].sum() > 0).float()

    def read(self, values: list[float]) -> StepReport:
        """The host values of one step's agreed flags, by name."""
        return StepReport(
            nonfinite_loss_ranks=tuple(r for r in range(self.world) if values[r] > 0),
            nonfinite_gradients=values[self.gradients] > 0,
            overflow=values[self.overflow] > 0,
            stop=values[self.stop] > 0,
        )


@dataclass(frozen=True)
class StepReport:
    """One step's agreed flags, read on the host."""

    nonfinite_loss_ranks: tuple[int, ...]
    nonfinite_gradients: bool
    overflow: bool
    stop: bool

    @property
    def reason(self) -> str:
        """Why the step was skipped, for the log; "" if it was not."""
        if self.nonfinite_loss_ranks:
            return "non-finite loss on rank " + ", ".join(map(str, self.nonfinite_loss_ranks))
        if self.overflow:
            return "fp16 gradients overflowed, loss scale halved"
        return "non-finite gradients" if self.nonfinite_gradients else ""


@dataclass(frozen=True)
class Decision:
    """What every rank agreed for one step."""

    skip: torch.Tensor
    """0-dim float32 on the guard's device: exactly 1.0 to skip the step, else 0.0 (the value
    torch's fused optimizers take as ``found_inf``)."""
    flags: torch.Tensor
    """The agreed flag vector (:class:`Flags`)."""
    stop: bool = False
    """Every rank agreed to stop after this step (a signal that arrived by the last step on
    several ranks, by this one on one rank)."""
    report: StepReport | None = None
    """The flags read on the host, where :meth:`StepGuard.read_now` read them; else None (the
    step is decided on the device and judged at the next read)."""

    @property
    def applied(self) -> torch.Tensor:
        """1.0 where the step is applied, 0.0 where it is skipped (on the device)."""
        return 1.0 - self.skip


class StepGuard:
    """Decides, with every rank, whether each step is applied; see the module docstring."""

    def __init__(
        self,
        max_skipped_steps: int,
        group: process_group.Group,
        device: torch.device,
        read_interval: int = 1,
    ) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.group = group
        self.device = device  # the flags live where the backend reduces (nccl: the GPU)
        self.read_interval = max(1, read_interval)
        self.signals: StopSignals | None = None
        """Set while a loop watches the stop signals (``Trainer.fit`` does)."""
        self.steps = 0
        """Optimizer steps seen (a resumed run sets the step it resumed at)."""
        self.consecutive_skips = 0
        """Skipped steps in a row, as of the last judged step."""
        self.judged = 0
        self.applied = 0
        """Steps judged, and of them applied, in this process."""
        self._loss: torch.Tensor | None = None
        self._stop_requested = False
        """Set by :meth:`request_stop` (from any thread)."""
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._late = _LateCopy()

    def request_stop(self) -> None:
        """Ask every rank to stop after the same step, as a stop signal does (a failed
        background checkpoint write does, from its thread)."""
        self._stop_requested = True

    def observe_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss (or losses) of the step about to be applied."""
        self._loss = loss.detach()

    def decide(
        self, grad_norm: torch.Tensor | None, overflow: torch.Tensor | None = None
    ) -> Decision:
        """Every rank's reports summed (a collective: every rank calls it once per step);
        ``overflow``: fp16's found-inf flag, already agreed over the ranks."""
        rank, world = process_group.rank(), process_group.world_size()
        layout = Flags(world)
        received = self.signals is not None and self.signals.received is not None
        local_stop = received or self._stop_requested
        zero = torch.zeros((), device=self.device)
        flags = layout.pack(
            rank,
            loss=self._nonfinite(self._loss),
            gradients=self._nonfinite(grad_norm),
            overflow=zero if overflow is None else (overflow.to(self.device) > 0).float(),
            stop=torch.full((), float(local_stop), device=self.device),
        )
        self._loss = None
        if world > 1:
            process_group.all_reduce_sum(flags, self.group)
            stop = self._late.read_stop(layout)  # the previous step's, finished long ago
            self._late.keep(flags)
        else:
            stop = local_stop  # nothing to agree with: the host knows
        self._pending.append((self.steps + 1, flags))
        return Decision(skip=layout.skip(flags), flags=flags, stop=stop)

    def read_now(self, decision: Decision) -> Decision:
        """``decision`` with its flags read to the host now (waits for the device), for a
        stepper that cannot take the skip as a device tensor; the steps pending before it are
        judged first. Judge this one with :meth:`judge_read` once it is applied or not."""
        assert self._pending and self._pending[-1][1] is decision.flags, "decide() first"
        self._pending.pop()
        self.judge_pending()
        values = [float(v) for v in decision.flags.tolist()]
        report = Flags(process_group.world_size()).read(values)
        return Decision(decision.skip, decision.flags, decision.stop, report)

    def judge_read(self, decision: Decision, skipped: bool) -> None:
        """Account for a step read by :meth:`read_now`; ``skipped`` is what the stepper did
        (DeepSpeed's fp16 engine also skips the overflows only it sees)."""
        assert decision.report is not None, "read_now() first"
        why = decision.report.reason or ("fp16 gradients overflowed" if skipped else "")
        self._judge(self.steps + 1, why)

    def step_done(self) -> None:
        """A step finished; every ``read_interval`` steps, read and judge the pending ones."""
        self.steps += 1
        if self.steps % self.read_interval == 0:
            self.judge_pending()

    def judge_pending(self) -> None:
        """Read the pending steps' flags in one copy and judge them in order. Every rank calls
        it at the same steps."""
        if not self._pending:
            return
        steps = [step for step, _ in self._pending]
        table = torch.stack([flags for _, flags in self._pending]).tolist()
        self._pending.clear()
        layout = Flags(process_group.world_size())
        for step, values in zip(steps, table, strict=True):
            self._judge(step, layout.read(values).reason)

    def _judge(self, step: int, why: str) -> None:
        """Account for one step, skipped where ``why`` says why: log it, and raise once
        ``--max-skipped-steps`` came in a row (nothing of them was applied: the parameters and
        checkpoints are intact)."""
        self.judged += 1
        if not why:
            self.consecutive_skips = 0
            self.applied += 1
            return
        self.consecutive_skips += 1
        if process_group.rank() == 0:
            log.warning("step %d skipped: %s", step, why)
        if self.consecutive_skips >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive steps skipped, the last at step {step} "
                f"({why}); --max-skipped-steps is {self.max_skipped_steps}. Nothing of them was "
                "applied, so the parameters and the last checkpoint are intact. Fix: check the "
                "data for bad samples, lower --lr, use bf16 instead of fp16, or raise "
                "--max-skipped-steps"
            )

    def refuse_if_nothing_applied(self, cause: str) -> None:
        """At the end of a run: one whose every judged step was skipped learned nothing, and
        must not end as a success (``cause``: what made the steps non-finite)."""
        if self.judged and not self.applied:
            raise NonFiniteError(
                f"every one of this run's {self.judged} steps was skipped, so it learned "
                f"nothing and no checkpoint of it is written: {cause}"
            )

    def _nonfinite(self, value: torch.Tensor | None) -> torch.Tensor:
        """1.0 where ``value`` holds an inf or NaN, else 0.0 (on the guard's device)."""
        if value is None:
            return torch.zeros((), device=self.device)
        return (~torch.isfinite(value.detach().to(self.device))).any().float()


class _LateCopy:
    """The last agreed flags on the host, copied without waiting; read one step later."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def keep(self, flags: torch.Tensor) -> None:
        if flags.device.type != "cuda":
            self.host = flags.clone()  # gloo's all-reduce returned finished values
            return
        if self.host is None or self.host.shape != flags.shape:
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        self.host.copy_(flags, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def read_stop(self, layout: Flags) -> bool:
        """The stop flag of the flags kept one step ago (False before the first)."""
        if self.host is None:
            return False
        if self.ready is not None:
            # Recorded a whole step ago, behind which this step's forward and backward are
            # queued: the copy finished long before, so this returns without waiting.
            self.ready.synchronize()
        return bool(self.host[layout.stop].item() > 0)
