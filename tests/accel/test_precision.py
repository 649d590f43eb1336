"""fp16 (autocast + GradScaler) and bf16 autocast: they take effect, fp16 skips overflow steps,
and both track the fp32 loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from tests.helpers.trainers import read_losses, tiny_trainer

TOLERANCE = 5e-2  # max |loss - fp32 loss| over the run, tiny model


def _engine(precision: str) -> tuple[RapidformerEngine, torch.nn.Module]:
    config = RapidformerConfig.from_dict(
        {"precision": precision, "lr": 1e-3, "micro_batch_size": 4}
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    torch.manual_seed(0)
    state = engine.compose(
        TinyTransformerLM(),
        lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
    )
    return engine, state.model


def _batch() -> dict[str, torch.Tensor]:
    data = MarkovLMDataset(4, seed=5)
    return pad_collate([data[i] for i in range(4)])


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_autocast_takes_effect(precision: str, dtype: torch.dtype) -> None:
    engine, model = _engine(precision)
    assert model(_batch()["input_ids"]).dtype == dtype
    assert (engine.state.precision.grad_scaler is not None) == (precision == "fp16")  # type: ignore[union-attr]


def test_fp16_skips_an_overflow_step_and_lowers_the_scale() -> None:
    engine, model = _engine("fp16")
    state = engine.state
    assert (
        state is not None
        and state.precision.grad_scaler is not None
        and state.lr_scheduler is not None
    )

    engine.backward(lm_loss(model, _batch())["loss"])
    first = engine.step()
    assert first is not None and not first.skipped
    scale = state.precision.grad_scaler.get_scale()
    before = {k: v.clone() for k, v in state.unwrapped_model.state_dict().items()}
    schedule_position = state.lr_scheduler.last_epoch

    engine.backward(lm_loss(model, _batch())["loss"] * 1e30)  # overflows fp16 in backward
    overflow = engine.step()
    assert overflow is not None and overflow.skipped
    assert state.precision.grad_scaler.get_scale() == scale / 2
    after = state.unwrapped_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed weights"
    assert state.lr_scheduler.last_epoch == schedule_position

    engine.backward(lm_loss(model, _batch())["loss"])
    recovered = engine.step()
    assert recovered is not None and not recovered.skipped
    assert not torch.equal(before["head.weight"], state.unwrapped_model.state_dict()["head.weight"])


def test_fp16_and_bf16_follow_the_fp32_loss_curve(tmp_path: Path) -> None:
    curves = {}
    for name, flags in {
        "fp32": [],
        "fp16": ["--mixed-precision"],
        "bf16": ["--precision", "bf16"],
    }.items():
        save = tmp_path / name
        tiny_trainer(
            "--train-iters", "10", "--micro-batch-size", "8", "--save", str(save), *flags
        ).fit()
        curves[name] = read_losses(save)
    for name in ("fp16", "bf16"):
        worst = max(abs(curves[name][s] - curves["fp32"][s]) for s in curves["fp32"])
        assert worst <= TOLERANCE, f"{name}: {worst}"
        assert curves[name] != curves["fp32"]  # reduced precision really ran
