"""The save directory: which checkpoints it holds, which one to resume from, what to delete.

``--save DIR`` holds ``iter_NNNNNNN`` checkpoints and a ``latest`` file naming the newest
complete one. A checkpoint is staged in ``.tmp-iter_NNNNNNN`` and renamed into place before
``latest`` moves, so a crash at any moment leaves ``latest`` naming a whole checkpoint; the
debris a crash leaves (staging directories, a half-written pointer, a checkpoint set aside
while it was being replaced) is removed before the next save.

Nothing outside the save directory is written or followed: the files a run writes there are
opened without following a symbolic link (:func:`open_own`), a link in their place is refused,
``latest`` counts only when it names an ``iter_*`` directory of the save directory itself, and
pruning removes a linked ``iter_*`` as a link.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from rapidformer.checkpoint.integrity import damage, looks_whole
from rapidformer.errors import CheckpointError
from rapidformer.log import log

LATEST = "latest"
PROGRESS = "progress.json"
STAGING_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_ITERATION = re.compile(r"iter_(\d{7,})")


def read_progress(directory: Path) -> dict[str, Any]:
    """The checkpoint's ``progress.json``: a mapping with an integer ``step``, or
    CheckpointError naming the file and what is wrong with it."""
    path = directory / PROGRESS
    fix = "restore it from a copy, or resume from another checkpoint"
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        reason = error.strerror or error
        raise CheckpointError(f"{path} cannot be read ({reason}). Fix: {fix}") from None
    except ValueError as error:  # bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{path} is not JSON ({error}). Fix: {fix}") from None
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{path} holds a {type(record).__name__}, not a checkpoint record. Fix: {fix}"
        )
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{path} has no step count (its 'step' is {step!r}, not a whole number). Fix: {fix}"
        )
    return record


def read_pointer(pointer: Path) -> str | None:
    """The checkpoint a ``latest`` file names, or None where it names none of its directory's
    own: not text, not ``iter_NNNNNNN``, a path elsewhere, or a link (the caller falls back to
    the newest complete checkpoint, saying why)."""
    if pointer.is_symlink():
        return None
    try:
        name = pointer.read_bytes()[:256].decode("utf-8").strip()
    except (UnicodeDecodeError, OSError):
        return None
    candidate = pointer.parent / name
    if not _ITERATION.fullmatch(name) or candidate.is_symlink():
        return None
    return name


def iteration_dir(step: int) -> str:
    return f"iter_{step:07d}"


def iterations(root: Path, links: bool = False) -> list[Path]:
    """The ``iter_*`` directories under ``root``, newest (highest step) first; a link is none
    (resuming never follows one), unless ``links`` asks for the links named so too."""
    found = [
        p for p in root.iterdir()
        if _ITERATION.fullmatch(p.name)
        and ((links and p.is_symlink()) or (p.is_dir() and not p.is_symlink()))
    ]  # fmt: skip
    return sorted(found, key=lambda p: int(p.name[len("iter_") :]), reverse=True)


def remove_debris(root: Path) -> None:
    """Delete what an interrupted save left behind (rank 0, before saving)."""
    for path in root.iterdir():
        debris = path.name.startswith((STAGING_PREFIX, ASIDE_PREFIX))
        if (debris or path.name == f".{LATEST}.tmp") and path.is_symlink():
            path.unlink()  # the link, never what it points to
        elif debris and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name == f".{LATEST}.tmp":
            path.unlink(missing_ok=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` whole checkpoints, always the one ``latest`` names, and any
    newer than those (a damaged one left by an earlier run: kept for whoever looks into it,
    never counted, so it cannot push a whole one out). An ``iter_*`` that is a link is no
    checkpoint of this directory (it is never resumed): it is removed, as a link."""
    pointer = root / LATEST
    current = read_pointer(pointer) if pointer.is_file() else None
    for link in iterations(root, links=True):
        if link.is_symlink():
            link.unlink()
    whole = 0
    for checkpoint in iterations(root):
        if whole >= keep and checkpoint.name != current:
            shutil.rmtree(checkpoint, ignore_errors=True)
        elif looks_whole(checkpoint):
            whole += 1


def _problem(directory: Path) -> str | None:
    if not (directory / PROGRESS).is_file():
        return f"{directory / PROGRESS} is missing"
    try:
        read_progress(directory)
    except CheckpointError as error:
        return str(error).split(". Fix:")[0]
    return damage(directory)


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint to resume from at ``path``: ``path`` itself when it is one (an error if
    it is damaged), else the one its ``latest`` names; when that one is missing or damaged,
    the newest complete one before it, with a warning naming both. None when ``path`` holds
    no checkpoint yet."""
    path = Path(path)
    if (path / PROGRESS).is_file():
        problem = _problem(path)
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint {path} is damaged: {problem}. Fix: pass --load with its "
                "save directory (the newest complete checkpoint is then used) or another "
                "iter_* directory"
            )
        return path
    pointer = path / LATEST
    if not pointer.is_file() and not pointer.is_symlink():
        return None
    name = read_pointer(pointer)
    if name is None:
        problem = "it names no iter_* checkpoint of this directory"
        target = pointer
    else:
        target = path / name
        problem = _problem(target)
        if problem is None:
            return target
    for older in iterations(path):
        if older != target and _problem(older) is None:
            log.warning(
                "the latest checkpoint %s is damaged (%s): resuming from the previous "
                "complete checkpoint %s instead",
                target,
                problem,
                older,
            )
            return older
    if name is None:
        raise CheckpointError(
            f"{pointer} names no iter_* checkpoint of {path}, and {path} holds no complete "
            "checkpoint. Fix: delete it (or write the checkpoint's name into it), or start "
            "afresh with another --save"
        )
    raise CheckpointError(
        f"{pointer} names {target}, which is damaged ({problem}), and {path} holds no "
        "older complete checkpoint. Fix: restore the file, or start afresh with another --save"
    )


def sync_files(directory: Path) -> None:
    """Every file and directory under ``directory`` on disk (``fsync``): a checkpoint is
    published only once a power loss could not take its contents back."""
    for path in sorted(directory.rglob("*"), reverse=True):  # files before their directory
        if path.is_file():
            with open(path, "rb") as stream:
                os.fsync(stream.fileno())
        elif path.is_dir():
            sync_directory(path)
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """A rename in ``directory`` made durable: after a power loss the entry could otherwise
    still name the old file, whatever was flushed into the new one."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:  # some filesystems cannot sync a directory: nothing to wait for
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)
