"""ZeRO through the DeepSpeed engine (--zero-backend deepspeed) on 2 gloo ranks: stages 1, 2, 3
and ZeRO-Offload match the single-process fp32 run of the native engine, with the same uneven,
token-weighted micro-batches as the native sharding tests (counted before the forwards, so
nothing inside DeepSpeed is rescaled), and each rank holds the share of model state its stage
promises.

The 2-rank runs share two launches (:mod:`tests.helpers.grouped_launch`, fixture ``runs``):
a launch spends about 30 s spawning the ranks and importing torch, DeepSpeed and what
``deepspeed.initialize`` pulls in, and a run here trains for one to a few seconds. The first
launch runs everything that starts from scratch, the second resumes its checkpoints in new
processes (as a user resumes). They run in the background while each test waits for its own
run's files and checks them, so each test is still timed and reported on its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.grouped_launch import Case, Launches
from tests.helpers.sharded_runs import TOLERANCE, reference_run, train_tiny_lm

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

STAGES = {
    "--zero-1-memory-optimization": 1,
    "--zero-2-memory-optimization": 2,
    "--zero-3-memory-optimization": 3,
}

# case -> (flag, train_tiny_lm's extra options, loss tolerance against the fp32 reference)
PARITY: dict[str, tuple[str, dict[str, Any], float]] = {
    "zero1": ("--zero-1-memory-optimization", {}, TOLERANCE),
    "zero2": ("--zero-2-memory-optimization", {}, TOLERANCE),
    "zero3": ("--zero-3-memory-optimization", {}, TOLERANCE),
    "zero2-offload": ("--zero-2-memory-optimization", {"cpu_offload": True}, TOLERANCE),
    "zero3-offload": ("--zero-3-memory-optimization", {"cpu_offload": True}, TOLERANCE),
    # bf16 weights and activations against the fp32 reference (fp32 master weights).
    "zero2-bf16": ("--zero-2-memory-optimization", {"precision": "bf16"}, 5e-3),
    "zero3-ckpt": ("--zero-3-memory-optimization", {"checkpoint_activations": True}, TOLERANCE),
}

RUN = ("--train-iters", "10", "--global-batch-size", "8", "--micro-batch-size", "2")
DEEPSPEED = ("--zero-backend", "deepspeed")
RESUMED = ["--zero-2-memory-optimization", "--zero-3-memory-optimization"]
# 64 samples, global batch 24: two full steps and one of 16 samples per epoch, so the last
# step declares its boundary early and its micro-batches do not fill the accumulation.
EPOCHS = ("--epochs", "2", "--global-batch-size", "24", "--micro-batch-size", "2")


def _stage(flag: str) -> str:
    """A case name's part for a ZeRO flag: zero1, zero2, zero3."""
    return f"zero{STAGES[flag]}"


def _train_deepspeed(flag: str, out: str, extra: dict[str, Any]) -> None:
    train_tiny_lm(flag, out, zero_backend="deepspeed", **extra)


def _held_bytes(flag: str, out: str) -> None:
    """Two fp32 AdamW steps; this rank's bytes of each kind of model state, counted from the
    tensors DeepSpeed holds (gradients at the step boundary, the rest after the step)."""
    import torch

    from rapidformer import RapidformerConfig, RapidformerEngine
    from rapidformer.accel.deepspeed.state import held_state_bytes
    from tests.helpers.sharded_runs import tiny_lm

    torch.set_num_threads(1)
    options = {"micro_batch_size": 2, "lr": 1e-3, "zero_backend": "deepspeed"}
    options[flag.removeprefix("--").replace("-", "_")] = True
    engine = RapidformerEngine(RapidformerConfig.from_dict(options), builds_optimizer=True)
    state = engine.compose(tiny_lm())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(engine.env.rank))
    engine.backward(state.model(ids).float().pow(2).mean())
    gradients = held_state_bytes(state.model).gradients
    engine.step()
    after = held_state_bytes(state.model)
    full = sum(p.numel() * 4 for p in tiny_lm().parameters())
    record = [after.parameters, gradients, after.optimizer, full]
    (Path(out) / f"rank_{engine.env.rank}.json").write_text(json.dumps(record))
    engine.close()


def _fit(*flags: str) -> None:
    import torch

    from tests.helpers.trainers import tiny_trainer

    torch.set_num_threads(1)
    tiny_trainer(*flags).fit()


def _resume_expecting_error(out: str, *flags: str) -> None:
    import torch

    from rapidformer.errors import CheckpointError
    from tests.helpers.trainers import tiny_trainer

    torch.set_num_threads(1)
    trainer = tiny_trainer(*RUN, *DEEPSPEED, *flags)
    try:
        trainer.fit()
    except CheckpointError as error:
        Path(out, f"rank_{trainer.engine.env.rank}.txt").write_text(str(error))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launches]:
    """Every 2-rank run of this module, by case name, in two launches started here. The
    first runs everything that starts from scratch, in the order the tests read it:

    * a PARITY name: train_tiny_lm's rank_R.json of that configuration;
    * held-zeroN: _held_bytes's rank_R.json;
    * native: the 2-rank native ZeRO-1 run every resumed stage is compared with;
    * saved-zeroN: 10 steps at that stage, checkpointed at 5 and 10;
    * epochs: two epochs at ZeRO-2.

    The second resumes those checkpoints, in new processes as a user resumes:

    * resumed-zeroN: saved-zeroN resumed from step 5 to 10;
    * refused: rank R's CheckpointError (rank_R.txt) resuming saved-zero2 at stage 3.
    """
    root = tmp_path_factory.mktemp("deepspeed")
    fresh: dict[str, Case] = {
        name: (_train_deepspeed, (flag, str(root / name), extra))
        for name, (flag, extra, _) in PARITY.items()
    }
    for flag in STAGES:
        name = f"held-{_stage(flag)}"
        fresh[name] = (_held_bytes, (flag, str(root / name)))
    fresh["native"] = (_fit, (*RUN, "--zero-1-memory-optimization", "--save", str(root / "native")))
    for flag in RESUMED:
        name = f"saved-{_stage(flag)}"
        fresh[name] = (
            _fit,
            (*RUN, flag, *DEEPSPEED, "--save", str(root / name), "--save-interval", "5"),
        )
    fresh["epochs"] = (
        _fit,
        (*EPOCHS, "--zero-2-memory-optimization", *DEEPSPEED, "--save", str(root / "epochs")),
    )

    resumed: dict[str, Case] = {}
    for flag in RESUMED:
        name = f"resumed-{_stage(flag)}"
        load = ("--load", str(root / f"saved-{_stage(flag)}" / "iter_0000005"))
        resumed[name] = (_fit, (*RUN, flag, *DEEPSPEED, *load, "--save", str(root / name)))
    # Same ranks, another stage: refused before DeepSpeed reads a file. Last in its launch, so
    # that an error other than the expected one stops no other case.
    load = ("--load", str(root / "saved-zero2" / "iter_0000005"))
    again = ("--save", str(root / "again"))
    resumed["refused"] = (
        _resume_expecting_error,
        (str(root / "refused"), "--zero-3-memory-optimization", *load, *again),
    )
    launches = Launches(2, root, [fresh, resumed])
    yield launches
    launches.join()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The single-process fp32 run of the native engine: the same for every parity case
    (computed here while the ranks start)."""
    return reference_run(tmp_path_factory.mktemp("reference"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(PARITY))
def test_deepspeed_stages_match_the_single_processreference_run(
    case: str, runs: Launches, reference: dict[str, Any]
) -> None:
    flag, extra, tolerance = PARITY[case]
    out = runs.check(case)
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    for record in ranks:
        diffs = [abs(a - b) for a, b in zip(record["losses"], reference["losses"], strict=True)]
        assert max(diffs) <= tolerance, diffs
    plan = "\n".join(ranks[0]["plan"])
    assert f"ZeRO stage {STAGES[flag]}" in plan
    if extra.get("cpu_offload"):
        assert "ZeRO-Offload" in plan


# stage -> bytes per parameter per rank in fp32 at N ranks (DeepSpeed keeps a separate fp32
# master copy of its partition even when the model is fp32): (parameters, gradients, optimizer)
PER_PARAMETER = {
    1: lambda n: (4 + 4 / n, 4 / n, 8 / n),
    2: lambda n: (4 + 4 / n, 4 / n, 8 / n),
    3: lambda n: (8 / n, 4 / n, 8 / n),
}


@pytest.mark.distributed
@pytest.mark.parametrize("flag", list(STAGES))
def test_deepspeed_ranks_hold_their_stage_share(flag: str, runs: Launches) -> None:
    out = runs.check(f"held-{_stage(flag)}")
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    full = ranks[0][3]
    expected = PER_PARAMETER[STAGES[flag]](2)
    for kind, per_parameter in enumerate(expected):
        held = [record[kind] for record in ranks]
        # Partitions are padded to an alignment: within 1% of the formula.
        assert sum(held) == pytest.approx(2 * per_parameter * full / 4, rel=0.01), (kind, held)
        assert max(held) <= 0.55 * 2 * per_parameter * full / 4 + 64, (kind, held)


@pytest.mark.distributed
@pytest.mark.parametrize("flag", RESUMED)
def test_deepspeed_checkpoints_resume_exactly_and_export_in_one_process(
    flag: str, runs: Launches
) -> None:
    import torch

    from rapidformer.checkpoint import consolidated_model_state
    from tests.helpers.trainers import read_losses, tiny_trainer

    native, saved = runs.check("native"), runs.check(f"saved-{_stage(flag)}")
    resumed = runs.check(f"resumed-{_stage(flag)}")
    # DeepSpeed wrote its own partition files, one optimizer file per rank.
    files = sorted(p.name for p in (saved / "iter_0000005" / "deepspeed").iterdir())
    assert sum("optim_states" in name for name in files) == 2, files

    reference, before, after = read_losses(native), read_losses(saved), read_losses(resumed)
    assert max(abs(reference[s] - before[s]) for s in reference) <= TOLERANCE
    assert sorted(after) == list(range(6, 11))
    assert max(abs(before[s] - after[s]) for s in after) <= TOLERANCE
    # The partitions merge into the plain model in this process, equal to the native run's up
    # to Adam's amplification of rounding in near-zero gradients (seen: 1.8e-4 against weights
    # that moved ~3e-2 in 10 steps at lr 3e-3).
    merged = consolidated_model_state(saved / "iter_0000010")
    whole = torch.load(native / "iter_0000010" / "model.pt", weights_only=True)
    tiny_trainer(*RUN).build_model().load_state_dict(merged)
    assert max((merged[k] - whole[k]).abs().max().item() for k in whole) <= 1e-3


@pytest.mark.distributed
def test_deepspeed_checkpoint_refuses_another_rank_count_or_backend(
    runs: Launches, tmp_path: Path
) -> None:
    from rapidformer.errors import CheckpointError
    from tests.helpers.trainers import tiny_trainer

    # A ZeRO-2 checkpoint of 2 ranks, mid-run: the one the resume test resumes.
    flag = "--zero-2-memory-optimization"
    saved = runs.check("saved-zero2") / "iter_0000005"
    load = ("--load", str(saved), "--save", str(tmp_path / "again"))
    with pytest.raises(CheckpointError, match="partitions of 2 ranks and this run has 1"):
        tiny_trainer(*RUN, flag, *DEEPSPEED, *load).fit()
    with pytest.raises(CheckpointError, match="written by --zero-backend deepspeed"):
        tiny_trainer(*RUN, flag, *load).fit()
    # Same ranks, another stage: refused before DeepSpeed reads a file.
    refused = runs.check("refused")
    assert "stage 2 partitions and this run uses stage 3" in (refused / "rank_0.txt").read_text()


@pytest.mark.distributed
def test_deepspeed_epochs_with_a_short_last_step_match_one_native_process(
    runs: Launches, tmp_path: Path
) -> None:
    from tests.helpers.trainers import read_losses

    single = tmp_path / "single"
    _fit(*EPOCHS, "--save", str(single))
    reference, losses = read_losses(single), read_losses(runs.check("epochs"))
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    assert max(abs(reference[s] - losses[s]) for s in reference) <= TOLERANCE
