"""The notebooks in examples/notebooks run top to bottom on a CPU (each ends with assertions
on what it measured), and are committed without outputs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers.trainers import ROOT

NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_are_there_without_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        code = [cell for cell in book.cells if cell.cell_type == "code"]
        assert code, path
        for cell in code:
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_a_cpu(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.read(path, as_version=4)
    # The kernel inherits this environment: the package from src/, one thread per op.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    client = nbclient.NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    print(f"{path.name}: {time.perf_counter() - started:.1f} s")
