"""CUDA paths of whole runs: a checkpoint round trip, the dynamic-shape iterator, FSDP2 (the
ZeRO-3 engine) on a one-rank NCCL group, and the step that never waits for the device (counted
by ``torch.profiler``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from rapidformer.step_io import StepFunctions
from tests.helpers.gpu import batches, engine_for, lm_loss, max_difference, tiny_gpt, train
from tests.helpers.trainers import read_losses, tiny_trainer

RUN = ("--train-iters", "8", "--micro-batch-size", "4", "--global-batch-size", "8")
CUDA_REPEAT = 1e-5
"""A repeated CUDA computation is not bitwise: embedding and index backward accumulate with
atomics in a run-dependent order."""


def test_a_checkpoint_written_on_cuda_resumes_where_the_run_left_off(tmp_path: Path) -> None:
    full = tmp_path / "full"
    trainer = tiny_trainer(*RUN, "--save", str(full), "--save-interval", "4")
    trainer.fit()
    assert next(trainer.engine.state.model.parameters()).is_cuda  # type: ignore[union-attr]
    trainer.engine.close()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "iter_0000004", resumed / "iter_0000004")
    (resumed / "latest").write_text("iter_0000004\n")
    again = tiny_trainer(*RUN, "--save", str(resumed), "--save-interval", "4")
    again.fit()
    again.engine.close()
    expected, got = read_losses(full), read_losses(resumed)
    assert set(range(5, 9)) <= set(got)
    assert all(abs(got[s] - expected[s]) <= CUDA_REPEAT for s in range(5, 9)), (got, expected)
    final_a = torch.load(full / "iter_0000008" / "model.pt", map_location="cpu")
    final_b = torch.load(resumed / "iter_0000008" / "model.pt", map_location="cpu")
    assert all((final_a[k] - final_b[k]).abs().max() <= CUDA_REPEAT for k in final_a)


def test_the_dynamic_shape_iterator_on_cuda(tmp_path: Path) -> None:
    trainer = tiny_trainer(
        *("--train-iters", "30", "--micro-batch-size", "8"),
        *("--data-iterator", "dynamic-shape", "--save", str(tmp_path)),
    )
    trainer.fit()
    loader = trainer.engine.state.train_dataloader  # type: ignore[union-attr]
    assert loader is not None and loader.collate_fn.shapes_seen <= {8, 16, 24}
    losses = read_losses(tmp_path)
    assert losses[30] < losses[1] - 0.5
    trainer.engine.close()


@pytest.fixture
def one_rank_nccl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank NCCL process group the engine joins (as under torchrun with one worker)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp2_on_a_one_rank_nccl_group_trains_like_plain_and_skips_exactly(
    one_rank_nccl: None,
) -> None:
    """ZeRO-3's CUDA path on one GPU. With one data-parallel rank the flags shard nothing (the
    plan says so), so the model is sharded here with FSDP2 on a one-rank CUDA mesh: parameters
    and gradients become DTensors and every reduction runs through NCCL, through the engine's
    clipping and its on-device skip (fused AdamW over DTensors with ``found_inf``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference, engine, state = train({"zero_3_memory_optimization": True})
    assert dist.get_backend() == "nccl"
    assert any("nothing to shard" in str(p) for p in state.plan), state.plan
    engine.close()
    model = tiny_gpt().cuda()
    mesh = init_device_mesh("cuda", (1,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses, engine, state = train({}, model=model)
    assert isinstance(next(state.model.parameters()), DTensor)
    assert max_difference(losses, reference) <= 1e-5
    before = [p.full_tensor().clone() for p in state.model.parameters()]
    functions = StepFunctions(
        train_step=lambda ids: lm_loss(state.model, ids) * float("nan"),
        weight=lambda ids: ids.shape[0],
    )
    assert engine.run_step([batches(1)[0]], functions).skipped
    after = [p.full_tensor() for p in state.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    engine.close()


def test_no_sync_and_no_blocking_copy_between_two_log_steps() -> None:
    """Twenty steps between two reads, profiled: no ``cudaStreamSynchronize`` /
    ``cudaDeviceSynchronize`` and no device-to-host copy into pageable memory (a copy that
    blocks the host) come from the engine."""
    engine = engine_for(precision="bf16", log_interval=1000)
    state = engine.compose(tiny_gpt())
    functions = StepFunctions(
        train_step=lambda ids: lm_loss(state.model, ids), weight=lambda ids: ids.shape[0]
    )
    data = batches(22)
    for ids in data[:2]:  # warm-up: allocator, cuBLAS heuristics, first-step state
        engine.run_step([ids], functions)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as run:
        results = [engine.run_step([ids], functions) for ids in data[2:]]
    names = [event.name for event in run.events()]
    syncs = [n for n in names if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    blocking = [n for n in names if "DtoH" in n and "Pageable" in n]
    assert syncs == [] and blocking == [], (len(syncs), len(blocking))
    assert not any(r.skipped for r in results)  # read after the profile
    engine.close()
