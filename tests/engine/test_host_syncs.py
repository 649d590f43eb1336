"""No host sync inside a step: the loss, gradient norm and token counts stay on the device and
are read to the host once per --log-interval window. The only per-step read is the step
guard's agreed decision (skip a non-finite step, stop after a signal), which the step itself
needs.

Every tensor-to-host conversion that rapidformer's own code makes (``item``, ``tolist``,
``float()``, ``int()``, ``bool()``, ``cpu``, ``numpy``) is counted by patching those tensor
methods; on a GPU each would wait for the device to finish the queued work."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rapidformer
from rapidformer.engine import RapidformerEngine
from tests.conftest import tiny_trainer

PACKAGE = Path(rapidformer.__file__).parent
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
HOST_ONLY = {"data/samplers.py:_rank_indices"}
"""Reads of tensors that live on the host on any machine (the sampler's CPU permutation at the
start of each epoch): not a device sync."""


class HostReads:
    """Counts host reads made from rapidformer's code, by the step running when they happen."""

    def __init__(self) -> None:
        self.step = 0
        self.by_step: dict[int, Counter[str]] = {}

    def record(self) -> None:
        frame = sys._getframe(2)  # the caller of the patched method
        path = Path(frame.f_code.co_filename)
        where = (
            f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}" if PACKAGE in path.parents else ""
        )
        if where and where not in HOST_ONLY:
            self.by_step.setdefault(self.step, Counter())[where] += 1


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    reads = HostReads()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Callable = original) -> Any:
            reads.record()
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run_step = RapidformerEngine.run_step

    def numbered(engine: RapidformerEngine, *args: Any) -> Any:
        reads.step += 1  # reads from here to the next step's start belong to this step
        return run_step(engine, *args)

    monkeypatch.setattr(RapidformerEngine, "run_step", numbered)
    yield reads


def test_twenty_steps_read_the_host_only_for_the_guard_and_at_each_log(
    host_reads: HostReads, tmp_path: Path
) -> None:
    trainer = tiny_trainer(
        *("--train-iters", "20", "--log-interval", "10", "--eval-interval", "1000"),
        *("--global-batch-size", "8", "--micro-batch-size", "4"),  # 2 micro-batches a step
        *("--save", str(tmp_path / "run"), "--save-interval", "1000"),
    )
    metrics = trainer.fit()
    assert metrics["train_loss"] > 0
    # The guard's one read per step: the decision must be known before the optimizer steps.
    # One rank reads its own loss and norm; several read the agreed flags.
    guard = Counter({"reliability/guard.py:_local_flags": 1})
    for step in range(1, 21):
        reads = host_reads.by_step.get(step, Counter())
        if step in (10, 20):
            # The window's losses, last gradient norm and tokens in one copy (step 20 also
            # evaluates, saves and returns the final loss).
            assert reads["logging.py:_read"] == 1, (step, reads)
        else:
            assert reads == guard, (step, reads)
    print({step: dict(reads) for step, reads in sorted(host_reads.by_step.items())})
