"""The .bin/.idx format: hand-written bytes, the builder, every reader, every error."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from rapidformer.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    dataset_exists,
    index_file_path,
)
from rapidformer.errors import ConfigError, DataError

IMPLS = ["mmap", "cached", "lazy", "infer"]

# Two documents: the first of two sequences, the second of three (one of them empty).
SEQUENCES = [[1, 2, 3], [4], [5, 6], [], [7, 8, 9, 65535]]
DOC_IDX = [0, 2, 5]


def hand_built_bytes(
    sequences: list[list[int]], doc_idx: list[int], code: int, fmt: str
) -> tuple[bytes, bytes]:
    """(.bin, .idx) written from the layout, byte by byte, with struct."""
    itemsize = struct.calcsize("<" + fmt)
    data = b"".join(struct.pack(f"<{len(s)}{fmt}", *s) for s in sequences)
    pointers, position = [], 0
    for s in sequences:
        pointers.append(position)
        position += len(s) * itemsize
    n, d = len(sequences), len(doc_idx)
    index = b"MMIDIDX\x00\x00"  # magic, 9 bytes
    index += struct.pack("<Q", 1)  # version
    index += struct.pack("<B", code)  # dtype code
    index += struct.pack("<Q", n)  # sequence count
    index += struct.pack("<Q", d)  # document-index entries
    index += struct.pack(f"<{n}i", *(len(s) for s in sequences))  # sizes, int32
    index += struct.pack(f"<{n}q", *pointers)  # pointers, int64
    index += struct.pack(f"<{d}q", *doc_idx)  # document index, int64
    return data, index


def write_files(prefix: Path, data: bytes, index: bytes) -> str:
    Path(data_file_path(str(prefix))).write_bytes(data)
    Path(index_file_path(str(prefix))).write_bytes(index)
    return str(prefix)


@pytest.fixture
def hand_prefix(tmp_path: Path) -> str:
    return write_files(tmp_path / "hand", *hand_built_bytes(SEQUENCES, DOC_IDX, 8, "H"))


def test_paths_and_best_dtype(tmp_path: Path) -> None:
    assert data_file_path("a/b") == "a/b.bin"
    assert index_file_path("a/b") == "a/b.idx"
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(50257) == np.uint16
    assert not dataset_exists(str(tmp_path / "x"))
    (tmp_path / "x.idx").write_bytes(b"")
    assert not dataset_exists(str(tmp_path / "x"))
    (tmp_path / "x.bin").write_bytes(b"")
    assert dataset_exists(str(tmp_path / "x"))


def test_dtype_codes_are_megatrons() -> None:
    # megatron.core.datasets.indexed_dataset.DType
    expected = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64"}
    expected |= {7: "float32", 8: "uint16"}
    assert {code: dtype.name for code, dtype in DTYPE_CODES.items()} == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_reads_hand_built_files(hand_prefix: str, impl: str) -> None:
    ds = IndexedDataset(hand_prefix, impl=impl)
    assert ds.impl == ("mmap" if impl == "infer" else impl)
    assert len(ds) == 5
    assert ds.dtype == np.uint16
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == [3, 1, 2, 0, 4]
    assert ds.pointers.dtype == np.int64 and ds.pointers.tolist() == [0, 6, 8, 12, 12]
    assert ds.doc_idx.dtype == np.int64 and ds.doc_idx.tolist() == DOC_IDX
    for i, expected in enumerate(SEQUENCES):
        item = ds[i]
        assert item.dtype == np.uint16
        assert item.tolist() == expected
    assert ds[-1].tolist() == [7, 8, 9, 65535]
    assert ds[np.int64(2)].tolist() == [5, 6]
    assert [a.tolist() for a in ds[1:5]] == SEQUENCES[1:5]
    assert ds[3:3] == []
    assert ds.get(4).tolist() == [7, 8, 9, 65535]
    assert ds.get(4, offset=1).tolist() == [8, 9, 65535]
    assert ds.get(4, offset=1, length=2).tolist() == [8, 9]
    assert ds.get(0, offset=3).tolist() == []
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    # pickling keeps the prefix and the impl (DataLoader workers)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.impl == ds.impl and [clone[i].tolist() for i in range(5)] == SEQUENCES


def test_builder_writes_the_hand_built_bytes(tmp_path: Path, hand_prefix: str) -> None:
    prefix = str(tmp_path / "built")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    builder.add_item(SEQUENCES[0])
    builder.add_item(np.array(SEQUENCES[1], dtype=np.int64))
    builder.end_document()
    builder.add_item(SEQUENCES[2])
    builder.add_item([])
    builder.add_item(np.array(SEQUENCES[4]))
    builder.end_document()
    builder.finalize(index_file_path(prefix))
    for path in (data_file_path, index_file_path):
        assert Path(path(prefix)).read_bytes() == Path(path(hand_prefix)).read_bytes()


@pytest.mark.parametrize(
    ("dtype", "code", "fmt"),
    [
        (np.uint8, 1, "B"),
        (np.int8, 2, "b"),
        (np.int16, 3, "h"),
        (np.int32, 4, "i"),
        (np.int64, 5, "q"),
        (np.uint16, 8, "H"),
    ],
)
def test_every_integer_dtype_matches_the_layout(
    tmp_path: Path, dtype: type, code: int, fmt: str
) -> None:
    sequences = [[0, 1, 100], [], [7], [2, 3]]
    doc_idx = [0, 1, 3, 4]
    hand = write_files(tmp_path / "hand", *hand_built_bytes(sequences, doc_idx, code, fmt))
    prefix = str(tmp_path / "built")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    builder.add_document(sequences[0], [3])
    builder.add_document([7], [0, 1])
    builder.add_document([2, 3], [2])
    builder.finalize(index_file_path(prefix))
    assert Path(index_file_path(prefix)).read_bytes() == Path(index_file_path(hand)).read_bytes()
    assert Path(data_file_path(prefix)).read_bytes() == Path(data_file_path(hand)).read_bytes()
    ds = IndexedDataset(hand, impl="lazy")
    assert ds.dtype == dtype and [ds[i].tolist() for i in range(4)] == sequences


def test_finalize_closes_an_open_document(tmp_path: Path) -> None:
    prefix = str(tmp_path / "open")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    builder.add_item([1, 2])
    builder.end_document()
    builder.add_item([3])
    builder.finalize(index_file_path(prefix))
    assert IndexedDataset(prefix).doc_idx.tolist() == [0, 1, 2]


def test_random_dataset_identical_across_impls(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "random")
    sequences = [rng.integers(0, 70000, size=rng.integers(0, 50)) for _ in range(300)]
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=best_dtype(70000))
    for i, sequence in enumerate(sequences):
        builder.add_item(sequence)
        if i % 3 == 2:
            builder.end_document()
    builder.finalize(index_file_path(prefix))
    readers = {impl: IndexedDataset(prefix, impl=impl) for impl in IMPLS}
    for ds in readers.values():
        assert ds.dtype == np.int32
        assert ds.doc_idx.tolist() == list(range(0, 301, 3))
        assert ds.sizes.tolist() == [len(s) for s in sequences]
        for i in (0, 1, 150, 299):
            assert np.array_equal(ds[i], sequences[i])
        assert np.array_equal(ds.get(7, 2, 3), sequences[7][2:5])
    for i in range(300):
        items = [readers[impl][i] for impl in IMPLS]
        assert all(np.array_equal(items[0], other) for other in items[1:])
    assert os.path.getsize(data_file_path(prefix)) == 4 * sum(len(s) for s in sequences)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_dataset(tmp_path: Path, impl: str) -> None:
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(data_file_path(prefix)).finalize(index_file_path(prefix))
    assert os.path.getsize(index_file_path(prefix)) == 34 + 8
    ds = IndexedDataset(prefix, impl=impl)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]


# ---- errors ----------------------------------------------------------------------------------
def test_unknown_impl(hand_prefix: str) -> None:
    with pytest.raises(ConfigError, match="--data-impl"):
        IndexedDataset(hand_prefix, impl="fast")


@pytest.mark.parametrize("missing", [".idx", ".bin"])
@pytest.mark.parametrize("impl", IMPLS)
def test_missing_file(hand_prefix: str, missing: str, impl: str) -> None:
    os.remove(hand_prefix + missing)
    with pytest.raises(DataError, match="missing") as info:
        IndexedDataset(hand_prefix, impl=impl)
    assert hand_prefix + missing in str(info.value)


def corrupt(prefix: str, offset: int, new: bytes) -> str:
    path = index_file_path(prefix)
    raw = bytearray(Path(path).read_bytes())
    raw[offset : offset + len(new)] = new
    Path(path).write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize(
    ("offset", "new", "message"),
    [
        (0, b"NOTANIDX\x00", "wrong magic"),
        (9, struct.pack("<Q", 2), "unsupported index version 2"),
        (17, struct.pack("<B", 9), "unknown dtype code 9"),
        (17, struct.pack("<B", 0), "unknown dtype code 0"),
        (18, struct.pack("<Q", 6), "truncated index"),  # claims one sequence more than stored
        (26, struct.pack("<Q", 4), "truncated index"),
        (34 + 5 * 12 + 16, struct.pack("<q", 4), "corrupt document index"),  # last != count
        # Caught when opened, before any sequence is read (vectorised over the index):
        (34 + 4, struct.pack("<i", -1), "sequence 1 has size -1"),
        (34 + 5 * 12 + 8, struct.pack("<q", 7), r"entry 2 \(5\) comes before entry 1 \(7\)"),
        (34 + 5 * 4 + 16, struct.pack("<q", 100), "sequence 2 spans bytes 100 to 104, outside"),
    ],
)
@pytest.mark.parametrize("impl", ["mmap", "lazy"])
def test_bad_index(hand_prefix: str, offset: int, new: bytes, message: str, impl: str) -> None:
    path = corrupt(hand_prefix, offset, new)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(hand_prefix, impl=impl)
    assert path in str(info.value)


@pytest.mark.parametrize("keep", [0, 5, 20, 40, 34 + 5 * 12 + 8])
def test_truncated_index(hand_prefix: str, keep: int) -> None:
    path = index_file_path(hand_prefix)
    Path(path).write_bytes(Path(path).read_bytes()[:keep])
    with pytest.raises(DataError, match="truncated index") as info:
        IndexedDataset(hand_prefix)
    assert path in str(info.value)


def test_trailing_garbage_in_index(hand_prefix: str) -> None:
    path = index_file_path(hand_prefix)
    Path(path).write_bytes(Path(path).read_bytes() + b"\x00" * 3)
    with pytest.raises(DataError, match="corrupt index") as info:
        IndexedDataset(hand_prefix)
    assert path in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_truncated_data(hand_prefix: str, impl: str) -> None:
    path = data_file_path(hand_prefix)
    Path(path).write_bytes(Path(path).read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated or corrupt data file") as info:
        IndexedDataset(hand_prefix, impl=impl)
    assert path in str(info.value)


def test_pointer_outside_the_data_file(hand_prefix: str) -> None:
    # The first sequence's pointer moved past the end: found when the index is opened.
    corrupt(hand_prefix, 34 + 5 * 4, struct.pack("<q", 1000))
    outside = "sequence 0 spans bytes 1000 to 1006, outside the 20-byte"
    with pytest.raises(DataError, match=outside) as info:
        IndexedDataset(hand_prefix, impl="mmap")
    assert index_file_path(hand_prefix) in str(info.value)
    assert data_file_path(hand_prefix) in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_legacy_format_is_refused_with_advice(tmp_path: Path, impl: str) -> None:
    prefix = str(tmp_path / "legacy")
    header = b"TNTIDX\x00\x00" + struct.pack("<QQQ", 1, 4, 4) + struct.pack("<QQQ", 1, 1, 2)
    Path(index_file_path(prefix)).write_bytes(header + b"\x00" * 64)
    Path(data_file_path(prefix)).write_bytes(b"\x00" * 4)
    with pytest.raises(DataError, match=r"legacy .*TNTIDX.*re-running the preprocessing") as info:
        IndexedDataset(prefix, impl=impl)
    assert index_file_path(prefix) in str(info.value)


@pytest.mark.parametrize(
    ("dtype", "tokens", "bad"),
    [
        (np.uint16, [1, 65536], "65536"),
        (np.uint16, [3, -1], "-1"),
        (np.uint8, [256], "256"),
        (np.int8, [-129], "-129"),
        (np.int32, [2**31], str(2**31)),
    ],
)
def test_dtype_too_small_for_the_vocabulary(
    tmp_path: Path, dtype: type, tokens: list[int], bad: str
) -> None:
    path = str(tmp_path / "small.bin")
    builder = IndexedDatasetBuilder(path, dtype=dtype)
    builder.add_item([0, 1])
    with pytest.raises(DataError, match="dtype too small for the vocabulary") as info:
        builder.add_item(tokens)
    assert path in str(info.value) and f"token id {bad} " in str(info.value)
    with pytest.raises(DataError, match="dtype too small"):
        builder.add_document(tokens, [len(tokens)])
    builder.add_item([np.iinfo(dtype).max, np.iinfo(dtype).min])  # the limits themselves fit
    builder.finalize(str(tmp_path / "small.idx"))
    ds = IndexedDataset(str(tmp_path / "small"))
    assert ds.sizes.tolist() == [2, 2]
    assert ds[1].tolist() == [np.iinfo(dtype).max, np.iinfo(dtype).min]


def test_matches_megatron_core_byte_for_byte(tmp_path: Path) -> None:
    """Only where megatron-core is importable: its builder writes our bytes, it reads ours."""
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 60000, rng.integers(0, 9)) for _ in range(3)] for _ in range(20)]
    ours = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype=np.uint16)
    theirs = megatron.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in docs:
        for sequence in doc:
            ours.add_item(sequence)
            theirs.add_item(torch.tensor(sequence))
        ours.end_document()
        theirs.end_document()
    ours.finalize(str(tmp_path / "ours.idx"))
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()
    read_by_megatron = megatron.IndexedDataset(str(tmp_path / "ours"), mmap=False)
    flat = [s for doc in docs for s in doc]
    assert all(np.array_equal(read_by_megatron[i], s) for i, s in enumerate(flat))


def test_add_documents_in_bulk_equals_one_by_one(tmp_path: Path, hand_prefix: str) -> None:
    prefix = str(tmp_path / "bulk")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    flat = [t for s in SEQUENCES for t in s]
    builder.add_documents(np.array(flat), [len(s) for s in SEQUENCES], [2, 3])
    with pytest.raises(ValueError, match="do not describe"):
        builder.add_documents([1, 2], [1], [1])
    with pytest.raises(ValueError, match="do not describe"):
        builder.add_documents([1, 2], [1, 1], [1])
    builder.finalize(index_file_path(prefix))
    for path in (data_file_path, index_file_path):
        assert Path(path(prefix)).read_bytes() == Path(path(hand_prefix)).read_bytes()
