"""A data-loader worker that fails ends the loop with the worker's own error, in seconds,
through the loader compose() rebuilds (resumable sampler, same workers)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from rapidformer import RapidformerEngine, parse_args


class _Failing(Dataset):
    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> list[float]:
        if index == 37:
            if self.how == "raise":
                raise ValueError("sample 37 is unreadable")
            os._exit(1)  # the worker dies without a word
        # Plain values, not tensors: a tensor would travel as a shared file descriptor, which
        # the main process then fails to fetch from the dead worker (an EOFError racing with
        # torch's worker-death report).
        return [float(index)] * 4


def _as_lists(samples: list[list[float]]) -> list[list[float]]:
    return samples


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("raise", "sample 37 is unreadable"),
        ("die", r"DataLoader worker \(pid.* exited unexpectedly"),
    ],
)
def test_a_failing_worker_ends_the_loop_with_its_error(how: str, message: str) -> None:
    engine = RapidformerEngine(parse_args(["--micro-batch-size", "4", "--lr", "1e-3"]))
    loader = DataLoader(_Failing(how), batch_size=4, num_workers=1, collate_fn=_as_lists)
    state = engine.compose(torch.nn.Linear(4, 1), train_dataloader=loader)
    assert state.train_dataloader is not None and state.train_dataloader.num_workers == 1
    start = time.monotonic()
    with pytest.raises((ValueError, RuntimeError), match=message):
        for _ in state.train_dataloader:
            pass
    assert time.monotonic() - start < 30  # torch checks its workers every few seconds
    engine.close()
