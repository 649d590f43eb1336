"""Hugging Face breadth: ten families (BERT, RoBERTa, DeBERTa-v2, ModernBERT, GPT-2, Llama,
Qwen2, Mistral, T5, BART), built tiny and offline, through every fine-tuning task each supports:
each saved model reloads with transformers predicting the same, and each task learns beyond
chance on one family of each kind (:data:`LEARNERS`); each task a family does not support is
refused before anything is built, naming what it does support. docs/finetuning.md has the
measured table (benchmarks/hf_architectures.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from rapidformer import Finetuner, parse_args
from rapidformer.errors import ConfigError
from rapidformer.templates.architectures import model_type_of, supported_tasks
from rapidformer.templates.tasks import TASKS
from rapidformer.testing.breadth import ARCHITECTURES, run_cell
from rapidformer.testing.finetune import task_dataset, tiny_model

pytest.importorskip("transformers")

# What transformers (5.x) offers each family, as fine-tuning sees it: a change here (a new head
# in a transformers release) should be a decision, not a surprise.
EXPECTED = {
    "bert": "sequence_classification token_classification question_answering masked_lm causal_lm",
    "roberta": "sequence_classification token_classification question_answering masked_lm "
    "causal_lm",
    "deberta_v2": "sequence_classification token_classification question_answering masked_lm",
    "modernbert": "sequence_classification token_classification question_answering masked_lm",
    "gpt2": "sequence_classification token_classification question_answering causal_lm",
    "llama": "sequence_classification token_classification question_answering causal_lm",
    "qwen2": "sequence_classification token_classification question_answering causal_lm",
    "mistral": "sequence_classification token_classification question_answering causal_lm",
    "t5": "sequence_classification token_classification question_answering seq2seq_lm",
    "bart": "sequence_classification question_answering masked_lm seq2seq_lm",
}
CELLS = [(kind, task) for kind in ARCHITECTURES for task in EXPECTED[kind].split()]
LEARNERS = ("bert", "llama", "t5")
"""The families each task must learn beyond chance on, one of each kind (encoder, decoder,
encoder-decoder): rapidformer's code differs by kind and by task, not by family within a
kind. Every other cell trains :data:`SHORT_STEPS` steps and checks what is the family's own:
its head, its save and its reload by transformers. The learning of every cell is measured by
benchmarks/hf_architectures.py (docs/results/hf_architectures.md)."""
SHORT_STEPS = 4
REFUSED = [(kind, task) for kind in ARCHITECTURES for task in TASKS if (kind, task) not in CELLS]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {kind: tiny_model(kind, root / kind) for kind in ARCHITECTURES}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("task_data")
    return {task: task_dataset(task, root / task, train=512, validation=128) for task in TASKS}


def test_each_family_supports_the_expected_tasks(models: dict[str, Path]) -> None:
    for kind, path in models.items():
        model_type = model_type_of(path)
        assert model_type is not None, kind
        assert supported_tasks(model_type) == EXPECTED[kind].split(), kind


@pytest.mark.parametrize(("kind", "task"), CELLS, ids=[f"{k}-{t}" for k, t in CELLS])
def test_family_fine_tunes_the_task_and_reloads_with_transformers(
    kind: str, task: str, models: dict[str, Path], datasets: dict[str, Path], tmp_path: Path
) -> None:
    learns = kind in LEARNERS
    steps = None if learns else SHORT_STEPS
    result = run_cell(kind, task, models[kind], datasets[task], tmp_path / "out", steps)
    print(
        f"{kind} {task}: {result.model_class} {result.metric} {result.value:.3f} "
        f"(chance {result.chance:.3g}, bound {result.bound:.3g}), reload max |diff| "
        f"{result.reload_max_diff:.1e}, {result.seconds:.1f} s, {result.steps} steps"
    )
    assert result.learned or not learns, result
    assert result.steps == SHORT_STEPS or learns, result
    assert result.reload_same_predictions and result.reload_max_diff <= 1e-5, result
    if task == "causal_lm" and "masked_lm" in EXPECTED[kind]:
        # An encoder fine-tuned as a causal LM must attend causally (else it reads its targets).
        config = importlib.import_module("transformers").AutoConfig.from_pretrained(
            tmp_path / "out"
        )
        assert config.is_decoder


@pytest.mark.parametrize(("kind", "task"), REFUSED, ids=[f"{k}-{t}" for k, t in REFUSED])
def test_a_task_the_family_cannot_run_is_refused_naming_what_it_can(
    kind: str, task: str, models: dict[str, Path], datasets: dict[str, Path]
) -> None:
    flags = ["--task", task, "--pretrained-model-name-or-path", str(models[kind])]
    flags += ["--data-dir", str(datasets[task]), "--train-iters", "1", "--lr", "1e-3"]
    with pytest.raises(ConfigError) as caught:
        Finetuner(parse_args(flags))
    message = str(caught.value)
    assert f"--task='{task}'" in message, message
    assert "supports: " + ", ".join(EXPECTED[kind].split()) in message, message
