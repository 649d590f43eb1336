"""Fixtures and hooks for every test (helpers the tests share live in tests/helpers/)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads() -> None:
    # Two cores: one intra-op thread keeps reductions in a fixed order and leaves room for the
    # second rank of distributed tests.
    torch.set_num_threads(1)
