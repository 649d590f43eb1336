"""The GPU suite never rots: ``benchmarks/gpu/run.sh --dry-run`` runs every section's code on
tiny shapes (on this CPU) and writes its JSON and Markdown, with numbers that hang together;
and nothing the GPU machine runs imports a package its image lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.trainers import ROOT

MISSING_ON_THE_GPU_IMAGE = (
    "datasets",
    "deepspeed",
    "onnxruntime.training",
    "torchao",
    "liger_kernel",
)
"""Packages the GPU machine's image does not have (shared notes): nothing it runs may need
them at import time."""


def test_gpu_suite_dry_run_writes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=540,  # under pytest's own 600
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Results only in the results folder: the compile cache lives elsewhere.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_suite.json", "gpu_suite.md"]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = result["sections"]
    names = ["precision", "throughput", "recompute", "optimizers", "dynamic_shape", "onnxruntime"]
    names += ["adapters", "packing", "async_save"]
    assert list(sections) == names
    assert all(s["status"] == "ok" for s in sections.values()), sections
    assert result["dry_run"] and result["machine"]["cpu"]
    precision = sections["precision"]["data"]["rows"]
    assert set(precision) == {"fp32", "bf16", "fp16"} and precision["fp32"]["vs_fp32"] == 1.0
    throughput = sections["throughput"]["data"]
    rows = throughput["rows"]
    variants = ("eager", "compile", "compile (model scope)")
    built_in = ("compile + fused loss", "headline: compile + fp8 + fused loss")
    expected = [f"GPT-tiny {v}" for v in (*variants, *built_in)]
    expected += [f"Llama-tiny {v}" for v in ("eager", "eager + liger", *variants[1:])]
    assert list(rows) == expected
    assert "Liger-Kernel needs CUDA" in rows.pop("Llama-tiny eager + liger")["skipped"]
    assert "compute capability 8.9" in rows.pop(f"GPT-tiny {built_in[1]}")["skipped"]
    assert any("fused LM loss" in p for p in rows[f"GPT-tiny {built_in[0]}"]["plan"])
    assert throughput["repeats"] >= 3
    for name, row in rows.items():
        # Every row: the engine beside the hand loop, interleaved repeats, median and spread.
        ratios = row["ratios"]
        assert len(ratios) == throughput["repeats"] and all(r > 0 for r in ratios), name
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"], name
        assert row["engine_tokens_per_s"] > 0 and row["mfu"] > 0, (name, row)
        # Same start, same steps (bf16 autocast on both sides): the losses agree.
        engine, hand = row["last_loss"]["engine"], row["last_loss"]["hand"]
        assert abs(engine - hand) <= 1e-2 * abs(hand), (name, row["last_loss"])
        assert any("compile" in step for step in row["plan"]) == ("compile" in name), name
        if "compile" in name:  # counted its graphs (0 new ones where an earlier row's
            # equal tiny shapes are cached), and none fell back to eager
            assert row["compile_graphs"] >= 0 and row["compile_fallbacks"] == 0, (name, row)
        assert any("on the device, no host sync" in step for step in row["plan"]), name
    optimizers = sections["optimizers"]["data"]["rows"]
    assert "rapidformer LAMB (torch.compile)" in optimizers
    assert optimizers["AdamW(fused=True)"]["vs_fused_adamw"] == 1.0
    recompute = sections["recompute"]["data"]["rows"]
    assert list(recompute) == ["none", "full", "selective", "full, block half"]
    # Recomputation does not change the numbers (the same steps from the same start).
    assert all(abs(r["loss"] - recompute["none"]["loss"]) <= 1e-2 for r in recompute.values())
    # Each mode carries the dry run's estimate of its peak (on a GPU: within 10% is the goal).
    estimates = {name: row["dry_run_estimate_mb"] for name, row in recompute.items()}
    # (On the tiny dry-run shapes the step's end, not its activations, is the peak of the two
    # recomputing modes: equal there.)
    assert estimates["full"] <= estimates["selective"] < estimates["none"], estimates
    adapters = sections["adapters"]["data"]["rows"]
    assert list(adapters) == ["full", "lora", "qlora"]  # torchao is here (not on the GPU image)
    assert adapters["full"]["speed_vs_full"] == adapters["full"]["memory_vs_full"] == 1.0
    assert adapters["lora"]["trainable"] < 0.05 * adapters["full"]["trainable"]
    packing = sections["packing"]["data"]["rows"]
    assert list(packing) == ["padded", "buckets", "packed"]
    # The same samples in every mode: packing leaves the least padding, and its ratios are
    # the tokens/s it is compared by.
    padding = [packing[mode]["padding"] for mode in ("packed", "buckets", "padded")]
    assert padding == sorted(padding) and padding[0] < padding[1], padding
    for row in packing.values():
        speed = packing["packed"]["learned_tokens_per_s"] / row["learned_tokens_per_s"]
        assert row["packed_vs_this"] == speed and row["eval_loss"] > 0
    saves = sections["async_save"]["data"]
    assert list(saves["rows"]) == ["sync", "async"] and saves["same_end_state"], saves
    # The same files (the GPT's tied embedding one tensor in both), up to the zip's own bytes.
    sizes = [saves["rows"][mode]["checkpoint_gib"] for mode in ("sync", "async")]
    assert abs(sizes[0] - sizes[1]) <= 0.01 * sizes[0], sizes
    markdown = (tmp_path / "gpu_suite.md").read_text()
    assert "## throughput (ok" in markdown and "Llama-tiny compile (model scope)" in markdown


def test_gpu_entry_points_import_without_the_packages_the_gpu_image_lacks() -> None:
    """The suite's modules and tests/gpu/ import with those packages made unimportable."""
    blocker = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {MISSING_ON_THE_GPU_IMAGE!r}):
            raise ImportError(f"{{name}} is not on the GPU image")
sys.meta_path.insert(0, Block())
sys.path[:0] = ["benchmarks/gpu", "benchmarks", "src", "."]
import suite, side_by_side, finetuning, packing, packing_epoch, async_save
import tests.helpers.gpu, tests.gpu.test_cuda_training, tests.gpu.test_cuda_runs
print("imported")
"""
    done = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]
