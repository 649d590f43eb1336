"""Imports flow one way (config -> distributed -> state -> accel -> engine -> templates), and
the engine and the Trainer's loop hold no backend-specific branches: backends arrive through
the train state's slots, registered in engine/order.py only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rapidformer"


def _imports(path: Path) -> set[str]:
    """Every rapidformer module ``path`` imports, TYPE_CHECKING imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("rapidformer")}


def _files(folder: str) -> list[Path]:
    return sorted((SRC / folder).rglob("*.py")) if (SRC / folder).is_dir() else [SRC / folder]


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("accel", ("rapidformer.engine", "rapidformer.templates", "rapidformer.checkpoint")),
        ("config", ("rapidformer.distributed", "rapidformer.accel", "rapidformer.engine")),
        ("distributed", ("rapidformer.accel", "rapidformer.engine", "rapidformer.templates")),
        ("state.py", ("rapidformer.accel", "rapidformer.engine", "rapidformer.checkpoint")),
        ("checkpoint", ("rapidformer.engine", "rapidformer.templates")),
        ("models", ("rapidformer.accel", "rapidformer.engine", "rapidformer.templates")),
        (
            "reliability",
            (
                "rapidformer.accel",
                "rapidformer.engine",
                "rapidformer.templates",
                "rapidformer.checkpoint",
            ),
        ),
    ],
)
def test_nothing_imports_backwards(folder: str, forbidden: tuple[str, ...]) -> None:
    for path in _files(folder):
        bad = {name for name in _imports(path) if name.startswith(forbidden)}
        assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


@pytest.mark.parametrize("leaf", ["config/schema.py", "distributed/dims.py"])
def test_leaves_import_nothing_of_rapidformer(leaf: str) -> None:
    assert _imports(SRC / leaf) == set()


def test_the_engine_and_the_loop_name_no_backend_except_where_they_are_registered() -> None:
    pattern = re.compile(r"deepspeed|onnx|_ort")
    files = [*_files("engine"), SRC / "templates" / "trainer.py"]
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not pattern.search(line):
                continue
            registration = path.name == "order.py" and (
                line.startswith("from rapidformer.accel")
                or re.fullmatch(r"    (apply_\w+|\w+\.rules),", line)
            )
            assert registration, f"{path.relative_to(SRC)}:{number}: {line.strip()}"
