"""The files a run writes in its own directories (``--save``): opened without following a
symbolic link. A link where a run writes would have it truncate or fill the file the link points
to, outside the directory it was given; it is refused, naming the link and its target."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO

from rapidformer.errors import CheckpointError


def open_own(path: Path, mode: str = "w") -> IO[str]:
    """``path`` opened for text (``mode``: ``w``, ``a`` or ``a+``) where a run writes its own
    files, never through a symbolic link: a link there would have the run write outside its
    directory, so it is refused (CheckpointError naming it and where it points)."""
    access = {"w": os.O_WRONLY, "a": os.O_WRONLY | os.O_APPEND, "a+": os.O_RDWR | os.O_APPEND}
    flags = access[mode] | os.O_CREAT | os.O_NOFOLLOW
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP or path.is_symlink():
            raise CheckpointError(
                f"{path} is a symbolic link (to {os.readlink(path)}): a run writes only its own "
                "files, and writing it would change the file it points to. Fix: remove the link "
                "(or give the run another --save)"
            ) from None
        raise
    stream = os.fdopen(descriptor, mode, encoding="utf-8")
    if mode == "w":
        stream.truncate()
    return stream


def write_fix(failure: BaseException | None) -> str:
    """What to do about a failed write, by its cause: room for a full disk, permission for a
    directory this user may not write, and either where it is not known."""
    number = getattr(failure, "errno", None)
    if number in (errno.ENOSPC, errno.EDQUOT):
        return "free space there"
    if number in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "let this user write there"
    return "check that the disk there has room and this user may write"
