"""The engine's step against a hand-written PyTorch loop of the same model, in one process.

Both sides train the built-in GPT (same shape, same initial weights, same batch) with bf16
autocast (or fp16 with a GradScaler), ``AdamW(fused=True)`` and clipping at 1.0. The engine side
is ``RapidformerEngine.compose(model)`` + ``run_step``; the hand side is the five lines every
PyTorch user writes. Timed blocks are interleaved (engine, hand, hand, engine, ...) after a
warm-up of each, so drift in clocks and load hits both alike; each block is ``--steps`` steps
between two device synchronisations, and the engine's losses are read only after the block
(``loss_tensor``), as a loop that logs at intervals would.

Reported per row: tokens/s of each side per repeat, the engine / hand ratio per repeat, their
median and spread (min, max), and both sides' last loss (equal start, so they should agree).

    python3 benchmarks/gpu/engine_vs_hand.py --out DIR                 # on a GPU
    python3 benchmarks/gpu/engine_vs_hand.py --out DIR --dry-run       # tiny shapes (CPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import StepFunctions

SIZES = {"GPT-350M": (24, 1024, 16, 8), "GPT-1.3B": (24, 2048, 16, 4)}
"""name -> layers, hidden, heads, micro-batch (sequence length 1024)."""
TINY = {"GPT-tiny": (2, 64, 4, 2)}
VOCAB = 50304


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpt(shape: tuple[int, int, int, int], seq: int, device: str) -> GPTModel:
    layers, hidden, heads, _ = shape
    config = GPTConfig(
        vocab_size=VOCAB,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        max_position_embeddings=seq,
        dropout=0.0,
    )
    torch.manual_seed(0)
    return GPTModel.build(config, device=device)


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


class HandLoop:
    """The hand-written reference: autocast, backward, clip, fused AdamW."""

    def __init__(self, model: GPTModel, precision: str, device: torch.device) -> None:
        self.model = model
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        self.device = device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda"
        )
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype):
            loss = _loss(self.model, ids)
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _timed(step: Any, ids: torch.Tensor, steps: int, device: torch.device) -> tuple[float, Any]:
    _sync(device)
    started = time.perf_counter()
    last = None
    for _ in range(steps):
        last = step(ids)
    _sync(device)
    return time.perf_counter() - started, last


def run_row(name: str, shape: tuple[int, int, int, int], args: argparse.Namespace) -> dict:
    seq = 32 if args.dry_run else 1024
    batch = shape[3]
    config = RapidformerConfig.from_dict(
        {
            "lr": 1e-4,
            "precision": args.precision,
            "optimizers": "apex_adam",  # AdamW(fused=True) where torch has the kernel
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "seq_length": seq,
            "micro_batch_size": batch,
            "global_batch_size": batch,
        }
    )
    engine = RapidformerEngine(config, builds_optimizer=True)
    device = engine.device
    state = engine.compose(_gpt(shape, seq, "cpu"))
    hand = HandLoop(_gpt(shape, seq, "cpu").to(device), args.precision, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator).to(device)
    functions = StepFunctions(
        train_step=lambda b: _loss(state.model, b), weight=lambda b: b.shape[0]
    )

    def engine_step(b: torch.Tensor) -> torch.Tensor:
        return engine.run_step([b], functions).loss_tensor

    sides = {"engine": engine_step, "hand": hand.step}
    for step in sides.values():  # warm-up: allocator, cuDNN/cuBLAS heuristics
        _timed(step, ids, args.warmup, device)
    times: dict[str, list[float]] = {"engine": [], "hand": []}
    last: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = ["engine", "hand"] if repeat % 2 == 0 else ["hand", "engine"]
        for side in order:
            seconds, loss = _timed(sides[side], ids, args.steps, device)
            times[side].append(seconds)
            last[side] = float(loss)
    engine.close()
    tokens = batch * seq * args.steps
    ratios = [h / e for e, h in zip(times["engine"], times["hand"], strict=True)]
    return {
        "precision": args.precision,
        "tokens_per_s": {side: [tokens / t for t in ts] for side, ts in times.items()},
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "last_loss": last,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for engine_vs_hand.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, seconds)")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), help="rows to run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved blocks per side")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--label", default="", help="stored with the results (e.g. a commit)")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.repeats, args.warmup = 2, 2, 1
    torch.backends.cuda.matmul.allow_tf32 = True
    sizes = TINY if args.dry_run else {name: SIZES[name] for name in args.sizes}
    rows = {name: run_row(name, shape, args) for name, shape in sizes.items()}
    result = {"label": args.label, "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.label}" if args.label else ""
    (out / f"engine_vs_hand{suffix}.json").write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        print(
            f"{args.label or 'engine'} {name} {row['precision']}: engine/hand median "
            f"{row['ratio_median']:.3f} (min {row['ratio_min']:.3f}, max {row['ratio_max']:.3f}); "
            f"tokens/s engine {statistics.median(row['tokens_per_s']['engine']):.0f}, "
            f"hand {statistics.median(row['tokens_per_s']['hand']):.0f}; "
            f"last loss {row['last_loss']}"
        )


if __name__ == "__main__":
    main()
