"""The dry run's activation estimate against the memory a real step takes on the CPU.

For the built-in GPT in several shapes, with and without recomputation, with documents packed
into a sample (the document mask), in fp32 and under bf16
autocast, with one micro-batch per step and with two: a child process trains through the
engine (the CPU's fused attention) and measures how far a step's resident set rises above its
start; the dry run of the same flags predicts that rise as the rank's total minus its
parameters and optimizer state (what exists before the step: the gradients are freed after
each step, except DDP's, which live in its buckets). Both halves are
:mod:`rapidformer.testing.step_memory`. Within 15%: the resident set also holds the
allocator's small blocks and page rounding, the estimate counts tensors.

Launches are shared: the cases of one precision are measured one after another in one child
process, each by ``step_memory``'s own measurement of one spec (:func:`_measured_rises`); so
are the two Llama cases, and two of the data-parallel cases in one launch of two ranks (the
third goes through :func:`~rapidformer.testing.step_memory.measured_rise` itself, a launch of
its own, as the benchmark calls it). Starting a child costs seconds (torch's import, and
dynamo's at the first model build) that a case of these sizes does not take again. The first
test of a launch waits for all of its cases; the others find their figure measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from rapidformer.testing.step_memory import Spec, estimated_rise, measured_rise, supported

SIZES = {  # layers, hidden, heads, seq, micro-batch, vocab
    "small": (2, 256, 4, 256, 8, 2048),
    "medium": (4, 192, 3, 512, 4, 4096),  # once 384 wide: heads of 64 still, a third the products
    # bf16 matrix products run ~20x slower than fp32 on a CPU without avx512_bf16 (0.8 against
    # 17 GFLOP/s here). A layer's activations grow with the hidden size, its products with its
    # square: 64 wide on 8192 tokens, a step holds 92 MiB of activations (55 MiB under full
    # recomputation) for a fifth of "medium"'s products.
    "narrow": (2, 64, 2, 256, 32, 512),
    "wide": (4, 512, 8, 64, 1, 8192),  # gradients (64 MiB) above the activations
}
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"recompute_granularity": "full"},
    "selective": {"recompute_granularity": "selective"},
    # Packed documents: positions per document and the [B, 1, T, T] boolean mask, which the
    # CPU's attention turns into an additive one of the activations' dtype.
    "documents": {"reset_position_ids": True, "reset_attention_mask": True},
}
Case = tuple[str, str, int, str]  # size, mode, micro-batches per step, precision
CASES: list[Case] = [
    ("small", "none", 1, "fp32"),
    ("wide", "none", 2, "fp32"),
    ("small", "full", 2, "fp32"),
    ("medium", "documents", 1, "fp32"),
    ("medium", "selective", 1, "fp32"),
    ("medium", "full", 1, "fp32"),
    ("narrow", "none", 1, "bf16"),
    ("narrow", "full", 1, "bf16"),
]
DATA_PARALLEL = [  # size, mode, micro-batches per step, extra flags
    ("wide", "none", 1, {}),
    ("narrow", "full", 2, {}),  # narrow: two ranks share two cores, products cost double
    ("wide", "none", 1, {"zero_1_memory_optimization": True}),
]
TOLERANCE = 0.15
# MFU's denominator given, so that composing does not probe the CPU with 1024^2 products
# (seconds under bf16, once per case). Nothing a step allocates depends on it.
NO_PROBE = {"peak_tflops": 1.0}


def _spec(size: str, mode: str, accumulation: int, precision: str = "fp32") -> Spec:
    layers, hidden, heads, seq, micro, vocab = SIZES[size]
    return {
        "config": {
            "lr": 1e-3, "micro_batch_size": micro, "global_batch_size": micro * accumulation,
            "train_iters": 3, "seq_length": seq, "log_interval": 1000, "precision": precision,
            **MODES[mode], **NO_PROBE,
        },
        "shape": {
            "vocab_size": vocab, "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "max_position_embeddings": seq, "dropout": 0.0,
        },
    }  # fmt: skip


# One launch, several specs: each rank runs step_memory's documented command line
# (``python -m rapidformer.testing.step_memory SPEC``: two steps, collect the garbage, then the
# measured step's peak minus its start) for every spec in turn, in the one process. A spec's
# rise is still its own step's: the earlier engines are closed and collected before its start
# is read, and large blocks go back to the kernel when freed (MALLOC_MMAP_THRESHOLD_, as
# measured_rise sets it). With several ranks the group is made once (an engine that did not
# make it leaves it alone), and a barrier after each spec keeps the ranks' result lines in
# spec order.
_CHILD = """
import json, runpy, sys
import torch.distributed as dist

specs, ranks = json.loads(sys.argv[1]), int(sys.argv[2])
if ranks > 1:
    dist.init_process_group("gloo")
for spec in specs:
    sys.argv = ["step_memory", json.dumps(spec)]
    runpy.run_module("rapidformer.testing.step_memory", run_name="__main__")
    if ranks > 1:
        dist.barrier()
if ranks > 1:
    dist.destroy_process_group()
"""


def _measured_rises(specs: list[Spec], ranks: int = 1) -> list[int]:
    """:func:`rapidformer.testing.step_memory.measured_rise` of each spec (the most of any
    rank), all in one launch of ``ranks`` processes with one torch thread each."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    child = ["-c", _CHILD, json.dumps(specs), str(ranks)]
    done = subprocess.run(
        [sys.executable, *([*launch, "--no-python", sys.executable] if ranks > 1 else []), *child],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300 * len(specs),
    )
    results = [json.loads(r)["rise"] for r in re.findall(r"RESULT (\{[^}]*\})", done.stdout)]
    if done.returncode != 0 or len(results) != ranks * len(specs):
        raise RuntimeError(f"the measuring child failed:\n{done.stderr[-3000:]}")
    # The barrier after each spec: its ranks' lines come before the next spec's.
    return [max(results[i : i + ranks]) for i in range(0, len(results), ranks)]


def _rises_of(precision: str) -> dict[Case, int]:
    cases = [case for case in CASES if case[3] == precision]
    return dict(zip(cases, _measured_rises([_spec(*case) for case in cases]), strict=True))


# The launches are module fixtures: each runs once, when a test first needs it, and a launch
# that fails fails each of its tests with its error, without launching again.
@pytest.fixture(scope="module")
def fp32_rises() -> dict[Case, int]:
    return _rises_of("fp32")


@pytest.fixture(scope="module")
def bf16_rises() -> dict[Case, int]:
    return _rises_of("bf16")


FP32 = [case for case in CASES if case[3] == "fp32"]
BF16 = [case for case in CASES if case[3] == "bf16"]


# One test per launch, each naming its fixture (not request.getfixturevalue): the suite's tiers
# see which tests share a launch (tests/helpers/budget.py).
@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation", "precision"), FP32)
def test_the_activation_estimate_is_within_15_percent_of_a_cpu_step(
    size: str, mode: str, accumulation: int, precision: str, fp32_rises: dict[Case, int]
) -> None:
    """Every path of the estimate is one case, and the sizes change the figures, not the
    path. One micro-batch (its gradients appear while its activations are freed): "small".
    Two (the second meets the first's gradients): "wide", where the gradients are most of the
    rise, and "small" under full recomputation. No recomputation, selective, full and documents
    (the mask): each on "medium". bf16 autocast without and with full recomputation (whose
    forward, redone in backward, must see the same casts): "narrow".

    What was cut took one of these paths again: "medium" without recomputation (small's
    path), and a larger GPT (6 layers, 512 wide) with two micro-batches (now wide's) and with
    full recomputation (medium's). bf16 on "medium" took two fifths of the file's time."""
    _check_estimate((size, mode, accumulation, precision), fp32_rises)


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation", "precision"), BF16)
def test_the_bf16_activation_estimate_is_within_15_percent_of_a_cpu_step(
    size: str, mode: str, accumulation: int, precision: str, bf16_rises: dict[Case, int]
) -> None:
    _check_estimate((size, mode, accumulation, precision), bf16_rises)


def _check_estimate(case: Case, rises: dict[Case, int]) -> None:
    size, mode, accumulation, precision = case
    spec = _spec(size, mode, accumulation, precision)
    measured = rises[case]
    estimated = estimated_rise(spec)
    ratio = estimated / measured
    print(f"{size} {mode} x{accumulation} {precision}: estimated {estimated / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (size, mode, accumulation, precision, estimated, measured)


def _data_parallel_spec(size: str, mode: str, accumulation: int, flags: dict[str, Any]) -> Spec:
    spec = _spec(size, mode, accumulation)
    spec["config"].update(flags)
    spec["config"]["global_batch_size"] *= 2
    spec["world_size"] = 2
    return spec


@pytest.fixture(scope="module")
def data_parallel_rises() -> list[int]:
    """The data-parallel cases' rises, in DATA_PARALLEL's order: the first by measured_rise
    (every line of it runs: its torchrun launch), the others in one shared launch."""
    specs = [_data_parallel_spec(*case) for case in DATA_PARALLEL]
    return [measured_rise(specs[0]), *_measured_rises(specs[1:], ranks=2)]


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation", "flags"), DATA_PARALLEL)
def test_on_two_data_parallel_ranks_too(
    size: str, mode: str, accumulation: int, flags: dict[str, Any], data_parallel_rises: list[int]
) -> None:
    """DDP (and ZeRO-1 on it): the gradients are views of DDP's buckets, allocated from one
    step to the next, so a step adds its activations only. With DDP's default (buckets as a
    second copy, gradients dropped every step) the measured rises were 97 MiB ("wide", where
    the gradients outweigh the activations) and 148 MiB (two micro-batches of a 4-layer,
    384-wide GPT under full recomputation, since made "narrow"), against 48 and 114 with the
    buckets' views, as estimated."""
    spec = _data_parallel_spec(size, mode, accumulation, flags)
    estimated = estimated_rise(spec)
    measured = data_parallel_rises[DATA_PARALLEL.index((size, mode, accumulation, flags))]
    ratio = estimated / measured
    print(f"dp2 {size} {mode} x{accumulation} {flags}: estimated {estimated / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (size, mode, accumulation, flags, estimated, measured)


LLAMA = {  # 128 wide, heads of 64: a sixth of the products of the 384-wide Llama it was
    "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip


def _llama_spec(packing: bool) -> Spec:
    return {
        "config": {"lr": 1e-3, "micro_batch_size": 4, "train_iters": 3, "seq_length": 512,
                   "log_interval": 1000, "packing": packing, **NO_PROBE},
        "llama": LLAMA,
    }  # fmt: skip


@pytest.fixture(scope="module")
def llama_rises() -> dict[bool, int]:
    """Both Llama cases, in one launch (transformers' import paid once)."""
    packings = [True, False]
    return dict(zip(packings, _measured_rises([_llama_spec(p) for p in packings]), strict=True))


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_fine_tuned_llama_step_too(packing: bool, llama_rises: dict[bool, int]) -> None:
    """``--task causal_lm``'s dry run (a transformers Llama from its config on the meta
    device): 4 rows of 512 tokens packed (the positions, the additive block-diagonal mask, the
    CPU's fused attention under it) or padded (transformers' boolean mask)."""
    spec = _llama_spec(packing)
    estimated, measured = estimated_rise(spec), llama_rises[packing]
    ratio = estimated / measured
    print(f"llama packing={packing}: estimated {estimated / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (packing, estimated, measured)


def test_recomputation_lowers_the_estimate_as_it_lowers_the_memory() -> None:
    """The estimate follows each switch (the ranking the CPU measurements show), and a longer
    sequence costs more: the figures are not one constant."""
    rises = {mode: estimated_rise(_spec("medium", mode, 1)) for mode in MODES}
    assert rises["full"] < rises["selective"] < rises["none"]
    longer = _spec("medium", "none", 1)
    longer["config"]["micro_batch_size"] *= 2
    longer["config"]["global_batch_size"] *= 2
    assert estimated_rise(longer) > 1.5 * rises["none"] - 2 * 2**20
