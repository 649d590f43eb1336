"""The compile tests' shared fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rapidformer.accel.compile import apply as compile_module


@pytest.fixture
def eager_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.compile through dynamo's ``eager`` backend: the graphs, breaks and fallbacks are
    dynamo's, counted as under inductor, without inductor's minutes of code generation."""
    monkeypatch.setattr(compile_module, "BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
