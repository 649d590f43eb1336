"""The trackers that write files under ``--save``: ``metrics.jsonl`` (one JSON object per row)
and TensorBoard's event files (each number of a row as the scalar ``kind/name``; the config
and the plan as text).

TensorBoard writes from a thread of its own, which would print a traceback when it fails (a
full disk); that thread is kept quiet here, since its error is raised again at the next write
and reported there once (:mod:`.guard`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from rapidformer.own_files import open_own
from rapidformer.trackers.tracker import TrackedRun, scalars


class JsonlTracker:
    """``{"kind": kind, **record}`` per row, flushed at once."""

    name = "jsonl"
    run_id: str | None = None

    def __init__(self, run: TrackedRun) -> None:
        assert run.save_dir is not None
        path = Path(run.save_dir) / "metrics.jsonl"
        self.where = str(path)
        self._file = open_own(path, "a")  # open for the run; never through a link

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"kind": kind, **record}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """Each number of a row as the scalar ``kind/name`` at the row's step."""

    name = "tensorboard"
    run_id: str | None = None

    def __init__(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        assert run.save_dir is not None
        _quiet_writer_threads()
        directory = Path(run.save_dir) / "tensorboard"
        self.where = str(directory)
        self._writer = SummaryWriter(str(directory))
        if run.start_step == 0:  # a resumed run has them already
            self._writer.add_text("config", f"```\n{json.dumps(run.config, indent=1)}\n```")
            self._writer.add_text("run_plan", "\n".join(f"- {line}" for line in run.plan))

    def write(self, kind: str, record: dict[str, Any]) -> None:
        for key, value in scalars(kind, record).items():
            self._writer.add_scalar(key, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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
