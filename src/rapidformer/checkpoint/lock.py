"""One run per save directory: ``--save DIR`` is locked for the whole run.

Two runs given one directory would destroy each other's work: each one's cleanup would delete
the other's staging directory, a published checkpoint could hold one file, and a run could
resume the other's checkpoint. Rank 0 therefore takes an exclusive OS lock (``flock``) on
``DIR/.lock`` before anything else reads or writes there, and holds it until the run ends. A
directory that cannot be written, or whose disk is full, is refused there too. The file names
the holder (host, pid, start time, command) so that a refused run can say who has it. The
kernel drops the lock when its process dies, however it dies, so a lock is never stale: a file
left by a killed run is taken over at once.

The other ranks learn rank 0's answer through one collective, so every rank of a refused run
stops with the same message (exit 2) before data, model or checkpoint is touched. A filesystem
that cannot lock (some Lustre or FUSE mounts) gets a warning and runs unlocked, as before.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import IO

import torch

from rapidformer.distributed import process_group
from rapidformer.errors import CheckpointError
from rapidformer.log import log
from rapidformer.own_files import open_own, write_fix

LOCK_FILE = ".lock"
FULL_BELOW = 1 << 20
"""Free bytes under which the disk of ``--save`` counts as full when a run starts."""


class SaveDirectoryLock:
    """The held lock on a save directory; :meth:`release` (or the end of the process) frees
    it."""

    def __init__(self, root: Path, handle: IO[str] | None) -> None:
        self.root = root
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


def lock_save_directory(save: str | None, device: torch.device) -> SaveDirectoryLock | None:
    """Lock ``save`` for this run (on rank 0; every rank agrees), or raise CheckpointError
    naming the run that holds it, or why the directory cannot be used."""
    if save is None:
        return None
    lock, failure = None, None
    if process_group.rank() == 0:
        try:
            lock = _take(Path(save))
        except BaseException as error:  # noqa: BLE001 (shared with every rank, then raised)
            failure = error
    # Every rank joins, whatever rank 0 met: the others must not wait at a later collective.
    refused = torch.tensor([float(failure is not None)], device=device)
    process_group.all_reduce_sum(refused, process_group.world_group())
    if failure is not None:
        raise failure
    if refused.item():
        raise CheckpointError(f"--save {save}: refused on rank 0 (see its message)")
    return lock


def _take(root: Path) -> SaveDirectoryLock:
    fix = "give this run its own --save"
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"--save {root} is a file, not a directory. Fix: {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open_own(root / LOCK_FILE, "a+")  # held for the run; never through a link
    except OSError as error:
        raise CheckpointError(
            f"--save {root} cannot be written ({error.strerror or error}). Fix: {fix}, on a "
            "disk where this user may write"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise CheckpointError(
            f"--save {root} is in use by another run ({holder}); two runs in one directory "
            f"delete each other's checkpoints. Fix: {fix}, or wait for that run to end"
        ) from None
    except OSError as error:  # a filesystem without flock (some Lustre or FUSE mounts)
        handle.close()
        log.warning(
            "--save %s cannot be locked (%s): nothing keeps a second run out of it; give each "
            "run its own --save",
            root,
            error.strerror or error,
        )
        _refuse_full(root, fix)
        return SaveDirectoryLock(root, None)
    try:  # a held directory is said first: its holder, not the disk, is what to fix
        _refuse_full(root, fix)
        _refuse_links(root)
    except CheckpointError:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
        raise
    try:
        handle.seek(0)
        handle.truncate()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500]
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        handle.write(json.dumps({**record, "command": command}) + "\n")
        handle.flush()
    except OSError as error:  # a full disk: the lock is not kept half-taken
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
        raise CheckpointError(
            f"--save {root} cannot be written ({error.strerror or error}). Fix: "
            f"{write_fix(error)}, or {fix}"
        ) from None
    return SaveDirectoryLock(root, handle)


def _refuse_links(root: Path) -> None:
    """The run writes its files at the top of ``--save`` (the final model, its tokenizer,
    metrics, TensorBoard's directory): a link there would have it write elsewhere. An
    ``iter_*`` link is no checkpoint of the directory (never resumed; pruned as a link)."""
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() and not entry.name.startswith("iter_"):
            raise CheckpointError(
                f"--save {root} holds the symbolic link {entry.name} (to "
                f"{os.readlink(entry)}): a run writes only its own files there, and would write "
                "through it. Fix: remove the link, or give the run another --save"
            )


def _refuse_full(root: Path, fix: str) -> None:
    """No checkpoint could be written on a full disk: say so before training for nothing."""
    free = shutil.disk_usage(root).free
    if free < FULL_BELOW:
        raise CheckpointError(
            f"--save {root}: its disk is full ({free // 1024} KiB free), so no checkpoint or "
            f"metric of this run could be written. Fix: free space there, or {fix} on another "
            "disk"
        )


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as its file says. The holder writes its name just after it takes
    the lock, so a run started at the same moment waits up to a second to read it whole (it
    may find it half-written), and for the file to stop naming an earlier holder that is gone
    (a process of this host that no longer exists)."""
    deadline = time.monotonic() + 1.0
    while True:
        handle.seek(0)
        try:
            record = json.loads(handle.read())
            said = f"pid {record['pid']} on {record['host']}, started {record['started']}"
            if _alive(record) or time.monotonic() > deadline:
                return said
        except (ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "its holder has not written its name yet"
        time.sleep(0.01)


def _alive(record: dict[str, object]) -> bool:
    """Whether the process a lock record names may still run (always, on another host)."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(str(record["pid"])), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True  # another user's process, or a pid we cannot read: assume it runs
    return True
