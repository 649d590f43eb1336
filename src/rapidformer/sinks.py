"""Where rank 0's metric rows go beside the console: ``metrics.jsonl`` and TensorBoard's event
files under ``--save``.

A sink that fails (a full disk, a file system gone) must never end the run, nor lose the
progress made since the last checkpoint: it warns once, naming where it wrote and why, and is
dropped; training goes on, and the next checkpoint's save says plainly whether the disk has
room again. TensorBoard writes from a thread of its own, which would print the error's
traceback; that thread is kept quiet here, since its error is raised again at the next write
and reported there once.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Protocol

from rapidformer.logging import log


class Sink(Protocol):
    """One destination of metric rows."""

    where: str
    """What to name in a warning (a file or directory)."""

    def write(self, kind: str, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per row, ``{"kind": kind, **record}``, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"kind": kind, **record}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Each number of a row as the scalar ``kind/name`` at the row's step."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.where = str(directory)
        self._writer = SummaryWriter(str(directory))

    def write(self, kind: str, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._writer.add_scalar(f"{kind}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class GuardedSinks:
    """The run's sinks; one that raises is reported once and dropped."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks

    def write(self, kind: str, record: dict[str, Any]) -> None:
        for sink in list(self._sinks):
            self._attempt(sink, lambda sink=sink: sink.write(kind, record))

    def close(self) -> None:
        for sink in list(self._sinks):
            self._attempt(sink, sink.close)
        self._sinks = []

    def _attempt(self, sink: Sink, action: Any) -> None:
        try:
            action()
        except Exception as error:  # noqa: BLE001 (a sink never stops training)
            self._sinks.remove(sink)
            log.warning(
                "metrics are no longer written to %s (%s: %s); training goes on, and the "
                "console still shows every row. Fix: free space there (the next checkpoint "
                "needs it too)",
                sink.where,
                type(error).__name__,
                error,
            )
            with contextlib.suppress(Exception):  # already reported; closing is best effort
                sink.close()


def _quiet_writer_threads() -> None:
    """Keep TensorBoard's writer thread from printing a traceback when it fails: the same
    error is raised again in the training thread's next write, and reported there once.
    Installed again whenever another hook has replaced ours (test runners swap their own in
    and out)."""
    previous = threading.excepthook
    if getattr(previous, "rapidformer_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.rapidformer_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def open_sinks(save_dir: str) -> GuardedSinks:
    """metrics.jsonl and TensorBoard under ``save_dir``; one that cannot be opened is
    reported as a failing one is, and the run goes on without it."""
    root = Path(save_dir)
    sinks: list[Sink] = []
    openers: list[tuple[Any, Path]] = [
        (JsonlSink, root / "metrics.jsonl"),
        (TensorBoardSink, root / "tensorboard"),
    ]
    for opener, where in openers:
        try:
            root.mkdir(parents=True, exist_ok=True)
            sinks.append(opener(where))
        except OSError as error:
            log.warning(
                "metrics cannot be written to %s (%s); training goes on without them. Fix: "
                "free space there (the checkpoints need it too)",
                where,
                error.strerror or error,
            )
    return GuardedSinks(sinks)
