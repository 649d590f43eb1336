"""The black-box entry point: runs a user's Trainer, and rejects bad input before building
anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rapidformer.cli import main
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, EXAMPLE, TINY_FLAGS, read_losses

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_user_script_trains_from_the_command_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rapidformer",
            "--user-script",
            str(EXAMPLE),
            "--train-iters",
            "40",
            "--micro-batch-size",
            "16",
            "--lr",
            "3e-3",
            "--log-interval",
            "10",
            "--save",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rapidformer plan on cpu, dp 1 x tp 1 x pp 1 (ep 1), 1 ranks" in run.stderr
    losses = read_losses(tmp_path)
    assert losses[40] < losses[10] - 0.5  # learned the Markov chain's transitions
    final = json.loads(run.stderr.split("final metrics: ")[1].splitlines()[0])
    assert final["eval_loss"] < 3.0  # ln(64) = 4.16 is chance


def test_bad_flags_are_all_reported_and_nothing_is_built(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(
        [
            "--user-script",
            str(DETERMINISTIC_SCRIPT),  # a Trainer subclass only: the command runs it
            "--micro-batch-size",
            "3",
            "--global-batch-size",
            "8",
            "--cpu-offload",
            "--save",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--global-batch-size=8: must be a multiple of --micro-batch-size (3)" in err
    assert "--cpu-offload=True: offload needs sharded model state" in err
    assert "--train-iters=None: the run needs a length" in err
    assert not (tmp_path / "out").exists()


def test_a_fine_tuning_task_without_model_or_data_names_every_missing_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for task in ("sequence_classification", "casual_lm", "causal_lm"):
        assert main(["--task", task, "--lr", "1e-5"]) == 2
        err = capsys.readouterr().err
        assert "(2 problems)" in err
        assert "--pretrained-model-name-or-path=None: fine-tuning starts from a pretrained" in err
        assert "--data-dir=None: fine-tuning needs a dataset" in err
        # The length is the task's recipe (3 epochs), as for the learning rate and warmup.
        assert "the run needs a length" not in err
    assert main(["--train-iters", "1"]) == 2
    assert "a black-box run needs a task" in capsys.readouterr().err


def test_a_script_without_one_trainer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    assert main(["--user-script", str(script), "--train-iters", "1", "--lr", "1e-3"]) == 2
    assert "exactly one concrete Trainer subclass (found: none)" in capsys.readouterr().err


def test_help_and_flag_errors_answer_without_importing_torch() -> None:
    """Parsing flags needs no torch (seconds to import): `rapidformer --help` and a bad flag
    must not load it (measured: ~0.12 s for --help, against ~3.6 s with torch)."""
    probe = (
        "import sys\n"
        "from rapidformer.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(code)\n"
    )
    for args, expected in ((["--help"], 0), (["--lerning-rate", "1"], 2)):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == expected, done.stderr
        assert "torch was imported" not in done.stderr
    import rapidformer

    assert rapidformer.Finetuner.__name__ == "Finetuner"  # the lazy exports still resolve
    assert set(rapidformer.__all__) <= set(dir(rapidformer))


HEAVY = ("torch.distributed.tensor", "torch.distributed.pipelining", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "transformers", "datasets")  # fmt: skip
"""Packages of seconds each: a configuration error, and the templates' import, load none."""


def test_refusals_and_the_templates_import_cost_little_more_than_torch(tmp_path: Path) -> None:
    """Measured side by side, three times each, medians (the machine's load moves them
    together): a configuration error within 2x ``import torch``, ``from rapidformer import
    Finetuner`` within 1.5x; neither imports torch's distributed packages, transformers or
    datasets."""
    import statistics
    import time

    heavy = (
        f"import sys; loaded = [m for m in {HEAVY!r} if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    config_error = [
        "-c",
        "import sys; from rapidformer.cli import main; code = main(sys.argv[1:]); "
        f"{heavy}; sys.exit(code)",
        "--user-script", str(DETERMINISTIC_SCRIPT), "--lr", "3e-3", "--train-iters", "2",
        "--micro-batch-size", "2", "--global-batch-size", "7",
    ]  # fmt: skip
    commands = {
        "torch": (["-c", "import torch"], 0),
        "config error": (config_error, 2),
        "Finetuner": (["-c", f"from rapidformer import Finetuner; {heavy}"], 0),
    }
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(3):
        for name, (args, code) in commands.items():
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
            )
            seconds[name].append(time.perf_counter() - started)
            assert done.returncode == code, (name, done.stderr[-2000:])
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print({name: f"{value:.2f} s" for name, value in median.items()})
    assert median["config error"] <= 2.0 * median["torch"], median
    assert median["Finetuner"] <= 1.5 * median["torch"], median


def test_a_script_that_trains_at_its_top_level_trains_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's old quick start had its fit() at the top level, and --user-script ran it
    and then the class again: the file is now the program, and its own run is the one run."""
    script = tmp_path / "top_level.py"
    script.write_text(
        "from rapidformer.cli import load_trainer_class\n"
        f"Base = load_trainer_class({str(DETERMINISTIC_SCRIPT)!r})\n"
        "class TopLevel(Base):\n    pass\n"
        f"TopLevel(argv={[*TINY_FLAGS, '--train-iters', '2']!r}).fit()\n"
    )
    capsys.readouterr()
    assert main(["--user-script", str(script), *TINY_FLAGS, "--train-iters", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("rapidformer plan on ") == 1 and err.count("final metrics: ") == 1, err


@pytest.mark.parametrize(
    ("ending", "code", "said"),
    [
        ("sys.exit()", 0, ""),
        ("sys.exit(3)", 3, ""),
        ("sys.exit('no data today')", 1, "no data today"),
    ],
)
def test_a_scripts_own_exit_is_the_commands(
    ending: str, code: int, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As under ``python FILE``: the script's sys.exit() ends the command with its code (a
    message is printed and is 1), and main() returns it to an in-process caller."""
    script = tmp_path / "exits.py"
    script.write_text(f"import sys\nif __name__ == '__main__':\n    {ending}\n")
    capsys.readouterr()
    assert main(["--user-script", str(script), "--train-iters", "1", "--lr", "1e-3"]) == code
    assert capsys.readouterr().err.strip() == said


def test_a_scripts_classes_reach_spawned_processes(tmp_path: Path) -> None:
    """Data-loader workers started by spawn (macOS; forkserver from Python 3.14) find the
    script's functions and classes, as under ``python FILE``."""
    script = tmp_path / "spawns.py"
    script.write_text(
        "import multiprocessing, sys\n\n"
        "def double(x):\n    return 2 * x\n\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        print('doubled', pool.map(double, [1, 2]))\n"
        "    sys.exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "rapidformer", "--user-script", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "doubled [2, 4]" in done.stdout
