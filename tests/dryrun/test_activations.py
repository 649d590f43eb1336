"""The dry run's activation estimate against the memory a real step takes on the CPU.

For the built-in GPT at three sizes, with and without recomputation, with one micro-batch per
step and with two: a child process trains through the engine (``peak_child.py``, fp32, the
CPU's fused attention) and measures how far a step's resident set rises above its start; the
dry run of the same flags predicts that rise as the rank's total minus its parameters and
optimizer state (what exists before the step: the gradients are freed after each step). Within
15%: the resident set also holds the allocator's small blocks and page rounding, the estimate
counts tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rapidformer import RapidformerConfig
from rapidformer.dryrun import Workload, dry_run
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.templates.families.gpt import GPTFamily

CHILD = Path(__file__).with_name("peak_child.py")
SIZES = {  # layers, hidden, heads, seq, micro-batch, vocab
    "small": (2, 256, 4, 256, 8, 2048),
    "medium": (4, 384, 6, 512, 4, 4096),
    "large": (6, 512, 8, 512, 4, 8192),
}
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"recompute_granularity": "full"},
    "selective": {"recompute_granularity": "selective"},
}
CASES = [
    ("small", "none", 1),
    ("small", "full", 2),
    ("medium", "none", 1),
    ("medium", "selective", 1),
    ("medium", "full", 1),
    ("large", "none", 2),
    ("large", "full", 1),
]
TOLERANCE = 0.15


def _spec(size: str, mode: str, accumulation: int) -> dict[str, Any]:
    layers, hidden, heads, seq, micro, vocab = SIZES[size]
    return {
        "config": {
            "lr": 1e-3, "micro_batch_size": micro, "global_batch_size": micro * accumulation,
            "train_iters": 3, "seq_length": seq, "log_interval": 1000, **MODES[mode],
        },
        "shape": {
            "vocab_size": vocab, "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "max_position_embeddings": seq, "dropout": 0.0,
        },
    }  # fmt: skip


def _estimated_rise(spec: dict[str, Any]) -> int:
    config = RapidformerConfig.from_dict(spec["config"])
    shape = GPTConfig(**spec["shape"])
    family = GPTFamily()
    work = Workload(
        build=lambda: GPTModel.build(shape, "meta"),
        batch=family.example_batch(
            config.data.micro_batch_size, shape.max_position_embeddings, "meta"
        ),
        inputs=family.inputs,
        loss=family.loss,
        hidden_size=shape.hidden_size,
        seq_length=shape.max_position_embeddings,
    )
    rank = dry_run(config, 1, work, "test GPT").ranks[0]
    return rank.total - rank.state.parameters - rank.state.optimizer


def _measured_rise(spec: dict[str, Any]) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return int(json.loads(lines[-1][len("RESULT ") :])["rise"])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation"), CASES)
def test_the_activation_estimate_is_within_15_percent_of_a_cpu_step(
    size: str, mode: str, accumulation: int
) -> None:
    spec = _spec(size, mode, accumulation)
    estimated, measured = _estimated_rise(spec), _measured_rise(spec)
    ratio = estimated / measured
    print(f"{size} {mode} x{accumulation}: estimated {estimated / 2**20:.1f} MiB, measured "
          f"{measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (size, mode, accumulation, estimated, measured)


def test_recomputation_lowers_the_estimate_as_it_lowers_the_memory() -> None:
    """The estimate follows each switch (the ranking the CPU measurements show), and a longer
    sequence costs more: the figures are not one constant."""
    rises = {mode: _estimated_rise(_spec("medium", mode, 1)) for mode in MODES}
    assert rises["full"] < rises["selective"] < rises["none"]
    longer = _spec("medium", "none", 1)
    longer["config"]["micro_batch_size"] *= 2
    longer["config"]["global_batch_size"] *= 2
    assert _estimated_rise(longer) > 1.5 * rises["none"] - 2 * 2**20
