"""Gradient accumulation gives the gradients of one big batch, also with uneven padding and
across data-parallel ranks: counted before the forwards (``run_step``, no gradient rescaled
afterwards) for eager, DDP, FSDP2 and DeepSpeed, and in hand-written loops that learn the
weights after each forward (``backward(loss, weight=...)``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.step_io import StepFunctions
from rapidformer.testing import (
    MarkovLMDataset,
    lm_loss,
    pad_collate,
    run_distributed,
)
from tests.helpers.gradients import (
    TOLERANCE,
    max_difference,
    tiny_lm,
    tokens,
    uneven_samples,
)
from tests.helpers.steppers import RecordingGradients
from tests.helpers.trainers import read_losses, tiny_trainer


def _counted_grads(micro: int, samples: list[dict[str, torch.Tensor]], **options: Any) -> dict:
    """One optimizer step over ``samples`` (this rank's share) in micro-batches of ``micro``,
    weighted by tokens counted before the forwards; the gradients the update used."""
    dp = int(os.environ.get("WORLD_SIZE", "1"))
    config = RapidformerConfig.from_dict(
        {"micro_batch_size": micro, "global_batch_size": len(samples) * dp, "clip_grad": 0.0}
        | options
    )
    engine = RapidformerEngine(config)
    model = tiny_lm()
    state = engine.compose(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    assert engine.accumulation_steps == len(samples) // micro
    forwards: list[int] = []
    all_reduced_after: list[int] = []
    if isinstance(state.model, DistributedDataParallel):
        # Record after how many forwards each gradient bucket is all-reduced. No annotations:
        # DDP compares them with GradBucket, and this module's are strings.
        def counting_allreduce(process_group, bucket):  # type: ignore[no-untyped-def]
            all_reduced_after.append(len(forwards))
            return allreduce_hook(process_group, bucket)

        state.model.register_comm_hook(None, counting_allreduce)

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        forwards.append(1)
        return lm_loss(state.model, batch)["loss"]

    recording = RecordingGradients(state)
    state.stepper = recording
    batches = [pad_collate(samples[i : i + micro]) for i in range(0, len(samples), micro)]
    engine.run_step(batches, StepFunctions(train_step=loss_of, weight=tokens))
    if dp == 1:
        engine.close()  # several runs share one process group in the distributed tests
    return {"grads": recording.grads, "all_reduced_after": all_reduced_after}


def test_micro_2_times_4_equals_micro_8_with_uneven_padding() -> None:
    samples = uneven_samples()
    big = _counted_grads(8, samples)["grads"]
    accumulated = _counted_grads(2, samples)["grads"]
    assert max_difference(big, accumulated) <= TOLERANCE
    # The naive mean of per-micro-batch means would be wrong here: make sure the test can tell.
    naive = _late_grads(2, samples, token_weighted=False)
    assert max_difference(big, naive) > 100 * TOLERANCE


NATIVE = {
    "ddp": {},
    "zero1": {"zero_1_memory_optimization": True},
    "zero2": {"zero_2_memory_optimization": True},
    "zero3": {"zero_3_memory_optimization": True},
}
DEEPSPEED = {
    f"deepspeed-zero{stage}": {
        f"zero_{stage}_memory_optimization": True,
        "zero_backend": "deepspeed",
    }
    for stage in (1, 2, 3)
}


def _rank_counted_grads(out_dir: str, configs: dict[str, dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    mine = uneven_samples(16)[rank::2]  # the two ranks together hold the same 16 samples
    for name, options in configs.items():
        runs = {micro: _counted_grads(micro, mine, **options) for micro in (2, 8)}
        torch.save(
            {
                "accumulated": runs[2]["grads"],
                "whole": runs[8]["grads"],
                "all_reduced_after": runs[2]["all_reduced_after"],
            },
            Path(out_dir) / f"{name}_{rank}.pt",
        )


def _check_two_ranks(tmp_path: Path, configs: dict[str, dict[str, Any]]) -> dict[str, float]:
    run_distributed(_rank_counted_grads, 2, str(tmp_path), configs)
    reference = _counted_grads(16, uneven_samples(16))["grads"]  # one process, one batch
    worst = {}
    for name in configs:
        for rank in range(2):
            run = torch.load(tmp_path / f"{name}_{rank}.pt")
            worst[name] = max(
                max_difference(reference, run["accumulated"]),
                max_difference(reference, run["whole"]),
            )
            assert worst[name] <= TOLERANCE, (name, rank, worst[name])
            if name == "ddp":
                # Accumulation 4: gradients cross ranks once (one bucket), after the 4th forward.
                assert run["all_reduced_after"] == [4]
    return worst


@pytest.mark.distributed
def test_two_rank_counted_accumulation_equals_one_big_batch_native(tmp_path: Path) -> None:
    worst = _check_two_ranks(tmp_path, NATIVE)
    (tmp_path / "worst.json").write_text(json.dumps(worst))


@pytest.mark.distributed
def test_two_rank_counted_accumulation_equals_one_big_batch_deepspeed(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    _check_two_ranks(tmp_path, DEEPSPEED)


# ---- hand-written loops: backward(loss, weight) after each forward -----------------------
def _late_grads(
    micro: int, samples: list[dict[str, torch.Tensor]], *, token_weighted: bool = True, dp: int = 1
) -> dict[str, torch.Tensor]:
    config = RapidformerConfig.from_dict(
        {"micro_batch_size": micro, "global_batch_size": len(samples) * dp}
    )
    engine = RapidformerEngine(config)
    state = engine.compose(tiny_lm(), optimizer=torch.optim.SGD(tiny_lm().parameters(), lr=0.0))
    for start in range(0, len(samples), micro):
        out = lm_loss(state.model, pad_collate(samples[start : start + micro]))
        engine.backward(out["loss"], weight=out["num_tokens"] if token_weighted else None)
    grads = {n: p.grad.clone() for n, p in state.unwrapped_model.named_parameters()}
    engine.close()
    return grads


def test_hand_loop_weights_after_each_forward_equal_one_big_batch() -> None:
    samples = uneven_samples()
    assert max_difference(_late_grads(8, samples), _late_grads(2, samples)) <= TOLERANCE


def test_equal_weights_without_token_counts_match_for_equal_lengths() -> None:
    dataset = MarkovLMDataset(8, vocab_size=64, min_length=20, max_length=20, seed=4)
    samples = [dataset[i] for i in range(8)]
    assert (
        max_difference(
            _late_grads(8, samples, token_weighted=False),
            _late_grads(2, samples, token_weighted=False),
        )
        <= TOLERANCE
    )


def _rank_late_grads(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # Rank r takes every other sample: the two ranks together hold the same 8 samples.
    grads = _late_grads(2, uneven_samples()[rank::2], dp=2)
    torch.save(grads, Path(out_dir) / f"grads_{rank}.pt")


@pytest.mark.distributed
def test_two_rank_hand_loop_with_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    run_distributed(_rank_late_grads, 2, str(tmp_path))
    big = _late_grads(8, uneven_samples())
    for rank in range(2):
        assert max_difference(big, torch.load(tmp_path / f"grads_{rank}.pt")) <= TOLERANCE


def test_trainer_losses_with_accumulation_match_one_big_batch(tmp_path: Path) -> None:
    runs = {}
    for micro in (8, 2):
        save = tmp_path / f"micro{micro}"
        trainer = tiny_trainer(
            "--train-iters",
            "4",
            "--micro-batch-size",
            str(micro),
            "--global-batch-size",
            "8",
            "--save",
            str(save),
        )
        trainer.fit()
        runs[micro] = read_losses(save)
    assert runs[8].keys() == runs[2].keys() == {1, 2, 3, 4}
    assert max(abs(runs[8][s] - runs[2][s]) for s in runs[8]) <= 1e-5
    progress = json.loads((tmp_path / "micro2" / "iter_0000004" / "progress.json").read_text())
    assert progress["consumed"] == 16  # 4 steps x 4 micro-batches
    assert progress["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "ep": 1}
