"""Every loader rapidformer calls, made safe: its own files, DCP, DeepSpeed, Hugging Face.

* rapidformer's own files: scanned, then ``torch.load(weights_only=True)``
  (:func:`load_torch_file`);
* torch.distributed.checkpoint: its ``.metadata`` read by :class:`RestrictedUnpickler` instead
  of ``pickle.load`` (:func:`dcp_reader`), its non-tensor items with
  ``weights_only=True``, where DCP's own planner unpickles anything (:func:`dcp_load_planner`);
* DeepSpeed: its files scanned, and its own unrestricted ``torch.load`` calls forced to
  ``weights_only=True`` with only DeepSpeed's three types added (:func:`deepspeed_loading`);
* Hugging Face: safetensors where the directory has them, else its weight files scanned
  (transformers reads them with ``weights_only=True``) (:func:`hugging_face_weights`).

``--trust-checkpoint`` (:func:`set_trust`) turns all of it off.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rapidformer.errors import CheckpointError
from rapidformer.log import log
from rapidformer.safe_load.scan import (
    RestrictedUnpickler,
    UnsafeCheckpointError,
    check,
    torch_pickles,
)

_trusted = False
_warned = False


def set_trust(trust: bool, *, warn: bool = True) -> None:
    """``--trust-checkpoint``: with ``trust``, nothing is scanned and every loader unpickles
    as it would on its own. Every engine sets it from its config and clears it when it closes;
    ``warn``: log the warning (once per process; rank 0 speaks)."""
    global _trusted, _warned
    if trust and warn and not _warned:
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
        set_trust(previous, warn=False)


def scan_file(file: Path) -> None:
    """Refuse a ``torch.save`` file unless every global its pickles name is allowed (no-op
    when trusted)."""
    if _trusted:
        return
    for label, data in torch_pickles(file):
        check(label, data)


def scan_files(files: list[Path]) -> None:
    for file in files:
        scan_file(file)


# ---- rapidformer's own files ---------------------------------------------------------------
def load_torch_file(file: Path) -> Any:
    """A file rapidformer wrote: scanned, then read as tensors and plain containers only."""
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    if _trusted:
        return torch.load(file, map_location="cpu", weights_only=False)  # --trust-checkpoint
    scan_file(file)
    with torch.serialization.safe_globals(_legacy_safe_globals()):
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # what weights_only refuses
            raise UnsafeCheckpointError(
                f"{file} holds more than tensors and plain containers "
                f"({str(exc).splitlines()[0]}). If you trust the checkpoint's source, rerun "
                "with --trust-checkpoint"
            ) from None


_LEGACY: list[Any] = []


def _legacy_safe_globals() -> list[Any]:
    """numpy's array reconstruction, which rapidformer's older RNG files need, under the
    names numpy 1 and numpy 2 pickle it with."""
    if not _LEGACY:
        import numpy as np

        core = getattr(np, "_core", None) or np.core
        reconstruct = core.multiarray._reconstruct
        _LEGACY.extend(
            [
                reconstruct,
                (reconstruct, "numpy.core.multiarray._reconstruct"),
                (reconstruct, "numpy._core.multiarray._reconstruct"),
                np.ndarray,
                np.dtype,
                type(np.dtype("uint32")),
            ]
        )
    return _LEGACY


# ---- torch.distributed.checkpoint ----------------------------------------------------------
@functools.cache
def _dcp_classes() -> tuple[type[Any], type[Any]]:
    """DCP's reader and planner, made safe. Defined where DCP is first needed: importing it
    costs a second, which a run that reads no DCP checkpoint (or a configuration error) does
    not pay."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader, with its ``.metadata`` unpickled by :class:`RestrictedUnpickler`
        (DCP's own reads it with a plain ``pickle.load``)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if _trusted:
                return super().read_metadata(*args, **kwargs)
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = RestrictedUnpickler(stream, str(path)).load()
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{path} holds no DCP metadata")
            storage_meta = metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's default load planner, except that the non-tensor items (learning rates, step
        counts) are read with ``weights_only=True``: DCP's own unpickles them as anything."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:  # as DefaultLoadPlanner: into the caller's nested dict
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafeFileSystemReader, WeightsOnlyPlanner


def dcp_reader(directory: Path) -> Any:
    """The storage reader for ``dcp.load`` of the checkpoint in ``directory``, its metadata
    read once here: a refusal then reaches the user as it is, not wrapped in DCP's exception
    (which carries the traceback in its message)."""
    metadata = directory / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"{metadata} is missing: not a complete DCP checkpoint")
    reader = _dcp_classes()[0](directory)
    reader.read_metadata()
    return reader


def dcp_load_planner() -> Any:
    """The planner for ``dcp.load``: DCP's own under ``--trust-checkpoint``, else one that
    reads non-tensor items as plain values only."""
    if _trusted:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        return DefaultLoadPlanner()
    return _dcp_classes()[1]()


# ---- DeepSpeed ------------------------------------------------------------------------------
@contextlib.contextmanager
def deepspeed_loading(files: list[Path]) -> Iterator[None]:
    """Around a call into DeepSpeed's loaders: its files scanned first, and its own
    unrestricted ``torch.load`` calls forced to ``weights_only=True`` (torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``) with DeepSpeed's three checkpoint types allowed."""
    if _trusted:
        yield
        return
    scan_files(files)
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"a DeepSpeed file under {files[0].parent if files else 'the checkpoint'} holds "
            f"more than tensors and DeepSpeed's types ({str(exc).splitlines()[0]}). If you "
            "trust the checkpoint's source, rerun with --trust-checkpoint"
        ) from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


# ---- Hugging Face ---------------------------------------------------------------------------
def hugging_face_weights(directory: str | Path) -> dict[str, Any]:
    """``from_pretrained`` keywords that keep a local model directory's weights safe:
    safetensors where the directory has them (no pickle at all), else every pickled weight
    file it holds, scanned first (see :func:`pickled_weight_files`); transformers reads those
    with ``weights_only=True``. Nothing for a hub name."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        return {}
    if any(path.glob("*.safetensors")):
        return {"use_safetensors": True}
    scan_files(pickled_weight_files(path))
    return {}


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickled_weight_files(path: Path) -> list[Path]:
    """Every file transformers could unpickle from the model directory ``path``: each shard a
    ``*.index.json`` names (whatever its name), and every ``.bin``, ``.pt``, ``.pth`` and
    ``.ckpt`` file beside them."""
    files = {p for p in path.iterdir() if p.is_file() and p.suffix in PICKLED_SUFFIXES}
    for index in path.glob("*.index.json"):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            named = {str(shard) for shard in weight_map.values()}
        except (ValueError, AttributeError) as error:
            raise UnsafeCheckpointError(
                f"{index} is not a readable shard index ({error}), so its shards cannot be "
                "checked before they are loaded. Fix: restore the model directory's index"
            ) from None
        for shard in sorted(named):
            file = (path / shard).resolve()
            if path.resolve() not in file.parents:
                raise UnsafeCheckpointError(
                    f"{index} names the shard {shard}, outside its directory {path}. Fix: "
                    "use a model directory whose index names only files inside it"
                )
            if file.is_file():
                files.add(file)
    return sorted(files)
