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


def test_the_engine_and_the_loop_name_no_backend_except_where_they_are_chosen() -> None:
    """Backends are chosen once, in engine/order.py; the rest of the engine and the loop
    reach them only through the train state's slots."""
    pattern = re.compile(r"deepspeed|onnx|_ort", re.IGNORECASE)
    files = [p for p in _files("engine") if p.name != "order.py"]
    for path in [*files, SRC / "templates" / "trainer.py"]:
        for number, line in _code_lines(path):
            assert not pattern.search(line), f"{path.relative_to(SRC)}:{number}: {line.strip()}"


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """``path``'s lines that are code (comments and docstrings dropped)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    lines = path.read_text().splitlines()
    return [
        (number, line.split("#")[0])
        for number, line in enumerate(lines, 1)
        if number not in docstrings and line.split("#")[0].strip()
    ]


def test_no_accel_module_asks_which_backend_another_one_is() -> None:
    """Only DeepSpeed's own module (its slots and rules) reads --zero-backend; the native
    steps are simply not in DeepSpeed's order (engine/order.py)."""
    for path in _files("accel"):
        if path.name in {"deepspeed.py", "deepspeed_state.py"}:
            continue
        for number, line in _code_lines(path):
            assert "zero_backend" not in line, f"{path.relative_to(SRC)}:{number}: {line.strip()}"


def test_only_the_pipeline_slot_knows_it_is_a_pipeline() -> None:
    """What precision, data parallelism and checkpoints need from a pipeline they ask the
    forward-backward slot (``forward_modules``, ``gradient_sync``, ``holds_whole_model``):
    nobody else inspects the slot's type or its private members."""
    pattern = re.compile(
        r"PipelineForwardBackward|forward_backward\.(modules|model|_)|dims\.pp > 1"
    )
    # sharding decides FSDP2's resharding by the pp degree; DeepSpeed's rules refuse pp, and
    # the MoE rules refuse global_aux_loss with pp (validation, before any slot exists).
    allowed = {"pipeline.py", "pipeline_layout.py", "pipelined_model.py", "sharding.py"}
    allowed |= {"deepspeed.py", "moe_rules.py"}
    for folder in ("accel", "checkpoint", "templates", "engine"):
        for path in _files(folder):
            if path.name in allowed:
                continue
            for number, line in _code_lines(path):
                assert not pattern.search(line), f"{path.relative_to(SRC)}:{number}: {line}"


def test_the_engine_never_branches_on_moe() -> None:
    """MoE bookkeeping is a slot whose default does nothing (``state.moe``)."""
    for path in _files("engine"):
        for number, line in _code_lines(path):
            assert "moe is" not in line and "moe:" not in line.replace(" ", ""), (
                f"{path.relative_to(SRC)}:{number}: {line.strip()}"
            )


def test_one_helper_takes_a_tensors_local_part() -> None:
    """``rapidformer.distributed.tensors.local_part`` is the only DTensor-to-local helper."""
    pattern = re.compile(r"to_local\(\) if isinstance|def _local\(")
    for path in SRC.rglob("*.py"):
        if path.name == "tensors.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(SRC)}:{number}: {line.strip()}"


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("engine/engine.py", 300),
        ("templates/finetuner.py", 400),
        ("templates/trainer.py", 400),
        ("accel/pipeline.py", 400),
    ],
)
def test_the_busiest_files_stay_small(path: str, limit: int) -> None:
    lines = len((SRC / path).read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit}): split it"


def test_no_source_file_passes_480_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 480
    }
    assert not long, f"split these files: {long}"


def test_the_pretrainer_names_no_model_family() -> None:
    """Model families are objects (templates/families/): adding one must not touch the
    Pretrainer."""
    for number, line in _code_lines(SRC / "templates" / "pretrainer.py"):
        assert not re.search(r"""["'](gpt|bert)["']""", line), f"pretrainer.py:{number}: {line}"


def test_the_finetuner_loads_nothing_itself() -> None:
    """Hugging Face loading, its error mapping and saving live in rapidformer.models."""
    for number, line in _code_lines(SRC / "templates" / "finetuner.py"):
        assert "from_pretrained" not in line, f"finetuner.py:{number}: {line.strip()}"
