"""The catalogue of bad inputs through the command: each one ends it with a non-zero exit
code and one message that names the input (flag, file, line, key) and says how to fix it; no
Python traceback unless --debug asks for one; nothing left under --save that a later run could
take for a checkpoint.

Every case runs ``rapidformer.cli.main`` in this process (what the ``rapidformer`` command
runs; tests/reliability/test_preemption.py checks the real command's exit code and silence).
The catalogue is tests/helpers/bad_inputs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer.checkpoint import find_checkpoint
from rapidformer.cli import main
from tests.helpers.bad_inputs import (
    CASES,
    GOOD_ROWS,
    HEADER,
    Case,
    Inputs,
    argv_of,
    build_inputs,
    user_script,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return build_inputs(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_with_a_message_naming_it(
    case: Case, inputs: Inputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "save"
    argv = argv_of(case, inputs, save)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    error = capsys.readouterr().err
    assert code == case.code, error[-2000:]
    for part in case.message:
        assert part in error, f"{part!r} not in:\n{error[-2000:]}"
    assert "Traceback" not in error
    assert not save.exists() or find_checkpoint(save) is None


def test_catalogue_size() -> None:
    assert len(CASES) >= 40


def test_debug_prints_the_traceback(inputs: Inputs, capsys: pytest.CaptureFixture[str]) -> None:
    argv = user_script(
        "raises_debug",
        HEADER + "class A(Base):\n    def build_data(self):\n"
        "        raise ValueError('no such table')\n",
    )(inputs)
    assert main([*argv, "--debug"]) == 1
    error = capsys.readouterr().err
    assert "Traceback (most recent call last)" in error and "no such table" in error


def test_the_data_file_checks_leave_parquet_alone(tmp_path: Path) -> None:
    import datasets

    from rapidformer.data.finetune_data import load_splits

    datasets.Dataset.from_list(GOOD_ROWS).to_parquet(str(tmp_path / "train.parquet"))
    assert len(load_splits(str(tmp_path))["train"]) == len(GOOD_ROWS)
