"""Peak memory and time of the LM head + cross-entropy, plain vs ``--fused-lm-loss``.

One forward and backward of ``F.cross_entropy(F.linear(h, W))`` at vocabulary 50,304 (GPT-2's,
padded), hidden 1,024 and 4,096 tokens in fp32, against
:func:`rapidformer.models.fused_loss.fused_linear_cross_entropy` on the same tensors. Each run
is its own child process with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed buffers leave the
resident set, see activation_memory.py); the figure is the peak RSS increment over the RSS
once the inputs exist. Plain holds the logits (824 MB at this size) and their gradient; fused
holds one chunk's logits (256 MiB at most).

    .venv/bin/python benchmarks/lm_loss_memory.py            # full run, writes result files
    .venv/bin/python benchmarks/lm_loss_memory.py --quick    # smoke test, writes nothing
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from activation_memory import peak_rss_kib, rss_kib  # one way to read the resident set

VOCAB, HIDDEN, TOKENS = 50304, 1024, 4096
MMAP_THRESHOLD = "131072"  # what activation_memory.run_script_child sets for the children
RESULT_PREFIX = "RESULT "  # the line run_script_child reads
MODES = ("plain", "fused")


def child(mode: str, tokens: int, vocab: int) -> None:
    from rapidformer.models.fused_loss import chunk_tokens, fused_linear_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=generator, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, HIDDEN, generator=generator)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    baseline = rss_kib()
    started = time.perf_counter()
    if mode == "plain":
        loss = F.cross_entropy(F.linear(hidden, weight), targets)
    else:
        loss = fused_linear_cross_entropy(hidden, weight, None, targets)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = peak_rss_kib()
    result = {
        "mode": mode,
        "peak_increment_mib": (peak - baseline) / 1024,
        "seconds": seconds,
        "loss": loss.item(),
        "grad_norm": hidden.grad.norm().item(),  # type: ignore[union-attr]
        "chunk_tokens": chunk_tokens(vocab),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(mode: str, tokens: int, vocab: int) -> dict[str, Any]:
    from activation_memory import run_script_child  # same mmap threshold, same RESULT line

    return run_script_child(
        __file__, "--child", mode, "--tokens", str(tokens), "--vocab", str(vocab)
    )


def main() -> None:
    from common import argument_parser, stamp, write_results

    parser = argument_parser(__doc__ or "", quick="vocabulary 5,000, 512 tokens, 1 run each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens, args.vocab)
        return
    tokens, vocab, repeats = (512, 5000, 1) if args.quick else (TOKENS, VOCAB, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES:  # interleaved
            run = run_child(mode, tokens, vocab)
            runs[mode].append(run)
            print(
                f"run {repeat + 1}/{repeats} {mode:6s} peak increment "
                f"{run['peak_increment_mib']:7.1f} MiB, {run['seconds']:.2f} s, "
                f"loss {run['loss']:.6f}",
                flush=True,
            )
    summary = {
        mode: {
            "median_peak_increment_mib": statistics.median(r["peak_increment_mib"] for r in rs),
            "median_seconds": statistics.median(r["seconds"] for r in rs),
        }
        for mode, rs in runs.items()
    }
    plain, fused = summary["plain"], summary["fused"]
    loss_gap = abs(runs["plain"][0]["loss"] - runs["fused"][0]["loss"])
    memory = fused["median_peak_increment_mib"] / plain["median_peak_increment_mib"]
    speed = fused["median_seconds"] / plain["median_seconds"]
    print(f"fused / plain: memory {memory:.3f}, time {speed:.2f}, |loss gap| {loss_gap:.2e}")
    if args.quick:
        return
    result = stamp(
        {"tokens": tokens, "vocab": vocab, "hidden": HIDDEN, "repeats": repeats,
         "summary": summary, "runs": runs, "memory_ratio": memory, "time_ratio": speed,
         "loss_gap": loss_gap}
    )  # fmt: skip
    chunk = runs["fused"][0]["chunk_tokens"]
    write_results("lm_loss_memory", result, [
        "# LM head + cross-entropy: plain vs `--fused-lm-loss`",
        "",
        f"One forward and backward, {tokens} tokens x hidden {HIDDEN} -> vocabulary {vocab}, "
        f"fp32, on the CPU; each run its own process with `MALLOC_MMAP_THRESHOLD_="
        f"{MMAP_THRESHOLD}`, {repeats} interleaved runs per mode, medians. Peak increment: peak "
        "RSS minus RSS once the inputs exist (the weight's gradient, 196 MiB, is in both).",
        "",
        "| mode | peak increment (MiB) | s |",
        "|---|---|---|",
        f"| plain `F.cross_entropy(F.linear(h, W))` | {plain['median_peak_increment_mib']:.0f} "
        f"| {plain['median_seconds']:.2f} |",
        f"| fused, chunks of {chunk} tokens | {fused['median_peak_increment_mib']:.0f} "
        f"| {fused['median_seconds']:.2f} |",
        "",
        f"**fused / plain: memory {memory:.2f}x, time {speed:.2f}x** (the backward computes "
        f"each chunk's logits again); loss difference {loss_gap:.1e}.",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
