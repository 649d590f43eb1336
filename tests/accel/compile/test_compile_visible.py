"""Compile never silently falls back: Hugging Face models train without their generation cache
(one block graph per shape instead of one per layer), the run counts its graphs, a function
that hits dynamo's recompile limit is reported loudly and counted, and the whole-model scope
compiles the model and the template's loss with the numbers of eager.

Dynamo's graphs and guards do not depend on the backend, so these tests compile with the
``eager`` backend (``accel.compile.BACKEND``): the same graph count, no kernel generation."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from rapidformer import RapidformerConfig, RapidformerEngine, StepFunctions, Trainer
from rapidformer.cli import load_trainer_class
from rapidformer.config.loading import parse_args
from rapidformer.errors import ConfigError
from rapidformer.state import TrainState
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS, read_losses

LAYERS = 10  # more than dynamo's default recompile limit (8)


pytestmark = pytest.mark.usefixtures("eager_backend")


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """rapidformer's records (its logger does not propagate once the console is set up)."""
    logger = logging.getLogger("rapidformer")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="rapidformer")
    yield caplog
    logger.removeHandler(caplog.handler)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    assert config.use_cache  # the transformers default that recompiled every layer
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(model: nn.Module, lengths: list[int]) -> tuple[RapidformerEngine, TrainState]:
    engine = RapidformerEngine(RapidformerConfig.from_dict({"lr": 1e-3, "torch_compile": True}))
    state = engine.compose(model)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return state.model(input_ids=ids, labels=ids).loss

    step = StepFunctions(train_step=loss, weight=lambda ids: ids.numel())
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        engine.run_step([torch.randint(0, 128, (2, length), generator=generator)], step)
    return engine, state


def test_a_hugging_face_llama_compiles_one_block_graph_per_shape(
    logged: pytest.LogCaptureFixture,
) -> None:
    model = _llama()
    engine, state = _train(model, [8, 8, 12])
    assert model.config.use_cache is False
    plan = [str(p) for p in state.plan]
    assert plan[0].startswith("generation cache: config.use_cache=False (LlamaForCausalLM")
    # Ten decoder layers, two sequence lengths: one block graph for each length.
    assert engine.step_metrics() == {"compile_graphs": 2, "compile_fallbacks": 0}
    assert "compile (blocks scope): 1 graph(s) compiled by step 1" in logged.text
    engine.close()


def test_a_recompile_limit_hit_is_logged_loudly_and_counted(
    logged: pytest.LogCaptureFixture,
) -> None:
    """The old behaviour, forced: the model keeps its generation cache (as if rapidformer had
    not turned it off), every layer is a new guard, and layers past the limit run eagerly."""
    # dynamo's default (an earlier dynamic-shape run in this process may have raised it)
    model = _llama()
    model.rapidformer_use_cache = True  # type: ignore[assignment]  # "already handled"
    with torch._dynamo.config.patch(recompile_limit=8):
        engine, _ = _train(model, [8])
    metrics = engine.step_metrics()
    assert metrics["compile_fallbacks"] == 1, metrics
    assert metrics["compile_graphs"] == 8  # the limit, not 1
    warning = next(r.getMessage() for r in logged.records if "FELL BACK TO EAGER" in r.getMessage())
    assert "recompile_limit" in warning and "Fix:" in warning
    engine.close()


def _split_trainer(*flags: str) -> Trainer:
    """The deterministic demo trainer with its step split, so that the template owns its
    loss (as the Pretrainer and the Finetuner do)."""
    demo = load_trainer_class(str(DETERMINISTIC_SCRIPT))

    def model_inputs(self: Trainer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return (batch["input_ids"],)

    def compute_loss(self: Trainer, logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
        )

    hooks = {"model_inputs": model_inputs, "compute_loss": compute_loss}
    split = type("SplitTiny", (demo,), {**hooks, "train_step": Trainer.train_step})
    return split(parse_args([*TINY_FLAGS, *flags]))


def test_whole_model_scope_compiles_model_and_loss_with_eager_numbers(tmp_path: Path) -> None:
    # Buckets bound the shapes (the demo pads each batch to its longest sample otherwise).
    flags = ("--train-iters", "6", "--log-interval", "1", "--micro-batch-size", "8")
    flags += ("--data-iterator", "dynamic-shape")
    eager = _split_trainer(*flags, "--save", str(tmp_path / "eager"))
    eager.fit()
    whole = _split_trainer(
        *flags, "--save", str(tmp_path / "whole"), "--torch-compile",
        "--torch-compile-scope", "model",
    )  # fmt: skip
    whole.fit()
    state = whole.engine.state
    assert state is not None
    compile_step = next(str(p) for p in state.plan if str(p).startswith("compile"))
    assert "scope model (whole model: 1 x TinyTransformerLM)" in compile_step
    # The template owns the loss: it was compiled too (and eager's was not).
    assert hasattr(whole._compiled_loss, "_torchdynamo_orig_callable")
    assert eager._compiled_loss is None
    before, after = read_losses(tmp_path / "eager"), read_losses(tmp_path / "whole")
    assert before.keys() == after.keys() == set(range(1, 7))
    assert max(abs(before[k] - after[k]) for k in before) <= 1e-6
    metrics = whole.engine.step_metrics()
    watch = state.monitors[0]
    assert metrics["compile_graphs"] >= 2 and metrics["compile_fallbacks"] == 0, watch.fallbacks


def test_the_scope_flag_needs_the_switch() -> None:
    with pytest.raises(ConfigError, match="--torch-compile-scope='model': needs --torch-compile"):
        RapidformerEngine(RapidformerConfig.from_dict({"torch_compile_scope": "model"}))
