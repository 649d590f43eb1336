"""The PAI API in one process: HuggingFaceTrainer with both kinds of compute_metrics, the
flags get_args() shows, and the refusals that name PAI's name and ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rapidformer.compat import pai
from rapidformer.errors import HookError
from rapidformer.testing.finetune import task_dataset, tiny_model

LABELS = ["sells", "paints", "finds", "carries"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf")
    return tiny_model("bert", root / "bert"), task_dataset(
        "sequence_classification", root / "data", train=256, validation=64
    )


def _encoded(data: Path, split: str, tokenizer: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]
    return [dict(tokenizer(r["text"]), labels=LABELS.index(r["label"])) for r in rows]


class Accuracy:
    """Like a `datasets` / `evaluate` metric: compute(predictions=, references=)."""

    def compute(self, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
        return {"accuracy": float((predictions == references).mean()), "seen": len(references)}


def test_hugging_face_trainer_learns_with_a_metric_object_or_function(
    bert: tuple[Path, Path],
) -> None:
    import transformers

    model_dir, data = bert
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    results = []
    for metric in (
        Accuracy(),
        lambda p: {"accuracy": float((p.predictions == p.label_ids).mean())},
    ):
        engine = pai.RapidformerEngine(
            argv=["--lr", "5e-3", "--train-iters", "120", "--micro-batch-size", "16", "--seed", "3"]
        )
        torch.manual_seed(0)  # the new classification head
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=4
        )
        trainer = pai.HuggingFaceTrainer(
            engine=engine,
            model=model,
            train_dataset=_encoded(data, "train", tokenizer),
            eval_dataset=_encoded(data, "validation", tokenizer),
            compute_metrics=metric,
            data_collator=lambda rows: tokenizer.pad(rows, return_tensors="pt"),
        )
        try:
            results.append(trainer.train())
        finally:
            trainer.engine.close()
    first, second = results
    # 4 verbs: chance 0.25; the same seeded run behind both kinds of metric.
    assert first["accuracy"] > 0.6 and first["seen"] == 64, first
    assert second["accuracy"] == first["accuracy"]
    assert second["eval_loss"] == first["eval_loss"]


def test_get_args_shows_our_flags_the_scripts_own_and_the_launch() -> None:
    def extra(parser: Any) -> Any:
        group = parser.add_argument_group(title="mine")
        group.add_argument("--my-width", type=int, default=7)
        group.add_argument("--my-name", type=str)
        return parser

    pai.RapidformerEngine(extra, argv=["--micro-batch-size", "3", "--precision", "bf16"])
    args = pai.get_args()
    assert (args.micro_batch_size, args.my_width, args.my_name) == (3, 7, None)
    assert (args.bf16, args.fp16, args.rank, args.world_size) == (True, False, 0, 1)


def test_get_args_answers_pais_spellings_of_one_choice() -> None:
    """PAI scripts read args.zero_2_memory_optimization, args.checkpoint_activations, ...: the
    aliases of one typed field each, true where that field holds what they stand for."""
    argv = ["--oss-sdp-memory-optimization", "--mixed-precision", "--checkpoint-activations"]
    pai.RapidformerEngine(argv=argv)
    args = pai.get_args()
    assert args.sharding == "zero2" and args.precision == "fp16"
    assert args.zero_2_memory_optimization and args.oss_sdp_memory_optimization
    assert not (args.zero_1_memory_optimization or args.fsdp_memory_optimization)
    assert args.mixed_precision and args.checkpoint_activations


def test_pai_names_without_a_counterpart_are_refused_with_ours() -> None:
    with pytest.raises(ImportError, match=r"build_pretrain_huggingface_bert_datasets.*preprocess"):
        from rapidformer.compat.pai import build_pretrain_huggingface_bert_datasets  # noqa: F401
    engine = pai.RapidformerEngine(argv=["--lr", "1e-3", "--train-iters", "1"])
    with pytest.raises(TypeError, match=r"\['args'\].*rapidformer flags"):
        pai.HuggingFaceTrainer(engine=engine, model=None, train_dataset=[], args=object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"before engine\.compose"):
        engine.backward(None)  # type: ignore[arg-type]

    class NoProvider(pai.Finetuner):
        def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
            return [], None, None, None

    trainer = NoProvider(engine=engine)
    try:
        with pytest.raises(HookError, match="model_optimizer_lr_scheduler_provider"):
            trainer.train()
    finally:
        trainer.engine.close()
