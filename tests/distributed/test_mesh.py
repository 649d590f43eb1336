"""The device mesh and its groups, and the bug they fix: with a tensor-parallel axis, counts
and gradients reduce over the data-parallel ranks only (a world-group sum doubled the step's
token count at tp=2 and silently halved the gradients)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.distributed import ParallelDims, ParallelMesh
from rapidformer.step_io import StepFunctions
from rapidformer.testing import lm_loss, lm_tokens, pad_collate, run_distributed
from tests.helpers.gradients import TOLERANCE, max_difference, tiny_lm, uneven_samples
from tests.helpers.steppers import RecordingGradients


def test_ranks_are_laid_out_pipeline_outermost_tensor_innermost() -> None:
    layout = [
        (d.pp_rank, d.dp_rank, d.tp_rank)
        for d in (ParallelDims(world_size=8, tp=2, pp=2, rank=r) for r in range(8))
    ]
    assert layout == [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    dims = ParallelDims(world_size=8, tp=2, pp=2, ep=2)
    assert (dims.dp, dims.axes) == (2, {"dp": 2, "tp": 2, "pp": 2, "ep": 2})
    assert dims.accumulation_steps(2, 16) == 4 and dims.global_batch_size(2, None) == 4
    assert ParallelDims(world_size=6, tp=4).problems() == [
        "tp 4 x pp 1 does not divide the world size 6"
    ]
    assert ParallelDims(world_size=6, ep=4).problems() == [
        "ep 4 does not divide the data-parallel degree 6"
    ]
    one = ParallelMesh.build(ParallelDims(world_size=1), "cpu")
    assert one.device_mesh is None and one.group("dp") is None and one.group("world") is None


def _step_of_eight(tp: int) -> dict[str, Any]:
    """One step of micro 2 x accumulation 2 per data-parallel rank over 8 uneven samples; the
    model replicated on the tp axis (tp's forward is not needed to see where counts reduce)."""
    config = RapidformerConfig.from_dict(
        {"micro_batch_size": 2, "global_batch_size": 8, "clip_grad": 0.0}
    )
    if tp > 1:
        config = config.replace(tensor_model_parallel_size=tp)
    engine = RapidformerEngine(config)
    model = tiny_lm()
    model.tp_plan = {}  # an empty plan: the model stays replicated on the tp axis
    state = engine.compose(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    recording = RecordingGradients(state)
    state.stepper = recording
    dims = engine.dims
    mine = uneven_samples()[dims.dp_rank :: dims.dp]  # tp peers read the same samples
    batches = [pad_collate(mine[i : i + 2]) for i in range(0, len(mine), 2)]
    step = StepFunctions(train_step=lambda b: lm_loss(state.model, b)["loss"], weight=lm_tokens)
    result = engine.run_step(batches, step)
    return {"weight": result.weight, "loss": result.loss, "grads": recording.grads}


def _groups(dims: ParallelDims) -> dict[str, list[int]]:
    mesh = ParallelMesh.build(dims, "cpu")
    axes = ("dp", "tp", "pp", "ep", "edp")
    groups = {axis: mesh.group(axis) for axis in axes}  # type: ignore[arg-type]
    return {
        axis: dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        for axis, group in groups.items()
    }


def _four_ranks(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    result = _step_of_eight(tp=2)
    torch.save(result, Path(out) / f"tp_{rank}.pt")
    meshes = {
        "tp2": _groups(ParallelDims(world_size=4, tp=2, rank=rank)),
        "ep2": _groups(ParallelDims(world_size=4, ep=2, rank=rank)),
        "tp2_ep2": _groups(ParallelDims(world_size=4, tp=2, ep=2, rank=rank)),
    }
    (Path(out) / f"groups_{rank}.json").write_text(json.dumps(meshes))


def _two_ranks(out: str) -> None:
    torch.set_num_threads(1)
    torch.save(_step_of_eight(tp=1), Path(out) / f"dp_{os.environ['RANK']}.pt")


@pytest.mark.distributed
def test_a_tensor_parallel_axis_does_not_change_counts_or_gradients(tmp_path: Path) -> None:
    run_distributed(_four_ranks, 4, str(tmp_path))
    run_distributed(_two_ranks, 2, str(tmp_path))
    tokens = sum(int(lm_tokens(pad_collate([s]))) for s in uneven_samples())
    pure = torch.load(tmp_path / "dp_0.pt")
    assert pure["weight"] == tokens
    for rank in range(4):
        run = torch.load(tmp_path / f"tp_{rank}.pt")
        # A world-group sum would count each token twice (tp peers hold the same samples).
        assert run["weight"] == tokens, (rank, run["weight"], tokens)
        assert abs(run["loss"] - pure["loss"]) <= 1e-6
        assert max_difference(run["grads"], pure["grads"]) <= TOLERANCE
    groups = [json.loads((tmp_path / f"groups_{r}.json").read_text()) for r in range(4)]
    # tp innermost: neighbours share a tp group; dp strides over them.
    assert [g["tp2"]["tp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["tp2"]["dp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # Experts: ep is the inner part of dp, edp its outer part, dp the two flattened.
    assert [g["ep2"]["ep"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["ep2"]["edp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["ep2"]["dp"] for g in groups] == [[0, 1, 2, 3]] * 4
    # dp 2 = ep 2: every data-parallel rank holds other experts, so dp's group is ep's.
    assert [g["tp2_ep2"]["dp"] for g in groups] == [g["tp2_ep2"]["ep"] for g in groups]
    assert [g["tp2_ep2"]["dp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
