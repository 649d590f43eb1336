"""Loading never runs code from a checkpoint: every pickle is scanned before it is unpickled.

A pickle names the Python callables that rebuild its objects (``GLOBAL``/``STACK_GLOBAL``
opcodes), and unpickling calls them: a file whose object reduces to ``os.system`` runs a command
the moment it is loaded, before a single tensor is read. A manifest's checksums do not help
(whoever writes the files writes the manifest). So:

* rapidformer's own files are read with ``torch.load(weights_only=True)``: tensors and plain
  containers only (:func:`load_file`);
* before anything unpickles a file, rapidformer's loader or a foreign one (torch.distributed
  .checkpoint's ``.metadata``, DeepSpeed's files, a Hugging Face ``.bin``), every pickle in it is
  scanned with :mod:`pickletools` and each global it names is checked against
  :data:`ALLOWED_GLOBALS`; anything else is refused with the file and the global named
  (:class:`UnsafeCheckpointError`), before the loader runs;
* ``--trust-checkpoint`` turns both off for a checkpoint the user trusts (:func:`set_trust`).
"""

from __future__ import annotations

import contextlib
import io
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from rapidformer.errors import CheckpointError
from rapidformer.logging import log

_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")
TORCH_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._tensor._rebuild_from_type_v2",
        "torch.serialization._get_layout",
        "torch.Size",
        "torch.Tensor",
        "torch.bool",
        "collections.OrderedDict",
        *(f"torch.{kind}Storage" for kind in _STORAGES),
        *(f"torch.{dtype}" for dtype in _DTYPES),
    }
)
"""torch's tensor and storage rebuild functions, its storage types and dtypes, and
``OrderedDict`` (state dicts)."""

DCP_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
    }
)
"""torch.distributed.checkpoint's metadata classes (its ``.metadata`` file, which names the
checkpoint's path)."""

NUMPY_GLOBALS = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "_codecs.encode",
    }
)
"""numpy's RNG state array, which rapidformer's checkpoints held before they stored it as a
tensor (``_codecs.encode``: how pickle writes its bytes)."""

DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
"""What DeepSpeed's own files hold besides tensors: found by scanning the checkpoints
DeepSpeed writes for ZeRO-1/2/3, fp32 and bf16, with and without offload
(``tests/test_checkpoint_safety.py`` scans them again). An fp16 DeepSpeed checkpoint (GPUs only)
holds its dynamic loss scaler instead, not seen here: it is refused until scanned."""

ALLOWED_GLOBALS = TORCH_GLOBALS | DCP_GLOBALS | NUMPY_GLOBALS | DEEPSPEED_GLOBALS
"""Every global a scanned pickle may name."""

LEGACY_SAFE_GLOBALS: list[Any] = []
"""Callables ``torch.load(weights_only=True)`` may call for rapidformer's older RNG files
(numpy's state array): filled on first use, numpy imported late."""

_trusted = False
_warned = False


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names a global outside the allowlist, or holds more than tensors and
    plain containers."""


def set_trust(trust: bool) -> None:
    """``--trust-checkpoint``: with ``trust``, nothing is scanned and rapidformer's files load
    as any pickle (the log warns once per process). Every engine sets it from its config."""
    global _trusted, _warned
    if trust and not _warned:
        log.warning(
            "--trust-checkpoint: checkpoint files are unpickled without the allowlist scan; "
            "a file from an untrusted source can run any code on this machine"
        )
        _warned = True
    _trusted = trust


@contextlib.contextmanager
def trusting(trust: bool) -> Iterator[None]:
    """:func:`set_trust` for a block, restored after it."""
    previous = _trusted
    set_trust(trust)
    try:
        yield
    finally:
        set_trust(previous)


def is_trusted() -> bool:
    return _trusted


# ---- scanning -----------------------------------------------------------------------------
_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
     "SHORT_BINSTRING"}
)  # fmt: skip
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def pickle_globals(data: bytes) -> Iterator[str]:
    """Every global (``module.name``) the pickles in ``data`` name, without unpickling. A
    ``STACK_GLOBAL`` whose two names are not plain strings pushed just before is reported as
    ``<unresolved>`` (refused)."""
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        memo: dict[int, Any] = {}
        stack: list[Any] = []  # the values pushed, strings kept, anything else as None
        try:
            for opcode, arg, _ in pickletools.genops(stream):
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
                elif name in _STRING_OPS:
                    text = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
                    stack.append(text)
                elif name == "MEMOIZE":
                    memo[len(memo)] = stack[-1] if stack else None
                elif name in _PUT_OPS:
                    memo[int(str(arg))] = stack[-1] if stack else None
                elif name in _GET_OPS:
                    stack.append(memo.get(int(str(arg))))
                elif name == "STOP":
                    break
                else:
                    stack.append(None)
        except ValueError as exc:  # not a pickle (or a truncated one)
            raise CheckpointError(f"cannot read the pickle stream: {exc}") from exc
        # A legacy torch file holds several pickles back to back, then raw storage bytes.
        if not _starts_a_pickle(data, stream.tell()):
            return


def _starts_a_pickle(data: bytes, offset: int) -> bool:
    return offset < len(data) and data[offset] == 0x80  # the PROTO opcode


def _pickles_of(file: Path) -> Iterator[tuple[str, bytes]]:
    """(label, pickle bytes) for each pickle in ``file``: every ``.pkl`` member of a zip
    (``torch.save``'s format), else the file itself (a plain or legacy torch pickle)."""
    if zipfile.is_zipfile(file):
        with zipfile.ZipFile(file) as archive:
            for member in archive.namelist():
                if member.endswith(".pkl"):
                    yield f"{file} ({member})", archive.read(member)
        return
    yield str(file), file.read_bytes()


def scan_file(file: Path) -> None:
    """Refuse ``file`` unless every global its pickles name is allowed (no-op when trusted)."""
    if _trusted:
        return
    for label, data in _pickles_of(file):
        try:
            names = set(pickle_globals(data))
        except CheckpointError as exc:
            raise CheckpointError(f"{label}: {exc}") from None
        refused = sorted(names - ALLOWED_GLOBALS)
        if refused:
            raise UnsafeCheckpointError(
                f"{label} would call {', '.join(refused)} when loaded, which is not a tensor, "
                "a plain container or a type a checkpoint holds: refused before anything was "
                "unpickled (loading it could run code from whoever wrote the file). If you "
                "trust the checkpoint's source, rerun with --trust-checkpoint"
            )


def scan_files(files: list[Path]) -> None:
    for file in files:
        scan_file(file)


# ---- rapidformer's own files ---------------------------------------------------------------
def load_file(file: Path) -> Any:
    """A file rapidformer wrote: scanned, then read as tensors and plain containers only."""
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    if _trusted:
        return torch.load(file, map_location="cpu", weights_only=False)  # --trust-checkpoint
    scan_file(file)
    with torch.serialization.safe_globals(_legacy_safe_globals()):
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 (the unpickler raises several kinds)
            raise UnsafeCheckpointError(
                f"{file} cannot be read as tensors and plain containers ({exc}). If you "
                "trust the checkpoint's source, rerun with --trust-checkpoint"
            ) from None


def _legacy_safe_globals() -> list[Any]:
    """numpy's array reconstruction, which rapidformer's older RNG files need."""
    if not LEGACY_SAFE_GLOBALS:
        import numpy as np

        multiarray = getattr(np, "_core", None) or np.core
        LEGACY_SAFE_GLOBALS.extend(
            [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
        )
    return LEGACY_SAFE_GLOBALS


# ---- foreign loaders -----------------------------------------------------------------------
class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's default load planner, except that the non-tensor items
    (learning rates, step counts) are read with ``weights_only=True``: DCP's own planner
    unpickles them as anything."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = torch.load(value, weights_only=True)


def dcp_load_planner() -> DefaultLoadPlanner:
    """The planner for ``dcp.load``: DCP's own under ``--trust-checkpoint``, else one that
    reads non-tensor items as plain values only. Call :func:`scan_dcp` first."""
    return DefaultLoadPlanner() if _trusted else _WeightsOnlyPlanner()


def scan_dcp(directory: Path) -> None:
    """Scan a DCP checkpoint's ``.metadata`` (DCP reads it with a plain ``pickle.load``)."""
    metadata = directory / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"{metadata} is missing: not a complete DCP checkpoint")
    scan_file(metadata)


def hugging_face_weights(directory: str | Path) -> dict[str, Any]:
    """``from_pretrained`` keywords that keep a local model directory's weights safe:
    safetensors where the directory has them (no pickle at all), else its ``.bin`` files,
    scanned first. Nothing for a hub name (transformers reads hub ``.bin`` files with
    ``weights_only=True``)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        return {}
    if any(path.glob("*.safetensors")):
        return {"use_safetensors": True}
    scan_files(sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")))
    return {}
