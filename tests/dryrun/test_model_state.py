"""The dry run's model state is the real run's memory report, to the byte, on every rank.

Each layout runs for real on 1, 2 and 4 CPU ranks (one launch per world size, the layouts one
after another in it): the engine composes a small GPT and each rank records what its memory
report counts (``stepper.expected_bytes``, the figures ``model state on rank 0: ...`` logs).
The dry run of the same config, in this process on a fake process group, must give every rank
the same parameters, gradients and optimizer-state bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.dryrun import Workload, dry_run
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.templates.families.gpt import GPTFamily
from rapidformer.testing import run_distributed

SHAPE = GPTConfig(
    vocab_size=250, num_layers=4, hidden_size=64, num_attention_heads=4, max_position_embeddings=32
)
BASE: dict[str, Any] = {
    "lr": 1e-3,
    "micro_batch_size": 2,
    "seq_length": 32,
    "hidden_size": 64,
    "num_layers": 4,
    "train_iters": 10,
}
ZERO = {f"zero{s}": {f"zero_{s}_memory_optimization": True} for s in (1, 2, 3)}
MOE = {"num_experts": 4, "moe_router_topk": 2}
LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    1: {"one process": {}},
    2: {
        "ddp": {},
        **ZERO,
        "tp2": {"tensor_model_parallel_size": 2},
        "pp2": {"pipeline_model_parallel_size": 2},
        "ep2": {**MOE, "expert_model_parallel_size": 2},
    },
    4: {
        "ddp": {},
        **ZERO,
        "tp2 x dp2": {"tensor_model_parallel_size": 2},
        "pp2 x dp2 + zero1": {"pipeline_model_parallel_size": 2, **ZERO["zero1"]},
        "ep2 x dp4 + zero1": {**MOE, "expert_model_parallel_size": 2, **ZERO["zero1"]},
        "tp2 x pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    },
}


def _config(world: int, options: dict[str, Any]) -> RapidformerConfig:
    return RapidformerConfig.from_dict({**BASE, "global_batch_size": 4 * world, **options})


def _build() -> GPTModel:
    return GPTModel.build(SHAPE, "meta")


def _workload(config: RapidformerConfig) -> Workload:
    family = GPTFamily()
    return Workload(
        build=_build,
        batch=family.example_batch(config.data.micro_batch_size, 32, "meta"),
        inputs=family.inputs,
        loss=family.loss,
        hidden_size=SHAPE.hidden_size,
        seq_length=32,
    )


def _report_bytes(world: int, out: str) -> None:
    """Every layout of ``world`` composed for real: each rank's memory report, to a file."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo")  # shared by the layouts' engines
    rank = dist.get_rank() if world > 1 else 0
    found = {}
    for name, options in LAYOUTS[world].items():
        engine = RapidformerEngine(_config(world, options), builds_optimizer=True)
        state = engine.compose(_build())
        held, _ = state.stepper.expected_bytes(state)
        found[name] = [held.parameters, held.gradients, held.optimizer]
        engine.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_dry_run_counts_what_the_memory_report_counts(world: int, tmp_path: Path) -> None:
    if world == 1:
        _report_bytes(1, str(tmp_path))
    else:
        run_distributed(_report_bytes, world, world, str(tmp_path))
    real = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name, options in LAYOUTS[world].items():
        config = _config(world, options)
        report = dry_run(config, world, _workload(config), "test GPT")
        simulated = {r.rank: r.state for r in report.ranks}
        assert sorted(simulated) == list(range(world)), name
        for rank in range(world):
            state = simulated[rank]
            got = [state.parameters, state.gradients, state.optimizer]
            assert got == real[rank][name], f"{name}, rank {rank}: {got} != {real[rank][name]}"
        # The layouts differ, so equal bytes are not an accident of one formula.
        if options:
            assert (
                report.ranks[0].state
                != dry_run(_config(world, {}), world, _workload(config), "test GPT").ranks[0].state
            ), name
