"""Tensor parallelism of a Hugging Face model through the Finetuner: a tiny Llama (built
offline) loads with its own plan (``base_model_tp_plan``) on the tp axis and fine-tunes with
the one-process losses; a model without a plan is refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidformer import Finetuner, parse_args
from rapidformer.cli import main
from rapidformer.errors import ConfigError
from rapidformer.testing.finetune import task_dataset, tiny_model
from tests.helpers.trainers import launched, read_losses


def _flags(model: Path, data: Path) -> list[str]:
    return [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "4"),
        *("--global-batch-size", "16", "--train-iters", "6", "--lr", "3e-3"),
        *("--log-interval", "1", "--clip-grad", "0.5"),
    ]


@pytest.mark.distributed
def test_llama_under_tp2_fine_tunes_like_one_process(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model("llama", tmp_path / "llama")
    data = task_dataset("casual_lm", tmp_path / "data", train=128, validation=16)
    flags = _flags(model, data)
    assert main([*flags, "--save", str(tmp_path / "one")]) == 0
    tp2 = ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "tp2")]
    said = launched(["--nproc-per-node", "2", *flags, *tp2], capfd)
    assert "tensor parallel: transformers tp_plan" in said
    one, tp2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "tp2")
    assert one.keys() == tp2.keys() == set(range(1, 7))
    assert max(abs(one[s] - tp2[s]) for s in one) <= 1e-5


def test_a_model_without_a_plan_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    model = tiny_model("gpt2", tmp_path / "gpt2")
    data = task_dataset("casual_lm", tmp_path / "data", train=16, validation=4)
    config = parse_args([*_flags(model, data), "--tensor-model-parallel-size", "2"])
    # The template's rules read config.json only: no process group, no weights loaded.
    found = [v for v in Finetuner.config_violations(config) if "tp_plan" in v.rule]
    assert len(found) == 1 and found[0].flag == "--tensor-model-parallel-size"
    assert "Llama" in found[0].fix
    with pytest.raises(ConfigError, match="base_model_tp_plan"):
        Finetuner(config)
