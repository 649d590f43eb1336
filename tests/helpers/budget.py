"""The suite's time budget, kept by the suite itself (tests/conftest.py applies it).

* **Two tiers from measured times.** ``tests/durations.json`` holds each test's time on a
  two-core machine (``make durations`` writes it from a full run). A test measured at
  :data:`SLOW_S` or more is marked ``slow`` when collected, so ``make test-fast`` (``-m "not
  slow"``) leaves it out; no test carries the marker by hand.
* **Nothing slow hides in the fast tier.** In a run of the fast tier, a test that takes more
  than :data:`MARGIN` x :data:`SLOW_S` fails, naming its time and the file to refresh (a new
  test is not yet in the durations file).
* **No test past a minute.** In any run, a test that takes more than :data:`LIMIT_S` fails,
  unless :data:`LONG` lists it with the reason it needs the time.
"""

from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).parents[1] / "durations.json"
SLOW_S = 8.0
"""Measured seconds from which a test belongs to the slow tier."""
LIMIT_S = 60.0
"""Seconds a single test may take, unless it is listed in :data:`LONG`."""
LONG: dict[str, str] = {}
"""Tests allowed past :data:`LIMIT_S`, by node id, with the reason."""
MARGIN = 2.0
"""How much slower than the slow tier's threshold a fast test may run on a busy machine before
the fast tier's guard fails it."""


def measured() -> dict[str, float]:
    """The durations file's seconds by node id ({} where there is none)."""
    if not DURATIONS.is_file():
        return {}
    return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}


def is_slow(nodeid: str, durations: dict[str, float]) -> bool:
    return durations.get(nodeid, 0.0) >= SLOW_S
