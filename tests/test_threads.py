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


def test_the_plan_states_the_threads(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--train-iters", "1"]) == 0
    )
    hardware = next(line for line in capsys.readouterr().err.splitlines() if "hardware:" in line)
    assert "1 CPU thread per rank (set by the program" in hardware  # conftest's one thread
