"""docs/finetuning.md's worked examples, as written: a user's own small dataset (drawn afresh
here, with another seed), a tiny model built offline, the documented commands; each reaches the
result the page states (the classifier's accuracy; the chat model's five answers)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rapidformer.testing.chat import WHERE
from tests.helpers.trainers import ROOT, run_cli

PAGE = ROOT / "docs" / "finetuning.md"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BOUND = 0.95
"""The page states 1.00 and that the test asks for at least this."""


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.DOTALL)


def _commands(block: str) -> list[list[str]]:
    """The shell block's commands, one per logical line, split as the shell would."""
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_worked_example_learns_a_fresh_dataset_of_its_shape(tmp_path: Path) -> None:
    (writer,) = [block for block in _blocks("python") if block.startswith("# make_data.py")]
    assert "random.seed(7)" in writer and f"{BOUND}" in PAGE.read_text()
    (tmp_path / "make_data.py").write_text(writer.replace("random.seed(7)", "random.seed(2026)"))
    (shell,) = [block for block in _blocks("bash") if "python make_data.py" in block]
    for command in _commands(shell):
        program = {"python": [sys.executable], "rapidformer": [sys.executable, "-m", "rapidformer"]}
        done = subprocess.run(
            [*program[command[0]], *command[1:]],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=ENV,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-3000:])
    records = [json.loads(line) for line in (tmp_path / "runs/reviews/metrics.jsonl").open()]
    accuracy = [r["accuracy"] for r in records if r["kind"] == "eval"][-1]
    assert accuracy >= BOUND, accuracy
    assert (tmp_path / "runs/reviews/config.json").is_file()  # the model, for from_pretrained


def test_the_chat_example_answers_by_its_datas_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands run in this process (python -c as code, rapidformer through its main),
    from a working directory of their own, on conversations of another seed."""
    (shell,) = [
        block for block in _blocks("bash") if "tiny_chat_model('models/tiny-chat')" in block
    ]
    (talk,) = [block for block in _blocks("python") if block.startswith("# talk.py")]
    assert "seed=0" in shell
    monkeypatch.chdir(tmp_path)
    for command in _commands(shell.replace("seed=0", "seed=2026")):
        if command[0] == "python":
            assert command[1] == "-c", command
            exec(command[2], {})  # the page's own one-liner
        else:
            assert command[0] == "rapidformer" and run_cli(command[1:]) == 0, command
    capsys.readouterr()
    exec(talk, {})  # the page's own script
    replies = capsys.readouterr().out.splitlines()
    assert replies == [f"the {animal} is {WHERE[animal]}" for animal in WHERE], replies
    assert "the cat is on the mat" in PAGE.read_text()
