"""Fine-tuning a Hugging Face MoE model (tiny Mixtral and Qwen3-MoE built offline): its router
load-balancing loss is part of the objective, once per micro-batch, and logged apart from the
language-model loss; --num-experts on a Hugging Face model is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer import Finetuner, parse_args
from rapidformer.errors import ConfigError
from rapidformer.testing.finetune import task_dataset, tiny_model


def _flags(model: Path, data: Path) -> list[str]:
    return [
        *("--task", "causal_lm", "--pretrained-model-name-or-path", str(model)),
        *("--data-dir", str(data), "--seq-length", "32", "--micro-batch-size", "4"),
        *("--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3"),
        *("--log-interval", "2"),
    ]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_an_moe_model_fine_tunes_with_its_router_loss(tmp_path: Path, kind: str) -> None:
    model = tiny_model(kind, tmp_path / kind)
    data = task_dataset("casual_lm", tmp_path / "data", train=64, validation=8)
    trainer = Finetuner(parse_args([*_flags(model, data), "--save", str(tmp_path / "run")]))
    trainer.fit()
    assert trainer.model is not None
    # The objective is the task's loss plus the model's coefficient x its router loss.
    batch = next(
        iter(
            torch.utils.data.DataLoader(
                trainer.data.train, batch_size=4, collate_fn=trainer.task.collate
            )
        )
    )  # type: ignore[union-attr]
    trainer.model.train()
    outputs = trainer.model(**trainer.model_inputs(batch))
    assert outputs.aux_loss is not None  # output_router_logits was switched on
    total = trainer.compute_loss(outputs, batch)
    task_only = trainer.task.loss(outputs, batch)
    assert abs(float(total - task_only) - 0.02 * float(outputs.aux_loss)) <= 1e-6
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(r["moe_aux_loss"] > 0 for r in train)
    # Logged apart: about coefficient x 1 (a balanced top-2 router's loss is ~1).
    assert all(0.01 < r["moe_aux_loss"] < 0.1 for r in train)


def test_num_experts_on_a_hugging_face_model_is_refused_with_the_fix(tmp_path: Path) -> None:
    model = tiny_model("gpt2", tmp_path / "gpt2")
    data = task_dataset("casual_lm", tmp_path / "data", train=16, validation=4)
    config = parse_args([*_flags(model, data), "--num-experts", "4"])
    with pytest.raises(ConfigError, match="--num-experts=4: swaps the FFNs of rapidformer's"):
        Finetuner(config)
