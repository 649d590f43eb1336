"""A run prints its plan and its progress: no third-party notice in a fine-tuning run's first
lines (transformers' LOAD REPORT becomes one line of the run's own), everything back with
--verbose, and no optional engine imported by rapidformer unless its switch is on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents
from rapidformer.testing.finetune import task_dataset, tiny_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
for variable in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
    ENV.pop(variable, None)  # as a user's shell has them: unset


@pytest.fixture(scope="module")
def finetune_flags(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("quiet")
    model = tiny_model("bert", root / "bert", hidden=64)
    data = task_dataset("sequence_classification", root / "data", train=64, validation=16)
    return [
        *("--task", "sequence_classification", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--train-iters", "2", "--lr", "1e-3"),
        *("--micro-batch-size", "8", "--log-interval", "1", "--save", str(root / "run")),
    ]


def _rapidformer(*flags: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "rapidformer", *flags],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return (done.stdout + done.stderr).splitlines()


def test_the_first_30_lines_of_a_fine_tuning_run_are_rapidformers_own(
    finetune_flags: list[str], tmp_path: Path
) -> None:
    lines = _rapidformer(*finetune_flags)[:30]
    foreign = [line for line in lines if not line.startswith(("[rapidformer] ", "  "))]
    assert not foreign, "\n".join(lines)
    model_line = next(line for line in lines if line.startswith("[rapidformer] model: "))
    # transformers' LOAD REPORT, in one line: the head it initialised, what it left unused.
    assert "new: " in model_line and "classifier.weight (4 x 64)" in model_line, model_line
    assert "not used: 5 tensors (cls.predictions.*)" in model_line, model_line


@pytest.mark.parametrize("where", ["flag", "config file"])
def test_verbose_shows_what_the_libraries_print(
    finetune_flags: list[str], tmp_path: Path, where: str
) -> None:
    config = tmp_path / "verbose.yaml"
    config.write_text("verbose: true\n")
    verbose = ["--verbose"] if where == "flag" else ["--config", str(config)]
    flags = [*finetune_flags[:-1], str(tmp_path / "run"), *verbose]
    text = "\n".join(_rapidformer(*flags))
    assert "LOAD REPORT" in text  # transformers' own table, as it prints it


def test_rapidformer_imports_no_optional_engine_unless_switched_on(tmp_path: Path) -> None:
    """A pretraining run of the built-in GPT loads no transformers model: whatever DeepSpeed,
    ONNX Runtime, torchao or Liger module is in the process, rapidformer imported it."""
    data = build_pretraining_data(tmp_path / "corpus", "GPT2BPETokenizer", synthetic_documents(40))
    flags = [
        *("--task", "pretraining", "--num-layers", "2", "--hidden-size", "32"),
        *("--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3"),
        *("--train-iters", "2", "--micro-batch-size", "2", *data.flags()),
        *("--save", str(tmp_path / "run")),
    ]
    engines = ("deepspeed", "onnxruntime", "onnx", "torchao", "liger_kernel")
    code = (
        "import json, sys\n"
        "from rapidformer.cli import main\n"
        f"assert main({flags!r}) == 0\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(engines)!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
    # Its export is as quiet as the run: its one line, no progress bar or engine notice.
    done = subprocess.run(
        [sys.executable, "-m", "rapidformer.export", str(tmp_path / "run"), str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).splitlines() == [f"exported to {tmp_path / 'hf'}"], done


def test_making_a_tiny_model_offline_prints_nothing(tmp_path: Path) -> None:
    """The docs' offline recipe starts with ``tiny_model`` in the user's own script, before
    any run: the libraries it loads stay as quiet there as in a run."""
    code = (
        "from rapidformer.testing.finetune import tiny_model\n"
        f"tiny_model('bert', {str(tmp_path / 'bert')!r}, hidden=64)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout + done.stderr == ""
    assert (tmp_path / "bert" / "config.json").is_file()
