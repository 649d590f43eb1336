"""The suite keeps its own time budget (tests/helpers/budget.py): the tiers come from measured
durations, the fast tier fits five minutes and covers every package, and nothing marks a test
slow by hand."""

from __future__ import annotations

import re
import subprocess
import sys
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
    items = request.session.items
    tier = budget.slow_tier({item.nodeid: budget.shared_fixtures(item) for item in items}, measured)
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        assert slow == (item.nodeid in tier), item.nodeid
        assert not budget.is_slow(item.nodeid, measured) or slow, item.nodeid


def test_the_fast_tier_fits_five_minutes_and_reaches_every_package() -> None:
    """What ``make test-fast`` collects (the whole suite collected in a process of its own),
    measured."""
    measured = budget.measured()
    assert measured, "no tests/durations.json: make durations writes it"
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", str(TESTS)],
        capture_output=True,
        text=True,
        check=True,
        cwd=TESTS.parent,
        timeout=300,
    ).stdout.splitlines()
    fast = {line: measured.get(line, 0.0) for line in listed if "::" in line}
    assert len(fast) > 500, len(fast)  # the collection worked
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
    # A test sharing a module fixture with a slow one goes with it; one with no fixture stays.
    shared = {"m::a": frozenset({"m::f"}), "m::b": frozenset({"m::f"}), "m::c": frozenset()}
    assert budget.slow_tier(shared, {"m::a": budget.SLOW_S}) == {"m::a", "m::b"}
    assert budget.slow_tier(shared, {"m::c": budget.SLOW_S}) == {"m::c"}
