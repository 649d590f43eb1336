"""``--async-save``: checkpoints written in a background thread while training goes on.

The step that saves waits only for a copy of what the checkpoint holds, in host memory (pinned
when it comes from a GPU): the consolidated format's files, or this rank's DCP shards of the
model and optimizer (staged by DCP's own stager, which keeps them DTensors), and the RNG,
schedule and scaler state and the progress record. A thread on each rank then writes them into
the staging directory and rank 0 publishes the checkpoint as a synchronous save does:
manifest, ``fsync``, rename, ``latest``, pruning. So ``latest`` only ever names files that are
complete and on disk, and a kill at any moment leaves the previous checkpoint to resume from.

On several ranks the threads agree with each other through a gloo process group of their own
(the training's group is busy with the training: two threads of one rank may not share a
group): rank 0's staging directory exists before anyone writes, DCP plans and finishes its
write over that group, every rank's files are written before rank 0 publishes, and every rank
learns the outcome. The finiteness check of the copy rides on the same agreement.

* At most one save is in flight: the next save (and the end of the run) waits for it.
* A write that fails (a full disk) or a copy that is not finite removes the staging directory,
  leaves ``latest`` where it was, and stops the run with a :class:`CheckpointError`. On one
  process that happens at the next step. On several ranks, a thread cannot make the other ranks
  stop at the same step, so its failure is a stop request on the step guard's all-reduce, as a
  stop signal is: every rank stops after the same step, writes it synchronously (it may fit
  again), then raises the failure.
* The last save of a run, and the one a stop signal asks for, are synchronous: the run ends
  with its checkpoint on disk.

DeepSpeed's engine writes its own format synchronously; validation refuses the flag there.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from rapidformer.checkpoint.directory import STAGING_PREFIX, iteration_dir, remove_debris
from rapidformer.checkpoint.formats import (
    SHARDED,
    ConsolidatedFormat,
    DistributedFormat,
    format_of,
)
from rapidformer.checkpoint.save import (
    non_finite_error,
    publish_staged,
    required_files_of,
    state_files,
    write_objects,
)
from rapidformer.distributed import process_group
from rapidformer.distributed.tensors import local_part
from rapidformer.errors import CheckpointError
from rapidformer.log import log
from rapidformer.own_files import write_fix
from rapidformer.state import TrainState

_NON_FINITE, _FAILED = 0, 1
"""The places of the two reports in the threads' agreement."""


class BackgroundSaver:
    """Saves of one run, each written by a thread of its own (see the module docstring).

    ``on_failure`` is called from the thread once every rank knows a write failed (the
    trainer passes the step guard's stop request on several ranks)."""

    def __init__(
        self, on_failure: Callable[[], None] | None = None, timeout_minutes: float | None = None
    ) -> None:
        """``timeout_minutes``: how long the threads wait for each other (the run's
        ``--distributed-timeout-minutes``; torch's default without)."""
        self._on_failure = on_failure
        self._timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._step = 0
        self._buffers: dict[int, torch.Tensor] = {}
        """The host copies of the last save's tensors, by their place in its files."""
        self._stager: Any = None
        """DCP's stager of the shards (it reuses its host memory from one save to the next)."""
        self._group: dist.ProcessGroup | None = None
        """The threads' own gloo group (several ranks)."""
        self._broken = False
        """Whether that group failed once (no later save can agree over it)."""

    def save(
        self,
        save_dir: str | Path,
        step: int,
        state: TrainState,
        progress: dict[str, Any],
        *,
        keep: int | None = None,
    ) -> Path:
        """Start writing the checkpoint of ``step`` (every rank calls it); returns where it
        will be once published."""
        self.wait()  # at most one in flight, and a failed one stops the run here
        writer = format_of(state)
        if not isinstance(writer, ConsolidatedFormat | DistributedFormat):
            raise CheckpointError(f"--async-save cannot write the {writer.name} format")
        if process_group.world_size() > 1 and self._group is None:
            # Every rank, at the same save.
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        root = Path(save_dir)
        files = state_files(step, state, progress)
        if isinstance(writer, ConsolidatedFormat):
            files = {**writer.files(state), **files}  # ZeRO-1 gathers here: every rank
        trained = [name for name, p in state.unwrapped_model.named_parameters() if p.requires_grad]
        job = _Job(root, step, {}, None, trained, required_files_of(state), keep)
        try:  # the copy: all the step waits for
            if isinstance(writer, DistributedFormat):
                job.shards = self._stage(writer.content(state))
            job.files = self._snapshot(files)
        except Exception as error:  # noqa: BLE001 (one rank out of host memory: the thread's
            job.failure = error  # agreement tells every rank, which then stop together)
        self._step = step
        self._thread = threading.Thread(
            target=self._write, args=(job,), name=f"rapidformer-save-{step}", daemon=True
        )
        self._thread.start()
        return root / iteration_dir(step)

    def wait(self) -> None:
        """Until the save in flight is published; raise if it failed."""
        self.finish()
        self.raise_if_failed()

    def _stage(self, shards: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            pinned = torch.cuda.is_available()
            options = StagingOptions(pinned, use_shared_memory=False, use_async_staging=False,
                                     use_non_blocking_copy=False)  # fmt: skip
            self._stager = DefaultStager(options)
        staged = self._stager.stage(shards)
        assert isinstance(staged, dict)
        return staged

    def _snapshot(self, files: dict[str, Any]) -> dict[str, Any]:
        """``files`` with every tensor copied into host buffers that outlive the save: the
        previous save's buffers when the shapes agree (its write is done: ``wait()`` came
        first), so that a save after the first copies into memory already mapped (allocating
        3.4 GB afresh, page by page, took 2.5-4.8 s of a 304M model's stall; copying into
        mapped memory a fraction of that)."""
        leaves, spec = tree_flatten(files)
        copies = []
        seen: dict[tuple[Any, ...], torch.Tensor] = {}
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                copies.append(leaf)
                continue
            # Tied weights (a GPT's embedding and output layer) are one tensor under two
            # names: one copy for both, as torch.save stores one storage for both.
            alias = (leaf.device, leaf.data_ptr(), leaf.dtype, leaf.shape, leaf.stride())
            if alias in seen:
                copies.append(seen[alias])
                continue
            buffer = self._buffers.get(index)
            if buffer is None or buffer.shape != leaf.shape or buffer.dtype != leaf.dtype:
                pinned = leaf.device.type == "cuda"
                buffer = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=pinned)
                self._buffers[index] = buffer
            buffer.copy_(leaf.detach())
            seen[alias] = buffer
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

    @property
    def failed(self) -> bool:
        """Whether the last background write failed (and has not been raised yet)."""
        return self._failure is not None

    def raise_if_failed(self) -> None:
        """Stop the run (CheckpointError) if the last background write failed."""
        failure, self._failure = self._failure, None
        if isinstance(failure, CheckpointError):  # says what happened already (not finite)
            raise failure
        if failure is not None:
            raise CheckpointError(
                f"the background write of the checkpoint of step {self._step} failed "
                f"({type(failure).__name__}: {failure}); it was not published, and the "
                f"previous checkpoint and 'latest' are untouched. Fix: {write_fix(failure)} or "
                "pass another --save, then rerun to resume"
            ) from failure

    def _agree(self, reports: list[bool]) -> list[bool]:
        """Each report or'ed over the ranks (the threads' group; as is on one process). A
        group that fails (a peer gone, the timeout) raises :class:`_GroupLost`."""
        if self._group is None:
            return reports
        if self._broken:
            raise _GroupLost("an earlier background write lost the other ranks")
        flags = torch.tensor([float(r) for r in reports])
        try:
            dist.all_reduce(flags, group=self._group)
        except Exception as error:
            self._broken = True
            raise _GroupLost(f"the ranks' writers lost each other ({error})") from error
        return [bool(v > 0) for v in flags.tolist()]

    def _write(self, job: _Job) -> None:
        try:
            self._agreed_write(job)
        except _GroupLost as lost:  # no agreement is possible: this rank stops on its own
            shutil.rmtree(job.root / f"{STAGING_PREFIX}{iteration_dir(job.step)}", True)
            self._failed(job, CheckpointError(f"the background write of step {job.step} "
                                              f"failed: {lost}; it was not published"))  # fmt: skip

    def _failed(self, job: _Job, failure: BaseException) -> None:
        self._failure = failure
        log.warning("the background write of step %d failed: %s", job.step, failure)
        if self._on_failure is not None:
            self._on_failure()

    def _agreed_write(self, job: _Job) -> None:
        import torch.distributed.checkpoint as dcp

        rank = process_group.rank()
        staging = job.root / f"{STAGING_PREFIX}{iteration_dir(job.step)}"
        failure: BaseException | None = job.failure
        non_finite = False
        try:
            non_finite = failure is None and not job.finite()  # the copy, off the step
            if rank == 0 and not non_finite and failure is None:
                job.root.mkdir(parents=True, exist_ok=True)
                remove_debris(job.root)  # nothing of this run is in flight: wait() came first
                staging.mkdir()
        except BaseException as error:  # noqa: BLE001 (agreed, then reported at a step)
            failure = error
        # Also the barrier that puts rank 0's staging directory before every rank's files.
        reports = self._agree([non_finite, failure is not None])
        if not any(reports):
            try:
                if job.shards is not None:  # DCP plans and finishes over the threads' group
                    dcp.save(job.shards, checkpoint_id=staging / SHARDED,
                             process_group=self._group, no_dist=self._group is None)  # fmt: skip
                write_objects(staging, job.files)
            except BaseException as error:  # noqa: BLE001
                failure = error
            reports = self._agree([False, failure is not None])
        if not any(reports) and rank == 0:
            try:
                publish_staged(job.root, staging, job.root / iteration_dir(job.step), job.keep,
                               job.required)  # fmt: skip
            except BaseException as error:  # noqa: BLE001
                failure = error
        reports = self._agree([reports[_NON_FINITE], reports[_FAILED] or failure is not None])
        if not any(reports):
            return
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if reports[_NON_FINITE]:
            failure = non_finite_error(job.root, job.step)
        elif failure is None:
            failure = CheckpointError(
                f"the background write of the checkpoint of step {job.step} failed on another "
                "rank (its message says why); it was not published, and the previous checkpoint "
                "and 'latest' are untouched"
            )
        self._failed(job, failure)


class _Job:
    """One background save: what to write, where, and what the format requires."""

    def __init__(
        self,
        root: Path,
        step: int,
        files: dict[str, Any],
        shards: dict[str, Any] | None,
        trained: list[str],
        required: list[str],
        keep: int | None,
    ) -> None:
        self.root, self.step, self.files, self.shards = root, step, files, shards
        self.trained, self.required, self.keep = trained, required, keep
        self.failure: BaseException | None = None
        """What went wrong on this rank before the thread started (its copy)."""

    def finite(self) -> bool:
        """Whether this rank's copy of the trained parameters is finite (the synchronous
        save's check, on the copy: rank 0's whole ``model.pt``, or each rank's shards)."""
        model = self.files.get("model.pt")
        if self.shards is not None:
            model = self.shards["model"]
        if model is None:
            return True
        held = [model[name] for name in self.trained if name in model]
        local = [local_part(t) for t in held]
        return all(bool(torch.isfinite(t).all()) for t in local if t.numel())


class _GroupLost(RuntimeError):
    """The writers' process group failed: the ranks can no longer agree."""
