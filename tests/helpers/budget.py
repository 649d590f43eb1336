"""The suite's time budget, kept by the suite itself (tests/conftest.py applies it).

* **Two tiers from measured times.** ``tests/durations.json`` holds each test's time on a
  two-core machine (``make durations`` writes it from a full run). A test measured at
  :data:`SLOW_S` or more is marked ``slow`` when collected, and so is every test that shares a
  module-scoped fixture with it (:func:`slow_tier`), so ``make test-fast`` (``-m "not slow"``)
  leaves them out; no test carries the marker by hand.
* **No test past a minute, and the whole within budget.** The durations file holds no test
  over :data:`LIMIT_S` unless :data:`LONG` lists it with the reason it needs the time, and its
  tests add up to at most :data:`SUITE_S` (tests/test_suite_budget.py checks the file).
* **Live guards, with room for a busy machine.** In any run, a test past :data:`BUSY` x
  :data:`LIMIT_S` fails (unless in :data:`LONG`), and in a run of the fast tier a test whose
  set-up and call took past :data:`BUSY` x :data:`SLOW_S` fails, naming its time and the file
  to refresh (a new test is not yet in the durations file). The slack is measured, not
  hoped for: CI's shared machines have run the same suite 1.7 times slower than two quiet
  cores (73 against 42 minutes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).parents[1] / "durations.json"
SLOW_S = 5.0
"""Measured seconds from which a test belongs to the slow tier."""
LIMIT_S = 60.0
"""Measured seconds a single test may take, unless it is listed in :data:`LONG`."""
SUITE_S = 32 * 60.0
"""Measured seconds the whole suite may take (pytest alone; make test adds lint and docs): a
guard against growth at today's 28 minutes (plain pytest on a clean clone), not yet the 22
minutes that issue 51 asks for."""
LONG: dict[str, str] = {
    "tests/test_gpu_suite.py::test_gpu_suite_dry_run_writes_every_section": (
        "every section of the GPU suite in one process: the script is what it checks"
    ),
    "tests/distributed/test_3d.py::test_layout_matches_the_one_process_run[tp2]": (
        "waits for the module's two launches (21 layouts on 2 and 4 ranks)"
    ),
    "tests/distributed/test_moe_parallel.py::test_two_rank_layout_matches_the_one_process_run[ep2]": (  # noqa: E501 (a node id)
        "waits for the module's launches (every expert-parallel layout on 2 and 4 ranks)"
    ),
    "tests/accel/compile/test_compile.py::test_compiled_blocks_match_eager_and_compile_once_per_bucket": (  # noqa: E501 (a node id)
        "inductor's C++ builds of every bucket's graph: the kernels are what it checks"
    ),
    "tests/checkpoint/test_integrity.py::test_kill_9_at_random_moments_a_dozen_times_then_the_same_final_weights": (  # noqa: E501 (a node id)
        "a dozen killed processes and their resumes: the process boundary is the point"
    ),
    "tests/checkpoint/test_async_save.py::test_background_checkpoints_on_two_ranks_equal_synchronous_ones": (  # noqa: E501 (a node id)
        "two 2-rank runs, synchronous and in the background, with every tracker"
    ),
    "tests/accel/deepspeed/test_deepspeed.py::test_deepspeed_stages_match_the_single_processreference_run[zero1]": (  # noqa: E501 (a node id)
        "waits for the first of the module's two grouped DeepSpeed launches"
    ),
}
"""Tests allowed past :data:`LIMIT_S`, by node id, with the reason."""
BUSY = 2.5
"""How much slower than measured a test may run on a busy machine before a live guard fails it."""


def measured() -> dict[str, float]:
    """The durations file's seconds by node id ({} where there is none)."""
    if not DURATIONS.is_file():
        return {}
    return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}


def is_slow(nodeid: str, durations: dict[str, float]) -> bool:
    return durations.get(nodeid, 0.0) >= SLOW_S


def slow_tier(shared: dict[str, frozenset[str]], durations: dict[str, float]) -> set[str]:
    """The tests ``make test-fast`` leaves out, from each test's shared fixtures (node id ->
    the module-scoped fixtures it uses): those measured at :data:`SLOW_S` or more, and every
    test that shares a fixture with one of them. A shared fixture's setup is measured in the
    first test that uses it: left out alone, a slow first test would hand that setup to the
    next test, a fast one, and the fast tier would pay it unmeasured."""
    slow = {nodeid for nodeid in shared if is_slow(nodeid, durations)}
    fixtures = frozenset().union(*(shared[nodeid] for nodeid in slow))
    return slow | {nodeid for nodeid, used in shared.items() if used & fixtures}


def shared_fixtures(item: pytest.Item) -> frozenset[str]:
    """The module-scoped (or wider, but per module) fixtures ``item`` uses, each named by its
    module and name: one instance serves the module's tests that use it."""
    module = item.nodeid.split("::")[0]
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:  # not a Python test function (a doctest, say)
        return frozenset()
    return frozenset(
        f"{module}::{name}"
        for name, defs in definitions.name2fixturedefs.items()
        if defs[-1].scope in ("class", "module", "package")
    )
