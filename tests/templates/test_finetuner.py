"""Black-box fine-tuning of tiny BERT / GPT-2 / T5 models on every task: each learns beyond
chance, its saved model reloads with transformers and predicts the same, two ranks compute the
same metrics as one process, and bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapidformer import Finetuner, RapidformerConfig, parse_args
from rapidformer.cli import main
from rapidformer.errors import ConfigError, DataError
from rapidformer.testing.breadth import reload_gap
from rapidformer.testing.finetune import task_dataset, tiny_model
from tests.helpers.trainers import launched

COMMON = ["--seq-length", "64", "--micro-batch-size", "16", "--log-interval", "50"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        kind: tiny_model(kind, root / kind) for kind in ("bert", "gpt2", "t5", "llama", "roberta")
    }


def _eval_records(save: Path) -> list[dict[str, float]]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


# task, model, flags, (metric, bound): bounds sit well below what was measured (docs/finetuning.md)
CASES = {
    # 4 verbs: chance accuracy 0.25. Epoch-based, 2 micro-batches accumulated per step.
    "sequence_classification": (
        "bert",
        ["--epochs", "5", "--global-batch-size", "32", "--lr", "5e-3"],
        ("accuracy", 0.7),
    ),
    # Entity-level F1 of a random tagger is ~0. Dynamic shape: batches padded to buckets.
    "token_classification": (
        "bert",
        ["--train-iters", "60", "--lr", "3e-3", "--data-iterator", "dynamic-shape"],
        ("f1", 0.8),
    ),
    # Who / what / where: picking one of the three phrases at random gives 33 EM, a random
    # span ~0.
    "question_answering": ("bert", ["--epochs", "6", "--lr", "5e-3"], ("exact_match", 60.0)),
    # Masked-LM and causal-LM: perplexity falls (below); seq2seq: copies the place phrase.
    "masked_lm": ("bert", ["--train-iters", "90", "--lr", "3e-3"], ("token_accuracy", 0.15)),
    "casual_lm": ("gpt2", ["--train-iters", "90", "--lr", "3e-3"], ("token_accuracy", 0.25)),
    "seq2seq_lm": (
        "t5",
        ["--train-iters", "60", "--lr", "5e-3", "--data-iterator", "dynamic-shape"],
        ("token_accuracy", 0.8),
    ),
}


@pytest.mark.parametrize("task", list(CASES))
def test_each_task_learns_and_the_saved_model_reloads_with_transformers(
    task: str, models: dict[str, Path], tmp_path: Path
) -> None:
    kind, flags, (metric, bound) = CASES[task]
    interval = 10 if task in ("masked_lm", "casual_lm") else 30  # LM: see the perplexity fall
    data = task_dataset(task, tmp_path / "data", train=512, validation=128)
    save = tmp_path / "out"
    trainer = Finetuner(
        parse_args(
            [
                *("--task", task, "--pretrained-model-name-or-path", str(models[kind])),
                *("--data-dir", str(data), *COMMON, *flags, "--eval-interval", str(interval)),
                *("--save", str(save)),
            ]
        )
    )
    try:
        metrics = trainer.fit()
    finally:
        trainer.engine.close()
    assert metrics[metric] > bound, metrics
    if task == "sequence_classification":
        _check_real_tokens_are_counted(trainer, save)
    if task in ("masked_lm", "casual_lm"):
        perplexities = [r["perplexity"] for r in _eval_records(save)]
        # Uniform guessing over the 300-token vocabulary: perplexity 300.
        assert perplexities[-1] < 0.5 * perplexities[0] and perplexities[-1] < 60, perplexities

    transformers = pytest.importorskip("transformers")
    same, gap = reload_gap(trainer, save)
    assert same and gap <= 1e-5, gap
    tokenizer = transformers.AutoTokenizer.from_pretrained(save)
    text = "The farmer sells the bread in the market."
    assert tokenizer(text)["input_ids"] == trainer.tokenizer(text)["input_ids"]


def _check_real_tokens_are_counted(trainer: Finetuner, save: Path) -> None:
    """tokens_per_s / samples_per_s of a logged window is its mean tokens per sample: that of
    the real (unpadded) sentences, not the --seq-length (64) the batches are padded to."""
    assert trainer.data is not None
    lengths = [len(trainer.data.train[i]["input_ids"]) for i in range(len(trainer.data.train))]
    lines = (save / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert train
    for record in train:
        per_sample = record["tokens_per_s"] / record["samples_per_s"]
        assert min(lengths) <= per_sample <= max(lengths) < 64, (per_sample, min(lengths))


def _task_flags(task: str, model: Path, data: Path, steps: int) -> list[str]:
    return [
        *("--task", task, "--pretrained-model-name-or-path", str(model), "--data-dir", str(data)),
        *("--seq-length", "48", "--micro-batch-size", "8", "--global-batch-size", "32"),
        *("--train-iters", str(steps), "--lr", "5e-3", "--log-interval", "4"),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("task", ["sequence_classification", "question_answering"])
def test_two_rank_fine_tuning_computes_the_single_process_metrics(
    task: str, models: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # 97 validation rows: ranks hold 49 and 48; QA windows of one example may split across them.
    # Training stays on whole epochs of an even size (classification: 2 epochs of 512) or inside
    # the first epoch (QA: 384 windows of 512 examples), where 2 ranks read the same samples as 1.
    qa = task == "question_answering"
    data = task_dataset(task, tmp_path / "data", train=512, validation=97)
    flags = _task_flags(task, models["bert"], data, steps=12 if qa else 32)
    if task == "question_answering":
        flags += ["--seq-length", "16"]  # contexts exceed the window: several per example
    assert main([*flags, "--save", str(tmp_path / "single")]) == 0
    said = launched(["--nproc-per-node", "2", *flags, "--save", str(tmp_path / "ddp")], capfd)
    assert "accumulation 2 = global batch 32" in said
    single, ddp = _eval_records(tmp_path / "single")[-1], _eval_records(tmp_path / "ddp")[-1]
    assert single.keys() == ddp.keys()
    assert single["step"] == (12 if qa else 32)
    for key in set(single) - {"kind"}:
        assert abs(single[key] - ddp[key]) <= 1e-4 * max(1.0, abs(single[key])), (key, single, ddp)
    # Each of the 97 validation examples counted once: the score is a multiple of 1/97.
    correct = ddp["accuracy"] if task == "sequence_classification" else ddp["exact_match"] / 100
    assert abs(correct * 97 - round(correct * 97)) < 1e-6
    # Mixed predictions (one class throughout scores ~0.25), so a miscount would show.
    assert (0.3 if task == "sequence_classification" else 0.1) < correct < 1.0
    # Rank 0 wrote the DDP-trained model: it predicts what the single-process one does.
    transformers = pytest.importorskip("transformers")
    auto = (
        transformers.AutoModelForQuestionAnswering
        if qa
        else transformers.AutoModelForSequenceClassification
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "ddp")
    inputs = tokenizer(["Who is it?"], ["The farmer sells a lamp at dawn."], return_tensors="pt")
    with torch.no_grad():
        one, two = (
            auto.from_pretrained(tmp_path / name).eval()(**inputs) for name in ("single", "ddp")
        )
    for key in ("start_logits", "end_logits") if qa else ("logits",):
        # Compared after softmax: QA's start/end biases get zero gradients (a shift of all
        # positions), which Adam turns into rounding-noise-driven steps that differ by rank.
        difference = one[key].log_softmax(-1) - two[key].log_softmax(-1)
        assert difference.abs().max().item() <= 1e-4


def _trainer(model: Path, data: Path, *flags: str) -> Finetuner:
    return Finetuner(
        parse_args(
            [
                *("--task", "sequence_classification", "--lr", "1e-3", "--train-iters", "1"),
                *("--pretrained-model-name-or-path", str(model), "--data-dir", str(data)),
                *flags,
            ]
        )
    )


def test_bad_data_and_model_directories_are_named(models: dict[str, Path], tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "sst_train.jsonl").write_text('{"sentence_x": "a", "label": "p"}\n')
    with pytest.raises(DataError, match=r"no text column: looked for text, sentence.*sentence_x"):
        _trainer(models["bert"], data).build_data()

    two_classes = '{"text": "a b", "label": "p"}\n{"text": "b", "label": "r"}\n'
    (data / "sst_train.jsonl").write_text(two_classes)
    (data / "sst_validation.jsonl").write_text('{"text": "c", "label": "q"}\n')
    with pytest.raises(DataError, match=r"validation split has label 'q'.*known labels: p, r"):
        _trainer(models["bert"], data).build_data()

    with pytest.raises(ConfigError, match=r"--data-name='nope': no configuration.*sst_train"):
        _trainer(models["bert"], data, "--data-name", "nope").build_data()

    empty = tmp_path / "empty_model"
    empty.mkdir()
    (empty / "README").write_text("not a model")
    with pytest.raises(ConfigError, match=r"holds no model: no config.json there .found: README"):
        _trainer(empty, data).build_model()
    with pytest.raises(ConfigError, match="no such model directory"):
        _trainer(tmp_path / "missing", data).build_model()


def test_hub_names_without_network_say_to_pass_a_local_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    from rapidformer.data.finetune_data import load_splits
    from rapidformer.models.hf import load_model, load_tokenizer

    with pytest.raises(ConfigError, match=r"no network access to the hub.*local directory"):
        load_tokenizer("some-org/some-model")
    with pytest.raises(ConfigError, match=r"no network access to the hub.*local directory"):
        load_model("some-org/some-model", "AutoModelForMaskedLM")
    with pytest.raises(ConfigError, match=r"--data-dir='some-org/no-such-dataset'.*no network"):
        load_splits("some-org/no-such-dataset", None)


def test_white_box_subclass_overrides_one_hook(models: dict[str, Path], tmp_path: Path) -> None:
    data = task_dataset("sequence_classification", tmp_path / "data", train=64, validation=32)
    script = tmp_path / "my_finetuner.py"
    script.write_text(
        "from rapidformer import Finetuner\n\n"
        "class Frozen(Finetuner):\n"
        "    task_name = 'sequence_classification'\n\n"
        "    def build_model(self):\n"
        "        model = super().build_model()\n"
        "        for p in model.bert.parameters():\n"
        "            p.requires_grad_(False)\n"
        "        return model\n"
    )
    save = tmp_path / "out"
    flags = ["--pretrained-model-name-or-path", str(models["bert"]), "--data-dir", str(data)]
    flags += ["--train-iters", "4", "--lr", "1e-2", "--micro-batch-size", "16"]
    assert main(["--user-script", str(script), *flags, "--save", str(save)]) == 0
    from transformers import AutoModelForSequenceClassification

    tuned = AutoModelForSequenceClassification.from_pretrained(save)
    base = AutoModelForSequenceClassification.from_pretrained(models["bert"], num_labels=4)
    # The frozen encoder is unchanged; the new head trained.
    for name, value in base.bert.state_dict().items():
        if "pooler" not in name:
            assert torch.equal(value, tuned.bert.state_dict()[name]), name
    assert tuned.config.id2label == {0: "carries", 1: "finds", 2: "paints", 3: "sells"}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("backend", "kind"),
    # BERT through both backends; one decoder (Llama) and one more encoder (RoBERTa) natively.
    [("native", "bert"), ("deepspeed", "bert"), ("native", "llama"), ("native", "roberta")],
)
def test_zero3_fine_tuning_evaluates_uneven_shards_and_saves_the_whole_model(
    backend: str, kind: str, models: dict[str, Path], tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # 97 validation rows in micro-batches of 8: rank 0 runs 7 eval forwards, rank 1 six. Under
    # ZeRO-3 each forward all-gathers parameters, so rank 1 must join a seventh (discarded) one
    # or both hang. The saved model is gathered from the shards (DeepSpeed: its fp32 masters).
    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    data = task_dataset("sequence_classification", tmp_path / "data", train=512, validation=97)
    flags = _task_flags("sequence_classification", models[kind], data, steps=4)
    flags += ["--zero-3-memory-optimization", "--zero-backend", backend, "--eval-interval", "2"]
    assert main([*flags, "--save", str(tmp_path / "single")]) == 0
    launched(["--nproc-per-node", "2", *flags, "--save", str(tmp_path / "sharded")], capfd)
    single, sharded = _eval_records(tmp_path / "single"), _eval_records(tmp_path / "sharded")
    assert [r["step"] for r in sharded] == [2, 4]
    for one, two in zip(single, sharded, strict=True):
        assert abs(one["eval_loss"] - two["eval_loss"]) <= 1e-4, (one, two)
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForSequenceClassification
    saved = auto.from_pretrained(tmp_path / "sharded").state_dict()
    reference = auto.from_pretrained(tmp_path / "single").state_dict()
    assert saved.keys() == reference.keys()
    assert all(saved[k].dtype == torch.float32 and saved[k].numel() for k in saved)
    assert max((saved[k] - reference[k]).abs().max().item() for k in saved) <= 1e-3


@pytest.mark.parametrize(
    ("task", "lr", "epochs", "warmup"),
    [
        ("sequence_classification", 2e-5, 3, 0.1),
        ("token_classification", 5e-5, 3, 0.1),
        ("question_answering", 3e-5, 2, 0.1),
        ("masked_lm", 5e-5, 3, 0.0),
        ("casual_lm", 5e-5, 3, 0.0),
        ("seq2seq_lm", 5e-5, 3, 0.0),
    ],
)
def test_each_task_fills_what_the_flags_leave_open_with_its_recipe(
    task: str, lr: float, epochs: int, warmup: float
) -> None:
    """The Hugging Face examples' learning rate, epochs and warmup per task, where no flag
    chose them; a flag given wins, and a length given as --train-iters keeps epochs unset."""
    config = Finetuner.config_defaults(parse_args(["--task", task]))
    training = config.training
    assert (training.lr, training.epochs, training.lr_warmup_fraction) == (lr, epochs, warmup)
    given = parse_args(["--task", task, "--lr", "1e-3", "--train-iters", "5"])
    kept = Finetuner.config_defaults(given).training
    assert (kept.lr, kept.train_iters, kept.epochs) == (1e-3, 5, None)
    assert kept.lr_warmup_fraction == warmup
    no_warmup = parse_args(["--task", task, "--lr-warmup-iters", "7"])
    assert Finetuner.config_defaults(no_warmup).training.lr_warmup_fraction is None


def test_the_first_line_says_what_the_defaults_chose(
    models: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The line says the values the configuration got, from the recipe or from a subclass's
    own ``config_defaults``; ``--lr-warmup-fraction 0`` is a choice (no warmup), kept."""
    data = task_dataset("sequence_classification", tmp_path / "data", train=16, validation=8)
    base = [
        *("--task", "sequence_classification", "--data-dir", str(data)),
        *("--pretrained-model-name-or-path", str(models["bert"]), "--lr", "1e-3"),
    ]

    def said(trainer_class: type[Finetuner], *flags: str) -> list[str]:
        capfd.readouterr()
        trainer_class(parse_args([*base, *flags])).engine.close()
        return [line for line in capfd.readouterr().err.splitlines() if "defaults for" in line]

    assert said(Finetuner) == [
        "[rapidformer] fine-tuning defaults for sequence_classification (transformers' "
        "run_glue.py, with BERT's 10% warmup): --lr-warmup-fraction 0.1, --epochs 3; a flag "
        "given overrides each"
    ]

    class OneEpoch(Finetuner):
        @classmethod
        def config_defaults(cls, config: RapidformerConfig) -> RapidformerConfig:
            return config.replace(epochs=1) if config.training.epochs is None else config

    assert said(OneEpoch, "--lr-warmup-fraction", "0") == [
        "[rapidformer] fine-tuning defaults for sequence_classification "
        "(OneEpoch.config_defaults): --epochs 1; a flag given overrides each"
    ]
    no_warmup = parse_args([*base, "--lr-warmup-fraction", "0"])
    assert Finetuner.config_defaults(no_warmup).training.lr_warmup_fraction == 0
    assert said(Finetuner, "--epochs", "2", "--lr-warmup-fraction", "0") == []
