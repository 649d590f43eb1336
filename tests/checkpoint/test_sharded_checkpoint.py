"""Checkpoints of sharded runs resume on other rank counts: ZeRO-1 writes whole (consolidated)
state dicts, FSDP2 runs (ZeRO-2/3) write torch.distributed.checkpoint shards, one file per rank,
that DCP cuts again for the resuming layout. A run saved on 2 ranks resumes on 1 or 4 ranks and
its losses continue as if uninterrupted; the shards export in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidformer import parse_args
from rapidformer.checkpoint import consolidated_model_state
from rapidformer.export import export_checkpoint
from rapidformer.templates.pretrainer import Pretrainer, build_pretraining_model
from rapidformer.testing import run_distributed
from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents
from tests.helpers.trainers import read_losses, tiny_trainer

TOLERANCE = 1e-5
RUN = ("--train-iters", "10", "--global-batch-size", "8", "--micro-batch-size", "2")


def _fit(*flags: str) -> None:
    torch.set_num_threads(1)
    tiny_trainer(*RUN, *flags).fit()


def _saved_run(tmp_path: Path, flag: str) -> Path:
    """2 ranks, 10 steps, checkpoints at steps 5 and 10."""
    save = tmp_path / "two_ranks"
    run_distributed(_fit, 2, flag, "--save", str(save), "--save-interval", "5")
    return save


def _assert_continues(reference: Path, resumed: Path) -> None:
    before, after = read_losses(reference), read_losses(resumed)
    assert sorted(after) == list(range(6, 11))
    assert max(abs(before[step] - after[step]) for step in after) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("flag", ["--zero-1-memory-optimization", "--zero-2-memory-optimization"])
def test_sharded_checkpoint_from_two_ranks_resumes_on_one(flag: str, tmp_path: Path) -> None:
    saved = _saved_run(tmp_path, flag)
    resumed = tmp_path / "one_rank"
    load = str(saved / "iter_0000005")
    tiny_trainer(*RUN, flag, "--load", load, "--save", str(resumed)).fit()
    _assert_continues(saved, resumed)
    # ZeRO-1's model.pt is the consolidated state dict; ZeRO-2's shard files (one per rank, no
    # model.pt) are merged in this process. Both load into the plain model.
    checkpoint = saved / "iter_0000010"
    shard_files = sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp"))
    assert (len(shard_files), (checkpoint / "model.pt").exists()) == (
        (0, True) if flag == "--zero-1-memory-optimization" else (2, False)
    )
    record = json.loads((checkpoint / "progress.json").read_text())
    assert record["format"] == ("consolidated" if shard_files == [] else "dcp")
    assert record["parallel"] == {"dp": 2, "tp": 1, "pp": 1, "ep": 1}
    model = tiny_trainer(*RUN).build_model()
    model.load_state_dict(consolidated_model_state(checkpoint))


@pytest.mark.distributed
def test_sharded_checkpoint_resumes_under_plain_ddp(tmp_path: Path) -> None:
    """DDP's gradients exist from the wrap on (views of its buckets); the resumed optimizer's
    moments must still be created and filled from the shards (restarting Adam from zero would
    move the losses by far more than the tolerance)."""
    saved = _saved_run(tmp_path, "--zero-2-memory-optimization")
    resumed = tmp_path / "ddp"
    load = str(saved / "iter_0000005")
    run_distributed(_fit, 2, "--load", load, "--save", str(resumed))
    _assert_continues(saved, resumed)


@pytest.mark.distributed
def test_fsdp_checkpoint_from_two_ranks_resumes_on_four(tmp_path: Path) -> None:
    flag = "--zero-3-memory-optimization"
    saved = _saved_run(tmp_path, flag)
    resumed = tmp_path / "four_ranks"
    load = str(saved / "iter_0000005")
    run_distributed(_fit, 4, flag, "--load", load, "--save", str(resumed))
    _assert_continues(saved, resumed)


@pytest.mark.distributed
def test_black_box_zero3_pretraining_exports_to_hugging_face_without_processes(
    tmp_path: Path,
) -> None:
    # torchrun + the CLI: the plan names the engine, the memory report follows it; the
    # checkpoint of the sharded run is exported in this single process, no process group.
    transformers = pytest.importorskip("transformers")
    data = build_pretraining_data(
        tmp_path / "data", "GPT2BPETokenizer", synthetic_documents(100, seed=0)
    )
    model_flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    flags = [*data.flags(), *model_flags, "--seq-length", "64", "--lr", "2e-3"]
    run_flags = ["--train-iters", "3", "--micro-batch-size", "2", "--eval-iters", "1"]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *("-m", "rapidformer", "--task", "pretraining", *flags, *run_flags),
        *("--zero-3-memory-optimization", "--save", str(tmp_path / "run")),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ZeRO-3 (native): FSDP2 fully_shard(reshard_after_forward=True)" in run.stderr
    assert "model state on rank 0: parameters" in run.stderr
    assert "(0.50x), gradients" in run.stderr  # half of DDP's parameters per rank

    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    pretrainer = Pretrainer(parse_args([*flags, "--train-iters", "1"]))
    model = build_pretraining_model(pretrainer.config, pretrainer.tokenizer.vocab_size).eval()
    model.load_state_dict(consolidated_model_state(tmp_path / "run" / "iter_0000003"))
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - hf(input_ids=ids).logits).abs().max().item() <= 1e-5
