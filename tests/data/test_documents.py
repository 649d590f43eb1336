"""Document boundaries in GPT pretraining samples (``--reset-position-ids``,
``--reset-attention-mask``, ``--eod-mask-loss``): a sample holding several documents gives each
document the per-token losses and gradients it has alone (within 1e-5, fp32, the built-in GPT),
the collate function's parts are Megatron's, and the flags are refused where they cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rapidformer import RapidformerConfig
from rapidformer.cli import main
from rapidformer.data.documents import DocumentCollate
from rapidformer.labels import IGNORE_INDEX
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.templates.families.gpt import document_violations
from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents
from tests.helpers.trainers import launched, read_losses

EOD, TOLERANCE = 0, 1e-5
ALL = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}


def _collate(**flags: bool) -> DocumentCollate:
    return DocumentCollate(EOD, **{**dict.fromkeys(ALL, False), **flags})


def test_positions_mask_and_labels_restart_at_each_document() -> None:
    tokens = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 4]])
    batch = _collate(**ALL)([{"input_ids": tokens[0], "labels": tokens[0].roll(-1)}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert batch["documents"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    mask = batch["document_mask"][0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[2].tolist()[:3] == [True, True, True]  # the EOD belongs to its document
    assert (batch["labels"][0] == IGNORE_INDEX).tolist() == [t == EOD for t in tokens[0].tolist()]
    plain = _collate(reset_position_ids=True)([{"input_ids": tokens[0], "labels": tokens[0]}])
    assert "document_mask" not in plain and (plain["labels"] != IGNORE_INDEX).all()


def test_each_document_of_a_sample_learns_as_it_would_alone() -> None:
    config = GPTConfig(vocab_size=50, num_layers=2, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=32, dropout=0.0)  # fmt: skip
    model = GPTModel.build(config, device="cpu", seed=0)
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(1, 50, (n,), generator=generator) for n in (6, 9, 5)]
    stream = torch.cat([torch.cat([d, torch.tensor([EOD])]) for d in documents])
    sample = {"input_ids": stream[:-1], "labels": stream[1:]}
    batch = _collate(**ALL)([sample])
    logits = model(batch["input_ids"], position_ids=batch["position_ids"],
                   document_mask=batch["document_mask"])  # fmt: skip
    losses = F.cross_entropy(logits[0], batch["labels"][0], reduction="none")
    learned = batch["labels"][0] != IGNORE_INDEX
    losses[learned].sum().backward()
    packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = []
    for document in documents:  # each document with its EOD, run alone
        ids = torch.cat([document, torch.tensor([EOD])])
        own = F.cross_entropy(model(ids[None, :-1])[0], ids[1:], reduction="none")
        own.sum().backward()  # gradients summed over the documents, as the packed loss sums
        alone.append(own.detach())
    assert int(learned.sum()) == sum(len(d) for d in documents)  # every EOD input ignored
    assert (losses[learned].detach() - torch.cat(alone)).abs().max() <= TOLERANCE
    for got, param in zip(packed, model.parameters(), strict=True):
        assert param.grad is not None and (got - param.grad).abs().max() <= TOLERANCE


@pytest.mark.parametrize(
    ("options", "family", "refusal"),
    [
        ({"reset_attention_mask": True}, "bert", "built-in GPT's pretraining (this run: bert)"),
        (
            {
                "reset_position_ids": True,
                "sequence_parallel": True,
                "tensor_model_parallel_size": 2,
            },
            "gpt",
            "--sequence-parallel",
        ),
    ],
)
def test_the_document_flags_are_refused_where_they_cannot_work(
    options: dict[str, object], family: str, refusal: str
) -> None:
    violations = document_violations(RapidformerConfig.from_dict(options), family)
    assert violations and all(refusal in v.rule for v in violations)
    assert not document_violations(RapidformerConfig.from_dict(ALL), "gpt")


def test_a_pretraining_run_with_the_document_flags_learns(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = build_pretraining_data(tmp_path / "gpt", "GPT2BPETokenizer", synthetic_documents(80))
    flags = [
        *("--task", "pretraining", *data.flags(), "--num-layers", "2", "--hidden-size", "32"),
        *("--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4"),
        *("--lr", "5e-3", "--train-iters", "12", "--log-interval", "1"),
        *("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"),
    ]
    assert main([*flags, "--save", str(tmp_path / "run")]) == 0
    said = capfd.readouterr().err
    assert "documents inside a sample: positions restart; attention stays within" in said
    losses = read_losses(tmp_path / "run")
    assert losses[12] < 0.9 * losses[1]


@pytest.mark.distributed
def test_the_document_flags_on_two_tensor_or_pipeline_parallel_ranks_match_one_process(
    tmp_path: Path,
) -> None:
    """The built-in tp_plan splits the heads over 2 ranks, each reading the whole document
    mask; 2 pipeline stages each read the mask too (the schedule gives every stage the keyword
    inputs). Training and evaluation losses: those of one process, within 1e-5 (other
    reductions)."""
    data = build_pretraining_data(tmp_path / "gpt", "GPT2BPETokenizer", synthetic_documents(80))
    flags = [
        *("--task", "pretraining", *data.flags(), "--num-layers", "2", "--hidden-size", "32"),
        *("--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"),
        *("--global-batch-size", "4", "--lr", "5e-3", "--train-iters", "6"),
        *("--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1"),
        *("--hidden-dropout", "0", "--reset-position-ids", "--reset-attention-mask"),
        "--eod-mask-loss",
    ]  # no dropout: its masks are drawn per rank
    assert main([*flags, "--save", str(tmp_path / "one")]) == 0
    one = _losses(tmp_path / "one")
    for name, layout in (("tp2", "--tensor-model-parallel-size"),
                         ("pp2", "--pipeline-model-parallel-size")):  # fmt: skip
        two_ranks = ["--nproc-per-node", "2", *flags, layout, "2", "--save", str(tmp_path / name)]
        launched(two_ranks)
        got = _losses(tmp_path / name)
        assert got.keys() == one.keys() and len(one) == 8, (one, got)  # 6 train, 2 eval
        gap = max(abs(one[key] - got[key]) for key in one)
        print(f"{name}: largest loss gap to one process: {gap:.2e}")
        assert gap <= 1e-5, (one, got)


def _losses(save: Path) -> dict[tuple[str, int], float]:
    """Every train and eval loss of a run, by (kind, step)."""
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {(r["kind"], r["step"]): r.get("loss", r.get("eval_loss")) for r in rows}
