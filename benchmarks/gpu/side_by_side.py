"""Throughput as an instrument: the engine's step beside a hand-written loop of the same model.

Both sides train the same model (same shape, same initial weights, same batch) with bf16
autocast, ``AdamW(fused=True)`` and clipping at 1.0. The engine side is
``RapidformerEngine.compose(model)`` + ``run_step``; the hand side is the five lines every
PyTorch user writes, compiled the same way where the row is compiled (``blocks``: each
transformer block ``.compile()``d in place; ``model``: the model and its loss in one
``torch.compile``). Timed blocks are interleaved (engine, hand, hand, engine, ...) after a
warm-up of each side (which also compiles), so drift in clocks and load hits both alike; each
block is ``--steps`` steps between two device synchronisations, and the losses are read only
after the block (``loss_tensor``), as a loop that logs at intervals would.

Rows: the built-in GPT-350M and GPT-1.3B, and a Hugging Face ``LlamaForCausalLM`` of 1.2B
(24 x 2048, random weights: no download), each eager, compiled per block and compiled whole;
the Llama also eager with ``--liger-kernel`` (skipped, with the reason, without Liger or CUDA);
GPT-1.3B also compiled with ``--fused-lm-loss``, and the headline row: compiled with fp8 and
the fused loss (skipped without a float8 GPU or torchao), both beside the hand loop compiled
whole in bf16.
Reported per row: tokens/s of each side per repeat, the engine / hand ratio per repeat with its
median and spread (min, max), the engine's MFU and peak memory, the graphs compile counted and
any eager fallback, and both sides' last loss (equal start: they should agree).

    python3 benchmarks/gpu/side_by_side.py --out DIR                 # on a GPU
    python3 benchmarks/gpu/side_by_side.py --out DIR --dry-run       # tiny shapes (CPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidformer import RapidformerConfig, RapidformerEngine
from rapidformer.accel.compile import apply as compile_apply
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.step_io import StepFunctions

VOCAB = 50304
SEQ = 1024


@dataclass(frozen=True)
class ModelRow:
    """One model of the table: how to build it (on the CPU, seeded) and its micro-batch."""

    name: str
    kind: str  # "gpt" or "llama"
    layers: int
    hidden: int
    heads: int
    batch: int

    def build(self, seq: int, vocab: int) -> nn.Module:
        torch.manual_seed(0)
        if self.kind == "gpt":
            config = GPTConfig(
                vocab_size=vocab,
                num_layers=self.layers,
                hidden_size=self.hidden,
                num_attention_heads=self.heads,
                max_position_embeddings=seq,
                dropout=0.0,
            )
            return GPTModel.build(config, device="cpu")
        import transformers  # only for the Llama row (the GPU image has it)

        llama = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.hidden * 11 // 4,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(llama)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks a user would compile one by one."""
        if self.kind == "gpt":
            return list(model.blocks.values())  # type: ignore[union-attr,operator]
        return list(model.model.layers)  # type: ignore[union-attr,arg-type]


MODELS = [
    ModelRow("GPT-350M", "gpt", 24, 1024, 16, 8),
    ModelRow("GPT-1.3B", "gpt", 24, 2048, 16, 4),
    ModelRow("Llama-1.2B", "llama", 24, 2048, 16, 4),
]
TINY = [ModelRow("GPT-tiny", "gpt", 2, 64, 4, 2), ModelRow("Llama-tiny", "llama", 2, 64, 4, 2)]
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {},
    "eager + liger": {"liger_kernel": True},  # Hugging Face rows only
    "compile": {"torch_compile": True},
    "compile (model scope)": {"torch_compile": True, "torch_compile_scope": "model"},
    # Built-in GPT rows only: the fused LM loss, and the headline (the switches that fit
    # together: compile, fp8, the fused loss), each beside the hand loop compiled whole in bf16.
    "compile + fused loss": {"torch_compile": True, "fused_lm_loss": True},
    "headline: compile + fp8 + fused loss": {
        "torch_compile": True,
        "precision": "fp8",
        "fused_lm_loss": True,
    },
}
BUILT_IN_ONLY = ("compile + fused loss", "headline: compile + fp8 + fused loss")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits of the built-in GPT (a tensor) or a Hugging Face model (``.logits``)."""
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


class HandLoop:
    """The hand-written reference: autocast, backward, clip, fused AdamW; compiled like the
    row (``scope`` None: eager)."""

    def __init__(self, row: ModelRow, model: nn.Module, scope: str | None) -> None:
        self.device = next(model.parameters()).device
        self.model = model
        if hasattr(model, "generation_config"):  # Hugging Face: no KV cache in training
            model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.0, fused=self.device.type == "cuda"
        )

        def loss(ids: torch.Tensor) -> torch.Tensor:
            return next_token_loss(logits_of(self.model, ids[:, :-1]), ids)

        self.loss: Callable[[torch.Tensor], torch.Tensor] = loss
        # The engine's backend on both sides (a dry run swaps in aot_eager; suite.py).
        backend = compile_apply.BACKEND
        if scope == "blocks":
            for block in row.blocks(model):
                block.compile(backend=backend, dynamic=False)
        elif scope == "model":
            self.loss = torch.compile(loss, backend=backend, dynamic=False)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
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


def run_row(row: ModelRow, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    seq, vocab = (32, 512) if args.dry_run else (SEQ, VOCAB)
    config = RapidformerConfig.from_dict(
        {
            "lr": 1e-4,
            "precision": "bf16",
            "optimizers": "apex_adam",  # AdamW(fused=True) where torch has the kernel
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "seq_length": seq,
            "micro_batch_size": row.batch,
            "global_batch_size": row.batch,
            "log_interval": 10**9,  # the benchmark reads once per block
            "train_iters": 10**9,  # as a template's loop (--fused-lm-loss needs one)
            **options,
        }
    )
    engine = RapidformerEngine(config, builds_optimizer=True, runs_loop=True)
    device = engine.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    state = engine.compose(row.build(seq, vocab))
    engine_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    scope = options.get("torch_compile_scope", "blocks") if options.get("torch_compile") else None
    if options.get("fused_lm_loss"):
        scope = "model"  # the best hand-written baseline: the whole model and loss compiled
    hand = HandLoop(row, row.build(seq, vocab).to(device), scope)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (row.batch, seq + 1), generator=generator).to(device)
    # The template's split: the model's logits, then the loss (compiled with the model under
    # --torch-compile-scope model, as the Pretrainer's compute_loss is).
    loss_of = engine.compiled_loss(next_token_loss)
    functions = StepFunctions(
        train_step=lambda b: loss_of(logits_of(state.model, b[:, :-1]), b),
        weight=lambda b: b.shape[0],
    )
    if options.get("fused_lm_loss"):  # the built-in GPT computes its loss from the labels
        functions = StepFunctions(
            train_step=lambda b: state.model(b[:, :-1], None, b[:, 1:]),
            weight=lambda b: b.shape[0],
        )

    def engine_step(b: torch.Tensor) -> torch.Tensor:
        return engine.run_step([b], functions).loss_tensor

    sides = {"engine": engine_step, "hand": hand.step}
    warmup_s = {}
    for side, step in sides.items():  # warm-up: compile, allocator, cuBLAS heuristics
        warmup_s[side], _ = _timed(step, ids, args.warmup, device)
    times: dict[str, list[float]] = {"engine": [], "hand": []}
    last: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = ["engine", "hand"] if repeat % 2 == 0 else ["hand", "engine"]
        for side in order:
            seconds, loss = _timed(sides[side], ids, args.steps, device)
            times[side].append(seconds)
            last[side] = float(loss)
    tokens = row.batch * seq * args.steps
    ratios = [h / e for e, h in zip(times["engine"], times["hand"], strict=True)]
    engine_tokens = statistics.median(tokens / t for t in times["engine"])
    assert engine.mfu is not None
    result = {
        "tokens_per_s": {side: [tokens / t for t in ts] for side, ts in times.items()},
        "engine_tokens_per_s": engine_tokens,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        **engine.mfu.fields(engine_tokens),
        "peak_memory_mb": engine_memory / 2**20,
        "warmup_s": warmup_s,
        "last_loss": last,
        **engine.step_metrics(),  # compile_graphs / compile_fallbacks where compiled
        "plan": [str(p) for p in state.plan],
    }
    engine.close()
    torch._dynamo.reset()  # the next row compiles its own graphs (the kernel cache stays)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_table(args: argparse.Namespace) -> dict[str, Any]:
    """Every model x variant row (``args.models`` / ``args.variants`` select)."""
    models = TINY if args.dry_run else [m for m in MODELS if m.name in args.models]
    rows = {}
    for model in models:
        for variant in args.variants:
            options = VARIANTS[variant]
            if options.get("liger_kernel") and model.kind != "llama":
                continue  # Liger patches Hugging Face models
            if variant in BUILT_IN_ONLY and (model.kind != "gpt" or "350M" in model.name):
                continue  # the fused loss is the built-in GPT's; the headline is at 1.3B
            name = f"{model.name} {variant}"
            why = _cannot_run(options)
            if why:
                rows[name] = {"skipped": why}
                print(f"{name}: skipped ({why})", flush=True)
                continue
            rows[name] = run_row(model, options, args)
            print(_line(name, rows[name]), flush=True)
    seq = 32 if args.dry_run else SEQ
    return {"seq": seq, "steps": args.steps, "repeats": args.repeats, "rows": rows}


def _cannot_run(options: dict[str, Any]) -> str:
    """Why a row cannot run on this machine (a missing optional package), or ""."""
    if options.get("liger_kernel"):
        if not torch.cuda.is_available():
            return "Liger-Kernel needs CUDA"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (bring its wheel: docs/gpu-extras.md)"
    if options.get("precision") == "fp8":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            return "fp8 needs a GPU of compute capability 8.9 or newer"
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (bring its wheel: docs/gpu-extras.md)"
    return ""


def _line(name: str, row: dict[str, Any]) -> str:
    return (
        f"{name}: engine/hand median {row['ratio_median']:.3f} (min {row['ratio_min']:.3f}, "
        f"max {row['ratio_max']:.3f}); engine {row['engine_tokens_per_s']:.0f} tokens/s, "
        f"MFU {row.get('mfu', float('nan')):.3f}; last loss {row['last_loss']}"
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", help="folder for side_by_side.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, seconds)")
    parser.add_argument("--models", nargs="*", default=[m.name for m in MODELS])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved blocks per side")
    parser.add_argument("--warmup", type=int, default=3)
    return parser


def dry_run_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """A dry run's few steps (the code paths, not the numbers)."""
    if args.dry_run:
        args.steps, args.repeats, args.warmup = 2, 3, 1
    return args


def main() -> None:
    args = dry_run_sizes(parser().parse_args())
    if not args.out:
        raise SystemExit("--out DIR is required")
    torch.backends.cuda.matmul.allow_tf32 = True
    result = {"torch": torch.__version__, **run_table(args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_by_side.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
