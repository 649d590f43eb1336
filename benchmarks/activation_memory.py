"""Activation memory and step time per recompute mode: none, ``--checkpoint-activations`` (full,
every layer), ``--recompute-granularity selective``, ``--recompute-method block`` (half the
layers) and ``--recompute-method uniform`` (chunks of 2 layers).

Each run is a fresh child process (``sys.executable``), so one run's peak cannot hide the
next's, and the children run with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then serves every
block above 128 KiB with its own mmap and unmaps it on free, so activation buffers go back to
the kernel after each step and the peak resident set tracks the live activations instead of
the allocator's high-water mark.

A child trains a TinyTransformerLM whose activations dominate its memory (hidden 256,
8 layers, micro batch 32 x 256 tokens, vocab 64, dropout 0) for a few steps through the
rapidformer Trainer and reports the *training peak increment*: peak RSS (``VmHWM``) minus
the RSS measured once the model, optimizer and data loader exist, before the first step. The
increment therefore holds activations, gradients and the AdamW state (created at the first
step), which are the same in both configurations; only the activations differ. The losses of
every step must match exactly: checkpointing recomputes, it must not change the numbers.

    .venv/bin/python benchmarks/activation_memory.py            # full run, writes result files
    .venv/bin/python benchmarks/activation_memory.py --quick    # smoke test, writes nothing
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rapidformer import DataBundle, Trainer
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, lm_tokens, pad_collate

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, MICRO_BATCH = 64, 256, 8, 4, 256, 32
MODES: dict[str, list[str]] = {
    "none": [],
    "full (--checkpoint-activations)": ["--checkpoint-activations"],
    "selective": ["--recompute-granularity", "selective"],
    "full, block 4 of 8": [
        *("--recompute-granularity", "full", "--recompute-method", "block"),
        *("--recompute-num-layers", str(LAYERS // 2)),
    ],
    "full, uniform chunks of 2": [
        *("--recompute-granularity", "full", "--recompute-method", "uniform"),
        *("--recompute-num-layers", "2"),
    ],
}
"""Mode name -> its flags."""
MMAP_THRESHOLD = "131072"
RESULT_PREFIX = "RESULT "  # marks the child's one line of JSON among anything else it prints


# ---- the child: one training run ---------------------------------------------------------
def rss_kib() -> int:
    """This process's resident set now, in KiB."""
    return _status_kib("VmRSS")


def peak_rss_kib() -> int:
    """This process's peak resident set, in KiB: its memory's high-water mark (``VmHWM``).
    Not ``ru_maxrss``: a process started by fork and exec keeps, in that figure, the resident
    set its parent had when it forked (a large pytest process made a child's training peak
    look lower than its set-up)."""
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (this benchmark needs Linux)")


class MemoryTrainer(Trainer):
    """Takes the baseline once set-up is done and keeps every step's loss."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv=argv)
        self.losses: list[float] = []
        self.baseline_kib = 0
        self.peak_before_kib = 0
        self.setup_done = 0.0

    def build_model(self) -> nn.Module:
        return TinyTransformerLM(VOCAB, HIDDEN, LAYERS, HEADS, max_positions=SEQ, dropout=0.0)

    def build_data(self) -> DataBundle:
        # Full-length samples only: every batch is micro x SEQ, so every step holds the same
        # activations and the peak does not depend on which samples a step draws.
        samples = self.config.data.micro_batch_size * (self.config.training.train_iters or 1)
        return DataBundle(
            train=MarkovLMDataset(samples, VOCAB, SEQ, SEQ, seed=1), collate_fn=pad_collate
        )

    def build_lr_scheduler(self, optimizer: Optimizer, total_steps: int) -> LRScheduler:
        # fit() calls this last in set-up: model, optimizer and loaders exist, no step ran yet.
        scheduler = super().build_lr_scheduler(optimizer, total_steps)
        gc.collect()
        self.baseline_kib = rss_kib()
        self.peak_before_kib = peak_rss_kib()
        self.setup_done = time.perf_counter()
        return scheduler

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        output = lm_loss(self.model, batch)
        self.losses.append(output["loss"].item())
        return output["loss"]

    def batch_weight(self, batch: Any) -> torch.Tensor:
        return lm_tokens(batch)  # the loss is a mean over the real tokens


def child(mode: str, steps: int) -> None:
    argv = [
        "--train-iters", str(steps), "--micro-batch-size", str(MICRO_BATCH),
        "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", str(10 * steps),
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
        "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ),
    ]  # fmt: skip
    argv += MODES[mode]
    trainer = MemoryTrainer(argv)
    trainer.fit()
    end = time.perf_counter()
    peak = peak_rss_kib()
    assert trainer.engine.state is not None
    result = {
        "mode": mode,
        "plan": [str(step) for step in trainer.engine.state.plan],
        "baseline_mib": trainer.baseline_kib / 1024,
        "peak_mib": peak / 1024,
        "peak_before_training_mib": trainer.peak_before_kib / 1024,
        "peak_increment_mib": (peak - trainer.baseline_kib) / 1024,
        # If the process peaked before training (it should not), the increment is too low.
        "peak_rose_in_training": peak > trainer.peak_before_kib,
        "seconds_per_step": (end - trainer.setup_done) / steps,
        "losses": trainer.losses,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
    trainer.engine.close()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---- the parent: interleaved child runs and the report -----------------------------------
def run_child(mode: str, steps: int) -> dict[str, Any]:
    return run_script_child(__file__, "--child", "--steps", str(steps), "--mode", mode)


def run_script_child(script: str, *args: str, measures_memory: bool = True) -> dict[str, Any]:
    """``script args`` in a fresh process, with the mmap threshold set where it
    ``measures_memory``; the JSON of its last ``RESULT`` line (the process exits this one with
    its output when it fails). A child that measures speed only runs with glibc's own
    threshold, as a training run does: the fixed threshold maps and faults in every large
    buffer afresh each step, which costs time in proportion to the bytes a step allocates."""
    command = [sys.executable, script, *args]
    env = dict(os.environ)
    if measures_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        sys.exit(f"child {command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "median_peak_increment_mib": statistics.median(r["peak_increment_mib"] for r in runs),
        "median_baseline_mib": statistics.median(r["baseline_mib"] for r in runs),
        "median_peak_mib": statistics.median(r["peak_mib"] for r in runs),
        "median_seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
        "runs": runs,
    }


def max_loss_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """Largest |difference| between any step's loss in any run of ``a`` and of ``b``."""
    return max(
        abs(x - y)
        for run_a in a
        for run_b in b
        for x, y in zip(run_a["losses"], run_b["losses"], strict=True)
    )


def markdown(result: dict[str, Any]) -> list[str]:
    """docs/results/activation_memory.md without the footer (machine, date, command) that
    ``write_results`` adds."""
    modes = result["modes"]
    lines = [
        "# Activation memory and step time per recompute mode",
        "",
        f"TinyTransformerLM hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, micro batch "
        f"{MICRO_BATCH} x {SEQ} tokens, vocab {VOCAB}, dropout 0, fp32, trained "
        f"{result['steps']} steps through the rapidformer Trainer on the CPU. Each run is its own "
        f"process with `MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}`; {result['repeats']} runs per "
        "mode, interleaved, medians shown. *Peak increment* = peak RSS (`VmHWM`) "
        "minus RSS after model, optimizer and data loader creation, before the first step: "
        "activations plus gradients plus AdamW state (the last two equal in every mode).",
        "",
        "| mode | flags | peak increment (MiB) | vs none | s / step | vs none | max loss diff |",
        "|---|---|---|---|---|---|---|",
    ]
    none = modes["none"]
    for name, side in modes.items():
        flags = " ".join(MODES[name]) or "-"
        lines.append(
            f"| {name} | `{flags}` | {side['median_peak_increment_mib']:.0f} "
            f"| {side['median_peak_increment_mib'] / none['median_peak_increment_mib']:.2f} "
            f"| {side['median_seconds_per_step']:.2f} "
            f"| {side['median_seconds_per_step'] / none['median_seconds_per_step']:.2f} "
            f"| {side['max_abs_loss_diff']:.3g} |"
        )
    lines += [
        "",
        "Max loss diff: the largest difference between any step's loss in the mode and with no "
        "recomputation (recomputation must not change the numbers). s / step covers every "
        "step, the first included, and the page faults that the mmap threshold adds to every "
        "large allocation: it shows the recompute cost roughly, it is not a speed benchmark "
        "(the GPU suite times the modes on a GPU).",
    ]
    return lines


def main() -> None:
    # Imported here, not at the top: tests load this file by its path to call run_child(),
    # and benchmarks/ is on sys.path only when a script in it is run.
    from common import argument_parser, stamp, write_results

    parser = argument_parser(__doc__, quick="2 steps, 1 run each")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.mode, args.steps)
        return
    steps, repeats = (2, 1) if args.quick else (args.steps, args.repeats)

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES:  # interleaved: slow drift hits every mode alike
            run = run_child(mode, steps)
            runs[mode].append(run)
            print(
                f"run {repeat + 1}/{repeats} {mode:32s} "
                f"peak increment {run['peak_increment_mib']:7.1f} MiB  "
                f"(RSS {run['baseline_mib']:.0f} -> peak {run['peak_mib']:.0f} MiB)  "
                f"{run['seconds_per_step']:.2f} s/step",
                flush=True,
            )
            if not run["peak_rose_in_training"]:
                print("  WARNING: the process peaked before training; the increment is a floor")
            if mode != "none" and not any("checkpointing" in step for step in run["plan"]):
                sys.exit(f"{mode} did not show in the plan: {run['plan']}")

    modes = {}
    for mode, mode_runs in runs.items():
        modes[mode] = summary(mode_runs)
        modes[mode]["max_abs_loss_diff"] = max_loss_diff(runs["none"], mode_runs)
    result = {
        "steps": steps,
        "repeats": repeats,
        "modes": modes,
        "config": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS,
                   "seq_length": SEQ, "micro_batch": MICRO_BATCH,
                   "malloc_mmap_threshold": MMAP_THRESHOLD},
    }  # fmt: skip
    none = modes["none"]["median_peak_increment_mib"]
    for mode, side in modes.items():
        print(
            f"{mode}: peak increment {side['median_peak_increment_mib']:.1f} MiB "
            f"({side['median_peak_increment_mib'] / none:.3f} of none), "
            f"{side['median_seconds_per_step']:.2f} s/step, "
            f"max |loss difference| {side['max_abs_loss_diff']:.3g}"
        )
    if args.quick:
        return
    result = stamp(result)
    write_results("activation_memory", result, markdown(result))


if __name__ == "__main__":
    main()
