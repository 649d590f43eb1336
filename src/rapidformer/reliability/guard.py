"""The per-step agreement of every rank: skip this step? stop after it?, decided on the device.

Before the optimizer applies a step, each rank reports whether its own loss was finite, whether
the step's gradients were (after the reductions every layout runs, the gradient norm covers
every shard of every parameter), whether fp16's loss scaler found an overflow, and whether it
received a stop signal. One all-reduce over the whole job sums the reports into a small flag
vector, so every rank takes the same decision:

* **skip** when any loss or gradient anywhere is inf or NaN. The decision stays a 0-dim device
  tensor (:attr:`Decision.skip`): the optimizer reads it as its ``found_inf`` and the schedule
  as "not applied" (:mod:`rapidformer.accel.skipping`), so no parameter, optimizer state,
  learning-rate step or expert bias moves, the batch is consumed (as Megatron does), and the
  host never waits for the device inside a step.
* **stop** when any rank received a stop signal (:mod:`.signals`). One rank knows at once. On
  several ranks the agreed flags are copied to the host without waiting (a pinned buffer and an
  event on CUDA) and read at the *next* step, when the device has long finished them: a stop
  takes effect one step later than it arrived, at a step boundary, on every rank alike.

The host learns which steps were skipped when it reads the flags anyway: every
``--log-interval`` steps (:meth:`StepGuard.count`), before a checkpoint and at the end of the
run (:meth:`StepGuard.settle`), or at once where the step cannot be decided on the device
(:meth:`StepGuard.read_skip`: an optimizer without a ``found_inf`` input). Then each skipped
step is logged with the ranks whose loss was non-finite, and after ``--max-skipped-steps``
consecutive skips the run stops with :class:`~rapidformer.errors.NonFiniteError`: none of
those steps moved anything, so the parameters and the checkpoints are intact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import NonFiniteError
from rapidformer.logging import log
from rapidformer.reliability.signals import StopSignals


@dataclass(frozen=True)
class Decision:
    """What every rank agreed for one step; the skip stays on the device."""

    skip: torch.Tensor
    """0-dim float32 on the guard's device: exactly 1.0 to skip the step, else 0.0 (the value
    torch's fused optimizers take as ``found_inf``)."""
    flags: torch.Tensor
    """The agreed reports: one non-finite-loss count per rank, then non-finite gradients,
    fp16 overflow and stop (see :func:`reason`)."""
    stop: bool = False
    """Every rank agreed to stop after this step (a signal that arrived by the last step on
    several ranks, by this one on one rank)."""

    @property
    def applied(self) -> torch.Tensor:
        """1.0 where the step is applied, 0.0 where it is skipped (on the device)."""
        return 1.0 - self.skip


def reason(values: list[float], world: int) -> str:
    """Why a step with these (host) flag values was skipped, for the log; "" if it was not."""
    ranks = [r for r in range(world) if values[r] > 0]
    if ranks:
        return "non-finite loss on rank " + ", ".join(str(r) for r in ranks)
    if values[world + 1] > 0:
        return "fp16 gradients overflowed, loss scale halved"
    return "non-finite gradients" if values[world] > 0 else ""


class StepGuard:
    """Decides, with every rank, whether each step is applied; see the module docstring."""

    def __init__(
        self,
        max_skipped_steps: int,
        group: process_group.Group,
        device: torch.device,
        settle_interval: int = 1,
    ) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.group = group
        self.device = device  # the flags live where the backend reduces (nccl: the GPU)
        self.settle_interval = max(1, settle_interval)
        self.signals: StopSignals | None = None
        """Set while a loop watches the stop signals (``Trainer.fit`` does)."""
        self.steps = 0
        """Optimizer steps seen (a resumed run sets the step it resumed at)."""
        self.consecutive_skips = 0
        """Skipped steps in a row, as of the last :meth:`settle`."""
        self._loss: torch.Tensor | None = None
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._late = _LateCopy()

    def observe_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss (or losses) of the step about to be applied."""
        self._loss = loss.detach()

    def decide(
        self, grad_norm: torch.Tensor | None, found_inf: torch.Tensor | None = None
    ) -> Decision:
        """Every rank's reports summed (a collective: every rank calls it once per step);
        ``found_inf``: fp16's overflow flag, already agreed over the ranks."""
        rank, world = process_group.rank(), process_group.world_size()
        local_stop = self.signals is not None and self.signals.received is not None
        mine = torch.zeros(world, device=self.device)
        mine[rank] = 1.0  # a host scalar fill: no read
        overflow = torch.zeros((), device=self.device) if found_inf is None else found_inf
        flags = torch.cat(
            [
                mine * self._nonfinite(self._loss),
                torch.stack(
                    [
                        self._nonfinite(grad_norm),
                        (overflow.to(self.device) > 0).float(),
                        torch.full((), float(local_stop), device=self.device),
                    ]
                ),
            ]
        )
        self._loss = None
        if world > 1:
            process_group.all_reduce_sum(flags, self.group)
            stop = self._late.read_stop()  # the previous step's flags, finished long ago
            self._late.keep(flags)
        else:
            stop = local_stop  # nothing to agree with: the host knows
        skip = (flags[: world + 2].sum() > 0).float()
        self._pending.append((self.steps + 1, flags))
        return Decision(skip=skip, flags=flags, stop=stop)

    def read_skip(self, decision: Decision) -> bool:
        """The decision read to the host now (waits for the device): for steppers that cannot
        take it as a device tensor. Judges every pending step, this one last."""
        values = self.take(decision)
        why = reason(values, len(values) - 3)
        self.judge(self.steps + 1, why)
        return bool(why)

    def take(self, decision: Decision) -> list[float]:
        """This step's flags read to the host now, for a stepper that judges the step itself
        (:meth:`judge`); the steps pending before it are settled first."""
        assert self._pending and self._pending[-1][1] is decision.flags, "decide() first"
        self._pending.pop()
        self.settle()
        return [float(v) for v in decision.flags.tolist()]

    def count(self) -> None:
        """A step finished; every ``settle_interval`` steps, read and judge the pending ones."""
        self.steps += 1
        if self.steps % self.settle_interval == 0:
            self.settle()

    def settle(self) -> None:
        """Read the pending steps' flags in one copy and judge them in order. Every rank calls
        it at the same steps."""
        if not self._pending:
            return
        steps = [step for step, _ in self._pending]
        table = torch.stack([flags for _, flags in self._pending]).tolist()
        self._pending.clear()
        world = process_group.world_size()
        for step, values in zip(steps, table, strict=True):
            self.judge(step, reason(values, world))

    def judge(self, step: int, why: str) -> None:
        """Account for one step, skipped where ``why`` says why: log it, and raise once
        ``--max-skipped-steps`` came in a row (nothing of them was applied: the parameters and
        checkpoints are intact)."""
        if not why:
            self.consecutive_skips = 0
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

    def read_stop(self) -> bool:
        """The stop flag of the flags kept one step ago (False before the first)."""
        if self.host is None:
            return False
        if self.ready is not None:
            # Recorded a whole step ago, behind which this step's forward and backward are
            # queued: the copy finished long before, so this returns without waiting.
            self.ready.synchronize()
        return bool(self.host[-1].item() > 0)
