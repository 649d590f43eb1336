"""The dry run's activation estimate against the memory a real step takes on the CPU.

For the built-in GPT at three sizes, with and without recomputation, with documents packed
into a sample (the document mask), in fp32 and under bf16
autocast, with one micro-batch per step and with two: a child process trains through the
engine (the CPU's fused attention) and measures how far a step's resident set rises above its
start; the dry run of the same flags predicts that rise as the rank's total minus its
parameters and optimizer state (what exists before the step: the gradients are freed after
each step, except DDP's, which live in its buckets). Both halves are
:mod:`rapidformer.testing.step_memory`. Within 15%: the resident set also holds the
allocator's small blocks and page rounding, the estimate counts tensors.
"""

from __future__ import annotations

from typing import Any

import pytest

from rapidformer.testing.step_memory import Spec, estimated_rise, measured_rise, supported

SIZES = {  # layers, hidden, heads, seq, micro-batch, vocab
    "small": (2, 256, 4, 256, 8, 2048),
    "medium": (4, 384, 6, 512, 4, 4096),
    "large": (6, 512, 8, 512, 4, 8192),
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
CASES = [  # size, mode, micro-batches per step, precision
    ("small", "none", 1, "fp32"),
    ("small", "full", 2, "fp32"),
    ("medium", "none", 1, "fp32"),
    ("medium", "documents", 1, "fp32"),
    ("medium", "selective", 1, "fp32"),
    ("medium", "full", 1, "fp32"),
    ("medium", "none", 1, "bf16"),
    ("medium", "full", 1, "bf16"),
    ("large", "none", 2, "fp32"),
    ("large", "full", 1, "fp32"),
]
DATA_PARALLEL = [  # size, mode, micro-batches per step, extra flags
    ("wide", "none", 1, {}),
    ("medium", "full", 2, {}),
    ("wide", "none", 1, {"zero_1_memory_optimization": True}),
]
TOLERANCE = 0.15


def _spec(size: str, mode: str, accumulation: int, precision: str = "fp32") -> Spec:
    layers, hidden, heads, seq, micro, vocab = SIZES[size]
    return {
        "config": {
            "lr": 1e-3, "micro_batch_size": micro, "global_batch_size": micro * accumulation,
            "train_iters": 3, "seq_length": seq, "log_interval": 1000, "precision": precision,
            **MODES[mode],
        },
        "shape": {
            "vocab_size": vocab, "num_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "max_position_embeddings": seq, "dropout": 0.0,
        },
    }  # fmt: skip


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation", "precision"), CASES)
def test_the_activation_estimate_is_within_15_percent_of_a_cpu_step(
    size: str, mode: str, accumulation: int, precision: str
) -> None:
    spec = _spec(size, mode, accumulation, precision)
    estimated, measured = estimated_rise(spec), measured_rise(spec)
    ratio = estimated / measured
    print(f"{size} {mode} x{accumulation} {precision}: estimated {estimated / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (size, mode, accumulation, precision, estimated, measured)


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("size", "mode", "accumulation", "flags"), DATA_PARALLEL)
def test_on_two_data_parallel_ranks_too(
    size: str, mode: str, accumulation: int, flags: dict[str, Any]
) -> None:
    """DDP (and ZeRO-1 on it): the gradients are views of DDP's buckets, allocated from one
    step to the next, so a step adds its activations only. With DDP's default (buckets as a
    second copy, gradients dropped every step) the measured rises were 97 MiB ("wide", where
    the gradients outweigh the activations) and 148 MiB (accumulation), against 48 and 114
    now and estimated."""
    spec = _spec(size, mode, accumulation)
    spec["config"].update(flags)
    spec["config"]["global_batch_size"] *= 2
    spec["world_size"] = 2
    estimated, measured = estimated_rise(spec), measured_rise(spec)
    ratio = estimated / measured
    print(f"dp2 {size} {mode} x{accumulation} {flags}: estimated {estimated / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB, ratio {ratio:.3f}")  # fmt: skip
    assert abs(ratio - 1) <= TOLERANCE, (size, mode, accumulation, flags, estimated, measured)


LLAMA = {
    "vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 512,
}  # fmt: skip


@pytest.mark.skipif(not supported(), reason="needs Linux's /proc")
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_fine_tuned_llama_step_too(packing: bool) -> None:
    """``--task causal_lm``'s dry run (a transformers Llama from its config on the meta
    device): 4 rows of 512 tokens packed (the positions, the additive block-diagonal mask, the
    CPU's fused attention under it) or padded (transformers' boolean mask)."""
    spec = {
        "config": {"lr": 1e-3, "micro_batch_size": 4, "train_iters": 3, "seq_length": 512,
                   "log_interval": 1000, "packing": packing},
        "llama": LLAMA,
    }  # fmt: skip
    estimated, measured = estimated_rise(spec), measured_rise(spec)
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
