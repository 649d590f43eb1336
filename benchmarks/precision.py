"""fp32 vs bf16 vs fp16 end to end: samples/s, their ratios to fp32, and peak memory.

Two models train through RapidformerEngine with ``--precision`` set and nothing else changed:
the built-in GPT (4 layers, hidden 512, vocabulary 8192) and a Hugging Face BERT-base-shaped
``BertForMaskedLM`` (hidden 768, 12 heads, FFN 3072, vocabulary 30522) at reduced depth (2
layers here; the GPU suite runs all 12). Batches of 8 x 128 random tokens, AdamW. Each
(model, precision) runs in a fresh process (peak memory is per process: peak RSS with
``MALLOC_MMAP_THRESHOLD_=131072`` on a CPU, ``max_memory_allocated`` on a GPU); the
precisions alternate over rounds and the median step time of each is compared. The CPU's model
and matrix features are recorded: which precision is fastest depends on them (the reference
tool's anchor is 1.73x for mixed precision on BERT-base on GPUs).

    .venv/bin/python benchmarks/precision.py          # writes the result files
    .venv/bin/python benchmarks/precision.py --quick  # tiny shapes, one round, writes nothing
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from common import argument_parser, stamp, write_results

PRECISIONS = ("fp32", "bf16", "fp16")
SHAPES: dict[str, dict[str, int]] = {
    "gpt": {"layers": 4, "hidden": 512, "heads": 8, "vocab": 8192},
    "bert": {"layers": 2, "hidden": 768, "heads": 12, "vocab": 30522},
}
QUICK = {"layers": 1, "hidden": 64, "heads": 4, "vocab": 512}
Runs = dict[str, dict[str, list[dict[str, Any]]]]
"""model -> precision -> one result per round."""


def _model(kind: str, shape: dict[str, int], seq: int) -> torch.nn.Module:
    if kind == "gpt":
        from rapidformer.models.gpt import GPTConfig, GPTModel

        config = GPTConfig(
            vocab_size=shape["vocab"],
            num_layers=shape["layers"],
            hidden_size=shape["hidden"],
            num_attention_heads=shape["heads"],
            max_position_embeddings=seq,
            dropout=0.0,
        )
        return GPTModel.build(config)
    import transformers

    torch.manual_seed(0)
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"],
            intermediate_size=4 * shape["hidden"],
            max_position_embeddings=512,
        )
    )


def run_one(
    kind: str, precision: str, shape: dict[str, int], steps: int, batch: int, seq: int
) -> dict[str, Any]:
    """One (model, precision) in this process: step times and peak memory."""
    import torch.nn.functional as F

    from rapidformer import RapidformerConfig, RapidformerEngine
    from rapidformer.step_io import StepFunctions

    engine = RapidformerEngine(
        RapidformerConfig.from_dict({"lr": 1e-4, "precision": precision, "seed": 0}),
        builds_optimizer=True,
    )
    state = engine.compose(_model(kind, shape, seq))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, shape["vocab"], (batch, seq + 1), generator=generator)
    ids = ids.to(engine.device)

    def loss(batch_ids: torch.Tensor) -> torch.Tensor:
        if kind == "gpt":
            logits = state.model(batch_ids[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1).float(), batch_ids[:, 1:].flatten())
        labels = batch_ids[:, :-1].masked_fill(batch_ids[:, :-1] % 7 != 0, -100)  # ~15%
        return state.model(input_ids=batch_ids[:, :-1], labels=labels).loss

    step = StepFunctions(train_step=loss, weight=lambda batch_ids: batch_ids.shape[0])
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    times = []
    for index in range(steps + 2):  # two warm-up steps
        started = time.perf_counter()
        result = engine.run_step([ids], step)
        final_loss = result.loss  # reads the host: the step is done when this returns
        if index >= 2:
            times.append(time.perf_counter() - started)
    from rapidformer.memory import peak_memory_bytes

    engine.close()
    return {
        "step_s": times,
        "loss": final_loss,
        "peak_memory_mb": peak_memory_bytes(engine.device) / 2**20,
        "device": str(engine.device),
    }


def _child(kind: str, precision: str, args: Any) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        json.dumps({"kind": kind, "precision": precision, "quick": args.quick, **vars_of(args)}),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {precision} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def vars_of(args: Any) -> dict[str, Any]:
    return {"steps": args.steps, "batch": args.batch, "seq": args.seq, "layers": args.layers}


def main() -> None:
    parser = argument_parser(__doc__ or "", "tiny shapes, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="BERT depth (default 2)")
    parser.add_argument("--name", default="precision", help="result file name")
    parser.add_argument("--child", help=argparse_suppress())
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        shape = dict(QUICK if spec["quick"] else SHAPES[spec["kind"]])
        if spec["kind"] == "bert" and spec["layers"] and not spec["quick"]:
            shape["layers"] = spec["layers"]
        result = run_one(
            spec["kind"], spec["precision"], shape, spec["steps"], spec["batch"], spec["seq"]
        )
        print(json.dumps({**result, "shape": shape}))
        return
    if args.quick:
        args.rounds, args.steps, args.seq = 1, 2, 32
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {p: [] for p in PRECISIONS} for k in SHAPES
    }
    for round_index in range(args.rounds):
        for kind in SHAPES:
            for precision in PRECISIONS:  # alternating: drifts in machine speed hit all three
                run = _child(kind, precision, args)
                runs[kind][precision].append(run)
                print(
                    f"round {round_index + 1} {kind} {precision}: "
                    f"{statistics.median(run['step_s']) * 1e3:.0f} ms/step, "
                    f"{run['peak_memory_mb']:.0f} MiB, loss {run['loss']:.3f}"
                )
    table = summarize(runs, args.batch)
    for kind, rows in table.items():
        for precision, row in rows.items():
            print(
                f"{kind} {precision}: {row['samples_per_s']:.2f} samples/s, "
                f"{row['vs_fp32']:.2f}x fp32, {row['peak_memory_mb']:.0f} MiB"
            )
    if args.quick:
        return
    result = stamp(
        {
            "shapes": {k: runs[k]["fp32"][0]["shape"] for k in SHAPES},
            "batch": args.batch,
            "seq": args.seq,
            "rounds": args.rounds,
            "steps": args.steps,
            "table": table,
            "runs": runs,
        }
    )
    device = runs["gpt"]["fp32"][0]["device"]
    lines = [
        f"# Precision: fp32 vs bf16 vs fp16 ({device})",
        "",
        f"Batches of {args.batch} x {args.seq} tokens through RapidformerEngine, AdamW; each "
        f"(model, precision) in its own process, {args.rounds} alternating rounds of "
        f"{args.steps} timed steps after 2 warm-up steps; medians. Peak memory: the process's "
        "peak RSS on a CPU (MALLOC_MMAP_THRESHOLD_=131072), max_memory_allocated on a GPU.",
        "",
        "| model | precision | samples/s | vs fp32 | peak memory (MiB) | loss after the steps |",
        "|---|---|---|---|---|---|",
    ]
    for kind, rows in table.items():
        shape = runs[kind]["fp32"][0]["shape"]
        label = f"{kind} ({shape['layers']} layers, hidden {shape['hidden']})"
        for precision, row in rows.items():
            lines.append(
                f"| {label} | {precision} | {row['samples_per_s']:.2f} | "
                f"**{row['vs_fp32']:.2f}x** | {row['peak_memory_mb']:.0f} | {row['loss']:.3f} |"
            )
    lines += [
        "",
        "The reference tool's anchor: 1.73x for mixed precision on BERT-base on GPUs. On a CPU "
        "the answer depends on its matrix features (in the machine line below): with "
        "avx512_bf16 / AMX bf16 runs faster than fp32, without them slower.",
    ]
    write_results(args.name, result, lines)


def summarize(runs: Runs, batch: int) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for kind, by_precision in runs.items():
        medians = {
            p: statistics.median(t for run in rs for t in run["step_s"])
            for p, rs in by_precision.items()
        }
        table[kind] = {
            p: {
                "median_step_s": medians[p],
                "samples_per_s": batch / medians[p],
                "vs_fp32": medians["fp32"] / medians[p],
                "peak_memory_mb": max(run["peak_memory_mb"] for run in by_precision[p]),
                "loss": by_precision[p][-1]["loss"],
            }
            for p in by_precision
        }
    return table


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
