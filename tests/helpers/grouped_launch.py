"""Many multi-rank runs in few launches, each still checked by its own test.

A 2-rank launch of a tiny DeepSpeed run costs about 30 s on two busy cores, nearly all of it
fixed: spawning the ranks and importing torch, DeepSpeed and rapidformer (~15 s), the
torch._dynamo and inductor that the first ``deepspeed.initialize`` pulls in (DeepSpeed's
optimizer check imports its Muon optimizer, which calls ``torch.compile``: ~7 s), and leaving
(~4 s). One run of these tests trains for one to a few seconds. :class:`Launches` pays the
fixed cost once per group of runs: both ranks run every case of a group in turn, in one
process group that outlives the engines (as in a notebook or a test session, see
``process_group.ensure_process_group``), and each case writes into its own directory. A run
computes the same there as alone in its launch (checked bitwise for the DeepSpeed cases).

The launches run in a background thread, one group after another (a later group may read
what an earlier one wrote), while the tests run: each test waits for its own case
(:meth:`Launches.check`), so a test's time is the wait for its case, not the whole group's.
A case that raises stops the launches (the other rank may be waiting in a collective for it);
the cases that finished keep their results, and the tests of the failed case and of those
that never ran fail with the error.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rapidformer.testing import run_distributed

Case = tuple[Callable[..., Any], tuple[Any, ...]]
"""A module-level function and its arguments, as :func:`run_distributed` takes them."""

_MARKS = ".marks"


def _run_cases(cases: dict[str, Case], marks: str) -> None:
    import torch

    from rapidformer.distributed import process_group

    torch.set_num_threads(1)
    # A group no engine owns: closing one case's engine leaves it up for the next case, and
    # the groups DeepSpeed caches on it stay valid. run_distributed tears it down at the end.
    process_group.ensure_process_group(torch.device("cpu"))
    rank = os.environ["RANK"]
    for name, (fn, args) in cases.items():
        start = time.perf_counter()
        try:
            fn(*args)
        except BaseException:
            Path(marks, f"{name}.rank_{rank}.failed").write_text(traceback.format_exc())
            raise
        # The seconds it took: where a group's time goes, for whoever regroups the cases.
        Path(marks, f"{name}.rank_{rank}.done").write_text(f"{time.perf_counter() - start:.2f}")


class Launches:
    """Groups of cases, each group one launch of ``world_size`` ranks, run one group after
    another in the background from construction on. Case ``name`` gets the empty directory
    ``root/name``, made here (its arguments name it): :meth:`check` waits for it."""

    def __init__(self, world_size: int, root: Path, groups: list[dict[str, Case]]) -> None:
        self.root, self.world_size = root, world_size
        self.names = [name for cases in groups for name in cases]
        assert len(set(self.names)) == len(self.names), self.names
        for name in self.names:
            (root / name).mkdir(parents=True)
        (root / _MARKS).mkdir()
        self.error = ""
        """Why the launches stopped early ("" while none did)."""
        self._thread = threading.Thread(target=self._run, args=(groups,), daemon=True)
        self._thread.start()

    def _run(self, groups: list[dict[str, Case]]) -> None:
        for cases in groups:
            try:
                run_distributed(_run_cases, self.world_size, cases, str(self.root / _MARKS))
            except Exception as exc:  # noqa: BLE001 -- the tests waiting for the cases say it
                self.error = f"{type(exc).__name__}: {exc}"
                return

    def dir(self, name: str) -> Path:
        """Case ``name``'s directory, finished or not."""
        return self.root / name

    def check(self, name: str) -> Path:
        """Case ``name``'s directory once it finished on every rank; fails the calling test
        if it failed or will never run."""
        import pytest

        assert name in self.names, (name, self.names)
        marks = self.root / _MARKS
        while True:
            running = self._thread.is_alive()  # read first: a case may finish meanwhile
            if all((marks / f"{name}.rank_{r}.done").exists() for r in range(self.world_size)):
                return self.dir(name)
            failed = sorted(marks.glob(f"{name}.rank_*.failed"))
            if failed or not running:
                why = "\n".join(f.read_text() for f in failed) or f"it never ran: {self.error}"
                pytest.fail(f"case {name!r} of the grouped launches did not finish:\n{why}")
            time.sleep(0.1)

    def join(self) -> None:
        """Wait until the last launch has ended."""
        self._thread.join()
