"""Each checkpoint's manifest: the size and SHA-256 of every file in it.

Written last, once every rank's files are in the staging directory, and checked before a
checkpoint is resumed from, so a truncated or corrupted file (a full disk, a copy that stopped
half-way, bit rot) is found before any tensor is read, and the error names the file.
Checkpoints written before manifests existed carry none and are trusted as they are.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"


def _digest(file: Path) -> str:
    digest = hashlib.sha256()  # in chunks: hashlib.file_digest needs Python 3.11
    with open(file, "rb") as stream:
        while chunk := stream.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def _outside(directory: Path, name: str) -> bool:
    """Whether a manifest's entry names something but a file inside its checkpoint (a path
    from the root, one that climbs out, or a link to elsewhere): such an entry is never read."""
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return True
    return not (directory / path).resolve().is_relative_to(directory.resolve())


def write_manifest(directory: Path, required: list[str] | None = None) -> None:
    """Record every file under ``directory`` (but the manifest itself), and the files the
    checkpoint's format requires (``required``), so that a checkpoint missing one of them
    never verifies, whatever files it does hold."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {
        str(file.relative_to(directory)): {"size": file.stat().st_size, "sha256": _digest(file)}
        for file in files
    }
    record = {"files": entries, "required": sorted(required or [])}
    (directory / MANIFEST).write_text(json.dumps(record, indent=1))


def looks_whole(directory: Path) -> bool:
    """Whether every file the manifest lists (and every required one) is there at its
    recorded size: :func:`damage` without reading the files (pruning runs it at every save).
    A checkpoint without a manifest (written before manifests) counts as whole."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return (directory / "progress.json").is_file()
    try:
        record = json.loads(manifest.read_text())
        sizes = {str(name): int(entry["size"]) for name, entry in record["files"].items()}
        required = [str(name) for name in record.get("required", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    if any(name not in sizes for name in required) or any(
        _outside(directory, name) for name in sizes
    ):
        return False
    return all(
        (directory / name).is_file() and (directory / name).stat().st_size == size
        for name, size in sizes.items()
    )


def damage(directory: Path) -> str | None:
    """What is wrong with the checkpoint in ``directory`` (naming the file), or None when
    every file its manifest lists is there, whole and unchanged."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None
    try:
        record = json.loads(manifest.read_text())
        entries = {
            str(name): (int(entry["size"]), str(entry["sha256"]))
            for name, entry in record["files"].items()
        }
        required = [str(name) for name in record.get("required", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its manifest {manifest} is unreadable ({type(exc).__name__}: {exc})"
    strays = [name for name in entries if _outside(directory, name)]
    if strays:
        return f"its manifest {manifest} lists {strays[0]}, which is no file of the checkpoint"
    for name in required:
        if name not in entries:
            return (
                f"it is incomplete: {directory / name}, which its format requires, was never "
                "written"
            )
    for name, (expected_size, expected_digest) in entries.items():
        file = directory / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != expected_size:
            return f"{file} is truncated or overwritten: {size} bytes, {expected_size} expected"
        if _digest(file) != expected_digest:
            return f"{file} is corrupted: its SHA-256 differs from the manifest's"
    return None
