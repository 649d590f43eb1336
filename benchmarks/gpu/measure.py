"""Timing and peak memory of training steps on the device the engine chose (the GPU suite's
sections share them)."""

from __future__ import annotations

import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float:
    from rapidformer.memory import peak_memory_bytes

    return peak_memory_bytes(device) / 2**20


def timed_steps(engine: Any, batch: Any, functions: Any, steps: int) -> tuple[float, Any]:
    """Two warm-up steps, then ``steps`` timed ones; (seconds, the last loss tensor)."""
    for _ in range(2):
        engine.run_step([batch], functions)
    sync(engine.device)
    started = time.perf_counter()
    for _ in range(steps):
        loss = engine.run_step([batch], functions).loss_tensor
    sync(engine.device)
    return time.perf_counter() - started, loss
