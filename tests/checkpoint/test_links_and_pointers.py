"""Nothing outside the save directory is written or followed: a link where a run writes is
refused, ``latest`` counts only when it names an ``iter_*`` directory of its own directory
(else the newest complete checkpoint is used, as the docs promise), a linked ``iter_*`` is never
resumed and is pruned as a link, and a manifest lists only files inside its checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint import find_checkpoint
from rapidformer.checkpoint.directory import LATEST, prune, remove_debris
from rapidformer.checkpoint.integrity import damage, looks_whole, write_manifest
from rapidformer.checkpoint.lock import lock_save_directory
from rapidformer.errors import CheckpointError
from rapidformer.own_files import open_own


def _checkpoint(root: Path, step: int) -> Path:
    """A complete checkpoint as the save directory sees it: its progress and its manifest."""
    directory = root / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    (directory / "progress.json").write_text(json.dumps({"step": step}))
    write_manifest(directory, ["progress.json"])
    return directory


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text("mine")
    return victim


@pytest.mark.parametrize(
    "pointer",
    [b"\xff\xfe\x00 garbage", b"/abs/other_run/iter_0000009", b"../other/iter_0000009", b""],
    ids=["binary", "absolute", "climbing", "empty"],
)
def test_a_pointer_naming_nothing_of_its_own_gives_way_to_the_newest_checkpoint(
    tmp_path: Path, pointer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    _checkpoint(root, 2)
    newest = _checkpoint(root, 4)
    (root / LATEST).write_bytes(pointer)
    with caplog.at_level(logging.WARNING, logger="rapidformer"):
        assert find_checkpoint(root) == newest
    assert "names no iter_* checkpoint of this directory" in caplog.text


def test_a_pointer_to_another_run_with_nothing_here_is_refused(tmp_path: Path) -> None:
    other = _checkpoint(tmp_path / "other", 9)
    root = tmp_path / "run"
    root.mkdir()
    (root / LATEST).write_text(str(other))
    with pytest.raises(CheckpointError, match=r"names no iter_\* checkpoint of .*Fix: delete it"):
        find_checkpoint(root)


def test_links_are_never_followed_to_resume_and_are_pruned_as_links(tmp_path: Path) -> None:
    other = _checkpoint(tmp_path / "other", 9)
    root = tmp_path / "run"
    own = _checkpoint(root, 2)
    (root / "iter_0000009").symlink_to(other, target_is_directory=True)
    (root / LATEST).write_text("iter_0000009")  # names the link
    assert find_checkpoint(root) == own
    newer = _checkpoint(root, 4)
    (root / LATEST).write_text("iter_0000004")
    prune(root, keep=1)
    assert not (root / "iter_0000009").exists() and not (root / "iter_0000009").is_symlink()
    assert not own.exists() and newer.exists()
    assert (other / "progress.json").is_file()  # what the link pointed to is untouched


def test_a_manifest_lists_only_files_inside_its_checkpoint(tmp_path: Path) -> None:
    outside = _victim(tmp_path)
    checkpoint = _checkpoint(tmp_path / "run", 2)
    (checkpoint / "model.pt").symlink_to(outside)
    for name in ("../../elsewhere/precious.txt", str(outside), "model.pt"):
        manifest = {"files": {name: {"size": 4, "sha256": "0" * 64}}, "required": []}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
        assert f"lists {name}, which is no file of the checkpoint" in str(damage(checkpoint))
        assert not looks_whole(checkpoint)
    assert outside.read_text() == "mine"


def test_no_file_a_run_writes_is_written_through_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "run"
    root.mkdir()
    (root / ".lock").symlink_to(victim)
    with pytest.raises(CheckpointError, match=r"\.lock is a symbolic link .*precious\.txt"):
        lock_save_directory(str(root), torch.device("cpu"))
    (root / ".lock").unlink()
    (root / "config.json").symlink_to(victim)  # where a fine-tuning run saves its model
    with pytest.raises(CheckpointError, match=r"holds the symbolic link config\.json"):
        lock_save_directory(str(root), torch.device("cpu"))
    (root / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl is a symbolic link"):
        open_own(root / "metrics.jsonl", "a")
    assert victim.read_text() == "mine"
    with open_own(root / "own.txt") as stream:  # a plain file is written as it always was
        stream.write("ours")
    assert (root / "own.txt").read_text() == "ours"


def test_debris_that_is_a_link_is_removed_as_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    root = tmp_path / "run"
    root.mkdir()
    (root / ".tmp-iter_0000004").symlink_to(victim.parent, target_is_directory=True)
    (root / ".latest.tmp").symlink_to(victim)
    remove_debris(root)
    assert sorted(p.name for p in root.iterdir()) == []
    assert victim.read_text() == "mine"
