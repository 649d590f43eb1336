"""The per-step agreement of every rank: skip this step? stop after it?

Before the optimizer applies a step, each rank reports whether its own loss was finite, whether
the step's gradients were (after the reductions every layout runs, the gradient norm covers
every shard of every parameter), and whether it received a stop signal. One all-reduce over
the whole job sums the reports, so every rank takes the same decision:

* **skip** when any loss or gradient anywhere is inf or NaN: no parameter, optimizer state,
  loss-scale-free schedule or expert bias moves, the batch is consumed (as Megatron does), and
  the log names the ranks whose loss was non-finite. In fp16 the gradient scaler already found
  the overflow; the guard agrees with it. After ``--max-skipped-steps`` consecutive skips the
  run stops with :class:`~rapidformer.errors.NonFiniteError` before touching anything.
* **stop** when any rank received a stop signal (:mod:`.signals`).

The host reads the summed flags once per step: the step's own decision needs them. A job of
one rank has nothing to agree on: it reads its loss and gradient norm in one copy instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import NonFiniteError
from rapidformer.reliability.signals import StopSignals


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed for one step."""

    skip: bool = False
    stop: bool = False
    nonfinite_loss_ranks: tuple[int, ...] = ()
    """Ranks (of the whole job) whose own loss was inf or NaN."""
    nonfinite_gradients: bool = False

    @property
    def reason(self) -> str:
        """Why the step was skipped, for the log."""
        if self.nonfinite_loss_ranks:
            ranks = ", ".join(str(r) for r in self.nonfinite_loss_ranks)
            return f"non-finite loss on rank {ranks}"
        return "non-finite gradients" if self.nonfinite_gradients else ""


class StepGuard:
    """Decides, with every rank, whether each step is applied; see the module docstring."""

    def __init__(
        self, max_skipped_steps: int, group: process_group.Group, device: torch.device
    ) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.group = group
        self.device = device  # the flags live where the backend reduces (nccl: the GPU)
        self.signals: StopSignals | None = None
        """Set while a loop watches the stop signals (``Trainer.fit`` does)."""
        self.steps = 0
        """Optimizer steps seen (a resumed run sets the step it resumed at)."""
        self.consecutive_skips = 0
        self._loss: torch.Tensor | None = None

    def observe_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss (or losses) of the step about to be applied."""
        self._loss = loss.detach()

    def verdict(self, grad_norm: torch.Tensor | None) -> Verdict:
        """Every rank's reports summed (a collective: every rank calls it once per step)."""
        rank, world = process_group.rank(), process_group.world_size()
        stop = self.signals is not None and self.signals.received is not None
        if world == 1:  # nothing to agree with: read the numbers, judge them on the host
            values = [*self._local_flags(grad_norm), float(stop)]
        else:
            loss_bad, norm_bad = self._nonfinite(self._loss), self._nonfinite(grad_norm)
            flags = torch.zeros(world + 2, device=self.device)
            flags[rank] = loss_bad
            flags[world] = norm_bad
            flags[world + 1] = float(stop)
            process_group.all_reduce_sum(flags, self.group)
            values = flags.tolist()  # the host reads the decision once per step
        self._loss = None
        ranks = tuple(r for r in range(world) if values[r] > 0)
        nonfinite = values[world] > 0
        return Verdict(
            skip=bool(ranks) or nonfinite,
            stop=values[world + 1] > 0,
            nonfinite_loss_ranks=ranks,
            nonfinite_gradients=nonfinite,
        )

    def _local_flags(self, grad_norm: torch.Tensor | None) -> tuple[float, float]:
        """(loss non-finite, gradient norm non-finite) from one read of both."""
        empty = torch.zeros(0, device=self.device)
        loss = empty if self._loss is None else self._loss.detach().reshape(-1).float()
        norm = empty if grad_norm is None else grad_norm.detach().reshape(-1).float()
        numbers = torch.cat([loss.to(self.device), norm.to(self.device)]).tolist()
        count = loss.numel()
        return (
            float(not all(map(math.isfinite, numbers[:count]))),
            float(not all(map(math.isfinite, numbers[count:]))),
        )

    def _nonfinite(self, value: torch.Tensor | None) -> torch.Tensor:
        """1.0 where ``value`` holds an inf or NaN, else 0.0 (on the guard's device)."""
        if value is None:
            return torch.zeros((), device=self.device)
        return (~torch.isfinite(value.to(self.device))).any().float()

    def count(self, skipped: bool, reason: str) -> None:
        """Count a finished step; raise once ``--max-skipped-steps`` skips came in a row
        (nothing of the last one was applied: the parameters and checkpoints are intact)."""
        self.steps += 1
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive steps skipped, the last at step "
                f"{self.steps} ({reason or 'non-finite values'}); --max-skipped-steps is "
                f"{self.max_skipped_steps}. Nothing of them was applied, so the parameters and "
                "the last checkpoint are intact. Fix: check the data for bad samples, lower "
                "--lr, use bf16 instead of fp16, or raise --max-skipped-steps"
            )
