"""Charts of the benchmark results, for the docs: one PNG beside each result's Markdown.

Every chart is drawn from a result's JSON (``benchmarks/results/NAME.json``) into
``docs/results/NAME.png``. A benchmark draws its own when it writes its results
(``common.write_results`` calls :func:`draw`); this script redraws every chart from the
committed results, without running anything:

    .venv/bin/python benchmarks/charts.py

Charts: the loss curves (the demo's learning curve, every layout against one process), model
state per rank by ZeRO stage, memory per rank by tensor x pipeline layout (measured, formula,
the dry run's estimate, the reference's published peaks), throughput by switch, the pipeline
bubble against theory, and the dynamic-shape iterator's padding.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "results"
MIB = 2**20


def _figure(width: float = 8, height: float = 4.5, columns: int = 1) -> tuple[Figure, Any]:
    figure, axes = plt.subplots(1, columns, figsize=(width, height), layout="constrained")
    return figure, axes


def loss_parity(result: dict[str, Any]) -> Figure:
    figure, (curve, diffs) = _figure(11, 4.2, columns=2)
    one = result["one_process"]
    train = sorted((int(k), v) for k, v in one["train"].items())
    evals = sorted((int(k), v) for k, v in one["eval"].items())
    curve.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    curve.plot(*zip(*evals, strict=True), "o-", label="held-out loss")
    curve.set(xlabel="step", ylabel="loss", title="The demo's GPT pretraining (one process)")
    curve.legend()
    for name, layout in result["layouts"].items():
        steps = sorted(int(k) for k in layout["train"])
        reference = {int(k): v for k, v in one["train"].items()}
        values = {int(k): v for k, v in layout["train"].items()}
        # Equal losses plot at the floor: a log axis has no zero.
        gaps = [max(abs(values[s] - reference[s]), 1e-9) for s in steps]
        diffs.plot(steps, gaps, label=f"{name} (max {layout['max_abs_diff']:.1g})", linewidth=1)
    diffs.set_yscale("log")
    diffs.set_ylim(5e-10, 1e-2)
    diffs.set(
        xlabel="step",
        ylabel="|loss - one process's| (1e-9 = equal)",
        title="Every layout against one process, step by step",
    )
    diffs.legend(fontsize=8)
    return figure


def memory(result: dict[str, Any]) -> Figure:
    figure, axes = _figure(11, 4.2, columns=2)
    for axis, ranks in zip(axes, (2, 4), strict=True):
        rows = [r for r in result["rows"] if r["ranks"] == ranks]
        names = [r["mode"].replace("DeepSpeed ", "DS ") for r in rows]
        bottom = [0.0] * len(rows)
        for kind in ("parameters", "gradients", "optimizer"):
            values = [r[kind] / MIB for r in rows]
            axis.bar(names, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axis.set(ylabel="MiB per rank", title=f"Model state per rank, {ranks} ranks")
        axis.tick_params(axis="x", rotation=35)
        axis.legend(fontsize=8)
    return figure


def memory_3d(result: dict[str, Any]) -> Figure:
    figure, axis = _figure(10, 4.5)
    rows = result["rows"] + result.get("data_parallel_rows", [])
    names = [f"tp{r['tp']} x pp{r['pp']}" if "tp" in r else f"dp4 {r['row']}" for r in rows]
    series = {
        "model state: formula 16 P / (tp pp)": [r.get("formula_mib") for r in rows],
        "model state, largest rank (measured cut)": [r.get("largest_rank_mib") for r in rows],
        "dry-run estimate (state + buffers + activations)": [
            r.get("dry_run_total_mib") for r in rows
        ],
        # As published ("MB"; read as the MiB that memory tools print).
        "reference tool's published peak": [r["published_peak_mb"] for r in rows],
    }
    width = 0.2
    for index, (label, values) in enumerate(series.items()):
        positions = [i + (index - 1.5) * width for i in range(len(rows))]
        axis.bar(positions, [v or 0 for v in values], width, label=label)
    axis.set_xticks(range(len(rows)), names, rotation=35, ha="right")
    axis.set(ylabel="MiB per GPU", title="GPT 1.3B: memory per rank by layout")
    axis.legend(fontsize=8)
    return figure


def pipeline_bubble(result: dict[str, Any]) -> Figure:
    figure, axis = _figure(6, 5)
    schedules = sorted({r["schedule"] for r in result["rows"]})
    for schedule in schedules:
        rows = [r for r in result["rows"] if r["schedule"] == schedule]
        axis.scatter([r["theory"] for r in rows], [r["measured"] for r in rows], label=schedule)
    top = max(max(r["theory"], r["measured"]) for r in result["rows"]) * 1.05
    axis.plot([0, top], [0, top], "k--", linewidth=1, label="measured = theory")
    axis.set(
        xlabel="theoretical bubble (p-1)/(v m + p - 1)",
        ylabel="measured idle fraction",
        title="Pipeline bubble: measured vs theory",
    )
    axis.legend(fontsize=8)
    return figure


def dynamic_shape(result: dict[str, Any]) -> Figure:
    figure, (padding, speed) = _figure(9, 3.8, columns=2)
    summary = result["summary"]
    names = list(summary)
    padding.bar(names, [100 * summary[n]["padding_fraction"] for n in names], color="C1")
    padding.set(ylabel="% of tokens that are padding", title="Padding per batch")
    speed.bar(names, [summary[n]["median_tokens_per_s"] for n in names], color="C0")
    speed.set(ylabel="real tokens / s (CPU)", title=f"Throughput ({result['speedup']:.2f}x)")
    return figure


def _speed_ratios() -> dict[str, float]:
    """Speed of each switch relative to running without it, from the CPU results."""
    ratios: dict[str, float] = {}

    def read(name: str) -> dict[str, Any] | None:
        path = RESULTS / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    if precision := read("precision"):
        for model, table in precision["table"].items():
            for mode in ("bf16", "fp16"):
                if mode in table:
                    ratios[f"{mode} ({model.upper()})"] = table[mode]["vs_fp32"]
    if compiled := read("compile_cpu"):
        ratios["--torch-compile"] = compiled["speedup"]
    if dynamic := read("dynamic_shape"):
        ratios["dynamic-shape iterator"] = dynamic["speedup"]
    if optimizers := read("optimizers"):
        speedups = optimizers["speedup_vs_default_adamw"]
        ratios["fused AdamW (optimizer step)"] = speedups["AdamW(fused=True)"]
    if recompute := read("activation_memory"):
        none = recompute["modes"]["none"]["median_seconds_per_step"]
        for mode, side in recompute["modes"].items():
            if mode != "none":
                ratios[f"recompute: {mode.split(' (')[0]}"] = none / side["median_seconds_per_step"]
    if fused := read("lm_loss_memory"):
        ratios["--fused-lm-loss"] = 1 / fused["time_ratio"]
    if ort := read("onnxruntime_cpu"):
        for model, row in ort["models"].items():
            ratios[f"ONNX Runtime ({model.upper()})"] = 1 / row["ort_over_eager_time"]
    if overhead := read("overhead"):
        ratios["Trainer vs a hand-written loop"] = overhead["ratio"]
    return ratios


def throughput(ratios: dict[str, float]) -> Figure:
    figure, axis = _figure(8, 0.35 * len(ratios) + 1.4)
    names = list(ratios)
    values = [ratios[n] for n in names]
    colors = ["C2" if v >= 1 else "C3" for v in values]
    axis.barh(names, values, color=colors)
    axis.axvline(1.0, color="k", linewidth=1)
    for index, value in enumerate(values):
        axis.text(value, index, f" {value:.2f}x", va="center", fontsize=8)
    axis.invert_yaxis()
    axis.set(
        xlabel="speed relative to the same run without the switch (CPU, 2 cores)",
        title="Throughput by switch on a CPU (GPU figures: the GPU suite)",
    )
    return figure


CHARTS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "loss_parity": loss_parity,
    "memory": memory,
    "memory_3d": memory_3d,
    "pipeline_bubble": pipeline_bubble,
    "dynamic_shape": dynamic_shape,
}
"""Result name -> the chart drawn from its JSON."""


def draw(name: str, result: dict[str, Any]) -> str | None:
    """``docs/results/NAME.png`` from ``result`` if NAME has a chart; its file name."""
    chart = CHARTS.get(name)
    if chart is None:
        return None
    _save(chart(result), name)
    return f"{name}.png"


def _save(figure: Figure, name: str) -> None:
    path = DOCS / f"{name}.png"
    # No timestamp in the file: a redraw of the same numbers leaves git nothing to commit.
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    for name in CHARTS:
        path = RESULTS / f"{name}.json"
        if path.exists():
            draw(name, json.loads(path.read_text()))
        else:
            print(f"no {path.relative_to(ROOT)}: run benchmarks/{name}.py", file=sys.stderr)
    _save(throughput(_speed_ratios()), "throughput")


if __name__ == "__main__":
    main()
