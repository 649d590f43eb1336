"""The save directory: which checkpoints it holds, which one to resume from, what to delete.

``--save DIR`` holds ``iter_NNNNNNN`` checkpoints and a ``latest`` file naming the newest
complete one. A checkpoint is staged in ``.tmp-iter_NNNNNNN`` and renamed into place before
``latest`` moves, so a crash at any moment leaves ``latest`` naming a whole checkpoint; the
debris a crash leaves (staging directories, a half-written pointer, a checkpoint set aside
while it was being replaced) is removed before the next save.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from rapidformer.checkpoint.integrity import damage
from rapidformer.errors import CheckpointError
from rapidformer.logging import log

LATEST = "latest"
PROGRESS = "progress.json"
STAGING_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_ITERATION = re.compile(r"iter_(\d{7,})")


def iteration_dir(step: int) -> str:
    return f"iter_{step:07d}"


def iterations(root: Path) -> list[Path]:
    """The ``iter_*`` directories under ``root``, newest (highest step) first."""
    found = [p for p in root.iterdir() if p.is_dir() and _ITERATION.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[len("iter_") :]), reverse=True)


def remove_debris(root: Path) -> None:
    """Delete what an interrupted save left behind (rank 0, before saving)."""
    for path in root.iterdir():
        if path.name.startswith((STAGING_PREFIX, ASIDE_PREFIX)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name == f".{LATEST}.tmp":
            path.unlink(missing_ok=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints (and always the one ``latest`` names)."""
    pointer = root / LATEST
    current = pointer.read_text().strip() if pointer.is_file() else None
    for old in iterations(root)[keep:]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def _problem(directory: Path) -> str | None:
    if not (directory / PROGRESS).is_file():
        return f"{directory / PROGRESS} is missing"
    return damage(directory)


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint to resume from at ``path``: ``path`` itself when it is one (an error if
    it is damaged), else the one its ``latest`` names; when that one is missing or damaged,
    the newest complete one before it, with a warning naming both. None when ``path`` holds
    no checkpoint yet."""
    path = Path(path)
    if (path / PROGRESS).is_file():
        problem = damage(path)
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint {path} is damaged: {problem}. Fix: pass --load with its "
                "save directory (the newest complete checkpoint is then used) or another "
                "iter_* directory"
            )
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        return None
    target = path / pointer.read_text().strip()
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
    raise CheckpointError(
        f"{pointer} names {target}, which is damaged ({problem}), and {path} holds no "
        "older complete checkpoint. Fix: restore the file, or start afresh with another --save"
    )
