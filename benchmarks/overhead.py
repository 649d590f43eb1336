"""Trainer overhead: rapidformer's ``Trainer.fit()`` against a hand-written PyTorch loop.

Both sides train the same TinyTransformerLM on the same Markov corpus with the same fused
AdamW (two parameter groups), constant learning rate, clipping at 1.0, fp32, one process, no
gradient accumulation. Runs are interleaved (trainer, hand, trainer, hand, ...) in this one
process after one discarded warm-up run of each, so that drift in machine load (other jobs on
the same two cores) hits both sides alike.

What is timed (the headline "samples/s"): the training steps only.
  * hand loop: from just before the first batch is drawn to after the last optimizer step;
  * Trainer:   from the end of ``build_lr_scheduler`` (the last set-up hook ``fit()`` calls,
    once the model, optimizer and data loaders exist) to the return of ``fit()``. The few
    set-up lines after that hook (logging the plan, the resume check, creating the metrics
    logger) and the teardown (closing the logger) are charged to the Trainer, which can only
    make it look slower.

Run-to-run noise on a shared two-core machine is a few percent. Part of it is glibc's malloc:
depending on where small long-lived blocks land, freeing a step's activations may trim the
heap, and the next step then page-faults the memory back in (hundreds of faults per step, on
either side). ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1000000000`` in the
environment stops that; the MALLOC_ variables set are recorded with the results.

The Trainer runs without ``--save`` (nothing written to disk) and with a ``--log-interval``
larger than the run, so the only log line inside the timed region is the one ``fit()`` always
writes at the last step. The wall time of each whole run, set-up included, is reported too.

    .venv/bin/python benchmarks/overhead.py            # full run, writes the result files
    .venv/bin/python benchmarks/overhead.py --quick    # smoke test, writes nothing
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import torch
from common import argument_parser, stamp, write_results
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from rapidformer import DataBundle, Trainer
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, lm_tokens, pad_collate

# A small model on purpose: the Trainer's cost is a fixed amount of Python per step, so the
# cheaper the step, the larger its share. ~20 ms per step on two cores.
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 128, 2, 4, 64
MICRO_BATCH = 16
NUM_SAMPLES = 2048  # a multiple of MICRO_BATCH: every batch is full on both sides
# Every sample is SEQ tokens long, so every batch has the same shape on both sides. With
# variable lengths, each side's (different) shuffle pads its batches to different lengths
# and the two would not do the same amount of work.
LR, WEIGHT_DECAY, CLIP, SEED = 1e-3, 0.01, 1.0, 1234
LAST_N = 20  # steps whose mean loss is compared (a single step's loss is noisy)


@dataclass
class Tally:
    """Per-step bookkeeping, done identically on both sides at the same point (right after
    the forward): keep the loss, count the input positions, stamp the time."""

    losses: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    stamps: list[float] = field(default_factory=list)

    def record(self, batch: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())
        self.losses.append(loss.detach())
        self.tokens += batch["input_ids"].numel()


@dataclass
class RunResult:
    runner: str
    steps: int
    samples: int
    tokens: int
    """Input positions fed to the model (padding included): equal on both sides."""
    loop_s: float
    """Seconds spent in the training steps (see the module docstring)."""
    total_s: float
    """Seconds for the whole run, set-up (model, optimizer, loaders) included."""
    median_step_ms: float
    """Median time from one step's stamp to the next: a steady-state step time that a burst
    of load from other processes during part of the run barely moves."""
    final_loss: float
    mean_last_loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s


def make_model() -> nn.Module:
    # dropout 0: both sides then compute the same function, with no RNG draws in the step.
    return TinyTransformerLM(VOCAB, HIDDEN, LAYERS, HEADS, max_positions=SEQ, dropout=0.0)


def summarize(runner: str, tally: Tally, loop_s: float, total_s: float) -> RunResult:
    values = torch.stack(tally.losses).tolist()
    intervals = [b - a for a, b in pairwise(tally.stamps)]
    return RunResult(
        runner=runner,
        steps=len(values),
        samples=len(values) * MICRO_BATCH,
        tokens=tally.tokens,
        loop_s=loop_s,
        total_s=total_s,
        median_step_ms=statistics.median(intervals) * 1e3,
        final_loss=values[-1],
        mean_last_loss=statistics.fmean(values[-LAST_N:]),
    )


# ---- side A: the rapidformer Trainer -----------------------------------------------------
class BenchTrainer(Trainer):
    """The three hooks a user writes, plus a timestamp at the end of set-up."""

    def __init__(self, dataset: Dataset, argv: list[str]) -> None:
        super().__init__(argv=argv)
        self.dataset = dataset
        self.tally = Tally()
        self.setup_done = 0.0

    def build_model(self) -> nn.Module:
        return make_model()

    def build_data(self) -> DataBundle:
        # The corpus is built once outside the timed runs and shared by both sides.
        return DataBundle(train=self.dataset, collate_fn=pad_collate)

    def build_lr_scheduler(self, optimizer: Optimizer, total_steps: int) -> LRScheduler:
        scheduler = super().build_lr_scheduler(optimizer, total_steps)
        self.setup_done = time.perf_counter()
        return scheduler

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        output = lm_loss(self.model, batch)
        self.tally.record(batch, output["loss"])
        return output["loss"]

    def batch_weight(self, batch: Any) -> torch.Tensor:
        return lm_tokens(batch)  # the loss is a mean over the real tokens


def trainer_argv(steps: int) -> list[str]:
    return [
        "--train-iters", str(steps), "--micro-batch-size", str(MICRO_BATCH),
        "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", str(WEIGHT_DECAY),
        "--clip-grad", str(CLIP), "--seed", str(SEED),
        "--log-interval", str(10 * steps),  # only the final-step line is logged
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
        "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ),
    ]  # fmt: skip


def run_trainer(dataset: Dataset, steps: int) -> RunResult:
    # Parsing flags and creating the engine happen before fit() and are not timed.
    trainer = BenchTrainer(dataset, trainer_argv(steps))
    start = time.perf_counter()
    trainer.fit()
    end = time.perf_counter()
    trainer.engine.close()
    return summarize("trainer", trainer.tally, end - trainer.setup_done, end - start)


# ---- side B: the hand-written loop -------------------------------------------------------
def run_hand(dataset: Dataset, steps: int) -> RunResult:
    start = time.perf_counter()
    torch.manual_seed(SEED)  # fit() seeds the same way before build_model: same initial weights
    model = make_model()
    # The Trainer's groups: decay on matrices and embeddings, none on biases and norm weights.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=LR,
        fused=True,
    )
    # A constant learning rate needs no scheduler object in a hand-written loop.
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True, collate_fn=pad_collate)
    tally = Tally()
    model.train()
    loop_start = time.perf_counter()
    while len(tally.losses) < steps:  # several epochs if steps asks for more than one
        for batch in loader:
            loss = lm_loss(model, batch)["loss"]
            tally.record(batch, loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if len(tally.losses) == steps:
                break
    end = time.perf_counter()
    return summarize("hand", tally, end - loop_start, end - start)


# ---- reporting ---------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> list[str]:
    """docs/results/overhead.md without the footer (machine, date, command) that
    ``write_results`` adds."""
    trainer, hand = result["trainer"], result["hand"]
    machine = result["machine"]
    lines = [
        "# Trainer overhead",
        "",
        "rapidformer's `Trainer.fit()` against a hand-written PyTorch loop doing the same work "
        f"(TinyTransformerLM hidden {HIDDEN}, {LAYERS} layers, micro batch = global batch "
        f"{MICRO_BATCH}, sequences of {SEQ} tokens, fused AdamW, clip 1.0, constant LR, "
        f"fp32, one process), {result['steps']} steps per run, {result['pairs']} interleaved "
        "pairs after one warm-up run of each. samples/s counts the training steps only; "
        "see `benchmarks/overhead.py` for exactly what each side's clock covers.",
        "",
        "| runner | median samples/s | min | max | median step (ms) "
        f"| median run incl. set-up (s) | mean loss, last {LAST_N} steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, side in (("Trainer", trainer), ("hand loop", hand)):
        lines.append(
            f"| {name} | {side['median_samples_per_s']:.1f} | {side['min_samples_per_s']:.1f} "
            f"| {side['max_samples_per_s']:.1f} | {side['median_step_ms']:.2f} "
            f"| {side['median_total_s']:.2f} "
            f"| {statistics.median(side['mean_last_loss']):.4f} |"
        )
    lines += [
        "",
        f"**Ratio trainer / hand (medians): {result['ratio']:.3f}** (target >= 0.99); "
        f"median of the per-pair ratios: {result['median_pair_ratio']:.3f}; "
        f"best run against best run: {result['best_ratio']:.3f}; from the median step times "
        f"(hand / trainer): {result['step_ratio']:.3f}.",
        "",
        "Noise: the hand loop's own runs span "
        f"{hand['max_samples_per_s'] / hand['min_samples_per_s'] - 1:.1%} (fastest over "
        "slowest), so a gap of a few percent between the sides can come and go from one run "
        "of this script to the next. This machine's load average was "
        f"{machine['loadavg_start']} at the start, {machine['loadavg_end']} at the end; other "
        "jobs may share the physical cores without showing in it: compare the min/max spread.",
        "",
        "The losses differ slightly because the two sides shuffle with different generators "
        "(same initial weights, different batch order); each side's losses repeat exactly "
        "from run to run.",
    ]
    return lines


def side_summary(runs: list[RunResult]) -> dict[str, Any]:
    rates = [r.samples_per_s for r in runs]
    return {
        "median_samples_per_s": statistics.median(rates),
        "min_samples_per_s": min(rates),
        "max_samples_per_s": max(rates),
        "median_total_s": statistics.median(r.total_s for r in runs),
        "median_step_ms": statistics.median(r.median_step_ms for r in runs),
        "tokens_per_run": sorted({r.tokens for r in runs}),
        "final_loss": [r.final_loss for r in runs],
        "mean_last_loss": [r.mean_last_loss for r in runs],
        "runs": [asdict(r) | {"samples_per_s": r.samples_per_s} for r in runs],
    }


def main() -> None:
    parser = argument_parser(__doc__, quick="30 steps, 2 pairs")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--pairs", type=int, default=20, help="interleaved trainer/hand pairs")
    args = parser.parse_args()
    steps, pairs = (30, 2) if args.quick else (args.steps, args.pairs)
    if steps < LAST_N or pairs < 1:
        parser.error(f"need --steps >= {LAST_N} and --pairs >= 1")

    loadavg_start = os.getloadavg()
    malloc_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
    dataset = MarkovLMDataset(NUM_SAMPLES, VOCAB, SEQ, SEQ, seed=1)
    # Warm-up: first-call costs (lazy imports, kernel selection, allocator growth) go here.
    run_trainer(dataset, steps)
    run_hand(dataset, steps)
    runs: dict[str, list[RunResult]] = {"trainer": [], "hand": []}
    for pair in range(pairs):
        for runner in (run_trainer, run_hand):
            run = runner(dataset, steps)
            runs[run.runner].append(run)
            print(
                f"pair {pair + 1}/{pairs} {run.runner:7s} {run.samples_per_s:8.1f} "
                f"samples/s  step {run.median_step_ms:6.2f} ms  loop {run.loop_s:6.2f} s  "
                f"total {run.total_s:6.2f} s  "
                f"final loss {run.final_loss:.4f}  last-{LAST_N} mean "
                f"{run.mean_last_loss:.4f}",
                flush=True,
            )
    loadavg_end = os.getloadavg()

    trainer, hand = side_summary(runs["trainer"]), side_summary(runs["hand"])
    pair_ratios = [
        t.samples_per_s / h.samples_per_s
        for t, h in zip(runs["trainer"], runs["hand"], strict=True)
    ]
    result = {
        "steps": steps,
        "pairs": pairs,
        "ratio": trainer["median_samples_per_s"] / hand["median_samples_per_s"],
        "median_pair_ratio": statistics.median(pair_ratios),
        # The fastest run of each side is the one least disturbed by other jobs.
        "best_ratio": trainer["max_samples_per_s"] / hand["max_samples_per_s"],
        "step_ratio": hand["median_step_ms"] / trainer["median_step_ms"],
        "trainer": trainer,
        "hand": hand,
        "config": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS,
                   "seq_length": SEQ, "micro_batch": MICRO_BATCH, "num_samples": NUM_SAMPLES,
                   "lr": LR, "weight_decay": WEIGHT_DECAY, "clip": CLIP, "seed": SEED},
    }  # fmt: skip
    print(
        f"trainer median {trainer['median_samples_per_s']:.1f} samples/s, hand median "
        f"{hand['median_samples_per_s']:.1f} samples/s, ratio {result['ratio']:.3f} "
        f"(per-pair median {result['median_pair_ratio']:.3f}, best/best "
        f"{result['best_ratio']:.3f}, median step times {result['step_ratio']:.3f})"
    )
    print(
        f"mean loss of the last {LAST_N} steps: trainer "
        f"{statistics.median(trainer['mean_last_loss']):.4f}, hand "
        f"{statistics.median(hand['mean_last_loss']):.4f}"
    )
    if trainer["tokens_per_run"] != hand["tokens_per_run"]:
        print(
            f"WARNING: unequal work: tokens per run {trainer['tokens_per_run']} (trainer) "
            f"vs {hand['tokens_per_run']} (hand)"
        )
    if args.quick:
        return
    # glibc's malloc tuning changes the page faults each step pays (see the docstring): the
    # command sets the same MALLOC_ variables, and the machine record keeps them.
    result = stamp(result, env=malloc_env)
    result["machine"] |= {
        "malloc_env": malloc_env,
        "loadavg_start": [round(x, 2) for x in loadavg_start],
        "loadavg_end": [round(x, 2) for x in loadavg_end],
    }
    write_results("overhead", result, markdown(result))


if __name__ == "__main__":
    main()
