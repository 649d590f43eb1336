"""The suite's time budget, kept by the suite itself (tests/conftest.py applies it).

* **Two tiers from measured times.** ``tests/durations.json`` holds each test's time on a
  two-core machine (``make durations`` writes it from a full run). A test measured at
  :data:`SLOW_S` or more is marked ``slow`` when collected, so ``make test-fast`` (``-m "not
  slow"``) leaves it out; no test carries the marker by hand.
* **No test past a minute, and the whole within budget.** The durations file holds no test
  over :data:`LIMIT_S` unless :data:`LONG` lists it with the reason it needs the time, and its
  tests add up to at most :data:`SUITE_S` (tests/test_suite_budget.py checks the file).
* **Live guards, with room for a busy machine.** In any run, a test past :data:`BUSY` x
  :data:`LIMIT_S` fails (unless in :data:`LONG`), and in a run of the fast tier a test past
  :data:`BUSY` x :data:`SLOW_S` fails, naming its time and the file to refresh (a new test is
  not yet in the durations file). The slack is measured, not hoped for: CI's shared machines
  have run the same suite 1.7 times slower than two quiet cores (73 against 42 minutes).
"""

from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).parents[1] / "durations.json"
SLOW_S = 5.0
"""Measured seconds from which a test belongs to the slow tier."""
LIMIT_S = 60.0
"""Measured seconds a single test may take, unless it is listed in :data:`LONG`."""
SUITE_S = 22 * 60.0
"""Measured seconds the whole suite may take (pytest alone; make test adds lint and docs)."""
LONG: dict[str, str] = {}
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
