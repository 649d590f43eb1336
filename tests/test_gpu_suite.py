"""The GPU suite never rots: ``benchmarks/gpu/run.sh --dry-run`` runs every section's code on
tiny shapes (on this CPU) and writes its JSON and Markdown, with numbers that hang together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_gpu_suite_dry_run_writes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["precision", "gpt", "optimizers", "dynamic_shape", "onnxruntime"]
    assert all(s["status"] == "ok" for s in sections.values()), sections
    assert result["dry_run"] and result["machine"]["cpu"]
    precision = sections["precision"]["data"]["rows"]
    assert set(precision) == {"fp32", "bf16", "fp16"} and precision["fp32"]["vs_fp32"] == 1.0
    gpt = sections["gpt"]["data"]["rows"]
    assert len(gpt) == 10
    for name, row in gpt.items():
        assert row["tokens_per_s"] > 0 and row["mfu"] > 0, (name, row)
        # Checkpointing: the hardware also runs the recomputed forward.
        assert ("hardware_tflops" in row) == ("checkpointing" in name), name
        assert row.get("hardware_tflops", row["tflops"]) >= row["tflops"]
        assert any("bf16" in step for step in row["plan"]), row["plan"]
        assert any("compile" in step for step in row["plan"]) == ("compile" in name), name
        if "compile" in name:  # the run counted its graphs (the dry run's equal tiny shapes
            # reuse earlier rows' graphs: 0 new ones is right there), and none fell back
            assert row["compile_graphs"] >= 0 and row["compile_fallbacks"] == 0, (name, row)
    assert gpt["GPT-350M compile"]["compile_graphs"] >= 1  # the first compiled row compiles
    dynamic = sections["dynamic_shape"]["data"]["rows"]
    # A length-skewed corpus: dynamic shape pads far less than fixed shape.
    assert dynamic["dynamic-shape"]["padding_fraction"] < dynamic["fixed-shape"]["padding_fraction"]
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "## gpt (ok" in markdown and "GPT-1.3B compile + checkpointing" in markdown


def test_engine_vs_hand_dry_run_trains_both_sides_alike(tmp_path: Path) -> None:
    """The engine-vs-hand-loop benchmark on tiny shapes: both sides start from the same
    weights and batch and take the same number of steps, so their losses agree (bf16 autocast
    on both sides: a stated 1e-3 relative tolerance), and every ratio is a positive number."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT / "src")}
    script = ROOT / "benchmarks" / "gpu" / "engine_vs_hand.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--dry-run", "--label", "dry"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "engine_vs_hand_dry.json").read_text())["rows"]["GPT-tiny"]
    assert len(row["ratios"]) == 2 and all(r > 0 for r in row["ratios"])
    engine, hand = row["last_loss"]["engine"], row["last_loss"]["hand"]
    assert abs(engine - hand) <= 1e-3 * abs(hand), row["last_loss"]
