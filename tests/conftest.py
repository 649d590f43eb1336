"""Fixtures and hooks for every test (helpers the tests share live in tests/helpers/): one
intra-op thread per test, and the suite's time budget (:mod:`tests.helpers.budget`)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import budget

MEASURED = budget.measured()
_seconds: defaultdict[str, float] = defaultdict(float)


@pytest.fixture(autouse=True)
def _deterministic_threads() -> None:
    # Two cores: one intra-op thread keeps reductions in a fixed order and leaves room for the
    # second rank of distributed tests.
    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-durations",
        metavar="FILE",
        help="write each test's seconds (setup, call and teardown) to FILE as JSON "
        "(make durations writes tests/durations.json)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier: what the durations file measured at budget.SLOW_S or more, and the
    tests that share a module-scoped fixture with it (budget.slow_tier)."""
    slow = budget.slow_tier({i.nodeid: budget.shared_fixtures(i) for i in items}, MEASURED)
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    _seconds[item.nodeid] += report.duration
    if report.when != "call" or not report.passed:
        return
    problem = _over_budget(item, report.duration)
    if problem:
        report.outcome = "failed"
        report.longrepr = problem


def _over_budget(item: pytest.Item, seconds: float) -> str:
    """Why a passing test fails the budget ("" when it keeps it). Both guards give a busy
    machine budget.BUSY of slack over the measured limits."""
    if item.nodeid not in budget.LONG and seconds > budget.LIMIT_S * budget.BUSY:
        return (
            f"{item.nodeid} took {seconds:.0f} s, past {budget.BUSY:g} x the "
            f"{budget.LIMIT_S:.0f} s a test may take: share its fixtures or launches with its "
            "neighbours, or list it in tests/helpers/budget.py's LONG with the reason"
        )
    fast_tier = item.config.getoption("markexpr") == "not slow"
    with_setup = _seconds[item.nodeid]  # its set-up (a module fixture's, say) and its call
    if fast_tier and with_setup > budget.SLOW_S * budget.BUSY:
        return (
            f"{item.nodeid} took {with_setup:.0f} s in the fast tier: it is slow (at least "
            f"{budget.SLOW_S:.0f} s). Fix: make durations (tests/durations.json), which "
            "moves it to the slow tier"
        )
    return ""


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--write-durations")
    if target and _seconds:
        rounded = {nodeid: round(seconds, 2) for nodeid, seconds in sorted(_seconds.items())}
        Path(target).write_text(json.dumps(rounded, indent=0) + "\n")
