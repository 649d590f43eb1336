"""``--async-save``: checkpoints written in a background thread while training goes on.

The step that saves waits only for a copy of what the checkpoint holds, in host memory (the
model's and optimizer's state cloned off the live tensors, the RNG, schedule and scaler state,
the progress record); a thread then writes the files into the staging directory and publishes
the checkpoint as a synchronous save does: manifest, flush to disk (``fsync``), rename,
``latest``, pruning. So ``latest`` only ever names files that are complete and on disk, and a
kill at any moment leaves the previous checkpoint to resume from.

* At most one save is in flight: the next save (and the end of the run) waits for it.
* A write that fails (a full disk) removes its staging directory, leaves ``latest`` where it
  was, and stops the run with a :class:`CheckpointError` at its next step. So do parameters
  that are not finite: the thread checks the copy before it writes anything (the synchronous
  save checks the live parameters; here the check leaves the step's stall).
* The last save of a run, and the one a stop signal asks for, are synchronous: the run ends
  with its checkpoint on disk.

One process, in the consolidated format (the native format of an unsharded run): several ranks
would have to agree that every rank's files are written before rank 0 publishes, which a
background thread cannot ask of a process group the training thread is using. Refused
elsewhere, naming the flag (``config/validate.py``).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from rapidformer.checkpoint import (
    format_of,
    non_finite_error,
    publish_staged,
    required_files_of,
    state_files,
    write_objects,
)
from rapidformer.checkpoint.directory import STAGING_PREFIX, iteration_dir, remove_debris
from rapidformer.checkpoint.formats import ConsolidatedFormat
from rapidformer.errors import CheckpointError
from rapidformer.logging import log
from rapidformer.state import TrainState


class BackgroundSaver:
    """Saves of one run, each written by a thread of its own (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._step = 0
        self._buffers: dict[int, torch.Tensor] = {}
        """The host copies of the last save's tensors, by their place in its files."""

    def save(
        self,
        save_dir: str | Path,
        step: int,
        state: TrainState,
        progress: dict[str, Any],
        *,
        keep: int | None = None,
    ) -> Path:
        """Start writing the checkpoint of ``step``; returns where it will be once published."""
        self.wait()  # at most one in flight, and a failed one stops the run here
        writer = format_of(state)
        if not isinstance(writer, ConsolidatedFormat):  # validation refuses the others
            raise CheckpointError(f"--async-save cannot write the {writer.name} format")
        root = Path(save_dir)
        files = {**writer.files(state), **state_files(step, state, progress)}
        snapshot = self._snapshot(files)  # the only part the step waits for
        trained = [name for name, p in state.unwrapped_model.named_parameters() if p.requires_grad]
        required = required_files_of(state)
        self._step = step
        self._thread = threading.Thread(
            target=self._write,
            args=(root, step, snapshot, trained, required, keep),
            name=f"rapidformer-save-{step}",
            daemon=True,
        )
        self._thread.start()
        return root / iteration_dir(step)

    def wait(self) -> None:
        """Until the save in flight is published; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_if_failed()

    def _snapshot(self, files: dict[str, Any]) -> dict[str, Any]:
        """``files`` with every tensor copied into host buffers that outlive the save: the
        previous save's buffers when the shapes agree (its write is done: ``wait()`` came
        first), so that a save after the first copies into memory already mapped (allocating
        3.4 GB afresh, page by page, took 2.5-4.8 s of a 304M model's stall; copying into
        mapped memory a fraction of that)."""
        leaves, spec = tree_flatten(files)
        copies = []
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                copies.append(leaf)
                continue
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != leaf.shape or buffer.dtype != leaf.dtype:
                buffer = torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu")
                self._buffers[index] = buffer
            buffer.copy_(leaf.detach())
            copies.append(buffer)
        return tree_unflatten(copies, spec)

    @property
    def in_flight(self) -> bool:
        """Whether a write is running now."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> None:
        """At the end of the run, however it ends: the write in flight completes (its failure
        is logged by the thread; the run is already ending with its own outcome)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def raise_if_failed(self) -> None:
        """Stop the run (CheckpointError) if the last background write failed."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise CheckpointError(
                f"the background write of the checkpoint of step {self._step} failed "
                f"({type(failure).__name__}: {failure}); it was not published, and the "
                "previous checkpoint and 'latest' are untouched. Fix: free space there or pass "
                "another --save, then rerun to resume"
            ) from failure

    def _write(
        self,
        root: Path,
        step: int,
        files: dict[str, Any],
        trained: list[str],
        required: list[str],
        keep: int | None,
    ) -> None:
        staging = root / f"{STAGING_PREFIX}{iteration_dir(step)}"
        try:
            # The synchronous save's finiteness check, on the copy, off the training thread.
            model = files["model.pt"]
            held = [model[name] for name in trained if name in model]
            if not all(bool(torch.isfinite(tensor).all()) for tensor in held):
                raise non_finite_error(root, step)
            root.mkdir(parents=True, exist_ok=True)
            remove_debris(root)  # nothing of this run is in flight: wait() came first
            staging.mkdir()
            write_objects(staging, files)
            publish_staged(root, staging, root / iteration_dir(step), keep, required)
        except BaseException as failure:  # noqa: BLE001 (reported at the next step)
            shutil.rmtree(staging, ignore_errors=True)
            self._failure = failure
            log.warning("the background write of step %d failed: %s", step, failure)
