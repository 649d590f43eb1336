"""Optimizer step time on a ~50M-parameter transformer: default AdamW, fused AdamW, rapidformer's
multi-tensor LAMB, the same LAMB through ``torch.compile`` and pytorch-optimizer's reference LAMB.

Only ``optimizer.step()`` is timed, on fixed random gradients of the parameter shapes of a
TinyTransformerLM (hidden 512, 6 layers, vocabulary 32000: ~51.7M parameters) with rapidformer's
two parameter groups (weight decay on matrices and embeddings only). Each optimizer owns its
copy of the parameters. After two warm-up steps each, rounds alternate the optimizers (a few
steps each per round); medians per optimizer and ratios to default AdamW are reported.
pytorch-optimizer must be installed (the ``dev`` extra).

    .venv/bin/python benchmarks/optimizers.py           # full run, writes result files
    .venv/bin/python benchmarks/optimizers.py --quick   # smoke test, writes nothing
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import argument_parser, stamp, write_results
from pytorch_optimizer import Lamb as ReferenceLamb
from torch import nn

from rapidformer.accel.optim.lamb import Lamb
from rapidformer.accel.optim.optimizers import parameter_groups
from rapidformer.testing import TinyTransformerLM

HIDDEN, LAYERS, VOCAB, LR, DECAY = 512, 6, 32000, 1e-3, 0.01


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in g.items() if k != "trust_ratio"} for g in parameter_groups(model, DECAY)
    ]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "AdamW (default, for-loop)": lambda m: torch.optim.AdamW(
        _groups(m), lr=LR, foreach=False, fused=False
    ),
    "AdamW(fused=True)": lambda m: torch.optim.AdamW(_groups(m), lr=LR, fused=True),
    "rapidformer Lamb (foreach)": lambda m: Lamb(
        parameter_groups(m, DECAY), lr=LR, weight_decay=DECAY
    ),
    "rapidformer Lamb (torch.compile)": lambda m: Lamb(
        parameter_groups(m, DECAY), lr=LR, weight_decay=DECAY, compiled=True
    ),
    "pytorch-optimizer Lamb": lambda m: ReferenceLamb(_groups(m), lr=LR, weight_decay=DECAY),
}


def build(name: str, hidden: int, layers: int, vocab: int) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = TinyTransformerLM(
        vocab_size=vocab, hidden=hidden, layers=layers, heads=8, max_positions=512
    )
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, generator=generator)
    return OPTIMIZERS[name](model)


def timed_steps(optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argument_parser(__doc__, "hidden 128, 2 layers, vocabulary 1000, 1 round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per optimizer per round")
    args = parser.parse_args()
    shape = (128, 2, 1000) if args.quick else (HIDDEN, LAYERS, VOCAB)
    rounds = 1 if args.quick else args.rounds
    optimizers = {name: build(name, *shape) for name in OPTIMIZERS}
    params = sum(
        p.numel() for g in optimizers["AdamW(fused=True)"].param_groups for p in g["params"]
    )
    print(f"{params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads")
    warmup_s = {}
    for name, optimizer in optimizers.items():
        # warm-up: state allocation and first-call costs (the compile, for the compiled one)
        warmup_s[name] = sum(timed_steps(optimizer, 2))
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for r in range(rounds):
        for name, optimizer in optimizers.items():
            times[name] += timed_steps(optimizer, args.steps)
            print(
                f"round {r + 1}/{rounds} {name:28s} {statistics.median(times[name]) * 1e3:9.1f} ms"
            )
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = median_ms["AdamW (default, for-loop)"]
    ratios = {name: base / ms for name, ms in median_ms.items()}
    lamb_vs_reference = (
        median_ms["pytorch-optimizer Lamb"] / median_ms["rapidformer Lamb (foreach)"]
    )
    lamb_vs_fused = median_ms["rapidformer Lamb (foreach)"] / median_ms["AdamW(fused=True)"]
    compiled = "rapidformer Lamb (torch.compile)"
    compiled_vs_fused = median_ms[compiled] / median_ms["AdamW(fused=True)"]
    compiled_vs_foreach = median_ms["rapidformer Lamb (foreach)"] / median_ms[compiled]
    for name in optimizers:
        print(f"{name:28s} {median_ms[name]:9.1f} ms  {ratios[name]:6.2f}x vs default AdamW")
    print(f"rapidformer Lamb vs reference Lamb: {lamb_vs_reference:.2f}x faster")
    if args.quick:
        return
    result = stamp(
        {
            "parameters": params,
            "rounds": rounds,
            "steps_per_round": args.steps,
            "median_step_ms": median_ms,
            "speedup_vs_default_adamw": ratios,
            "lamb_speedup_vs_reference": lamb_vs_reference,
            "lamb_time_vs_fused_adamw": lamb_vs_fused,
            "compiled_lamb_time_vs_fused_adamw": compiled_vs_fused,
            "compiled_lamb_speedup_vs_foreach": compiled_vs_foreach,
            "warmup_s": warmup_s,
            "times_s": times,
        }
    )
    write_results("optimizers", result, [
        "# Optimizer step time",
        "",
        f"`optimizer.step()` alone on fixed random gradients, TinyTransformerLM hidden "
        f"{shape[0]}, {shape[1]} layers, vocabulary {shape[2]}: {params / 1e6:.1f}M parameters "
        f"in rapidformer's two groups; {rounds} interleaved rounds of {args.steps} steps per "
        "optimizer after 2 warm-up steps each; medians.",
        "",
        "| optimizer | median step (ms) | speedup vs default AdamW |",
        "|---|---|---|",
        *(f"| {name} | {median_ms[name]:.1f} | {ratios[name]:.2f}x |" for name in optimizers),
        "",
        f"**rapidformer LAMB vs pytorch-optimizer's LAMB: {lamb_vs_reference:.2f}x faster; "
        f"LAMB step / fused AdamW step: {lamb_vs_fused:.2f} (multi-tensor), "
        f"{compiled_vs_fused:.2f} (torch.compile, {compiled_vs_foreach:.2f}x faster than "
        f"multi-tensor after a {warmup_s[compiled]:.0f} s first compile and step)**",
        "",
        "On CUDA rapidformer builds the compiled LAMB (`--optimizers apex_lamb` without apex); "
        "the GPU suite's optimizer section times it against fused AdamW there.",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
