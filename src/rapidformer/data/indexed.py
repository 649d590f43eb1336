"""Megatron-compatible indexed datasets: token sequences in a ``.bin`` file, described by an
``.idx`` file.

A dataset is a *prefix*: ``PREFIX.bin`` holds every sequence's token ids back to back, in one
numpy dtype, and ``PREFIX.idx`` says where each sequence starts, how long it is, and which
sequences form a document. The byte layout is the one Megatron-LM's ``preprocess_data.py``
writes and ``megatron.core.datasets.indexed_dataset`` reads (the "MMIDIDX" format), so files
move between the two projects unchanged. All numbers are little-endian:

====== ==================== ========== ===================================================
offset size                 type       meaning
====== ==================== ========== ===================================================
0      9                    bytes      magic ``b"MMIDIDX\\x00\\x00"``
9      8                    uint64     format version, always 1
17     1                    uint8      dtype code of the tokens in ``.bin`` (:data:`DTYPE_CODES`)
18     8                    uint64     ``S``: number of sequences
26     8                    uint64     ``D``: number of entries in the document index
34     4 S                  int32[S]   tokens per sequence ("sizes")
34+4S  8 S                  int64[S]   byte offset of each sequence in ``.bin`` ("pointers")
34+12S 8 D                  int64[D]   document index: 0, then the sequence index after the
                                       last sequence of each document; the last entry is S
====== ==================== ========== ===================================================

Document ``k`` is made of sequences ``doc_idx[k] .. doc_idx[k + 1] - 1``. With sentence
splitting a document holds one sequence per sentence; otherwise one sequence per document.

Reading (``impl``, the ``--data-impl`` flag) can use a memory map of ``.bin`` (``mmap``), read
the whole ``.bin`` into memory once (``cached``), or read each sequence with a file read on
access (``lazy``); ``infer`` looks at the index's magic. All three read the same file format:
in Megatron-LM's old ``megatron/data`` code ``lazy`` and ``cached`` were readers of a second,
non-mmap format (magic ``b"TNTIDX\\x00\\x00"``). That legacy format is not read here; such an
index gives a :class:`~rapidformer.errors.DataError` that says to re-run the preprocessing.

Every problem with the files (missing, wrong magic, unsupported version, unknown dtype code,
truncated index or data) is a :class:`~rapidformer.errors.DataError` naming the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from rapidformer.data.index_format import (
    DTYPE_CODES,
    HEADER_SIZE,
    LEGACY_MAGIC,
    MAGIC,
    VERSION,
    check_entries,
    legacy_error,
    read_header,
)
from rapidformer.errors import ConfigError, DataError

IMPLS = ("mmap", "cached", "lazy", "infer")


def data_file_path(prefix: str) -> str:
    """The ``.bin`` file of a dataset prefix."""
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    """The ``.idx`` file of a dataset prefix."""
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    """Whether both files of ``prefix`` exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def best_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype: npt.DTypeLike) -> int:
    """The ``.idx`` code of a token dtype."""
    wanted = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if candidate == wanted:
            return code
    names = ", ".join(str(d) for d in DTYPE_CODES.values())
    raise ValueError(f"dtype {wanted} cannot be stored in an indexed dataset (one of: {names})")


class IndexedDatasetBuilder:
    """Writes ``.bin`` while sequences arrive and ``.idx`` at :meth:`finalize`.

    Call :meth:`add_item` once per sequence (a whole document, or one sentence of it) and
    :meth:`end_document` after the last sequence of each document, or :meth:`add_document`
    with all of a document's sequences at once.
    """

    def __init__(self, bin_path: str, dtype: npt.DTypeLike = np.uint16) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.sizes: list[int] = []
        self.doc_idx: list[int] = [0]
        self._file: BinaryIO | None = open(bin_path, "wb", buffering=1 << 20)  # noqa: SIM115

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            array = array.reshape(-1)
        if array.size == 0 or self._limits is None:
            return array.astype(self.dtype, copy=False)
        if array.dtype.kind not in "iub":
            raise DataError(
                f"{self.bin_path}: token ids must be integers, got an array of {array.dtype}"
            )
        low, high = int(array.min()), int(array.max())
        if low < self._limits.min or high > self._limits.max:
            bad = low if low < self._limits.min else high
            raise DataError(
                f"{self.bin_path}: dtype too small for the vocabulary: token id {bad} does not "
                f"fit {self.dtype} (range {self._limits.min}..{self._limits.max}); build with a "
                "wider dtype, e.g. best_dtype(vocab_size) of the tokenizer's full vocabulary"
            )
        return array.astype(self.dtype, copy=False)

    def _write(self, array: np.ndarray) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.bin_path}: the builder was already finalized")
        self._file.write(array.tobytes(order="C"))

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (any 1-D array-like of token ids, e.g. a list or a tensor)."""
        array = self._as_tokens(tokens)
        if array.size > np.iinfo(np.int32).max:
            raise DataError(f"{self.bin_path}: a sequence of {array.size} tokens exceeds int32")
        self._write(array)
        self.sizes.append(int(array.size))

    def add_document(self, tokens: Any, lengths: Iterable[int]) -> None:
        """Append one document: ``tokens`` concatenates its sequences, ``lengths`` gives their
        sizes (their sum must be ``len(tokens)``); then end the document."""
        lengths = [int(n) for n in lengths]
        self.add_documents(tokens, lengths, [len(lengths)])

    def add_documents(
        self, tokens: Any, lengths: Sequence[int], sequences_per_document: Sequence[int]
    ) -> None:
        """Append several documents at once: ``tokens`` concatenates all their sequences,
        ``lengths`` gives each sequence's size and ``sequences_per_document`` how many of the
        sequences, in order, form each document (``sum(lengths) == len(tokens)``,
        ``sum(sequences_per_document) == len(lengths)``)."""
        array = self._as_tokens(tokens)
        sizes = np.asarray(lengths, dtype=np.int64).reshape(-1)
        counts = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if (
            int(sizes.sum()) != array.size
            or int(counts.sum()) != sizes.size
            or (sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max))
            or (counts.size and counts.min() < 0)
        ):
            raise ValueError(
                f"{self.bin_path}: {sizes.size} sequence lengths summing to {int(sizes.sum())} "
                f"and {counts.size} documents of {int(counts.sum())} sequences in all do not "
                f"describe {array.size} tokens"
            )
        self._write(array)
        start = len(self.sizes)
        self.sizes.extend(sizes.tolist())
        self.doc_idx.extend((start + np.cumsum(counts)).tolist())

    def end_document(self) -> None:
        """Mark a document boundary after the sequences added so far."""
        self.doc_idx.append(len(self.sizes))

    def finalize(self, idx_path: str) -> None:
        """Close ``.bin`` and write the index. Sequences added after the last
        :meth:`end_document` form a final document."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.doc_idx[-1] != len(self.sizes):
            self.end_document()
        write_index(idx_path, self.dtype, self.sizes, self.doc_idx)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_index(
    idx_path: str,
    dtype: npt.DTypeLike,
    sizes: Sequence[int] | np.ndarray,
    doc_idx: Sequence[int] | np.ndarray,
) -> None:
    """Write an ``.idx`` file for sequences stored back to back in ``dtype``, in the order
    given (so the pointers are the running sums of ``sizes`` times the item size)."""
    sizes_arr = np.asarray(sizes, dtype=np.int64).reshape(-1)
    docs_arr = np.asarray(doc_idx, dtype=np.int64).reshape(-1)
    if len(sizes_arr) and (sizes_arr.min() < 0 or sizes_arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{idx_path}: sequence sizes must be in 0..2**31-1")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes_arr), dtype=np.int64)
    if len(sizes_arr) > 1:
        np.cumsum(sizes_arr[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes_arr)))
        f.write(struct.pack("<Q", len(docs_arr)))
        f.write(sizes_arr.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(docs_arr.astype("<i8").tobytes(order="C"))


def infer_impl(prefix: str) -> str:
    """The ``impl`` that reads ``prefix``: ``"mmap"`` for an MMIDIDX index."""
    idx_path = index_file_path(prefix)
    _check_exists(prefix)
    with open(idx_path, "rb") as f:
        magic = f.read(len(MAGIC))
    if magic.startswith(LEGACY_MAGIC):
        raise legacy_error(idx_path)
    if magic != MAGIC:
        raise DataError(
            f"{idx_path}: cannot infer the dataset format: wrong magic {magic!r} "
            f"(expected {MAGIC!r})"
        )
    return "mmap"


def _check_exists(prefix: str) -> None:
    paths = (index_file_path(prefix), data_file_path(prefix))
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(
            f"indexed dataset {prefix!r}: missing file(s): {', '.join(missing)} "
            "(a dataset is the pair PREFIX.bin + PREFIX.idx; pass the prefix without extension)"
        )


class IndexedDataset:
    """Reads a ``.bin``/``.idx`` pair written by :class:`IndexedDatasetBuilder` or Megatron-LM.

    ``dataset[i]`` is sequence ``i`` as a 1-D array of :attr:`dtype` (a read-only view of the
    file's memory map or of the cached bytes for ``mmap`` and ``cached``; a fresh array for
    ``lazy``); ``dataset[a:b]`` is a list of them. Pickling keeps only the prefix and the impl,
    so a dataset can travel to DataLoader worker processes.
    """

    sizes: np.ndarray
    """Tokens per sequence (int32)."""
    pointers: np.ndarray
    """Byte offset of each sequence in ``.bin`` (int64)."""
    doc_idx: np.ndarray
    """Document index (int64): ``doc_idx[0] == 0``, ``doc_idx[-1] == len(self)``."""
    dtype: np.dtype[Any]
    """dtype of the token ids."""

    def __init__(self, prefix: str, impl: str = "mmap") -> None:
        if impl not in IMPLS:
            raise ConfigError.single(
                "--data-impl", impl, f"must be one of {', '.join(IMPLS)}", "pick one of them"
            )
        self._open(prefix, impl)

    def _open(self, prefix: str, impl: str) -> None:
        self.prefix = prefix
        self._requested_impl = impl
        _check_exists(prefix)
        resolved = infer_impl(prefix) if impl == "infer" else impl
        self._impl = resolved
        self.idx_path, self.bin_path = index_file_path(prefix), data_file_path(prefix)
        self.dtype, count, docs = read_header(self.idx_path)

        offsets = (HEADER_SIZE, HEADER_SIZE + 4 * count, HEADER_SIZE + 12 * count)
        if resolved == "mmap" and count > 0:
            index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
            self.sizes = np.frombuffer(index, "<i4", count, offsets[0])
            self.pointers = np.frombuffer(index, "<i8", count, offsets[1])
            self.doc_idx = np.frombuffer(index, "<i8", docs, offsets[2])
        else:
            with open(self.idx_path, "rb") as f:
                f.seek(HEADER_SIZE)
                self.sizes = np.fromfile(f, "<i4", count)
                self.pointers = np.fromfile(f, "<i8", count)
                self.doc_idx = np.fromfile(f, "<i8", docs)

        if docs == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != count:
            first = int(self.doc_idx[0]) if docs else None
            last = int(self.doc_idx[-1]) if docs else None
            raise DataError(
                f"{self.idx_path}: corrupt document index: it must start at 0 and end at the "
                f"sequence count {count}, but has {docs} entries (first {first}, last {last})"
            )
        bin_size = os.path.getsize(self.bin_path)
        needed = 0
        if count > 0:
            needed = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
        if bin_size < needed:
            raise DataError(
                f"{self.bin_path}: truncated or corrupt data file: {bin_size} bytes, but "
                f"{self.idx_path} places its last sequence to end at byte {needed}. Fix: copy "
                "the .bin again (an interrupted copy?) or preprocess the corpus again"
            )
        check_entries(
            self.idx_path, self.sizes, self.pointers, self.doc_idx, self.dtype.itemsize,
            self.bin_path, bin_size,
        )  # fmt: skip
        self._bin_size = bin_size

        self._buffer: Any = None
        self._fd: int | None = None
        if resolved == "mmap":
            self._buffer = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if bin_size else b""
        elif resolved == "cached":
            with open(self.bin_path, "rb") as f:
                self._buffer = f.read()
        elif resolved != "lazy":  # pragma: no cover - _check_exists and infer_impl cover it
            raise AssertionError(resolved)

    @property
    def impl(self) -> str:
        """How the data is read: ``"mmap"``, ``"cached"`` or ``"lazy"`` (``infer`` resolved)."""
        return self._impl

    def __len__(self) -> int:
        return len(self.sizes)

    def _read(self, pointer: int, count: int) -> np.ndarray:
        nbytes = count * self.dtype.itemsize
        if pointer < 0 or pointer + nbytes > self._bin_size:
            raise DataError(
                f"{self.bin_path}: corrupt index {self.idx_path}: a sequence spans bytes "
                f"{pointer}..{pointer + nbytes}, outside the {self._bin_size}-byte data file"
            )
        if self._impl != "lazy":
            return np.frombuffer(self._buffer, self.dtype, count, pointer)
        if self._fd is None:
            self._fd = os.open(self.bin_path, os.O_RDONLY)
        data = os.pread(self._fd, nbytes, pointer)
        if len(data) != nbytes:
            raise DataError(f"{self.bin_path}: short read at byte {pointer} (file truncated?)")
        return np.frombuffer(bytearray(data), self.dtype, count)

    def _check_index(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences")
        return i

    def __getitem__(self, i: int | np.integer | slice) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous (step 1)")
            if stop <= start:
                return []
            sizes = self.sizes[start:stop]
            flat = self._read(int(self.pointers[start]), int(sizes.sum(dtype=np.int64)))
            return np.split(flat, np.cumsum(sizes[:-1], dtype=np.int64))
        index = self._check_index(int(i))
        return self._read(int(self.pointers[index]), int(self.sizes[index]))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``i`` (to its end by default)."""
        index = self._check_index(int(i))
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens {offset}..{offset + length} out of range for sequence {index} "
                f"of {size} tokens"
            )
        return self._read(int(self.pointers[index]) + offset * self.dtype.itemsize, length)

    def close(self) -> None:
        """Release the file handle of ``lazy`` reads (the memory map goes with the object)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict[str, str]:
        return {"prefix": self.prefix, "impl": self._requested_impl}

    def __setstate__(self, state: dict[str, str]) -> None:
        self._open(state["prefix"], state["impl"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, impl={self._impl!r}, sequences={len(self)}, "
            f"documents={len(self.doc_idx) - 1}, dtype={self.dtype})"
        )
