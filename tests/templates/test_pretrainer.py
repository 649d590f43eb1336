"""Black-box and white-box pretraining on a corpus preprocessed like Megatron's, its export to
Hugging Face, and its single-process / two-rank parity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidformer import parse_args
from rapidformer.data.blended import BlendedDataset
from rapidformer.errors import CheckpointError, ConfigError
from rapidformer.export import export_checkpoint
from rapidformer.templates.pretrainer import Pretrainer, build_pretraining_model
from rapidformer.testing.corpus import PretrainingData, build_pretraining_data, synthetic_documents
from tests.helpers.trainers import read_losses

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--lr",
    "2e-3",
    "--lr-warmup-iters",
    "10",
    "--log-interval",
    "10",
]


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory: pytest.TempPathFactory) -> PretrainingData:
    return build_pretraining_data(
        tmp_path_factory.mktemp("gpt"), "GPT2BPETokenizer", synthetic_documents(400, seed=0)
    )


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory: pytest.TempPathFactory) -> PretrainingData:
    return build_pretraining_data(
        tmp_path_factory.mktemp("bert"), "BertWordPieceLowerCase", synthetic_documents(400, seed=0)
    )


def _pretrain(data: PretrainingData, save: Path, *flags: str) -> dict[str, float]:
    config = parse_args([*data.flags(), *MODEL, "--save", str(save), *flags])
    trainer = Pretrainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.engine.close()


def test_gpt_pretraining_learns_and_exports_to_transformers(
    gpt_data: PretrainingData, tmp_path: Path
) -> None:
    metrics = _pretrain(
        gpt_data,
        tmp_path / "run",
        "--train-iters",
        "100",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "16",
        "--eval-interval",
        "50",
        "--eval-iters",
        "4",
    )
    losses = read_losses(tmp_path / "run")
    assert losses[10] > 4.0  # ln(400 tokens) = 6.0 at the start
    assert losses[100] < 2.5 and metrics["eval_loss"] < 2.5  # measured ~1.6 and ~1.5

    transformers = pytest.importorskip("transformers")
    taken = tmp_path / "notes.txt"  # an existing file is refused, not silently skipped
    taken.write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt is a file"):
        export_checkpoint(tmp_path / "run", taken)
    assert taken.read_text() == "mine"
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("The old miller carries a lamp near the river.", return_tensors="pt")
    config = parse_args([*gpt_data.flags(), *MODEL, "--train-iters", "1"])
    trainer = Pretrainer(config)
    model = build_pretraining_model(config, trainer.tokenizer.vocab_size).eval()
    model.load_state_dict(torch.load(tmp_path / "run" / "iter_0000100" / "model.pt"))
    with torch.no_grad():
        ours = model(ids["input_ids"])
        theirs = hf(input_ids=ids["input_ids"]).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_reads_a_moved_vocabulary_from_its_own_flags(
    gpt_data: PretrainingData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's tokenizer files moved: the export names the file and its own flag (exit 2,
    no traceback); given the new places it writes the model; a vocabulary of another size is
    named, not a shape error. The checkpoint stays as it was (its manifest still verifies)."""
    from rapidformer.checkpoint.integrity import damage
    from rapidformer.data.tokenizers import train_tokenizer
    from rapidformer.export import main as export

    assert gpt_data.merge_file is not None
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    moved = {name: old / Path(name).name for name in (gpt_data.vocab_file, gpt_data.merge_file)}
    for source, copy in moved.items():
        copy.write_bytes(Path(source).read_bytes())
    data = PretrainingData(
        gpt_data.prefix, gpt_data.tokenizer_type, str(moved[gpt_data.vocab_file]),
        str(moved[gpt_data.merge_file]),
    )  # fmt: skip
    _pretrain(data, tmp_path / "run", "--train-iters", "2")
    old.rename(new)
    capsys.readouterr()
    assert export([str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    said = capsys.readouterr().err
    assert "(the run's --vocab-file), which is not there" in said and "Traceback" not in said
    vocab, merges = (str(new / Path(f).name) for f in (data.vocab_file, data.merge_file))
    assert export([str(tmp_path / "run"), str(tmp_path / "hf"), "--vocab-file", vocab]) == 2
    assert "(the run's --merge-file), which is not there" in capsys.readouterr().err
    flags = ["--vocab-file", vocab, "--merge-file", merges]
    assert export([str(tmp_path / "run"), str(tmp_path / "hf"), *flags]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    other = train_tokenizer(synthetic_documents(50, seed=1), "GPT2BPETokenizer",
                            str(tmp_path / "other"), vocab_size=300)  # fmt: skip
    assert export([str(tmp_path / "run"), str(tmp_path / "hf2"), "--vocab-file", other[0],
                   "--merge-file", str(other[1])]) == 2  # fmt: skip
    said = capsys.readouterr().err
    assert "does not fit the tokenizer given" in said and "Traceback" not in said
    assert damage(tmp_path / "run" / "iter_0000002") is None


def test_bert_pretraining_masked_lm_accuracy_rises_above_chance(
    bert_data: PretrainingData, tmp_path: Path
) -> None:
    metrics = _pretrain(
        bert_data,
        tmp_path / "run",
        "--train-iters",
        "100",
        "--micro-batch-size",
        "16",
        "--eval-interval",
        "100",
        "--eval-iters",
        "4",
        "--data-iterator",
        "dynamic-shape",
    )
    # Chance is 1/400; the most frequent word of the grammar is ~10% of tokens.
    assert metrics["mlm_accuracy"] > 0.15, metrics
    transformers = pytest.importorskip("transformers")
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_hidden_layers == 2


def test_bert_loss_is_the_same_with_bucket_and_full_padding(bert_data: PretrainingData) -> None:
    trainer = Pretrainer(
        parse_args(
            [
                *bert_data.flags(),
                *MODEL,
                "--train-iters",
                "20",
                "--micro-batch-size",
                "16",
                "--hidden-dropout",
                "0",
            ]
        )
    )
    bundle = trainer.build_data()
    trainer.model = build_pretraining_model(trainer.config, trainer.tokenizer.vocab_size).eval()
    train = bundle.train
    shortest = sorted(range(len(train)), key=lambda i: len(train[i]["input_ids"]))[:8]  # type: ignore[index]
    samples = [train[i] for i in shortest]  # type: ignore[index]
    longest = max(len(s["input_ids"]) for s in samples)
    assert bundle.collate_fn is not None and longest < 64
    full = trainer.train_step(bundle.collate_fn(samples))
    bucket = trainer.train_step(bundle.collate_fn(samples, pad_to=-(-longest // 8) * 8))
    difference = full - bucket  # type: ignore[operator]
    assert abs(difference.item()) <= 1e-5


def test_missing_pretraining_flags_are_reported_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rapidformer.cli import main

    assert (
        main(
            [
                "--task",
                "pretraining",
                "--train-iters",
                "5",
                "--lr",
                "1e-3",
                "--tokenizer-type",
                "GPT2BPETokenizer",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    for flag in ("--data-path", "--vocab-file", "--merge-file", "--seq-length", "--num-layers"):
        assert f"{flag}=None" in err
    with pytest.raises(ConfigError, match="pretraining is iteration-based"):
        Pretrainer(parse_args(["--epochs", "1", "--lr", "1e-3"]))


@pytest.mark.distributed
def test_two_rank_pretraining_under_torchrun_matches_single_process(
    gpt_data: PretrainingData, tmp_path: Path
) -> None:
    flags = [
        *gpt_data.flags(),
        *MODEL,
        "--train-iters",
        "8",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--hidden-dropout",
        "0",
        "--eval-iters",
        "2",
        "--log-interval",
        "1",
    ]
    _pretrain(gpt_data, tmp_path / "single", *flags[len(gpt_data.flags()) + len(MODEL) :])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "rapidformer",
        "--task",
        "pretraining",
        *flags,
        "--save",
        str(tmp_path / "ddp"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    single, ddp = read_losses(tmp_path / "single"), read_losses(tmp_path / "ddp")
    assert single.keys() == ddp.keys() == set(range(1, 9))
    assert max(abs(single[s] - ddp[s]) for s in single) <= 1e-5


def test_a_blend_of_corpora_follows_its_weights(gpt_data: PretrainingData) -> None:
    flags = gpt_data.flags()
    flags[flags.index("--data-path") + 1] = f"0.3 {gpt_data.prefix} 0.7 {gpt_data.prefix}"
    trainer = Pretrainer(
        parse_args([*flags, *MODEL, "--train-iters", "10", "--micro-batch-size", "10"])
    )
    train = trainer.build_data().train
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert (train.which == 0).sum() == 30
    assert train[0]["input_ids"].shape == (64,)


def test_pretraining_resumes_bitwise_after_a_crash(
    gpt_data: PretrainingData, tmp_path: Path
) -> None:
    flags = [
        "--train-iters",
        "6",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--save-interval",
        "3",
        "--eval-iters",
        "2",
        "--log-interval",
        "1",
    ]
    _pretrain(gpt_data, tmp_path / "full", *flags)
    config = parse_args([*gpt_data.flags(), *MODEL, *flags, "--save", str(tmp_path / "cut")])
    trainer = Pretrainer(config)
    original = trainer.train_step
    steps = {"n": 0}

    def crash_in_step_5(batch: dict[str, torch.Tensor]) -> object:
        assert trainer.model is not None
        steps["n"] += trainer.model.training
        if steps["n"] > 8:  # two micro-batches per step
            raise KeyboardInterrupt
        return original(batch)

    trainer.train_step = crash_in_step_5  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    trainer.engine.close()
    _pretrain(gpt_data, tmp_path / "cut", *flags)  # resumes from step 3
    full, cut = read_losses(tmp_path / "full"), read_losses(tmp_path / "cut")
    assert [cut[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
