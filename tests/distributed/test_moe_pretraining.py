"""Black-box MoE GPT pretraining (the Pretrainer from flags, as `rapidformer --task
pretraining` runs it) on one process, dp2 and ep2, for every balancing type: the same loss
curve and the same routing figures within 1e-5 over 10 steps, because every layout reads the
same micro-batches. (With ranks taking every dp-th sample, aux_loss differed by 2e-3.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidformer import parse_args
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.testing import run_distributed
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents
from tests.helpers.trainers import read_losses

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--lr", "2e-3", "--hidden-dropout", "0",
    "--train-iters", "10", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--eval-interval", "1000", "--log-interval", "1", "--seed", "11",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-z-loss-coeff", "1e-3",
]  # fmt: skip
BALANCING = ["aux_loss", "seq_aux_loss", "global_aux_loss", "expert_bias", "none"]
LAYOUTS = {"dp2": [], "ep2": ["--expert-model-parallel-size", "2"]}


def _fit(data: PretrainingData, balancing: str, extra: list[str], save: Path) -> None:
    flags = [*data.flags(), *FLAGS, "--moe-router-load-balancing-type", balancing]
    trainer = Pretrainer(parse_args([*flags, *extra, "--save", str(save)]))
    trainer.fit()  # the process group stays for the launch's next run


def _two_ranks(data: PretrainingData, out: str) -> None:
    torch.set_num_threads(1)
    for layout, extra in LAYOUTS.items():
        for balancing in BALANCING:
            _fit(data, balancing, extra, Path(out) / f"{layout}_{balancing}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe_pretraining")
    data = build_pretraining_data(
        out / "data", "GPT2BPETokenizer", synthetic_documents(120, seed=29), vocab_size=300
    )
    for balancing in BALANCING:
        trainer = Pretrainer(
            parse_args(
                [*data.flags(), *FLAGS, "--moe-router-load-balancing-type", balancing,
                 "--save", str(out / f"one_{balancing}")]
            )
        )  # fmt: skip
        try:
            trainer.fit()
        finally:
            trainer.engine.close()
    run_distributed(_two_ranks, 2, data, str(out))
    return out


def _routing(save: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    fields = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance")
    return [{k: r[k] for k in fields if k in r} for r in records if r["kind"] == "train"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("balancing", BALANCING)
def test_black_box_moe_pretraining_is_the_same_on_every_layout(
    runs: Path, layout: str, balancing: str
) -> None:
    one, other = runs / f"one_{balancing}", runs / f"{layout}_{balancing}"
    expected, got = read_losses(one), read_losses(other)
    assert expected.keys() == got.keys() == set(range(1, 11))
    assert max(abs(expected[s] - got[s]) for s in expected) <= 1e-5, (expected, got)
    for a, b in zip(_routing(one), _routing(other), strict=True):
        assert a.keys() == b.keys() and "moe_load_imbalance" in a
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a, b)
