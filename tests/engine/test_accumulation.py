"""Gradient accumulation gives the gradients of one big batch, also with uneven padding and
across data-parallel ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.testing import (
    MarkovLMDataset,
    TinyTransformerLM,
    lm_loss,
    pad_collate,
    run_distributed,
)
from tests.conftest import read_losses, tiny_trainer

TOLERANCE = 1e-6  # fp32, max abs difference of any gradient element


def _model() -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=64)


def _samples(count: int = 8) -> list[dict[str, torch.Tensor]]:
    # Lengths 4..40: micro-batches of two pad to very different lengths and token counts.
    dataset = MarkovLMDataset(count, vocab_size=64, min_length=4, max_length=40, seed=3)
    return [dataset[i] for i in range(count)]


allreduce_micro_steps: list[int] = []


def _accumulated_grads(
    micro: int, samples: list[dict[str, torch.Tensor]], *, token_weighted: bool = True, dp: int = 1
) -> dict[str, torch.Tensor]:
    config = RapidformerConfig.from_dict(
        {"micro_batch_size": micro, "global_batch_size": len(samples) * dp}
    )
    engine = RapidformerEngine(config)
    state = engine.compose(_model(), optimizer=torch.optim.SGD(_model().parameters(), lr=0.0))
    assert engine.accumulation_steps == len(samples) // micro
    if isinstance(state.model, DistributedDataParallel):
        # Record in which micro-step each gradient bucket is all-reduced.
        # No annotations: DDP compares them with GradBucket, and this module's are strings.
        def counting_allreduce(process_group, bucket):  # type: ignore[no-untyped-def]
            allreduce_micro_steps.append(engine._micro_steps)  # the micro-step in backward now
            return allreduce_hook(process_group, bucket)

        state.model.register_comm_hook(None, counting_allreduce)
    for start in range(0, len(samples), micro):
        out = lm_loss(state.model, pad_collate(samples[start : start + micro]))
        engine.backward(out["loss"], weight=out["num_tokens"] if token_weighted else None)
    grads = {n: p.grad.clone() for n, p in state.unwrapped_model.named_parameters()}
    engine.close()
    return grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_micro_2_times_4_equals_micro_8_with_uneven_padding() -> None:
    samples = _samples()
    big = _accumulated_grads(8, samples)
    accumulated = _accumulated_grads(2, samples)
    assert _max_diff(big, accumulated) <= TOLERANCE
    # The naive mean of per-micro-batch means would be wrong here: make sure the test can tell.
    naive = _accumulated_grads(2, samples, token_weighted=False)
    assert _max_diff(big, naive) > 100 * TOLERANCE


def test_equal_weights_without_token_counts_match_for_equal_lengths() -> None:
    dataset = MarkovLMDataset(8, vocab_size=64, min_length=20, max_length=20, seed=4)
    samples = [dataset[i] for i in range(8)]
    assert (
        _max_diff(
            _accumulated_grads(8, samples, token_weighted=False),
            _accumulated_grads(2, samples, token_weighted=False),
        )
        <= TOLERANCE
    )


def _rank_grads(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # Rank r takes every other sample: the two ranks together hold the same 8 samples.
    grads = _accumulated_grads(2, _samples()[rank::2], dp=2)
    torch.save((grads, allreduce_micro_steps), Path(out_dir) / f"grads_{rank}.pt")


@pytest.mark.distributed
def test_two_ranks_with_accumulation_equal_one_big_batch(tmp_path: Path) -> None:
    run_distributed(_rank_grads, 2, str(tmp_path))
    big = _accumulated_grads(8, _samples())
    for rank in range(2):
        grads, allreduce_micro_steps = torch.load(tmp_path / f"grads_{rank}.pt")
        assert _max_diff(big, grads) <= TOLERANCE
        # Accumulation 2: gradients cross ranks once (one bucket), in the second micro-step.
        assert allreduce_micro_steps == [2]


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
