"""No host sync inside a step: on one rank the engine reads nothing to the host in 20 steps
(fp32, bf16, fp16); the Trainer reads once per --log-interval window; several ranks read one
already-finished host copy per step (the agreed stop flag, one step late). See
tests/helpers/host_reads.py for what counts as a read."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.schedules import build_lr_scheduler
from rapidformer.step_io import StepFunctions
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from rapidformer.testing.launch import run_distributed
from tests.helpers.host_reads import counting_host_reads
from tests.helpers.trainers import tiny_trainer

STEPS = 20


def _engine_run(
    precision: str, steps: int = STEPS, **layout: bool
) -> tuple[RapidformerEngine, list[Any]]:
    """An engine over the tiny LM with the flags' schedule; 2 micro-batches per step."""
    config = RapidformerConfig.from_dict(
        {
            "precision": precision,
            "lr": 1e-3,
            "micro_batch_size": 4,
            "global_batch_size": 8 * _world(),
            "lr_warmup_iters": 3,
            "lr_decay_style": "cosine",
            "log_interval": 1000,  # no log read inside the counted steps
            **layout,
        }
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    torch.manual_seed(0)
    engine.compose(
        TinyTransformerLM(), lr_scheduler_fn=lambda opt: build_lr_scheduler(opt, config, steps)
    )
    data = MarkovLMDataset(steps * 8, seed=5)
    rank = engine.env.rank
    batches = [
        [pad_collate([data[(s * 2 + m) * 4 + i] for i in range(4)]) for m in range(2)]
        for s in range(steps)
    ]
    if rank:  # each rank its own share
        batches = batches[rank:] + batches[:rank]
    return engine, batches


def _world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _functions(engine: RapidformerEngine) -> StepFunctions:
    model = engine.state.model  # type: ignore[union-attr]
    return StepFunctions(
        train_step=lambda batch: lm_loss(model, batch)["loss"],
        weight=lambda batch: (batch["labels"] != -100).sum(),
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_twenty_steps_on_one_rank_read_nothing(precision: str) -> None:
    engine, batches = _engine_run(precision)
    assert any("on the device, no host sync" in str(step) for step in engine.state.plan)  # type: ignore[union-attr]
    functions = _functions(engine)
    with counting_host_reads() as reads:
        results = [engine.run_step(group, functions) for group in batches]
    assert reads.total() == 0, dict(reads.by_step)
    assert all(not r.skipped for r in results)  # read here, outside the counted steps
    assert results[-1].loss < results[0].loss
    engine.close()


def test_the_trainer_reads_once_per_log_window(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        *("--train-iters", "20", "--log-interval", "10", "--eval-interval", "1000"),
        *("--global-batch-size", "8", "--micro-batch-size", "4"),  # 2 micro-batches a step
        *("--save", str(tmp_path / "run"), "--save-interval", "1000"),
    )
    with counting_host_reads() as reads:
        metrics = trainer.fit()
    assert metrics["train_loss"] > 0
    for step in range(1, 21):
        if step == 10:
            # The window's losses, skip flags, LR, last gradient norm and tokens in one copy;
            # the guard's skip flags of the window in another.
            expected = {"trackers/metrics.py:_read": 1, "reliability/guard.py:judge_pending": 1}
            assert reads.of(step) == Counter(expected), reads.of(step)
        elif step != 20:  # step 20 also evaluates, saves and returns the final loss
            assert reads.of(step) == Counter(), (step, reads.of(step))
    print({step: dict(counts) for step, counts in sorted(reads.by_step.items())})


def _two_ranks(out: str, layout: str) -> None:
    torch.set_num_threads(1)
    engine, batches = _engine_run("fp32", **({layout: True} if layout else {}))
    assert any("on the device, no host sync" in str(p) for p in engine.state.plan)  # type: ignore[union-attr]
    rank = engine.env.rank
    signals = engine.watch_signals()  # as Trainer.fit does (without entering: no handlers)
    functions = _functions(engine)
    stops = []
    with counting_host_reads() as reads:
        for step, group in enumerate(batches, start=1):
            if step == 5 and rank == 1:
                signals.received = "SIGTERM"  # arrives on rank 1 only
            stops.append(engine.run_step(group, functions).stop_requested)
    record = {"reads": {s: dict(c) for s, c in reads.by_step.items()}, "stops": stops}
    (Path(out) / f"rank_{rank}.json").write_text(json.dumps(record))
    engine.close()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", ["", "zero_1_memory_optimization", "zero_3_memory_optimization"]
)  # DDP, ZeroRedundancyOptimizer (its inner optimizer skips), FSDP2 (DTensor parameters)
def test_two_ranks_read_one_finished_host_copy_per_step(layout: str, tmp_path: Path) -> None:
    run_distributed(_two_ranks, 2, str(tmp_path), layout)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        for step in range(2, STEPS + 1):
            # The stop flag agreed at the previous step, from its host copy: one read.
            assert record["reads"].get(str(step)) == {"reliability/guard.py:read_stop": 1}, (
                rank,
                step,
                record["reads"],
            )
        assert "1" not in record["reads"]  # nothing agreed before the first step
        # A signal received on rank 1 during step 5 stops both ranks after step 6.
        assert record["stops"].index(True) == 5, record["stops"]
