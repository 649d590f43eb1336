"""The suite keeps its own time budget (tests/helpers/budget.py): the tiers come from measured
durations, the fast tier fits five minutes and covers every package, and nothing marks a test
slow by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import budget

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "rapidformer"
FAST_TIER_S = 300.0


def test_no_test_is_marked_slow_by_hand() -> None:
    """The durations file is the one source of the tiers: a marker written by hand would go
    stale as the test gets faster or slower."""
    written = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in TESTS.rglob("test_*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"mark\.slow\b", line) and path.name != Path(__file__).name
    ]
    assert not written, written


def test_the_measured_slow_tests_are_marked_and_the_fast_ones_are_not(
    request: pytest.FixtureRequest,
) -> None:
    measured = budget.measured()
    for item in request.session.items:
        slow = item.get_closest_marker("slow") is not None
        assert slow == budget.is_slow(item.nodeid, measured), item.nodeid


def test_the_fast_tier_fits_five_minutes_and_reaches_every_package() -> None:
    measured = budget.measured()
    assert measured, "no tests/durations.json: make durations writes it"
    fast = {nodeid: s for nodeid, s in measured.items() if s < budget.SLOW_S}
    assert sum(fast.values()) <= FAST_TIER_S, sum(fast.values())
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    packages -= {"compat", "testing"} | {p for p in packages if not (TESTS / p).is_dir()}
    reached = {nodeid.split("/")[1] for nodeid in fast if nodeid.count("/") >= 2}
    assert packages <= reached, sorted(packages - reached)


def test_no_measured_test_takes_a_minute_and_the_whole_fits_its_budget() -> None:
    measured = budget.measured()
    assert measured, "no tests/durations.json: make durations writes it"
    over = {n: s for n, s in measured.items() if s > budget.LIMIT_S and n not in budget.LONG}
    assert not over, over
    assert sum(measured.values()) <= budget.SUITE_S, sum(measured.values())
    assert set(budget.LONG) <= set(measured), set(budget.LONG) - set(measured)


def test_the_budget_guard_fails_what_is_over_it() -> None:
    """The guard's rules on made-up times (not vacuous): past a minute, and slow in the fast
    tier."""
    assert budget.LIMIT_S == 60.0 and budget.SLOW_S * budget.BUSY < budget.LIMIT_S
    assert budget.is_slow("a::b", {"a::b": budget.SLOW_S})
    assert not budget.is_slow("a::b", {"a::b": budget.SLOW_S - 0.01})
    assert not budget.is_slow("new::test", {})  # unmeasured: the fast tier's guard times it
