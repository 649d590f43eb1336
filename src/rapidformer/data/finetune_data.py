"""Fine-tuning datasets found by ``--data-dir`` and ``--data-name``, loaded with ``datasets``.

``--data-dir`` is one of:

* a directory saved with ``DatasetDict.save_to_disk`` (``dataset_dict.json`` inside), or a
  folder holding one per ``--data-name``;
* a folder of json / jsonl / csv / parquet files. ``--data-name`` then names a sub-folder or
  the prefix of the files to use (``sst2`` picks ``sst2_train.jsonl``, ``sst2.validation.csv``;
  a full file name picks that one file). Each file's split comes from its name: ``train``,
  ``validation`` (also ``valid``, ``val``, ``dev``, ``eval``) or ``test``; a lone file without
  a split in its name is the training split;
* anything else is a ``datasets`` builder or hub dataset (``--data-dir glue --data-name sst2``),
  which needs network access to the hub unless it is cached.

Every failure names what is wrong: the folder, the name that matched nothing and the files
there are, or that the hub cannot be reached and how to pass a local folder instead.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapidformer.errors import ConfigError, DataError
from rapidformer.hub import hub_unreachable

if TYPE_CHECKING:
    from datasets import Dataset

FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev", "eval"),
    "test": ("test",),
}


def load_splits(data_dir: str, data_name: str | None = None) -> dict[str, Dataset]:
    """The train / validation / test splits that ``--data-dir`` and ``--data-name`` name
    (the ones that exist), keyed by those canonical split names. Local files are checked
    before the datasets library is imported: a bad file is said in a second or two."""
    root = Path(data_dir)
    if root.is_dir():
        return _local_files(root, data_name)
    if _looks_like_a_path(data_dir):
        raise ConfigError.single(
            "--data-dir", data_dir, "no such directory", "pass a folder of data files"
        )
    return _from_hub(data_dir, data_name)


def training_split(splits: dict[str, Dataset], data_dir: str) -> Dataset:
    """The ``train`` split of ``splits`` (DataError naming what was found and the fix)."""
    if "train" not in splits:
        raise DataError(
            f"{data_dir}: no training split (found: {', '.join(splits) or 'none'}). "
            "Fix: add a file named train.jsonl (or .json, .csv, .parquet) beside the others"
        )
    return splits["train"]


def _library() -> Any:
    import datasets

    datasets.disable_progress_bars()  # one bar per split and rank drowns the run's log
    return datasets


def _local_files(root: Path, data_name: str | None) -> dict[str, Dataset]:
    folder = root / data_name if data_name and (root / data_name).is_dir() else root
    if (folder / "dataset_dict.json").is_file():
        loaded = _library().load_from_disk(str(folder))
        return _canonical(dict(loaded), str(folder))
    by_split = _files_by_split(root, data_name)
    builders = {FORMATS[Path(p).suffix] for paths in by_split.values() for p in paths}
    if len(builders) > 1:
        raise ConfigError.single(
            "--data-dir", str(folder), "mixes file formats", "keep one format per dataset"
        )
    for split, paths in by_split.items():
        for file in paths:
            _check_file(Path(file), split)
    loaded = _library().load_dataset(builders.pop(), data_files=by_split)
    return dict(loaded)


def _files_by_split(root: Path, data_name: str | None) -> dict[str, list[str]]:
    """The data files of ``--data-dir`` (and ``--data-name``) by the split each holds, in
    the order the loader reads them."""
    folder = root / data_name if data_name and (root / data_name).is_dir() else root
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in FORMATS)
    if data_name and folder == root:
        stem = data_name.rsplit(".", 1)[0] if Path(data_name).suffix in FORMATS else data_name
        files = [p for p in files if p.name == data_name or p.name.startswith(stem)]
        if not files:
            available = sorted(p.name for p in root.iterdir() if p.is_dir() or p.suffix in FORMATS)
            raise ConfigError.single(
                "--data-name",
                data_name,
                f"no configuration, sub-folder or data file of that name in {root} "
                f"(there: {', '.join(available) or 'nothing'})",
                "pass one of those names",
            )
    if not files:
        raise ConfigError.single(
            "--data-dir",
            str(folder),
            f"holds no {'/'.join(sorted(set(FORMATS)))} files and no saved dataset",
            "point --data-dir (and --data-name) at the data files",
        )
    by_split: dict[str, list[str]] = {}
    for path in files:
        split = _split_of(path.stem, "train" if len(files) == 1 else None)
        if split is None:
            raise ConfigError.single(
                "--data-dir",
                str(folder),
                f"cannot tell the split of {path.name}: its name has none of "
                + ", ".join(w for words in SPLIT_WORDS.values() for w in words),
                "name the files e.g. train.jsonl and validation.jsonl",
            )
        by_split.setdefault(split, []).append(str(path))
    return by_split


ROW = re.compile(r"the (\w+) split's (rows?) (\d+(?:, \d+)*)")
"""How a data error names the rows it is about: "the train split's row 100"."""


def located(error: DataError, data_dir: str, data_name: str | None) -> DataError:
    """``error`` with each row it names given as the file and line it came from (counted from
    1, the row beside), where the split came from local data files."""
    root = Path(data_dir)
    if not root.is_dir() or (root / "dataset_dict.json").is_file():
        return error
    try:
        by_split = _files_by_split(root, data_name)
    except ConfigError:
        return error

    def place(match: re.Match[str]) -> str:
        split, word, numbers = match.group(1), match.group(2), match.group(3)
        rows = [int(n) for n in numbers.replace(",", " ").split()]
        places = [_line_of(by_split.get(split, []), row) for row in rows]
        if any(p is None for p in places):
            return match.group(0)
        return f"{'; '.join(str(p) for p in places)} (the {split} split's {word} {numbers})"

    return DataError(ROW.sub(place, str(error)))


def _line_of(files: list[str], row: int) -> str | None:
    """``FILE, line N`` of the split's row ``row`` (0-based over its files in order)."""
    for name in files:
        path = Path(name)
        if path.suffix not in (".jsonl", ".csv"):
            return None  # a JSON array or parquet: no line per row
        with open(path, "rb") as stream:
            lines = [n for n, line in enumerate(stream, 1) if line.strip()]
        if path.suffix == ".csv":
            lines = lines[1:]  # the header
        if row < len(lines):
            return f"{path}, line {lines[row]}"
        row -= len(lines)
    return None


MAX_LINE_BYTES = 16 * 2**20
"""The longest line a JSON Lines or CSV file may hold."""


def _check_file(path: Path, split: str) -> None:
    """Name the file and line of what the datasets loader would report as an anonymous
    pyarrow error (a malformed JSON line) or a StopIteration (an empty file)."""
    if path.suffix not in (".json", ".jsonl", ".csv"):
        return  # binary formats (parquet) carry their own structure
    with open(path, "rb") as stream:
        empty = not any(line.strip() for line in stream)
    if empty:
        raise DataError(
            f"{path}: the file is empty, so the {split} split holds no rows. Fix: fill it, or "
            "remove it from --data-dir"
        )
    with open(path, "rb") as stream:  # the loaders' own error names neither file nor line
        number = 0
        # Each line read up to the limit: an over-long one is refused by its length, before
        # anything holds or parses it whole.
        while raw := stream.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(
                    f"{path}, line {number}: longer than {MAX_LINE_BYTES // 2**20} MiB, which "
                    "no sample needs (one row per line, and a row is cut to --seq-length "
                    "tokens). Fix: split it into rows, or check that the file is the data"
                )
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}, line {number}, byte {exc.start + 1}: not UTF-8 text "
                    f"({exc.reason}). Fix: save the file as UTF-8"
                ) from None
    if path.suffix == ".csv":
        _check_csv(path)
    if path.suffix != ".jsonl":
        return
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}, line {number}, column {exc.colno}: not valid JSON ({exc.msg}). "
                    f"Fix: make every line one JSON object, like its others: {_example(path)}"
                ) from exc


EXAMPLES = {
    "messages": '{"messages": [{"role": "user", "content": "..."}, '
    '{"role": "assistant", "content": "..."}]}',
    "prompt": '{"prompt": "...", "completion": "..."}',
    "text": '{"text": "...", "label": "..."}',
}
"""A row of each kind of data, for a Fix in the format of the file at hand."""


def _example(path: Path) -> str:
    """A row in the format of ``path``'s readable rows (chat, prompt and completion, or text)."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                kind = next((key for key in ("messages", "prompt") if key in row), "text")
                return EXAMPLES[kind]
    return EXAMPLES["text"]


def _check_csv(path: Path) -> None:
    """Every row as many fields as the header (the loader says only that generation failed)."""
    import csv

    with open(path, encoding="utf-8", newline="") as stream:
        rows = csv.reader(stream)
        header = next(rows, [])
        for row in rows:
            if row and len(row) != len(header):
                raise DataError(
                    f"{path}, line {rows.line_num}: {len(row)} fields, but the header has "
                    f"{len(header)} ({', '.join(header)}). Fix: quote fields that hold a comma"
                )


def _split_of(stem: str, default: str | None) -> str | None:
    words = set(re.split(r"[^a-z]+", stem.lower()))
    for split, names in SPLIT_WORDS.items():
        if words.intersection(names):
            return split
    return default


def _canonical(splits: dict[str, Dataset], where: str) -> dict[str, Dataset]:
    found: dict[str, Dataset] = {}
    for name, split in splits.items():
        canonical = _split_of(name, None)
        if canonical is not None and canonical not in found:
            found[canonical] = split
    if "train" not in found:
        raise ConfigError.single(
            "--data-dir",
            where,
            f"has no training split (splits: {', '.join(splits) or 'none'})",
            "provide a split named train",
        )
    return found


def _looks_like_a_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep + os.sep in name or name.count("/") > 1


def _from_hub(name: str, config: str | None) -> dict[str, Dataset]:
    datasets = _library()
    try:
        if hub_unreachable():
            raise ConnectionError("the hub did not answer a connection within 3 s")
        loaded = datasets.load_dataset(name, config)
    except (ConnectionError, OSError) as exc:
        raise ConfigError.single(
            "--data-dir",
            name,
            f"is not a local directory, and loading it from the hub failed: no network access "
            f"to the hub from this machine ({type(exc).__name__})",
            "download the dataset where the hub is reachable and pass its local directory",
        ) from exc
    except ValueError as exc:  # e.g. an unknown configuration of a dataset found in the cache
        rule = str(exc).splitlines()[0]
        raise ConfigError.single("--data-name", config, rule, "check it") from exc
    return _canonical(dict(loaded), name)
