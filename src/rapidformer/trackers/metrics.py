"""Rank-0 reporting of a run's numbers: a log line every --log-interval, a progress bar, and
the rows every tracker --report-to names receives (by default metrics.jsonl and TensorBoard
event files under --save). Other ranks report nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rapidformer.log import log, setup_console_logging
from rapidformer.memory import peak_memory_bytes
from rapidformer.trackers.setup import TrackerSetup, open_trackers
from rapidformer.trackers.tracker import TrackedRun

if TYPE_CHECKING:
    from rapidformer.flops import MfuMeter
    from rapidformer.trackers.guard import GuardedTrackers


class MetricsLogger:
    """Accumulates per-step numbers and reports them every ``log_interval`` steps."""

    _tokens: torch.Tensor | int  # summed on the device; read only when a line is logged

    def __init__(
        self,
        *,
        enabled: bool,
        log_interval: int,
        total_steps: int,
        save_dir: str | None,
        device: torch.device,
        start_step: int = 0,
        extras: Callable[[], dict[str, Any]] | None = None,
        mfu: MfuMeter | None = None,
        trackers: TrackerSetup | None = None,
    ) -> None:
        """``extras()`` adds fields to every logged line (e.g. MoE routing statistics); it is
        called on every rank at each logged step, so it may reduce over ranks. ``mfu`` turns
        the tokens/s into achieved TFLOP/s per device and MFU. ``trackers``: where the rows go
        beside the console (``--report-to``; default: metrics.jsonl and TensorBoard under
        ``save_dir``)."""
        self.enabled = enabled
        self.mfu = mfu
        self.extras = extras
        self.log_interval = log_interval
        self.total_steps = total_steps
        self.device = device
        self._trackers: GuardedTrackers | None = None
        self._bar = None
        if enabled:
            setup_console_logging()
            if trackers is None:
                run = TrackedRun(save_dir=save_dir, name="rapidformer", project=None)
                trackers = TrackerSetup(("tensorboard", "jsonl"), run)
            self._trackers = open_trackers(trackers)
            if sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total_steps, initial=start_step, unit="step", dynamic_ncols=True
                )
        self._reset_window()

    def step(
        self,
        step: int,
        *,
        loss: float | torch.Tensor,
        lr: float | torch.Tensor,
        grad_norm: float | torch.Tensor,
        samples: int,
        tokens: torch.Tensor | int,
        skipped: bool | torch.Tensor,
    ) -> list[tuple[int, float, bool]] | None:
        """Record one optimizer step (call on every rank; only rank 0 writes). Loss, learning
        rate, gradient norm, tokens and the skip flag may be device tensors: they are read to
        the host once per logged window, all in one copy, never at the other steps. Returns,
        at a logged step, the window's ``(step, loss, skipped)`` as host numbers (e.g. for the
        spike check), else None."""
        self._window.append((step, loss, skipped))
        self._samples += samples
        self._tokens = self._tokens + tokens
        if self._bar is not None:
            self._bar.update(1)
        if step % self.log_interval and step != self.total_steps:
            return None
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        count = len(self._window)
        values = self._read(
            [
                *(entry[1] for entry in self._window),
                *(entry[2] for entry in self._window),
                lr,
                grad_norm,
                self._tokens,
            ]
        )
        losses, skips = values[:count], values[count : 2 * count]
        lr_read, norm, tokens_read = values[-3:]
        window = [
            (s, value, bool(k))
            for (s, _, _), value, k in zip(self._window, losses, skips, strict=True)
        ]
        record = {
            "step": step,
            "loss": sum(losses) / len(losses),
            "lr": lr_read,
            "grad_norm": norm,
            "samples_per_s": self._samples / elapsed,
            "tokens_per_s": tokens_read / elapsed,
        }
        if self.mfu is not None:
            record.update(self.mfu.fields(tokens_read / elapsed))
        record["peak_memory_mb"] = peak_memory_bytes(self.device) / 2**20
        skipped_steps = sum(k for _, _, k in window)
        if skipped_steps:
            record["skipped_steps"] = skipped_steps  # in this window; each is logged with why
        if self.extras is not None:
            record.update(self.extras())
        self.write("train", record)
        self._reset_window()
        return window

    def tracker_places(self) -> list[str]:
        """Where each tracker reports (for the run's closing line)."""
        return self._trackers.places() if self._trackers is not None else []

    def run_ids(self) -> dict[str, str]:
        """Each tracker's id of this run (kept in checkpoints: a resume continues it)."""
        return self._trackers.run_ids() if self._trackers is not None else {}

    def _read(self, values: list[float | int | torch.Tensor]) -> list[float]:
        """Host copies of ``values`` in one device-to-host transfer (float64: token counts of
        a long window stay exact)."""
        on_device = [
            torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in values
        ]
        return [float(v) for v in torch.stack(on_device).tolist()]

    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()
        self._window: list[tuple[int, float | torch.Tensor, bool | torch.Tensor]] = []
        self._samples = 0
        self._tokens = 0

    def write(self, kind: str, record: dict[str, Any]) -> None:
        """Log a record (``kind`` is train or eval) to the console, JSONL and TensorBoard."""
        if not self.enabled:
            return
        step = record["step"]
        text = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k != "step")
        message = f"{kind} step {step}/{self.total_steps} | {text}"
        if self._bar is not None:
            self._bar.write(message)
        else:
            log.info(message)
        if self._trackers is not None:
            self._trackers.write(kind, record)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._trackers is not None:
            self._trackers.close()


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
