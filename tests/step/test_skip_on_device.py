"""A non-finite step is skipped on the device and moves nothing: a run with a NaN step ends
bitwise where the same run without that batch ends (parameters, optimizer state, learning
rate), in fp32, bf16 and fp16 (where the loss scale also halves). Optimizers or schedules that
cannot take the decision on the device read it on the host, and the plan says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.accel.optim.lamb import Lamb
from rapidformer.schedules import build_lr_scheduler
from rapidformer.state import TrainState
from rapidformer.step_io import StepFunctions
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate

STEPS = 8
POISONED = 3  # 1-based step whose micro-batches give a NaN loss


def _config(precision: str, **extra: Any) -> RapidformerConfig:
    return RapidformerConfig.from_dict(
        {
            "precision": precision,
            "lr": 1e-3,
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "lr_warmup_iters": 2,
            "lr_decay_style": "cosine",  # the LR differs at every step: a slip would show
            "log_interval": 1000,
            **extra,
        }
    )


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    data = MarkovLMDataset(STEPS * 8, seed=11)
    return [
        [pad_collate([data[(s * 2 + m) * 4 + i] for i in range(4)]) for m in range(2)]
        for s in range(STEPS)
    ]


def _train(precision: str, drop: bool, **extra: Any) -> TrainState:
    """STEPS steps with step POISONED's loss NaN, or (``drop``) without that step's batches;
    fp16's run without it halves the loss scale where the NaN step would have."""
    config = _config(precision, **extra)
    engine = RapidformerEngine(config, builds_optimizer=True)
    torch.manual_seed(0)
    state = engine.compose(
        TinyTransformerLM(), lr_scheduler_fn=lambda opt: build_lr_scheduler(opt, config, STEPS)
    )
    model = state.model

    def loss(batch: dict[str, Any]) -> torch.Tensor:
        value = lm_loss(model, batch)["loss"]
        return value * float("nan") if batch.get("poison") else value

    functions = StepFunctions(train_step=loss, weight=lambda b: (b["labels"] != -100).sum())
    for step, group in enumerate(_batches(), start=1):
        if step == POISONED:
            if drop:
                if state.precision.grad_scaler is not None:
                    state.precision.grad_scaler.update(state.precision.grad_scaler.get_scale() / 2)
                continue
            group = [{**batch, "poison": True} for batch in group]
        engine.run_step(group, functions)
    engine.judge_skipped_steps()
    engine.close()
    return state


def _optimizer_tensors(state: TrainState) -> list[torch.Tensor]:
    assert state.optimizer is not None
    return [
        value
        for param_state in state.optimizer.state.values()
        for value in param_state.values()
        if isinstance(value, torch.Tensor)
    ]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_nan_step_ends_bitwise_where_the_run_without_its_batch_ends(precision: str) -> None:
    poisoned, dropped = _train(precision, drop=False), _train(precision, drop=True)
    for a, b in zip(
        poisoned.unwrapped_model.parameters(), dropped.unwrapped_model.parameters(), strict=True
    ):
        assert torch.equal(a, b)
    moments_a, moments_b = _optimizer_tensors(poisoned), _optimizer_tensors(dropped)
    assert len(moments_a) == len(moments_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(moments_a, moments_b, strict=True))
    assert poisoned.optimizer is not None and dropped.optimizer is not None
    lrs = [
        (float(a["lr"]), float(b["lr"]))
        for a, b in zip(
            poisoned.optimizer.param_groups, dropped.optimizer.param_groups, strict=True
        )
    ]
    assert all(a == b for a, b in lrs), lrs
    assert poisoned.lr_scheduler is not None and dropped.lr_scheduler is not None
    assert poisoned.lr_scheduler.state_dict()["last_epoch"] == STEPS - 1
    if precision == "fp16":
        assert (
            poisoned.precision.grad_scaler is not None and dropped.precision.grad_scaler is not None
        )
        assert (
            poisoned.precision.grad_scaler.get_scale()
            == dropped.precision.grad_scaler.get_scale()
            == 2.0**15
        )


def test_lamb_skips_on_the_device_too() -> None:
    poisoned = _train("fp32", drop=False, optimizers="apex_lamb")
    dropped = _train("fp32", drop=True, optimizers="apex_lamb")
    assert isinstance(poisoned.optimizer, Lamb)
    assert any("on the device" in str(step) for step in poisoned.plan)
    for a, b in zip(
        poisoned.unwrapped_model.parameters(), dropped.unwrapped_model.parameters(), strict=True
    ):
        assert torch.equal(a, b)
    moments_a, moments_b = _optimizer_tensors(poisoned), _optimizer_tensors(dropped)
    assert all(torch.equal(a, b) for a, b in zip(moments_a, moments_b, strict=True))


def test_a_host_schedule_reads_the_decision_on_the_host_and_still_skips() -> None:
    config = _config("fp32")
    engine = RapidformerEngine(config, builds_optimizer=True)
    torch.manual_seed(0)
    state = engine.compose(
        TinyTransformerLM(),
        lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s),
    )
    plan = "\n".join(str(step) for step in state.plan)
    assert "step decision: on the host, one read per step (the LR scheduler LambdaLR" in plan
    model = state.model
    group = _batches()[0]
    before = [p.detach().clone() for p in model.parameters()]
    functions = StepFunctions(
        train_step=lambda b: lm_loss(model, b)["loss"] * float("nan"),
        weight=lambda b: (b["labels"] != -100).sum(),
    )
    result = engine.run_step(group, functions)
    assert result.skipped and result.lr == 1e-3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert state.lr_scheduler is not None and state.lr_scheduler.last_epoch == 0
    engine.close()
