"""Reading the globals a pickle names without unpickling it, and an unpickler that refuses the
rest.

The scan is the early, clear answer ("this file would call posix.system"); the enforcement is
where the bytes are unpickled: ``torch.load(weights_only=True)`` for torch files, and
:class:`RestrictedUnpickler` for a plain pickle. A pickle resolves every callable through
``find_class`` (``GLOBAL``, ``STACK_GLOBAL``, ``INST`` and the copyreg extension codes
``EXT1/2/4``), so a ``find_class`` that refuses what is not allowed refuses them all, whatever
the scan made of the bytes.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rapidformer.errors import CheckpointError
from rapidformer.safe_load.allowlist import ALLOWED_GLOBALS

ZIP_MAGIC = b"PK\x03\x04"
"""How torch.load tells its zip format from the others (the file's first bytes)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names a global outside the allowlist, or holds more than tensors and
    plain containers."""


def refusal(label: str, names: list[str]) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{label} would call {', '.join(names)} when loaded, which is not a tensor, a plain "
        "container or a type a checkpoint holds: refused before anything was unpickled "
        "(loading it could run code from whoever wrote the file). If you trust the "
        "checkpoint's source, rerun with --trust-checkpoint"
    )


_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
     "SHORT_BINSTRING"}
)  # fmt: skip
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_EXT_OPS = frozenset({"EXT1", "EXT2", "EXT4"})


def pickle_globals(data: bytes) -> Iterator[str]:
    """Every global (``module.name``) the first pickle in ``data`` names (what ``pickle.load``
    reads), without unpickling it. A ``STACK_GLOBAL`` whose two names are not plain strings
    pushed before it, and a copyreg extension code, are reported as unresolved (refused)."""
    memo: dict[int, Any] = {}
    stack: list[Any] = []  # the values pushed: strings kept, anything else as None
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, attribute = str(arg).partition(" ")
                yield f"{module}.{attribute}"
                stack.append(None)
            elif name == "STACK_GLOBAL":
                pair = stack[-2:]
                del stack[-2:]
                if len(pair) == 2 and all(isinstance(part, str) for part in pair):
                    yield f"{pair[0]}.{pair[1]}"
                else:
                    yield "<unresolved STACK_GLOBAL>"
                stack.append(None)
            elif name in _EXT_OPS:
                yield f"<copyreg extension code {arg}>"
                stack.append(None)
            elif name in _STRING_OPS:
                stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else str(arg))
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
            elif name in _PUT_OPS:
                memo[int(str(arg))] = stack[-1] if stack else None
            elif name in _GET_OPS:
                stack.append(memo.get(int(str(arg))))
            elif name == "STOP":
                return
            else:
                stack.append(None)
    except ValueError as exc:  # not a pickle, or a truncated one
        raise CheckpointError(f"cannot read the pickle stream: {exc}") from exc


def torch_pickles(file: Path) -> Iterator[tuple[str, bytes]]:
    """(label, bytes) of every pickle in a ``torch.save`` file, read with torch's own zip
    reader (the records torch.load will unpickle). Files in torch's older formats (legacy,
    tar) are refused: torch unpickles several pickles and members there that cannot be
    checked here."""
    with file.open("rb") as handle:
        magic = handle.read(len(ZIP_MAGIC))
    if magic != ZIP_MAGIC:
        raise UnsafeCheckpointError(
            f"{file} is not in torch's zip format (torch.save since torch 1.6): its older "
            "formats cannot be checked before they are unpickled. If you trust the "
            "checkpoint's source, rerun with --trust-checkpoint"
        )
    try:
        reader = torch._C.PyTorchFileReader(str(file))
        records = [name for name in reader.get_all_records() if name.endswith(".pkl")]
        for name in records:
            data = reader.get_record(name)
            yield f"{file} ({name})", bytes(data)
    except RuntimeError as exc:
        raise CheckpointError(f"{file} is not a readable torch file: {exc}") from None


def check(label: str, data: bytes) -> None:
    """Refuse the pickle ``data`` unless every global it names is allowed."""
    try:
        names = set(pickle_globals(data))
    except CheckpointError as exc:
        raise CheckpointError(f"{label}: {exc}") from None
    refused = sorted(names - ALLOWED_GLOBALS)
    if refused:
        raise refusal(label, refused)


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allowed globals (every opcode that imports goes
    through ``find_class``) and no persistent ids."""

    def __init__(self, file: Any, label: str) -> None:
        super().__init__(file)
        self.label = label

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in ALLOWED_GLOBALS:
            raise refusal(self.label, [f"{module}.{name}"])
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self.label, [f"<persistent id {pid!r}>"])
