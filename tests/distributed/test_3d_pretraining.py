"""Black-box pretraining of the built-in BERT under tensor x pipeline parallelism (tp2 x pp2
on 4 ranks) against one process: the padding mask crosses the stages, the MLM loss is
vocab-parallel, evaluation and its metrics run through the stages, and the run's sharded
checkpoint exports to one Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from rapidformer import parse_args
from rapidformer.export import export_checkpoint
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents
from tests.helpers.trainers import launched, read_losses

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--lr", "2e-3", "--hidden-dropout", "0", "--train-iters", "6",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "6",
    "--eval-iters", "2", "--log-interval", "1", "--clip-grad", "0.5",
]  # fmt: skip


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory: pytest.TempPathFactory) -> PretrainingData:
    return build_pretraining_data(
        tmp_path_factory.mktemp("bert"), "BertWordPieceLowerCase", synthetic_documents(200, seed=1)
    )


def _evaluation(save: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["kind"] == "eval")


@pytest.mark.distributed
def test_bert_under_tp2_pp2_matches_one_process(
    bert_data: PretrainingData, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    single = Pretrainer(parse_args([*bert_data.flags(), *FLAGS, "--save", str(tmp_path / "one")]))
    try:
        single.fit()
    finally:
        single.engine.close()
    said = launched([
        "--nproc-per-node", "4", "--task", "pretraining", *bert_data.flags(), *FLAGS,
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", str(tmp_path / "3d"),
    ], capfd)  # fmt: skip
    one, three_d = read_losses(tmp_path / "one"), read_losses(tmp_path / "3d")
    assert one.keys() == three_d.keys() == set(range(1, 7))
    assert max(abs(one[s] - three_d[s]) for s in one) <= 1e-5
    evaluated, reference = _evaluation(tmp_path / "3d"), _evaluation(tmp_path / "one")
    assert abs(evaluated["eval_loss"] - reference["eval_loss"]) <= 1e-5
    assert evaluated["mlm_accuracy"] == pytest.approx(reference["mlm_accuracy"], abs=1e-6)
    assert "pipeline parallel" in said and "vocab-parallel loss" in said
    # Export in one process from the tp2 x pp2 shards: the weights of the one-process run.
    exported = {}
    for name in ("one", "3d"):
        export_checkpoint(tmp_path / name, tmp_path / f"hf_{name}")
        model = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / f"hf_{name}")
        exported[name] = model.state_dict()
    assert exported["one"].keys() == exported["3d"].keys()
    differences = [(exported["one"][k] - exported["3d"][k]).abs().max() for k in exported["one"]]
    assert max(float(d) for d in differences) <= 1e-5
