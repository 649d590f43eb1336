"""What every benchmark shares besides its numbers: the command line's common part (a
description and --quick), the machine, the date, the command, and the two result files (JSON
for tools, Markdown for docs/results/)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def argument_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` (the script's docstring), with
    --quick: a smoke test that prints and writes no files; ``quick`` says what it runs."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test ({quick}); prints, writes no files"
    )
    return parser


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


MATMUL_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
"""CPU features that decide how fast fp32 / bf16 / fp16 matrix work runs (numbers from one
x86 machine do not carry over to another without them)."""


def lscpu() -> dict[str, Any]:
    """The CPU model as lscpu names it (vendor, family, model) and its matrix features."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in text.splitlines())
        if value
    )
    flags = set(fields.get("Flags", "").split())
    return {
        "model": fields.get("Model name", cpu_name()),
        "vendor": fields.get("Vendor ID"),
        "family": fields.get("CPU family"),
        "model_number": fields.get("Model"),
        "matmul_isa": [flag for flag in MATMUL_ISA if flag in flags],
    }


def machine_info() -> dict[str, Any]:
    return {
        "cpu": cpu_name(),
        "lscpu": lscpu(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def stamp(result: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``result`` plus machine, date and the command that reproduces it; ``env`` holds the
    environment variables that the command sets in front (``NAME=value ...``)."""
    script = Path(sys.argv[0]).resolve().relative_to(ROOT)
    assignments = [f"{name}={value}" for name, value in (env or {}).items()]
    return {
        **result,
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([*assignments, ".venv/bin/python", str(script), *sys.argv[1:]]),
    }


def footer(result: dict[str, Any]) -> list[str]:
    machine = result["machine"]
    cpu = machine.get("lscpu") or {}
    described = machine["cpu"]
    if cpu:
        isa = ", ".join(cpu["matmul_isa"]) or "no AVX2"
        described = f"{cpu['model']}, {cpu['vendor']} family {cpu['family']} model "
        described += f"{cpu['model_number']}; {isa}"
    device = machine["cuda"] or f"{machine['cpu_count']} CPU cores ({described})"
    return [
        f"- Machine: {device}, {machine['torch_threads']} torch threads, torch "
        f"{machine['torch']}, Python {machine['python']}.",
        f"- Date: {result['date']}",
        f"- Reproduce: `{result['command']}`",
        "",
    ]


def write_results(name: str, result: dict[str, Any], markdown: list[str]) -> None:
    """benchmarks/results/NAME.json and docs/results/NAME.md (with the footer appended), and
    docs/results/NAME.png where ``charts.py`` draws one for NAME (linked under the title)."""
    json_path = ROOT / "benchmarks" / "results" / f"{name}.json"
    md_path = ROOT / "docs" / "results" / f"{name}.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    from charts import draw  # matplotlib: only where results are written (not the GPU image)

    chart = draw(name, json.loads(json_path.read_text()))  # the JSON as the docs will read it
    if chart is not None:
        title, *rest = markdown
        # Shown at the column's width; a click opens it at full size.
        markdown = [title, "", f"[![{name} chart]({chart})]({chart})", *rest]
    md_path.write_text("\n".join([*markdown, "", *footer(result)]))
    print(f"wrote {json_path.relative_to(ROOT)} and {md_path.relative_to(ROOT)}")
