"""Adapters on several ranks compute what one process computes: the loss curve of 10 steps
(fp32) under DDP on 2 ranks, under ZeRO-3 (FSDP2: frozen and trainable parameters of a block in
one unit) on 2 ranks, and a 2-rank ZeRO-3 checkpoint resumed on 1 rank, each within 1e-5 of one
process."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer.cli import main
from rapidformer.testing.finetune import task_dataset, tiny_model
from tests.helpers.trainers import launched, read_losses

TOLERANCE = 1e-5


def _flags(model: Path, data: Path, save: Path, steps: int, variant: str = "dora") -> list[str]:
    return [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "4"),
        *("--global-batch-size", "8", "--lr", "1e-2", "--lr-decay-style", "constant"),
        *("--train-iters", str(steps), "--log-interval", "1", "--save", str(save)),
        *("--lora-rank", "4", "--lora-variant", variant, "--eval-interval", "1000"),
    ]


def _two_ranks(flags: list[str]) -> None:
    launched(["--nproc-per-node", "2", *flags])


@pytest.mark.distributed
def test_adapter_loss_curves_agree_across_layouts_and_a_resume(tmp_path: Path) -> None:
    model = tiny_model("llama", tmp_path / "llama")
    data = task_dataset("causal_lm", tmp_path / "data", train=96, validation=8)
    assert main(_flags(model, data, tmp_path / "one", 10)) == 0
    reference = read_losses(tmp_path / "one")

    _two_ranks(_flags(model, data, tmp_path / "ddp", 10))
    _two_ranks([*_flags(model, data, tmp_path / "zero3", 5), "--zero-3-memory-optimization"])
    # The 2-rank sharded checkpoint of step 5, continued on one process to step 10.
    assert main([*_flags(model, data, tmp_path / "zero3", 10), "--zero-3-memory-optimization"]) == 0

    records = (tmp_path / "zero3" / "metrics.jsonl").read_text().count('"kind": "train"')
    assert records == 10  # steps 1-5 on two ranks, 6-10 resumed on one: none run twice
    for name in ("ddp", "zero3"):
        losses = read_losses(tmp_path / name)
        assert sorted(losses) == list(range(1, 11)), name
        gaps = {step: abs(losses[step] - reference[step]) for step in reference}
        print(name, "largest loss gap to one process:", max(gaps.values()))
        assert max(gaps.values()) <= TOLERANCE, (name, gaps)
    assert reference[10] < reference[1] - 0.05  # the adapters learn


@pytest.mark.distributed
def test_adapters_on_tensor_parallel_layers_agree_and_a_zero3_checkpoint_resumes_on_tp2(
    tmp_path: Path,
) -> None:
    """rsLoRA on transformers' tp_plan (column- and row-parallel layers): 10 steps on tp2, and
    a 2-rank ZeRO-3 checkpoint of step 5 (FSDP2 shards) continued on tp2 (tensor-parallel
    shards), against one process. (dp2 x tp2 needs transformers to shard on the tp sub-mesh:
    it shards over all 4 ranks, with or without adapters.)"""
    model = tiny_model("llama", tmp_path / "llama")
    data = task_dataset("causal_lm", tmp_path / "data", train=96, validation=8)
    assert main(_flags(model, data, tmp_path / "one", 10, "rslora")) == 0
    reference = read_losses(tmp_path / "one")
    tp2 = ["--tensor-model-parallel-size", "2"]
    _two_ranks([*_flags(model, data, tmp_path / "tp2", 10, "rslora"), *tp2])
    zero3 = "--zero-3-memory-optimization"
    _two_ranks([*_flags(model, data, tmp_path / "moved", 5, "rslora"), zero3])
    _two_ranks([*_flags(model, data, tmp_path / "moved", 10, "rslora"), *tp2])
    for name in ("tp2", "moved"):
        losses = read_losses(tmp_path / name)
        assert sorted(losses) == list(range(1, 11)), name
        gap = max(abs(losses[step] - reference[step]) for step in reference)
        print(name, "largest loss gap to one process:", gap)
        assert gap <= TOLERANCE, (name, losses, reference)
    records = (tmp_path / "moved" / "metrics.jsonl").read_text().count('"kind": "train"')
    assert records == 10  # steps 6-10 resumed on the new layout, none run twice
