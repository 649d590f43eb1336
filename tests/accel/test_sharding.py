"""Native model-state sharding (ZeRO-1/OSS, ZeRO-2/SDP, ZeRO-3/FSDP) on 2 gloo ranks: the
losses match the single-process fp32 run, and each rank holds the share of parameters,
gradients and optimizer state its mode promises, counted from the tensors it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.distributed.tensors import local_part
from rapidformer.testing import (
    MarkovLMDataset,
    lm_loss,
    pad_collate,
    run_distributed,
)
from tests.helpers.sharded_runs import TOLERANCE, reference_run, tiny_lm, train_tiny_lm

# stage -> which kinds of state are sharded (1/N per rank), the rest stay whole. Each stage
# is spelled one way here: the other spellings are aliases of the same typed value
# (tests/config/test_flags.py), which run the same code.
PROMISES = {
    "--oss-memory-optimization": {"optimizer"},
    "--sharding=zero2": {"optimizer", "gradients"},
    "--zero-3-memory-optimization": {"optimizer", "gradients", "parameters"},
}


@pytest.mark.distributed
@pytest.mark.parametrize("flag", list(PROMISES))
def test_two_rank_sharding_matches_single_process_and_holds_its_share(
    flag: str, tmp_path: Path
) -> None:
    reference = reference_run(tmp_path)
    out = tmp_path / "sharded"
    out.mkdir()
    run_distributed(train_tiny_lm, 2, flag, str(out))
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]

    for record in ranks:
        diffs = [abs(a - b) for a, b in zip(record["losses"], reference["losses"], strict=True)]
        assert max(diffs) <= TOLERANCE, diffs
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it trained

    full = reference["held"]
    # Between steps FSDP2 keeps only the shard of every parameter, ZeRO-2 included: its
    # promise (whole parameters) concerns forward and backward, checked below.
    at_rest = PROMISES[flag] | ({"parameters"} if "gradients" in PROMISES[flag] else set())
    for kind in ("parameters", "gradients", "optimizer"):
        held = [record["held"][kind] for record in ranks]
        if kind in at_rest:
            # The shards partition the state: together exactly the whole, each about half.
            assert sum(held) == full[kind], (kind, held, full[kind])
            assert max(held) <= 0.6 * full[kind], (kind, held, full[kind])
        else:
            assert held == [full[kind]] * 2, (kind, held, full[kind])
    # The report logged at start predicted exactly what each rank came to hold.
    expected = [[r["held"][k] for k in ("parameters", "gradients", "optimizer")] for r in ranks]
    assert [r["expected"] for r in ranks] == expected
    assert ranks[0]["ddp"] == [full["parameters"], full["gradients"], full["optimizer"]]
    # ZeRO-2 keeps the whole parameters from forward to the end of backward; ZeRO-3 gathers
    # only the running block, so only the root's own parameters (embeddings, head) are whole.
    in_forward = [record["held"]["parameters_in_forward"] for record in ranks]
    if "parameters" in PROMISES[flag]:
        assert max(in_forward) < 0.8 * full["parameters"]
    else:
        assert in_forward == [full["parameters"]] * 2
    name = {"oss": "ZeroRedundancyOptimizer", "sdp": "reshard_after_forward=False"}
    plan = "\n".join(ranks[0]["plan"])
    if "optimizer" in PROMISES[flag] and "gradients" not in PROMISES[flag]:
        assert name["oss"] in plan
    elif "parameters" not in PROMISES[flag]:
        assert name["sdp"] in plan
    else:
        assert "reshard_after_forward=True" in plan


def _train_with(flag: str, out: str, extra: dict[str, Any]) -> None:
    train_tiny_lm(flag, out, **extra)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("flag", "extra", "tolerance", "plan_text"),
    [
        ("--zero-3-memory-optimization", {"cpu_offload": True}, TOLERANCE, "CPUOffloadPolicy"),
        ("--zero-2-memory-optimization", {"precision": "bf16"}, 2e-3, "MixedPrecisionPolicy bf16"),
        ("--zero-3-memory-optimization", {"hf": True}, TOLERANCE, "2 units x GPT2Block + root"),
        ("--fsdp-memory-optimization", {"user_optimizer": True}, TOLERANCE, "user-supplied"),
    ],
)
def test_cpu_offload_mixed_precision_and_hugging_face_models_under_fsdp2(
    flag: str, extra: dict[str, Any], tolerance: float, plan_text: str, tmp_path: Path
) -> None:
    same_model = {k: v for k, v in extra.items() if k in ("hf", "user_optimizer")}
    reference = reference_run(tmp_path, **same_model)
    out = tmp_path / "sharded"
    out.mkdir()
    run_distributed(_train_with, 2, flag, str(out), extra)
    record = json.loads((out / "rank_0.json").read_text())
    diffs = [abs(a - b) for a, b in zip(record["losses"], reference["losses"], strict=True)]
    assert max(diffs) <= tolerance, diffs  # bf16 compute: close to fp32, not equal
    assert plan_text in "\n".join(record["plan"])


def _fp16_overflow_on_one_rank(out: str) -> None:
    """ZeRO-2 in fp16 on 2 ranks; in step 2 only rank 1's gradient shard holds an inf."""
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    options = {"micro_batch_size": 4, "lr": 1e-3, "zero_2_memory_optimization": True}
    engine = RapidformerEngine(
        RapidformerConfig.from_dict({**options, "precision": "fp16"}), builds_optimizer=True
    )
    state = engine.compose(tiny_lm())
    rank = engine.env.rank
    assert state.precision.grad_scaler is not None
    dataset = MarkovLMDataset(8, vocab_size=64, seed=5)
    batch = pad_collate([dataset[rank * 4 + i] for i in range(4)])

    def shards() -> list[torch.Tensor]:
        return [
            p.to_local().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
            for p in state.model.parameters()
        ]

    engine.backward(lm_loss(state.model, batch)["loss"])
    assert engine.step() is not None
    scale, before = state.precision.grad_scaler.get_scale(), shards()
    engine.backward(lm_loss(state.model, batch)["loss"])
    if rank == 1:  # an overflow only this rank can see: its own shard of one gradient
        grad = next(p.grad for p in state.model.parameters() if p.grad is not None)
        local_part(grad).view(-1)[0] = float("inf")
    result = engine.step()
    assert result is not None
    unchanged = all(torch.equal(a, b) for a, b in zip(before, shards(), strict=True))
    record = {"skipped": result.skipped, "unchanged": unchanged, "scale": scale}
    record["scale_after"] = state.precision.grad_scaler.get_scale()
    (Path(out) / f"rank_{rank}.json").write_text(json.dumps(record))
    engine.close()


@pytest.mark.distributed
def test_fp16_overflow_seen_by_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    # Each rank checks only its own gradient shards; without the all-reduce of the scaler's
    # found-inf, rank 0 would step and rank 1 would not, and their parameters would diverge.
    run_distributed(_fp16_overflow_on_one_rank, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    for record in ranks:
        assert record["skipped"] and record["unchanged"], record
        assert record["scale_after"] == record["scale"] / 2, record
