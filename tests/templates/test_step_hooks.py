"""The Trainer's step hooks: ``train_step``, or its split form ``model_inputs`` +
``compute_loss`` (what a pipeline needs), weighted by ``batch_weight`` before the forwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rapidformer import DataBundle, Trainer, parse_args
from rapidformer.cli import load_trainer_class
from rapidformer.errors import ConfigError, HookError
from rapidformer.labels import IGNORE_INDEX
from rapidformer.testing import lm_loss
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses, tiny_trainer

Deterministic = load_trainer_class(str(DETERMINISTIC_SCRIPT))


class SplitTrainer(Deterministic):  # type: ignore[valid-type, misc]
    """The same model and loss as the demo, written as the split step."""

    train_step = Trainer.train_step  # the default: compute_loss(model(*model_inputs(batch)))

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return (batch["input_ids"],)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        labels = batch["labels"]
        return F.cross_entropy(
            outputs.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )


RUN = ("--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8")


def test_the_split_step_trains_exactly_like_train_step(tmp_path: Path) -> None:
    tiny_trainer(*RUN, "--save", str(tmp_path / "whole")).fit()
    split = SplitTrainer(parse_args([*TINY_FLAGS, *RUN, "--save", str(tmp_path / "split")]))
    split.fit()
    assert split.step_functions().model_inputs is not None  # a pipeline could cut it
    assert tiny_trainer(*RUN).step_functions().model_inputs is None  # train_step cannot be cut
    # The same computation in the same order: bitwise the same losses.
    assert read_losses(tmp_path / "split") == read_losses(tmp_path / "whole")


class LegacyTrainer(Deterministic):  # type: ignore[valid-type, misc]
    """Returns num_tokens to be weighted by tokens, without saying so before the forward."""

    batch_weight = Trainer.batch_weight

    def train_step(self, batch: Any) -> dict[str, Any]:
        assert self.model is not None
        return lm_loss(self.model, batch)


def test_num_tokens_returned_after_the_forward_is_refused_before_any_backward() -> None:
    trainer = LegacyTrainer(parse_args([*TINY_FLAGS, *RUN]))
    with pytest.raises(HookError, match=r"override batch_weight\(batch\)") as error:
        trainer.fit()
    assert "LegacyTrainer.train_step returned num_tokens" in str(error.value)
    state = trainer.engine.state
    assert state is not None and all(p.grad is None for p in state.parameters)


class NoStep(Trainer):
    def build_model(self) -> nn.Module:
        return nn.Linear(2, 2)

    def build_data(self) -> DataBundle:
        return DataBundle(train=None)


def test_a_trainer_without_a_step_is_refused_at_construction() -> None:
    with pytest.raises(HookError, match=r"implement train_step\(batch\) -> loss, or model_"):
        NoStep(parse_args(["--train-iters", "1", "--lr", "1e-3"]))


def test_pipeline_parallelism_asks_for_the_split_step() -> None:
    flags = [*TINY_FLAGS, *RUN, "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ConfigError) as error:
        tiny_trainer(*RUN, "--pipeline-model-parallel-size", "2")
    assert (
        "override model_inputs(batch) and compute_loss(outputs, batch) in Tiny instead of "
        "train_step" in str(error.value)
    )
    with pytest.raises(ConfigError) as error:
        SplitTrainer(parse_args(flags))
    assert "compute_loss" not in str(error.value)  # only the world-size rule (1 process) remains
    assert "tp 1 x pp 2 does not divide" in str(error.value)
