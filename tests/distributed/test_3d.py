"""Tensor and pipeline parallelism (3D) against the one-process fp32 run.

Every layout trains the built-in GPT for 10 steps of 4 micro-batches with uneven token counts,
clipping on, and must reproduce the one-process losses within 1e-5: tensor parallelism (with
and without sequence parallelism), each pipeline schedule, their product, and their
compositions with ZeRO-1, ZeRO-2 and FSDP. One launch per rank count runs all of its layouts.
A checkpoint written by tp2 x pp2 resumes on one process, on dp2 and on pp2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer.accel.compile import apply as compile_apply
from rapidformer.testing import run_distributed
from tests.helpers.parity import PARITY, train_gpt

TWO_RANKS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sequence_parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2_1F1B": {"pipeline_model_parallel_size": 2},
    "pp2_GPipe": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "GPipe"},
    "pp2_Interleaved1F1B": {
        "pipeline_model_parallel_size": 2,
        "pipeline_schedule": "Interleaved1F1B",
    },
    "pp2_ZBV": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "ZBV"},
    "tp2_checkpointing": {"tensor_model_parallel_size": 2, "checkpoint_activations": True},
    "pp2_checkpointing": {"pipeline_model_parallel_size": 2, "checkpoint_activations": True},
    "tp2_compile": {"tensor_model_parallel_size": 2, "torch_compile": True},
    "pp2_compile": {"pipeline_model_parallel_size": 2, "torch_compile": True},
}
RAGGED = {"pp2_1F1B_ragged": {"pipeline_model_parallel_size": 2}}
"""Micro-batches of different lengths in one step (the dynamic-shape iterator's batches)."""
AGAINST = {
    # name: (layout, the one-process run it must match, tolerance)
    "tp2_lamb": ({"tensor_model_parallel_size": 2, "optimizers": "apex_lamb"}, "lamb", PARITY),
    "pp2_lamb": ({"pipeline_model_parallel_size": 2, "optimizers": "apex_lamb"}, "lamb", PARITY),
    # Reduced precision: other shapes round differently; bounded, not exact.
    "tp2_fp16": ({"tensor_model_parallel_size": 2, "precision": "fp16"}, "fp16", 2e-3),
    "pp2_fp16": ({"pipeline_model_parallel_size": 2, "precision": "fp16"}, "fp16", 2e-3),
    "pp2_bf16": ({"pipeline_model_parallel_size": 2, "precision": "bf16"}, "bf16", 2e-2),
}
REFERENCES = {
    "lamb": {"optimizers": "apex_lamb"},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
}
FOUR_RANKS: dict[str, dict[str, Any]] = {
    "tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "dp2_tp2_zero1": {"tensor_model_parallel_size": 2, "zero_1_memory_optimization": True},
    "dp2_pp2_zero2": {"pipeline_model_parallel_size": 2, "zero_2_memory_optimization": True},
    "dp2_pp2_fsdp": {"pipeline_model_parallel_size": 2, "fsdp_memory_optimization": True},
}
RESUME_FROM = "tp2_pp2"
RESUMED_ON = {
    "dp2": {},
    "pp2": {"pipeline_model_parallel_size": 2},
}
SAVE_AT = 5


def _write(out: Path, name: str, result: dict[str, Any]) -> None:
    (out / f"{name}_rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def _four(out: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    for name, layout in FOUR_RANKS.items():
        save = (checkpoint, SAVE_AT) if name == RESUME_FROM else None
        _write(Path(out), name, train_gpt(layout, save=save))


def _overflow_on_the_last_stage(state: Any, index: int) -> None:
    """At step 2, make one gradient of the last stage inf (only on that rank)."""
    if index == 2 and state.mesh.dims.pp_rank == 1:
        param = state.parameters[-1]
        handle = param.register_hook(lambda grad: grad * float("inf"))
        state.forward_backward._overflow_hook = handle  # removed after this step
    elif index == 3 and hasattr(state.forward_backward, "_overflow_hook"):
        state.forward_backward._overflow_hook.remove()


def _two(out: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    # Compile composes with tensor and pipeline parallelism through dynamo's graphs and AOT
    # autograd's split; inductor's kernels are checked against eager on one process
    # (tests/accel/compile), since a cold C++ build on each rank costs a minute here.
    compile_apply.BACKEND = "aot_eager"
    for name, layout in TWO_RANKS.items():
        _write(Path(out), name, train_gpt(layout))
    for name, layout in RAGGED.items():
        _write(Path(out), name, train_gpt(layout, ragged=True))
    for name, (layout, _, _) in AGAINST.items():
        _write(Path(out), name, train_gpt(layout))
    overflow = {"pipeline_model_parallel_size": 2, "precision": "fp16"}
    _write(
        Path(out),
        "pp2_fp16_overflow",
        train_gpt(overflow, steps=4, before_step=_overflow_on_the_last_stage),
    )
    for name, layout in RESUMED_ON.items():
        _write(Path(out), f"resumed_{name}", train_gpt(layout, load=checkpoint))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every layout's results per rank (one launch per rank count), the one-process
    reference, and the one-process resume."""
    out = tmp_path_factory.mktemp("3d")
    checkpoint = str(out / "checkpoint")
    run_distributed(_four, 4, str(out), checkpoint)
    run_distributed(_two, 2, str(out), checkpoint)
    results: dict[str, Any] = {}
    for file in out.glob("*_rank*.json"):
        name, rank = file.stem.rsplit("_rank", 1)
        results.setdefault(name, {})[int(rank)] = json.loads(file.read_text())
    results["reference"] = {0: train_gpt({})}
    for name, layout in REFERENCES.items():
        results[f"reference_{name}"] = {0: train_gpt(layout)}
    results["resumed_one_process"] = {0: train_gpt({}, load=checkpoint)}
    return results


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS, *RAGGED])
def test_layout_matches_the_one_process_run(runs: dict[str, Any], name: str) -> None:
    reference = runs["reference"][0]
    for rank, run in runs[name].items():
        # Every rank reports the step's loss (the pipeline's last stage shares it).
        assert _max_diff(run["losses"], reference["losses"]) <= PARITY, (name, rank)
        assert _max_diff(run["norms"], reference["norms"]) <= 1e-4, (name, rank)
    assert reference["norms"][0] > 0.05  # clipping acted on every step


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(AGAINST))
def test_composition_matches_its_one_process_run(runs: dict[str, Any], name: str) -> None:
    _, against, tolerance = AGAINST[name]
    reference = runs[f"reference_{against}"][0]
    for rank, run in runs[name].items():
        assert _max_diff(run["losses"], reference["losses"]) <= tolerance, (name, rank)


@pytest.mark.distributed
def test_an_fp16_overflow_on_one_stage_skips_the_step_everywhere(runs: dict[str, Any]) -> None:
    first, last = runs["pp2_fp16_overflow"][0], runs["pp2_fp16_overflow"][1]
    # Only the last stage saw inf, yet both skip step 2 (and only it).
    assert first["skipped"] == last["skipped"] == [False, False, True, False]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["resumed_one_process", *(f"resumed_{n}" for n in RESUMED_ON)])
def test_a_checkpoint_resumes_on_another_layout(runs: dict[str, Any], name: str) -> None:
    reference = runs["reference"][0]["losses"][SAVE_AT:]
    for rank, run in runs[name].items():
        assert _max_diff(run["losses"], reference) <= PARITY, (name, rank)


@pytest.mark.distributed
def test_tensor_parallel_halves_every_sharded_layer(runs: dict[str, Any]) -> None:
    held = runs["tp2"][0]["held"]
    sharded = [n for n in held if n.endswith(("proj.weight", "fc1.weight", "fc2.weight"))]
    sharded += ["token_embeddings.weight", "blocks.0.ffn.fc1.bias"]
    for name in sharded:
        whole, param, grad, moment = held[name]
        assert (param, grad, moment) == (whole // 2,) * 3, name
    whole, param, grad, moment = held["blocks.0.attention_norm.weight"]
    assert (param, grad, moment) == (whole,) * 3  # LayerNorms stay replicated
    # Sequence parallelism changes activations, not what parameters each rank holds.
    assert runs["tp2_sequence_parallel"][0]["held"]["blocks.0.ffn.fc2.weight"][1] == (
        held["blocks.0.ffn.fc2.weight"][0] // 2
    )


@pytest.mark.distributed
def test_a_pipeline_stage_holds_its_layers_only(runs: dict[str, Any]) -> None:
    first, last = (set(runs["pp2_1F1B"][r]["held"]) for r in (0, 1))
    layers = {n.split(".")[1] for n in first if n.startswith("blocks.")}
    assert layers == {"0", "1"} and "token_embeddings.weight" in first
    assert not any(n.startswith(("blocks.2", "blocks.3", "lm_head")) for n in first)
    assert {n.split(".")[1] for n in last if n.startswith("blocks.")} == {"2", "3"}
    assert "lm_head.weight" in last and "token_embeddings.weight" not in last
    # ZBV folds the stages into a V: rank 0 holds the first and the last stage.
    zbv = set(runs["pp2_ZBV"][0]["held"])
    assert {"token_embeddings.weight", "lm_head.weight"} <= zbv


@pytest.mark.distributed
def test_the_plan_shows_axes_stages_schedule_and_bubble(runs: dict[str, Any]) -> None:
    plan = " ".join(runs["pp2_1F1B"][0]["plan"])
    assert "2 ranks x 1 virtual = 2 stages" in plan
    assert "pp rank 0: stage 0: embedding + layers 0-1" in plan
    assert "pp rank 1: stage 1: layers 2-3 + head" in plan
    assert "bubble 20.0% ((p-1)/(m+p-1))" in plan  # p 2, m 4: 1/5
    interleaved = " ".join(runs["pp2_Interleaved1F1B"][0]["plan"])
    assert "bubble 11.1% ((p-1)/(v*m+p-1), v=2)" in interleaved  # 1/9
    tp = " ".join(runs["tp2_sequence_parallel"][0]["plan"])
    assert "vocab-parallel loss" in tp and "sequence parallel" in tp
    # This rank's model state next to the whole model's: a pp stage holds about half.
    memory = runs["pp2_1F1B"][0]["memory"]
    assert "(the whole, unsplit model)" in memory
    ratio = float(memory.split("parameters ")[1].split("(")[1].split("x")[0])
    assert 0.4 < ratio < 0.65, memory


def _eight(out: str) -> None:
    torch.set_num_threads(1)
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    _write(Path(out), "dp2_tp2_pp2", train_gpt(layout))
    _write(
        Path(out), "dp2_tp2_pp2_zero1", train_gpt({**layout, "zero_1_memory_optimization": True})
    )


@pytest.mark.distributed
def test_dp2_tp2_pp2_on_eight_ranks_matches_the_one_process_run(tmp_path: Path) -> None:
    run_distributed(_eight, 8, str(tmp_path))
    reference = train_gpt({})
    for name in ("dp2_tp2_pp2", "dp2_tp2_pp2_zero1"):
        for rank in range(8):
            run = json.loads((tmp_path / f"{name}_rank{rank}.json").read_text())
            assert _max_diff(run["losses"], reference["losses"]) <= PARITY, (name, rank)
