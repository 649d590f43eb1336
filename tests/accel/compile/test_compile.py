"""--torch-compile: the same losses as eager, a bounded number of compiled graphs under the
dynamic-shape iterator, and flags that need it refused without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.errors import ConfigError
from tests.helpers.trainers import read_losses, tiny_trainer

STEPS = 12
DYNAMIC = ["--train-iters", str(STEPS), "--micro-batch-size", "8", "--data-iterator"]


def test_compiled_blocks_match_eager_and_compile_once_per_bucket(tmp_path: Path) -> None:
    """One cold compile (~50 s on two cores). Checkpointing is on in the compiled run, so the
    canonical order (checkpoint, then compile) is exercised too; it does not change losses."""
    eager = tiny_trainer(*DYNAMIC, "dynamic-shape", "--save", str(tmp_path / "eager"))
    eager.fit()
    torch._dynamo.reset()
    counters.clear()
    cache = tmp_path / "inductor-cache"
    compiled = tiny_trainer(
        *DYNAMIC, "dynamic-shape", "--save", str(tmp_path / "compiled"),
        "--torch-compile", "--checkpoint-activations", "--torch-compile-cache-dir", str(cache),
    )  # fmt: skip
    compiled.fit()
    state = compiled.engine.state
    assert state is not None
    plan = [str(step) for step in state.plan]
    assert any(
        p.startswith("compile: torch.compile (inductor) (scope blocks (blocks: 2 x Block), mode")
        for p in plan
    )
    assert plan.index(next(p for p in plan if p.startswith("compile"))) == 1  # after checkpointing
    # Loss parity: measured max difference 6.4e-7 over 12 steps (inductor reorders reductions).
    eager_losses, compiled_losses = (
        read_losses(tmp_path / "eager"),
        read_losses(tmp_path / "compiled"),
    )
    assert eager_losses.keys() == compiled_losses.keys()
    assert max(abs(eager_losses[k] - compiled_losses[k]) for k in eager_losses) <= 1e-5
    # Bounded compiles: one graph per bucket length in training, and per bucket in evaluation
    # (a different dropout mode); measured 5 for 3 buckets over 12 + evaluation batches.
    loader = state.train_dataloader
    assert loader is not None
    shapes = len(loader.collate_fn.shapes_seen)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2 * shapes + 1 < STEPS, (graphs, shapes)
    # The run counted the same graphs itself, and nothing fell back to eager.
    assert compiled.engine.step_metrics() == {"compile_graphs": graphs, "compile_fallbacks": 0}
    assert any(cache.iterdir())  # inductor wrote its kernels where --torch-compile-cache-dir says
    torch._dynamo.reset()


def test_compile_options_need_the_switch_and_a_model_with_blocks() -> None:
    with pytest.raises(ConfigError) as error:
        RapidformerEngine(
            RapidformerConfig.from_dict(
                {"torch_compile_mode": "max-autotune", "torch_compile_cache_dir": "x"}
            )
        )
    assert "--torch-compile-mode='max-autotune': needs --torch-compile" in str(error.value)
    assert "--torch-compile-cache-dir='x': needs --torch-compile" in str(error.value)
    engine = RapidformerEngine(RapidformerConfig.from_dict({"torch_compile": True}))
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="found no transformer blocks in Linear to compile"):
        engine.compose(model, optimizer=torch.optim.SGD(model.parameters()))
