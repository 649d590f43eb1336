"""Every test under tests/gpu/ needs CUDA: marked ``gpu`` and skipped (with the reason) where
there is none. ``make test-gpu`` runs them on the GPU machine's own python3 (its torch and
transformers; no ``datasets``, DeepSpeed or onnxruntime-training there, so nothing here imports
them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (run make test-gpu on a GPU)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _fresh_cuda_state() -> None:
    """Each test measures its own memory and compiles its own graphs."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
