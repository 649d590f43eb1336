"""The model and micro-batch a dry run measures, from the flags (``--task pretraining``)."""

from __future__ import annotations

from pathlib import Path

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.documents import document_collate
from rapidformer.data.splits import parse_data_path
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.dryrun.estimate import Workload
from rapidformer.dryrun.finetuning import refuse_tensor_parallelism
from rapidformer.errors import ConfigError
from rapidformer.templates.families import family_for
from rapidformer.templates.tasks import canonical_task

DEFAULT_VOCAB = {"gpt": 50257, "bert": 30522}
"""GPT-2's and BERT's vocabularies: the sizes assumed when ``--vocab-file`` is not there."""


def pretraining_workload(config: RapidformerConfig, warnings: list[str]) -> tuple[Workload, str]:
    """The built-in model the flags describe and an empty micro-batch of ``--seq-length``
    tokens; data paths are only checked for existence (a warning each)."""
    check_task(config)
    data, model = config.data, config.model
    assert data.tokenizer_type is not None and model.seq_length is not None
    family = family_for(data.tokenizer_type)
    vocab_size = _vocab_size(config, family.name, warnings)
    for path in _data_files(config):
        if not path.exists():
            warnings.append(f"--data-path: {path} does not exist (a real run would stop there)")

    def build():  # type: ignore[no-untyped-def]
        return family.build_model(config, vocab_size, device="meta")

    batch = family.example_batch(data.micro_batch_size, model.seq_length, "meta")
    documents = document_collate(data, eod=0)
    if documents is not None:  # positions and the [B, 1, T, T] mask are the micro-batch's too
        batch = documents.add_parts(batch)
    work = Workload(
        build=build,
        batch=batch,
        inputs=family.loss_inputs if config.memory.fused_lm_loss else family.inputs,
        loss=family.loss,
        hidden_size=model.hidden_size or 0,
        seq_length=model.seq_length,
    )
    parameters = sum(p.numel() for p in build().parameters())
    description = (
        f"built-in {family.name.upper()}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads, seq {model.seq_length}, vocab {vocab_size}, "
        f"{parameters:,} parameters"
        + (", a document mask per micro-batch" if data.reset_attention_mask else "")
    )
    return work, description


DRY_RUN_TASKS = ("pretraining", "causal_lm")
"""The tasks a dry run builds: the built-in models', and a Hugging Face causal LM's from its
config.json (:mod:`rapidformer.dryrun.finetuning`)."""


def check_task(config: RapidformerConfig) -> None:
    """Refuse what a dry run cannot build: a user script's model, a task but those above."""

    task = config.training.task
    if config.training.user_script is None and canonical_task(task or "") in DRY_RUN_TASKS:
        if task != "pretraining":
            refuse_tensor_parallelism(config)
        return
    raise ConfigError.single(
        "--dry-run",
        True,
        "a dry run measures the built-in models of --task pretraining (GPT, BERT) and the "
        "Hugging Face model of --task causal_lm, built from config.json; other fine-tuning "
        "tasks and --user-script models are not built without their weights or code",
        "drop --dry-run, or estimate the same shape with --task causal_lm or pretraining",
    )


def _vocab_size(config: RapidformerConfig, family: str, warnings: list[str]) -> int:
    data = config.data
    assert data.tokenizer_type is not None and data.vocab_file is not None
    if Path(data.vocab_file).is_file():
        return build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file).vocab_size
    size = DEFAULT_VOCAB[family]
    warnings.append(
        f"--vocab-file: {data.vocab_file} does not exist; assuming {family.upper()}'s "
        f"vocabulary of {size} tokens"
    )
    return size


def _data_files(config: RapidformerConfig) -> list[Path]:
    if config.data.data_path is None:
        return []
    prefixes = [prefix for _, prefix in parse_data_path(config.data.data_path)]
    return [Path(prefix + suffix) for prefix in prefixes for suffix in (".bin", ".idx")]
