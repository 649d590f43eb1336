"""The README's Python runs as written: its template as a script and through
``--user-script`` (one training run each), its hand-written loops as one program."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.trainers import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SHORT = ["--train-iters", "3", "--lr", "3e-3", "--micro-batch-size", "16", "--log-interval", "1"]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def _runs(stderr: str) -> int:
    """Training runs a process made: each composes once and logs its plan once."""
    plans = stderr.count("rapidformer plan on ")
    assert plans == stderr.count("final metrics: "), stderr[-3000:]
    return plans


@pytest.fixture(scope="module")
def my_trainer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    template = _python_blocks()[0]
    assert 'if __name__ == "__main__":' in template  # the template trains in its main block
    path = tmp_path_factory.mktemp("readme") / "my_trainer.py"
    path.write_text(template)
    return path


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param([], id="python my_trainer.py"),
        pytest.param(["-m", "rapidformer", "--user-script"], id="rapidformer --user-script"),
    ],
)
def test_the_readme_template_trains_once(my_trainer: Path, launch: list[str]) -> None:
    save = f"run-{len(launch)}"  # a directory per way in: the other's would be resumed
    done = subprocess.run(
        [sys.executable, *launch, str(my_trainer), *SHORT, "--save", save],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=my_trainer.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert _runs(done.stderr) == 1
    assert "train step 3/3" in done.stderr  # the command line's --train-iters, not a default
    # The run ends by saying where it saved, and it did save there.
    checkpoint = f"{save}/iter_0000003"
    assert f"saved: checkpoint {checkpoint} " in done.stderr, done.stderr[-2000:]
    assert f"jsonl ({save}/metrics.jsonl)" in done.stderr
    assert (my_trainer.parent / checkpoint).is_dir()
    assert (my_trainer.parent / save / "metrics.jsonl").is_file()


def test_the_readme_hand_written_loops_run(tmp_path: Path) -> None:
    """The engine loop, then the loop that learns each weight after its forward (the second
    continues the first's engine and state, as the README reads)."""
    blocks = _python_blocks()
    loops = [block for block in blocks if "RapidformerEngine(" in block or "engine." in block]
    assert len(loops) == 2, blocks
    program = tmp_path / "loops.py"
    program.write_text("\n".join(loops))
    done = subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"loss \d+\.\d+", done.stdout), done.stdout
