"""Loss curves: the demo's pretraining on one process, and the same run on every layout.

The demo's black-box GPT pretraining (`make demo`: 2000 synthetic documents, GPT-2 BPE, 2
layers, hidden 64, seq 64, micro-batch 8, global batch 16, cosine schedule; dropout off, whose
masks depend on each layout's random streams) with every step's
loss logged. One process trains the demo's 300 steps (its learning curve, with the held-out
loss every 50 steps). Then the same 300 steps on 2 ranks: dp2 (DDP), dp2 with ZeRO-3 (FSDP2),
tp2, and pp2 (1F1B). Every layout reads the same micro-batches (issue 27), so each
step's loss should equal the one process's up to float rounding: the largest difference per
layout is reported, and the chart plots the curves and the differences.

    .venv/bin/python benchmarks/loss_parity.py          # writes the result files and chart
    .venv/bin/python benchmarks/loss_parity.py --quick  # 10 steps, writes nothing
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from common import argument_parser, stamp, write_results

from rapidformer.cli import main as rapidformer
from rapidformer.testing import run_distributed
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents

FLAGS = [
    "--task", "pretraining", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "8",
    "--global-batch-size", "16", "--lr", "2e-3", "--lr-warmup-iters", "20",
    "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-iters", "5",
    "--hidden-dropout", "0",  # dropout masks depend on the layout's RNG streams
]  # fmt: skip
LAYOUTS: dict[str, list[str]] = {
    "dp2 (DDP)": [],
    "dp2 + ZeRO-3 (FSDP2)": ["--zero-3-memory-optimization"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2 (1F1B)": ["--pipeline-model-parallel-size", "2"],
}


def _train(data_flags: list[str], extra: list[str], steps: int, save: str) -> None:
    flags = [*data_flags, *FLAGS, "--train-iters", str(steps), *extra]
    flags += ["--eval-interval", "50"]  # the demo's 100, halved: a held-out curve
    code = rapidformer([*flags, "--save", save])
    if code != 0:
        raise SystemExit(code)


def _curves(save: Path) -> dict[str, dict[int, float]]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {
        "train": {r["step"]: r["loss"] for r in rows if r["kind"] == "train"},
        "eval": {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"},
    }


def run(data: PretrainingData, out: Path, steps: int) -> dict[str, Any]:
    flags = data.flags()
    _train(flags, [], steps, str(out / "one"))
    one = _curves(out / "one")
    layouts = {}
    for name, extra in LAYOUTS.items():
        save = out / f"layout{len(layouts)}"
        run_distributed(_train, 2, flags, extra, steps, str(save))
        curve = _curves(save)["train"]
        diffs = [abs(curve[s] - one["train"][s]) for s in sorted(curve)]
        layouts[name] = {
            "flags": extra,
            "train": curve,
            "max_abs_diff": max(diffs),
        }
        print(f"{name}: max |loss - one process| over {steps} steps {max(diffs):.3g}")
    return {"one_process": one, "layouts": layouts}


def markdown(result: dict[str, Any]) -> list[str]:
    one = result["one_process"]
    train = {int(k): v for k, v in one["train"].items()}
    evals = {int(k): v for k, v in one["eval"].items()}
    lines = [
        "# Loss curves: the demo, and every layout against one process",
        "",
        f"The demo's GPT pretraining on one process ({max(train)} steps): training loss "
        f"{train[1]:.3f} at step 1, {train[max(train)]:.3f} at the end; held-out loss "
        + ", ".join(f"{v:.3f} at step {k}" for k, v in sorted(evals.items()))
        + ".",
        "",
        "The same run on 2 ranks, step by step against one process (every layout reads the "
        "same micro-batches):",
        "",
        "| layout | flags | max loss difference |",
        "|---|---|---|",
    ]
    for name, layout in result["layouts"].items():
        flags = " ".join(layout["flags"]) or "-"
        lines.append(f"| {name} | `{flags}` | {layout['max_abs_diff']:.2g} |")
    return lines


def main() -> None:
    parser = argument_parser(__doc__, "10 steps per run")
    args = parser.parse_args()
    steps = 10 if args.quick else 300
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = build_pretraining_data(out / "data", "GPT2BPETokenizer", synthetic_documents(2000))
        result = run(data, out, steps)
    if args.quick:
        return
    result = stamp({**result, "steps": steps})
    write_results("loss_parity", result, markdown(result))


if __name__ == "__main__":
    main()
