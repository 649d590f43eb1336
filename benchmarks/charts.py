"""Charts of the benchmark results, for the docs: one PNG beside each result's Markdown.

Every chart is drawn from a result's JSON (``benchmarks/results/NAME.json``) into
``docs/results/NAME.png``. A benchmark draws its own when it writes its results
(``common.write_results`` calls :func:`draw`); this script redraws every chart from the
committed results, without running anything:

    .venv/bin/python benchmarks/charts.py

Charts: the loss curves (the demo's learning curve, every layout against one process), model
state per rank by ZeRO stage, memory per rank by tensor x pipeline layout (measured, formula,
the dry run's estimate, the reference's published peaks), throughput by switch, the pipeline
bubble against theory, the dynamic-shape iterator's padding, full fine-tuning against LoRA
and QLoRA, and packing against padding.
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
import numpy as np
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "results"
MIB = 2**20
DPI = 110
"""Pixels per inch. The docs' text column is about 690 px wide: a chart of at most 10 inches
(1100 px) is shown at 0.63 of its size or more, which keeps the 13-14 pt text below at 11 px
or more on the page; a click opens it at full size."""

plt.rcParams.update(
    {
        "font.size": 14,
        "axes.titlesize": 15,
        "axes.labelsize": 14,
        "legend.fontsize": 12,
        "xtick.labelsize": 13,
        "ytick.labelsize": 13,
    }
)


def _figure(width: float = 8, height: float = 4.5, columns: int = 1) -> tuple[Figure, Any]:
    figure, axes = plt.subplots(1, columns, figsize=(width, height), layout="constrained")
    return figure, axes


def _legend_above(figure: Figure, columns: int = 2) -> None:
    """One legend for the figure, above its panels, where it can cover no bar or line."""
    figure.legend(loc="outside upper center", ncols=columns, frameon=False)


def loss_parity(result: dict[str, Any]) -> Figure:
    figure, (curve, parity) = plt.subplots(
        1, 2, figsize=(10, 5), layout="constrained", width_ratios=(4, 5)
    )
    one = result["one_process"]
    train = sorted((int(k), v) for k, v in one["train"].items())
    evals = sorted((int(k), v) for k, v in one["eval"].items())
    curve.plot(*zip(*train, strict=True), label="training loss", linewidth=1.5)
    curve.plot(*zip(*evals, strict=True), "o-", label="held-out loss")
    curve.set(xlabel="step", ylabel="loss", title="The demo's GPT pretraining, one process")
    curve.legend()
    _parity_counts(parity, result)
    return figure


def float32_distances(result: dict[str, Any]) -> dict[str, list[int]]:
    """Per layout, each step's distance from one process's loss in float32 rounding steps.

    The loss is a float32: two layouts that add the same numbers in another order can only
    differ by whole steps of float32's spacing at the loss's value (6e-8 near 0.6, 4.8e-7
    near 6).
    """
    reference = {int(k): v for k, v in result["one_process"]["train"].items()}
    return {
        name: [
            round(abs(v - reference[int(k)]) / float(np.spacing(np.float32(reference[int(k)]))))
            for k, v in sorted(layout["train"].items(), key=lambda item: int(item[0]))
        ]
        for name, layout in result["layouts"].items()
    }


def _parity_counts(axis: Any, result: dict[str, Any]) -> None:
    """Per layout, how many steps lie 0, 1, 2, ... float32 rounding steps from one process:
    at a glance what 300 lines of differences cannot show, how often the layouts agree
    exactly, and that they never drift further."""
    by_layout = float32_distances(result)
    layouts = list(by_layout)
    # Two lines for a long name: the panel keeps its width for the bars.
    names = [name.replace(" + ", " +\n") for name in layouts]
    distances = dict(zip(names, by_layout.values(), strict=True))
    largest = max(max(d) for d in distances.values())
    # Green for agreement fading to orange with distance: no colour reads as an error.
    shades = ["#1a9850", "#91cf60", "#d9ef8b", "#fee08b", "#fc8d59", "#d73027"]
    left = [0] * len(names)
    for distance in range(largest + 1):
        counts = [distances[name].count(distance) for name in names]
        label = "equal" if distance == 0 else f"{distance} float32 step" + "s" * (distance > 1)
        axis.barh(names, counts, left=left, label=label, color=shades[min(distance, 5)])
        left = [a + c for a, c in zip(left, counts, strict=True)]
    for index, (label, name) in enumerate(zip(names, layouts, strict=True)):
        equal = distances[label].count(0)
        note = f"{equal} equal, largest {result['layouts'][name]['max_abs_diff']:.2g}"
        axis.text(4, index, note, va="center", ha="left", color="white", fontsize=12)
    axis.invert_yaxis()
    axis.set_xlim(0, max(left))
    axis.set(
        xlabel=f"steps of {max(left)}, by distance from one process",
        title="Each 2-rank layout vs one process",
    )
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.17), ncols=2, frameon=False)


def memory(result: dict[str, Any]) -> Figure:
    figure, axes = _figure(10, 5.2, columns=2)
    for axis, ranks in zip(axes, (2, 4), strict=True):
        rows = [r for r in result["rows"] if r["ranks"] == ranks]
        names = [r["mode"].replace("DeepSpeed ", "DS ") for r in rows]
        bottom = [0.0] * len(rows)
        for kind in ("parameters", "gradients", "optimizer"):
            values = [r[kind] / MIB for r in rows]
            # Labelled once: the figure's one legend names each kind.
            axis.bar(names, values, bottom=bottom, label=kind if ranks == 2 else None)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axis.set(ylabel="MiB per rank", title=f"{ranks} ranks")
        axis.set_xticks(range(len(names)), names, rotation=35, ha="right")
    _legend_above(figure, columns=3)
    return figure


def memory_3d(result: dict[str, Any]) -> Figure:
    figure, axis = _figure(10, 5.6)
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
    _legend_above(figure)
    return figure


def pipeline_bubble(result: dict[str, Any]) -> Figure:
    figure, axis = _figure(7, 6)
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
    axis.legend()
    return figure


def dynamic_shape(result: dict[str, Any]) -> Figure:
    figure, (padding, speed) = _figure(9, 4.2, columns=2)
    summary = result["summary"]
    names = list(summary)
    padding.bar(names, [100 * summary[n]["padding_fraction"] for n in names], color="C1")
    padding.set(ylabel="% of tokens that are padding", title="Padding per batch")
    speed.bar(names, [summary[n]["median_tokens_per_s"] for n in names], color="C0")
    speed.set(ylabel="real tokens / s (CPU)", title=f"Throughput ({result['speedup']:.2f}x)")
    return figure


def lora(result: dict[str, Any]) -> Figure:
    figure, (memory_axis, speed_axis) = _figure(9, 4.2, columns=2)
    summary = result["summary"]
    names = list(summary)
    memory_axis.bar(names, [summary[n]["peak_mib"] for n in names], color="C1")
    memory_axis.set(ylabel="MiB, peak of a step", title="Memory")
    speed_axis.bar(names, [summary[n]["tokens_per_s"] for n in names], color="C0")
    speed_axis.set(ylabel="tokens / s (CPU)", title="Throughput")
    for axis, key in ((memory_axis, "memory"), (speed_axis, "speed")):
        for index, name in enumerate(names):
            axis.annotate(f"{result['ratios'][name][key]:.2f}x", (index, 0), xytext=(0, 4),
                          textcoords="offset points", ha="center", color="white")  # fmt: skip
    return figure


def packing(result: dict[str, Any]) -> Figure:
    figure, (speed_axis, memory_axis) = _figure(9, 4.2, columns=2)
    summary = result["summary"]
    names = list(summary)
    speed_axis.bar(names, [summary[n]["learned_tokens_per_s"] for n in names], color="C0")
    speed_axis.set(ylabel="learned tokens / s (CPU)", title="Throughput")
    memory_axis.bar(names, [summary[n]["peak_mib"] for n in names], color="C1")
    memory_axis.set(ylabel="MiB, peak of the epoch", title="Memory")
    for axis in (speed_axis, memory_axis):
        axis.tick_params(axis="x", labelrotation=30)  # five names side by side
    # Each mode's speed over the buckets': the paired ratio within each run, as the page has it.
    for index, name in enumerate(names):
        speed_axis.annotate(f"{result['versus_buckets'][name]:.2f}x",
                            (index, 0), xytext=(0, 4), textcoords="offset points",
                            ha="center", color="white")  # fmt: skip
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
    figure, axis = _figure(9, 0.42 * len(ratios) + 1.6)
    names = list(ratios)
    values = [ratios[n] for n in names]
    colors = ["C2" if v >= 1 else "C3" for v in values]
    axis.barh(names, values, color=colors)
    axis.axvline(1.0, color="k", linewidth=1, zorder=0)
    for index, value in enumerate(values):
        # Past the bar's end and past the 1.0 line, so neither crosses the figure.
        axis.text(max(value, 1.0) + 0.05, index, f"{value:.2f}x", va="center", fontsize=12)
    axis.set_xlim(0, max(values) * 1.15)
    axis.invert_yaxis()
    axis.set(
        xlabel="speed relative to the same run without the switch",
    )
    # Over the whole figure: the long switch names push the axes right of its centre.
    figure.suptitle("Speed by switch on a 2-core CPU (GPU: the GPU suite)", fontsize=15)
    return figure


CHARTS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "loss_parity": loss_parity,
    "memory": memory,
    "memory_3d": memory_3d,
    "pipeline_bubble": pipeline_bubble,
    "dynamic_shape": dynamic_shape,
    "lora": lora,
    "packing": packing,
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
    figure.savefig(path, dpi=DPI, metadata={"Software": None})
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
