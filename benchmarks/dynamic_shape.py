"""Dynamic shape vs fixed shape on a corpus with skewed lengths: padding fraction and tokens/s.

The corpus mimics real text: most samples are short and a few are long (lengths drawn from a
log-normal distribution, capped at --seq-length 256). Fixed shape pads every batch to
--seq-length, as the built-in templates do; dynamic shape groups similar lengths and pads to
one of a few bucket lengths. Both train the same model through the Trainer on the same samples
(in a different grouping) and must reach a similar loss. Runs alternate (fixed, dynamic, ...)
after a warm-up of each; medians and the ratio are reported.

    .venv/bin/python benchmarks/dynamic_shape.py           # full run, writes result files
    .venv/bin/python benchmarks/dynamic_shape.py --quick   # smoke test, writes nothing
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from common import stamp, write_results
from torch import nn

from rapidformer import DataBundle, Trainer
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, lm_tokens, pad_collate

SEQ, HIDDEN, LAYERS, MICRO_BATCH, SAMPLES = 256, 128, 2, 16, 4096


class SkewedCorpus(MarkovLMDataset):
    """Markov-chain text whose lengths follow a log-normal law (median ~40 tokens)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        super().__init__(count, vocab_size=64, min_length=2, max_length=2, seed=seed)
        rng = np.random.RandomState(seed)
        lengths = np.clip(rng.lognormal(mean=3.7, sigma=0.8, size=count), 4, SEQ).astype(int)
        self.samples = [
            torch.randint(1, 64, (n + 1,), generator=torch.Generator().manual_seed(i))
            for i, n in enumerate(lengths)
        ]
        self.lengths = [int(n) for n in lengths]


class ShapeTrainer(Trainer):
    def __init__(self, argv: list[str], corpus: SkewedCorpus) -> None:
        super().__init__(argv=argv)
        self.corpus = corpus
        self.real_tokens = 0
        self.padded_tokens = 0

    def build_model(self) -> nn.Module:
        return TinyTransformerLM(vocab_size=64, hidden=HIDDEN, layers=LAYERS, max_positions=SEQ)

    def build_data(self) -> DataBundle:
        def collate(samples: list[Any], pad_to: int = SEQ) -> dict[str, torch.Tensor]:
            return pad_collate(samples, pad_to=pad_to)  # fixed shape: --seq-length

        return DataBundle(train=self.corpus, collate_fn=collate)

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        output = lm_loss(self.model, batch)
        self.padded_tokens += batch["input_ids"].numel()
        self.real_tokens += int(output["num_tokens"])
        return output["loss"]

    def batch_weight(self, batch: Any) -> torch.Tensor:
        return lm_tokens(batch)  # the loss is a mean over the real tokens


def run(corpus: SkewedCorpus, iterator: str, steps: int) -> dict[str, Any]:
    argv = [
        "--train-iters",
        str(steps),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--lr",
        "1e-3",
        "--lr-decay-style",
        "constant",
        "--log-interval",
        str(10 * steps),
        "--seq-length",
        str(SEQ),
        "--data-iterator",
        iterator,
    ]
    trainer = ShapeTrainer(argv, corpus)
    start = time.perf_counter()
    metrics = trainer.fit()
    elapsed = time.perf_counter() - start
    return {
        "iterator": iterator,
        "seconds": elapsed,
        "tokens_per_s": trainer.real_tokens / elapsed,
        "padding_fraction": 1 - trainer.real_tokens / trainer.padded_tokens,
        "final_loss": metrics["train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 pair, no files")
    args = parser.parse_args()
    steps, pairs = (5, 1) if args.quick else (args.steps, args.pairs)
    corpus = SkewedCorpus(SAMPLES)
    run(corpus, "fixed-shape", 3)  # warm-up: first-call costs land here
    run(corpus, "dynamic-shape", 3)
    runs: dict[str, list[dict[str, Any]]] = {"fixed-shape": [], "dynamic-shape": []}
    for pair in range(pairs):
        for iterator in runs:
            result = run(corpus, iterator, steps)
            runs[iterator].append(result)
            print(
                f"pair {pair + 1}/{pairs} {iterator:13s} {result['tokens_per_s']:9.0f} tokens/s"
                f"  padding {result['padding_fraction']:.1%}  loss {result['final_loss']:.3f}"
            )
    summary = {
        name: {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "padding_fraction": statistics.median(r["padding_fraction"] for r in rs),
            "final_loss": [r["final_loss"] for r in rs],
        }
        for name, rs in runs.items()
    }
    fixed, dynamic = summary["fixed-shape"], summary["dynamic-shape"]
    speedup = dynamic["median_tokens_per_s"] / fixed["median_tokens_per_s"]
    print(f"dynamic / fixed tokens/s: {speedup:.2f}")
    if args.quick:
        return
    result = stamp(
        {
            "steps": steps,
            "pairs": pairs,
            "seq_length": SEQ,
            "summary": summary,
            "speedup": speedup,
            "runs": runs,
        }
    )
    lengths = np.array(corpus.lengths)
    write_results("dynamic_shape", result, [
        "# Dynamic shape vs fixed shape",
        "",
        f"TinyTransformerLM hidden {HIDDEN}, {LAYERS} layers, micro batch {MICRO_BATCH}, "
        f"--seq-length {SEQ}; {SAMPLES} samples with log-normal lengths (median "
        f"{int(np.median(lengths))}, 90th percentile {int(np.percentile(lengths, 90))}, max "
        f"{lengths.max()} tokens); {steps} steps per run, {pairs} interleaved pairs after a "
        "warm-up. tokens/s counts real (unpadded) tokens.",
        "",
        "| iterator | padding fraction | median tokens/s | final losses |",
        "|---|---|---|---|",
        *(f"| {name} | {s['padding_fraction']:.1%} | {s['median_tokens_per_s']:.0f} | "
          f"{', '.join(f'{x:.3f}' for x in s['final_loss'])} |" for name, s in summary.items()),
        "",
        f"**dynamic / fixed tokens/s: {speedup:.2f}x**",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
