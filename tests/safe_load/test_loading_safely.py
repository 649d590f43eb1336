"""Loading a checkpoint or a model never runs code from it.

Each format gets a crafted file whose unpickling would create a marker file (``os.system``),
with the checkpoint's manifest rewritten to match, as an attacker who writes the files would:
resuming from it (or fine-tuning from the Hugging Face directory) exits with the checkpoint
exit code, names the file and the global, prints no traceback, and the marker never appears.
Real checkpoints of every format still scan clean; ``--trust-checkpoint`` is the one way round.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer.checkpoint.integrity import write_manifest
from rapidformer.errors import CheckpointError, exit_code_of
from rapidformer.safe_load import (
    ALLOWED_GLOBALS,
    RestrictedUnpickler,
    UnsafeCheckpointError,
    dcp_load_planner,
    dcp_reader,
    load_torch_file,
    pickle_globals,
    scan_file,
    trusting,
)
from rapidformer.testing import run_distributed
from rapidformer.testing.families import tiny_model
from rapidformer.testing.finetune import task_dataset
from tests.helpers.grouped_launch import Case, Launches
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, ROOT, TINY_FLAGS

CHECKPOINT_EXIT = exit_code_of(CheckpointError("a bad checkpoint"))
RUN = ["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--micro-batch-size", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Payload:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def _plant(file: Path, marker: Path, *, zip_format: bool = True) -> None:
    """Replace ``file`` by the payload (in torch.save's zip format, or as a plain pickle, as
    DCP's .metadata is) and rewrite its checkpoint's manifest to match."""
    if zip_format:
        torch.save({"model": Payload(marker)}, file)
    else:
        file.write_bytes(pickle.dumps(Payload(marker)))
    checkpoint = next(p for p in file.parents if p.name.startswith("iter_"))
    write_manifest(checkpoint)


def _rapidformer(*flags: str, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    launch = [sys.executable, "-m", "rapidformer"]
    if ranks > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += ["--nproc_per_node", str(ranks), "-m", "rapidformer"]
    return subprocess.run(
        [*launch, *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
        check=False,
    )


def _assert_refused(done: subprocess.CompletedProcess[str], file: Path, marker: Path) -> None:
    assert done.returncode == CHECKPOINT_EXIT, done.stderr[-3000:]
    assert str(file) in done.stderr and "posix.system" in done.stderr, done.stderr[-3000:]
    assert "--trust-checkpoint" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


# ---- the scanner ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_the_scan_finds_the_callable_of_every_pickle_protocol(protocol: int) -> None:
    """GLOBAL (protocols 0-3) and STACK_GLOBAL with memoized names (4-5)."""
    data = pickle.dumps([Payload(Path("m")), Payload(Path("n"))], protocol=protocol)
    assert "posix.system" in set(pickle_globals(data))


def test_a_state_dict_names_only_allowed_globals(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    for name, value in (("model", model.state_dict()), ("optimizer", optimizer.state_dict())):
        torch.save(value, tmp_path / f"{name}.pt")
        scan_file(tmp_path / f"{name}.pt")  # raises on anything outside the allowlist
        names = set(pickle_globals(_pkl_of(tmp_path / f"{name}.pt")))
        assert names and names <= ALLOWED_GLOBALS, names


def test_names_the_scan_cannot_resolve_are_refused() -> None:
    """A STACK_GLOBAL whose names are not plain strings, a copyreg extension code: refused, not
    guessed; the restricted unpickler refuses them too (every import goes through find_class)."""
    unresolved = b"\x80\x04K\x01K\x02\x93)R."  # STACK_GLOBAL over two integers
    extension = b"\x80\x02\x82\x01)R."  # EXT1 1: copyreg's extension registry
    assert "<unresolved STACK_GLOBAL>" in set(pickle_globals(unresolved))
    assert "<copyreg extension code 1>" in set(pickle_globals(extension))
    for data in (pickle.dumps(Payload(Path("m")), protocol=4), extension):
        with pytest.raises((UnsafeCheckpointError, pickle.UnpicklingError, ValueError)):
            RestrictedUnpickler(io.BytesIO(data), "test").load()


def test_files_torch_would_read_past_the_scan_are_refused(tmp_path: Path) -> None:
    """torch.load decides the format from the first bytes and reads zip records with its own
    reader; the scan does the same. A pickle with a zip appended (Python's zipfile finds the
    zip, torch.load unpickles the leading pickle) and torch's older non-zip formats are refused."""
    marker = tmp_path / "MARKER"
    disguised = tmp_path / "disguised.pt"
    torch.save({"x": torch.ones(1)}, tmp_path / "clean.pt")
    disguised.write_bytes(pickle.dumps(Payload(marker)) + (tmp_path / "clean.pt").read_bytes())
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": torch.ones(128)}, legacy, _use_new_zipfile_serialization=False)
    for file in (disguised, legacy):
        with pytest.raises(UnsafeCheckpointError, match="not in torch's zip format"):
            scan_file(file)
        with pytest.raises(UnsafeCheckpointError):
            load_torch_file(file)
    assert not marker.exists()


def test_dcp_reads_back_the_saved_non_tensor_values(tmp_path: Path) -> None:
    """DCP's planner puts non-tensor items into the caller's nested dict; the weights-only
    planner must too (a learning rate saved as 0.5 comes back as 0.5, not the template's)."""
    import torch.distributed.checkpoint as dcp

    saved = {"optimizer": {"param_groups": {"w": {"lr": 0.5, "betas": (0.8, 0.9)}}}}
    saved["optimizer"]["state"] = {"w": {"exp_avg": torch.arange(3.0)}}
    dcp.save(saved, checkpoint_id=tmp_path / "c", no_dist=True)
    template = {"optimizer": {"param_groups": {"w": {"lr": 1e-3, "betas": (0.0, 0.0)}}}}
    template["optimizer"]["state"] = {"w": {"exp_avg": torch.zeros(3)}}
    dcp.load(
        template,
        storage_reader=dcp_reader(tmp_path / "c"),
        planner=dcp_load_planner(),
        no_dist=True,
    )
    assert template["optimizer"]["param_groups"]["w"] == {"lr": 0.5, "betas": (0.8, 0.9)}
    assert torch.equal(template["optimizer"]["state"]["w"]["exp_avg"], torch.arange(3.0))


def test_own_files_are_read_as_tensors_and_plain_values_only(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    torch.save({"weights": torch.ones(2), "payload": Payload(marker)}, tmp_path / "x.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        load_torch_file(tmp_path / "x.pt")
    assert not marker.exists()
    with trusting(True):  # --trust-checkpoint: the one path that unpickles anything
        load_torch_file(tmp_path / "x.pt")
    assert marker.exists()


def test_no_weights_only_false_outside_the_trusted_path() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"weights_only\s*=\s*False", line)
    ]
    assert len(hits) == 1 and hits[0].startswith("src/rapidformer/safe_load/loaders.py:"), hits
    line = (ROOT / hits[0].split(":")[0]).read_text().splitlines()[int(hits[0].split(":")[1]) - 1]
    assert "--trust-checkpoint" in line


# ---- crafted checkpoints, refused before anything runs --------------------------------------
def test_a_consolidated_checkpoint_with_a_payload_is_refused(tmp_path: Path) -> None:
    save, marker = tmp_path / "run", tmp_path / "MARKER"
    assert _rapidformer(*RUN, "--train-iters", "2", "--save", str(save)).returncode == 0
    model = save / "iter_0000002" / "model.pt"
    _plant(model, marker)
    done = _rapidformer(*RUN, "--train-iters", "4", "--load", str(save))
    _assert_refused(done, model, marker)
    # The one way round, for a checkpoint the user trusts: the payload runs (and the file,
    # not being a state dict, then fails to load).
    trusted = _rapidformer(*RUN, "--train-iters", "4", "--load", str(save), "--trust-checkpoint")
    assert trusted.returncode != 0 and marker.exists()
    assert "--trust-checkpoint: checkpoint files are unpickled without the allowlist" in (
        trusted.stderr
    )


def _fit(*flags: str) -> None:
    from tests.helpers.trainers import tiny_trainer

    torch.set_num_threads(1)
    trainer = tiny_trainer(*flags)
    trainer.fit()


@pytest.mark.distributed
def test_a_dcp_checkpoint_of_two_ranks_with_a_payload_is_refused_on_one(tmp_path: Path) -> None:
    save, marker = tmp_path / "run", tmp_path / "MARKER"
    flags = ("--train-iters", "2", "--micro-batch-size", "4", "--zero-3-memory-optimization")
    run_distributed(_fit, 2, *flags, "--save", str(save))
    metadata = save / "iter_0000002" / "sharded" / ".metadata"
    with metadata.open("rb") as stream:  # the real one passes the restricted unpickler
        RestrictedUnpickler(stream, str(metadata)).load()
    _plant(metadata, marker, zip_format=False)
    done = _rapidformer(*RUN, "--train-iters", "4", "--load", str(save))
    _assert_refused(done, metadata, marker)


@pytest.mark.distributed
def test_deepspeed_checkpoints_scan_clean_and_a_payload_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from rapidformer.accel.deepspeed.state import deepspeed_files

    marker = tmp_path / "MARKER"
    common = ("--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "2")
    # The three stages in one launch: its imports take far longer than 2 steps of each.
    cases: dict[str, Case] = {}
    for stage in (1, 2, 3):
        flag, save = f"--zero-{stage}-memory-optimization", str(tmp_path / f"zero{stage}")
        cases[f"zero{stage}"] = (
            _fit,
            (*common, flag, "--zero-backend", "deepspeed", "--save", save),
        )
    runs = Launches(2, tmp_path, [cases])
    for stage in (1, 2, 3):
        files = deepspeed_files(runs.check(f"zero{stage}") / "iter_0000002")
        assert files, stage
        for file in files:  # every global of a real DeepSpeed checkpoint is on the allowlist
            scan_file(file)
    target = deepspeed_files(tmp_path / "zero2" / "iter_0000002")[0]
    _plant(target, marker)
    flags = [*RUN, "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "4"]
    flags += ["--zero-2-memory-optimization", "--zero-backend", "deepspeed"]
    # DeepSpeed resumes on as many ranks as wrote it.
    done = _rapidformer(*flags, "--load", str(tmp_path / "zero2"), ranks=2)
    assert done.returncode != 0 and str(target) in done.stderr, done.stderr[-3000:]
    assert "posix.system" in done.stderr and "--trust-checkpoint" in done.stderr
    assert not marker.exists()
    runs.join()  # the launch has long ended: nothing of it outlives the test


# ---- Hugging Face directories --------------------------------------------------------------
def _finetune(model: Path, data: Path, *flags: str) -> list[str]:
    return [
        *("--task", "sequence_classification", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--lr", "1e-3"),
        *("--train-iters", "1", "--micro-batch-size", "4", *flags),
    ]


def test_a_hugging_face_bin_with_a_payload_is_refused(tmp_path: Path) -> None:
    model = tiny_model("bert", tmp_path / "bert")
    data = task_dataset("sequence_classification", tmp_path / "cls", train=32, validation=16)
    marker = tmp_path / "MARKER"
    # Only pickled weights (as older transformers wrote them): the .bin is what is read.
    for file in model.glob("*.safetensors"):
        file.unlink()
    weights = model / "pytorch_model.bin"
    torch.save(Payload(marker), weights)
    done = _rapidformer(*_finetune(model, data))
    assert done.returncode == CHECKPOINT_EXIT, done.stderr[-3000:]
    assert str(weights) in done.stderr and "posix.system" in done.stderr
    assert "Traceback" not in done.stderr and not marker.exists()


@pytest.mark.parametrize("shard", ["weights-00001-of-00002.data", "extra.pth"])
def test_every_shard_an_index_names_and_every_pickled_file_is_scanned(
    tmp_path: Path, shard: str
) -> None:
    """A shard named otherwise than ``pytorch_model*.bin`` in the index (transformers reads it
    whatever its name), and a ``.pth`` beside the weights: each is scanned before any load,
    and the payload refused naming its file."""
    from rapidformer.safe_load.loaders import hugging_face_weights, pickled_weight_files

    marker = tmp_path / "MARKER"
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model-00001-of-00002.bin")
    torch.save(Payload(marker), model / shard)
    index = {"weight_map": {"w": "pytorch_model-00001-of-00002.bin"}}
    if shard.endswith(".data"):
        index["weight_map"]["v"] = shard
    (model / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert model / shard in pickled_weight_files(model)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(model / shard))):
        hugging_face_weights(model)
    assert not marker.exists()
    index["weight_map"]["v"] = "../outside.bin"  # an index may not reach out of its directory
    (model / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match="outside its directory"):
        pickled_weight_files(model)


def test_safetensors_are_preferred_to_a_bin_beside_them(tmp_path: Path) -> None:
    model = tiny_model("bert", tmp_path / "bert")  # saved as safetensors
    data = task_dataset("sequence_classification", tmp_path / "cls", train=32, validation=16)
    marker = tmp_path / "MARKER"
    torch.save(Payload(marker), model / "pytorch_model.bin")
    done = _rapidformer(*_finetune(model, data))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()


def test_a_model_that_ships_code_needs_trust_remote_code(tmp_path: Path) -> None:
    """A model type transformers does not know, mapped to Python files in its directory:
    refused without --trust-remote-code (the files never run), trained with it. (A known type
    that also maps custom code loads transformers' own class without running the files.)"""
    model = tiny_model("bert", tmp_path / "bert")
    data = task_dataset("sequence_classification", tmp_path / "cls", train=32, validation=16)
    marker = tmp_path / "MARKER"
    (model / "modeling_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import BertConfig, BertForSequenceClassification\n\n\n"
        "class CustomConfig(BertConfig):\n    model_type = 'custom_bert'\n\n\n"
        "class Custom(BertForSequenceClassification):\n    config_class = CustomConfig\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "custom_bert"
    config["auto_map"] = {
        "AutoConfig": "modeling_custom.CustomConfig",
        "AutoModelForSequenceClassification": "modeling_custom.Custom",
    }
    (model / "config.json").write_text(json.dumps(config))
    done = _rapidformer(*_finetune(model, data))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--trust-remote-code" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()
    trusted = _rapidformer(*_finetune(model, data, "--trust-remote-code"))
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    assert marker.exists()  # the directory's code ran, as the flag allows
    assert "Hugging Face remote code: trust_remote_code=True" in trusted.stderr


# ---- what does not change ------------------------------------------------------------------
def test_a_checkpoint_of_an_earlier_version_still_resumes(tmp_path: Path) -> None:
    """Before this version the RNG file held numpy's state as an array (a numpy global):
    scanned, allowed, and read without --trust-checkpoint."""
    import numpy as np

    save = tmp_path / "run"
    assert _rapidformer(*RUN, "--train-iters", "2", "--save", str(save)).returncode == 0
    rng = save / "iter_0000002" / "rng" / "rank_00000.pt"
    old = torch.load(rng, weights_only=True)
    old["numpy"] = np.random.get_state()
    torch.save(old, rng)
    write_manifest(save / "iter_0000002")
    assert any(name.startswith("numpy") for name in pickle_globals(_pkl_of(rng)))
    done = _rapidformer(*RUN, "--train-iters", "4", "--load", str(save))
    assert done.returncode == 0, done.stderr[-3000:]


def _pkl_of(file: Path) -> bytes:
    import zipfile

    with zipfile.ZipFile(file) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def test_the_trust_flags_without_anything_to_trust_are_refused() -> None:
    from rapidformer.cli import main

    assert main([*RUN, "--train-iters", "2", "--trust-checkpoint"]) == 2
    assert main([*RUN, "--train-iters", "2", "--trust-remote-code"]) == 2
