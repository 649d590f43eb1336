"""The dry run's memory estimate against a real step, at the GPU suite's GPT-1.3B shapes.

The GPU suite's recompute row is GPT-1.3B (24 layers, hidden 2048, 32 heads, vocabulary 50304,
micro-batch 4, sequence 1024, bf16). A CPU here has no room for 24 such layers in a few
minutes, so this runs 2 of them with everything else the same: the layers' activations, the
vocabulary-sized logits and the loss's fp32 copies, which dominate what a step adds, are those
of the GPU row. Per recompute mode, a child process trains through the engine and measures
how far one step's resident set rises above its start
(:mod:`rapidformer.testing.step_memory`); the dry run of the same flags predicts that rise.

    .venv/bin/python benchmarks/dry_run_accuracy.py          # writes the result files
    .venv/bin/python benchmarks/dry_run_accuracy.py --quick  # a 2-layer hidden-256 model
"""

from __future__ import annotations

from typing import Any

from common import argument_parser, stamp, write_results

from rapidformer.testing.step_memory import Spec, estimated_rise, measured_rise, supported

MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full"},
}
GPU_ROW = {"layers": 2, "hidden": 2048, "heads": 32, "vocab": 50304, "seq": 1024, "micro": 4}
QUICK = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 4096, "seq": 256, "micro": 4}


def spec(shape: dict[str, int], mode: str, precision: str) -> Spec:
    return {
        "config": {
            "lr": 1e-4, "micro_batch_size": shape["micro"], "global_batch_size": shape["micro"],
            "train_iters": 3, "seq_length": shape["seq"], "log_interval": 1000,
            "precision": precision, **MODES[mode],
        },
        "shape": {
            "vocab_size": shape["vocab"], "num_layers": shape["layers"],
            "hidden_size": shape["hidden"], "num_attention_heads": shape["heads"],
            "max_position_embeddings": shape["seq"], "dropout": 0.0,
        },
    }  # fmt: skip


def run(shape: dict[str, int], precision: str) -> dict[str, Any]:
    rows = {}
    for mode in MODES:
        case = spec(shape, mode, precision)
        estimated, measured = estimated_rise(case), measured_rise(case, timeout=1800)
        rows[mode] = {
            "estimated_mib": estimated / 2**20,
            "measured_mib": measured / 2**20,
            "ratio": estimated / measured,
        }
        print(f"{mode}: estimated {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f} "
              f"MiB, ratio {estimated / measured:.4f}", flush=True)  # fmt: skip
    return {"shape": shape, "precision": precision, "rows": rows}


def markdown(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    lines = [
        "# The dry run's estimate against a real step (GPT-1.3B shapes)",
        "",
        f"GPT with {shape['layers']} layers of GPT-1.3B's shape (hidden {shape['hidden']}, "
        f"{shape['heads']} heads), vocabulary {shape['vocab']}, micro-batch {shape['micro']} x "
        f"{shape['seq']} tokens, {result['precision']}, fused AdamW, one micro-batch per step, "
        "trained through the engine on the CPU. *Rise*: how far one step's resident set "
        "climbs above its start (activations, the loss's copies, the gradients as they "
        "appear), measured in a child process with `MALLOC_MMAP_THRESHOLD_=131072`, and "
        "predicted by `rapidformer --dry-run` for the same flags (its total minus the "
        "parameters and optimizer state).",
        "",
        "| recompute | estimated rise (MiB) | measured rise (MiB) | estimated / measured |",
        "|---|---|---|---|",
    ]
    for mode, row in result["rows"].items():
        lines.append(
            f"| {mode} | {row['estimated_mib']:.1f} | {row['measured_mib']:.1f} | "
            f"{row['ratio']:.4f} |"
        )
    lines += [
        "",
        "On a GPU the same count applies, with the CUDA kernels' own workspaces (cuBLAS, the "
        "attention kernel) and the caching allocator's rounding on top: the fit check keeps "
        "10% of the device for them. The GPU suite's recompute section prints the dry run's "
        "estimate beside each measured peak.",
    ]
    return lines


def main() -> None:
    parser = argument_parser(__doc__, "a 2-layer hidden-256 model")
    args = parser.parse_args()
    if not supported():
        raise SystemExit("needs Linux's /proc (VmHWM reset through /proc/self/clear_refs)")
    result = run(QUICK if args.quick else GPU_ROW, "bf16")
    if args.quick:
        return
    write_results("dry_run_accuracy", stamp(result), markdown(result))


if __name__ == "__main__":
    main()
