"""Every layout reads the same micro-batches: micro-step k of data-parallel rank r holds the
samples of one process's micro-step k*dp + r (fixed-shape and length-grouped orders), and a
position saved on one layout resumes after the same samples on another."""

from __future__ import annotations

import numpy as np
import pytest

from rapidformer.data.dynamic_shape import LengthGroupedSampler
from rapidformer.data.samplers import ResumableDistributedSampler, contiguous_share
from rapidformer.errors import CheckpointError
from rapidformer.templates.progress import consumed_here

LENGTHS = np.random.RandomState(0).randint(1, 200, size=1003)  # 1003: no layout divides it


def _sampler(kind: str, micro: int, rank: int, dp: int) -> ResumableDistributedSampler:
    if kind == "grouped":
        return LengthGroupedSampler(LENGTHS, micro, dp_rank=rank, dp_size=dp, seed=5)
    return ResumableDistributedSampler(
        len(LENGTHS), micro_batch_size=micro, dp_rank=rank, dp_size=dp, seed=5
    )


def _micro_batches(order: list[int], micro: int) -> list[list[int]]:
    return [order[i : i + micro] for i in range(0, len(order), micro)]


@pytest.mark.parametrize("kind", ["fixed", "grouped"])
@pytest.mark.parametrize(("micro", "dp"), [(4, 2), (3, 4), (2, 8)])
def test_rank_r_micro_step_k_is_one_process_micro_step_k_dp_plus_r(
    kind: str, micro: int, dp: int
) -> None:
    one = _micro_batches(list(_sampler(kind, micro, 0, 1)), micro)
    shares = [list(_sampler(kind, micro, rank, dp)) for rank in range(dp)]
    assert len({len(share) for share in shares}) == 1  # every rank runs as many steps
    assert len(shares[0]) == len(LENGTHS) // dp == len(_sampler(kind, micro, 0, dp))
    full_steps = len(LENGTHS) // (micro * dp)
    for rank, share in enumerate(shares):
        mine = _micro_batches(share, micro)
        for k in range(full_steps):
            assert mine[k] == one[k * dp + rank], (rank, k)
    # The epoch's tail: fewer than micro x dp samples, split evenly; under dp left out.
    used = sorted(i for share in shares for i in share)
    assert len(used) == len(set(used)) == len(LENGTHS) - len(LENGTHS) % dp


def test_one_micro_batch_per_rank_is_the_old_striding() -> None:
    # Micro-batches of 1: rank r takes positions r, r + dp, ... (what every layout used to get).
    assert contiguous_share(list(range(10)), 1, 1, 3) == [1, 4, 7]
    # Micro-batches of 2 on 3 ranks: chunks of 6; the tail 6..9 gives each rank one sample.
    assert [contiguous_share(list(range(10)), 2, r, 3) for r in range(3)] == [
        [0, 1, 6],
        [2, 3, 7],
        [4, 5, 8],
    ]


@pytest.mark.parametrize(
    ("kind", "saved", "resumed"),
    [
        ("fixed", (2, 2), (4, 1)),
        ("fixed", (4, 1), (1, 4)),
        ("fixed", (3, 4), (6, 2)),
        ("grouped", (2, 2), (2, 1)),  # length-grouped: the same micro-batch size, any dp
        ("grouped", (3, 1), (3, 4)),
    ],
)
def test_a_position_resumes_after_the_same_samples_on_another_layout(
    kind: str, saved: tuple[int, int], resumed: tuple[int, int]
) -> None:
    (micro, dp), (micro2, dp2) = saved, resumed
    consumed = 24 // (micro * dp)  # micro-batches per rank: 24 samples in all
    read = {i for r in range(dp) for i in list(_sampler(kind, micro, r, dp))[: consumed * micro]}
    position = {"consumed": consumed, "config": {"data": {"micro_batch_size": micro}}, "dp": dp}
    here = consumed_here(position, micro2, dp2, grouped=kind == "grouped")
    rest = []
    for rank in range(dp2):
        sampler = _sampler(kind, micro2, rank, dp2)
        sampler.set_position(0, here * micro2)
        rest.append(list(sampler))
    left = {i for share in rest for i in share}
    assert not read & left  # nothing read twice
    # Nothing skipped: what the two layouts read is the epoch less under dp2 samples.
    assert len(read) + len(left) == len(LENGTHS) - len(LENGTHS) % dp2
    # And from there on, micro-step k of rank r is the one process's micro-step k*dp2 + r.
    one = list(_sampler(kind, micro2, 0, 1))[24:]
    for rank, share in enumerate(rest):
        assert share[:micro2] == one[rank * micro2 : (rank + 1) * micro2]


def test_a_grouped_order_refuses_another_micro_batch_size_mid_epoch() -> None:
    position = {"consumed": 3, "config": {"data": {"micro_batch_size": 2}}, "dp": 2}
    assert consumed_here(position, 4, 1) == 3  # fixed shape: the same 12 samples
    with pytest.raises(CheckpointError, match="resume with --micro-batch-size 2"):
        consumed_here(position, 4, 1, grouped=True)
