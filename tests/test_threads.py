"""Each rank gets its share of the machine's cores unless a thread count was chosen already,
and says which (the plan's hardware line)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rapidformer.cli import main
from rapidformer.config.env import LaunchEnv
from rapidformer.threads import choose_threads, cores
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS


@pytest.fixture
def torch_default() -> Iterator[None]:
    """torch's start-up state: a thread per core."""
    before = torch.get_num_threads()
    torch.set_num_threads(cores())
    yield
    torch.set_num_threads(before)


def _env(local: int, omp: int | None = None) -> LaunchEnv:
    return LaunchEnv(rank=0, local_rank=0, world_size=local, local_world_size=local,
                     omp_num_threads=omp)  # fmt: skip


def test_ranks_on_one_machine_share_its_cores(torch_default: None) -> None:
    for local in (1, 2, 4):
        torch.set_num_threads(cores())
        choice = choose_threads(_env(local))
        expected = max(1, cores() // local)
        assert choice.threads == torch.get_num_threads() == expected
        assert f"{cores()} cores / {local} rank" in str(choice)


def test_a_count_chosen_already_is_kept(torch_default: None) -> None:
    choice = choose_threads(_env(2, omp=1))  # torchrun's, or the user's
    assert (choice.threads, choice.why) == (cores(), "OMP_NUM_THREADS")
    torch.set_num_threads(1)  # the program's own
    choice = choose_threads(_env(1))
    assert choice.threads == 1 and "torch.set_num_threads" in choice.why


def test_the_plan_states_the_threads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # CI may set it: then it would win
    assert (
        main(["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--train-iters", "1"]) == 0
    )
    hardware = next(line for line in capsys.readouterr().err.splitlines() if "hardware:" in line)
    assert "1 CPU thread per rank (set by the program" in hardware  # conftest's one thread


def test_torchs_count_per_physical_core_is_its_default_too(
    torch_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine with two hardware threads per core torch may start with one thread per
    physical core: that is its default, not the program's choice, and ranks share it."""
    monkeypatch.setattr("rapidformer.threads.cores", lambda: 2 * torch.get_num_threads())
    monkeypatch.setattr("rapidformer.threads.physical_cores", lambda: torch.get_num_threads())
    start = torch.get_num_threads()
    choice = choose_threads(_env(2))
    assert choice.threads == torch.get_num_threads() == max(1, start // 2)
    assert f"{start} cores / 2 ranks" in str(choice)


def test_ranks_per_machine_unknown_keeps_torchs_count(
    torch_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """srun or mpirun without torchrun's LOCAL_WORLD_SIZE: the share is unknown, so the count
    is left as torch set it and the plan says how to choose."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = LaunchEnv.read()
    assert env.local_world_size is None
    choice = choose_threads(env)
    assert choice.threads == torch.get_num_threads() == cores()
    assert "LOCAL_WORLD_SIZE" in choice.why and "OMP_NUM_THREADS" in choice.why
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")  # Slurm's count, where it says
    assert LaunchEnv.read().local_world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process is alone, whatever the allocation
    assert LaunchEnv.read().local_world_size == 1
