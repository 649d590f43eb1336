"""The catalogue of bad inputs (tests/test_bad_inputs.py runs it through the command,
tests/test_bad_inputs_elsewhere.py through a script's fit() and on two ranks): each case is a
command line built on :class:`Inputs` (a preprocessed pretraining corpus, a tiny BERT,
fine-tuning files, user scripts and a checkpoint, built once per test module by
:func:`build_inputs`), the exit code it must end with and what its one message must say.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rapidformer.cli import main
from rapidformer.testing.corpus import build_pretraining_data, synthetic_documents
from rapidformer.testing.finetune import task_dataset, tiny_model
from tests.helpers.trainers import DETERMINISTIC_SCRIPT, TINY_FLAGS


@dataclass(frozen=True)
class Inputs:
    root: Path
    data: list[str]  # flags of a good pretraining corpus
    prefix: Path  # its .bin/.idx prefix
    bert: Path
    finetune: Path  # a good sequence_classification data dir
    checkpoint: Path  # a save dir of the deterministic trainer (2 steps)
    llama: Path  # a tiny causal LM (its tokenizer has no chat template)
    victim: Path  # a file of the user's outside every --save: no case may change it

    def copy_of_corpus(self, name: str) -> Path:
        """A copy of the corpus files under a new prefix (to damage)."""
        prefix = self.root / name / self.prefix.name
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".bin", ".idx"):
            shutil.copy(self.prefix.with_suffix(suffix), prefix.with_suffix(suffix))
        return prefix

    def with_data_path(self, prefix: Path | str) -> list[str]:
        flags = list(self.data)
        flags[flags.index("--data-path") + 1] = str(prefix)
        return flags

    def finetune_dir(self, name: str, files: dict[str, str]) -> Path:
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        for file, text in files.items():
            (directory / file).write_text(text)
        return directory

    def script(self, name: str, text: str) -> Path:
        path = self.root / f"{name}.py"
        path.write_text(text)
        return path


def build_inputs(root: Path) -> Inputs:
    """The good inputs the cases damage or combine, under ``root``."""
    data = build_pretraining_data(root / "corpus", "GPT2BPETokenizer", synthetic_documents(60))
    bert = tiny_model("bert", root / "bert")
    finetune = task_dataset("sequence_classification", root / "cls", train=32, validation=16)
    checkpoint = root / "checkpoint"
    run = ["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--train-iters", "2"]
    assert main([*run, "--micro-batch-size", "4", "--save", str(checkpoint)]) == 0
    llama = tiny_model("llama", root / "llama")
    (root / "chatml.jinja").write_text(CHATML)
    victim = root / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return Inputs(root, data.flags(), Path(data.prefix), bert, finetune, checkpoint, llama, victim)


VICTIM_TEXT = "the user's own notes"


CHATML = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


PRETRAIN = ["--task", "pretraining", "--num-layers", "2", "--hidden-size", "32"]
PRETRAIN += ["--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3"]
PRETRAIN += ["--train-iters", "2", "--micro-batch-size", "2"]
WHITE_BOX = ["--user-script", str(DETERMINISTIC_SCRIPT), *TINY_FLAGS, "--train-iters", "2"]


def _finetune(inputs: Inputs, data_dir: Path | str, *flags: str) -> list[str]:
    return [
        *("--task", "sequence_classification", "--pretrained-model-name-or-path"),
        *(str(inputs.bert), "--data-dir", str(data_dir), "--seq-length", "32"),
        *("--lr", "1e-3", "--train-iters", "2", "--micro-batch-size", "4", *flags),
    ]


def _chat(name: str, rows: list[object], *flags: str, template: bool = True) -> Callable:
    """A causal LM run on chat data ``rows`` (with a ChatML template file unless not
    ``template``)."""

    def argv(inputs: Inputs) -> list[str]:
        data = inputs.finetune_dir(name, {"train.jsonl": _jsonl(rows)})
        chat = ["--chat-template", str(inputs.root / "chatml.jinja")] if template else []
        return [
            *("--task", "causal_lm", "--pretrained-model-name-or-path", str(inputs.llama)),
            *("--data-dir", str(data), "--seq-length", "64", "--lr", "1e-3"),
            *("--train-iters", "2", "--micro-batch-size", "2", *chat, *flags),
        ]

    return argv


def _turns(*pairs: tuple[str, str]) -> dict[str, object]:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


CHAT = _turns(("user", "where is the cat"), ("assistant", "the cat is on the mat"))


def _foreign_adapter(inputs: Inputs) -> Path:
    """A PEFT-format adapter for a model twice as wide as the tiny BERT."""
    import torch
    from safetensors.torch import save_file

    out = inputs.root / "foreign_adapter"
    out.mkdir(exist_ok=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["query"]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = {
        f"base_model.model.bert.encoder.layer.{n}.attention.self.query.lora_{ab}.weight": t
        for n in (0, 1)
        for ab, t in (("A", torch.zeros(2, 64)), ("B", torch.zeros(64, 2)))
    }
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def _adapter(name: str, changes: dict[str, object] | list[object], recorded: str = "") -> Callable:
    """A fine-tuning run from an adapter that fits the tiny BERT, its adapter_config.json
    changed by ``changes`` (a key mapped to ``DROP`` is removed; a list replaces the whole
    file), and with ``recorded`` the fingerprint of the base it says it was trained on."""

    def argv(inputs: Inputs) -> list[str]:
        import torch
        from safetensors.torch import save_file

        out = inputs.root / f"adapter_{name}"
        out.mkdir(exist_ok=True)
        config: object = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["query"]}
        if isinstance(changes, list):
            config = changes
        else:
            config = {k: v for k, v in {**config, **changes}.items() if v is not DROP}
        (out / "adapter_config.json").write_text(json.dumps(config))
        tensors = {
            f"base_model.model.bert.encoder.layer.{n}.attention.self.query.lora_{ab}.weight": t
            for n in (0, 1)
            for ab, t in (("A", torch.zeros(2, 32)), ("B", torch.zeros(32, 2)))
        }
        save_file(tensors, out / "adapter_model.safetensors")
        if recorded:
            base = {"sha256": recorded, "source": "another/base"}
            (out / "rapidformer-base.json").write_text(json.dumps(base))
        return _finetune(inputs, inputs.finetune, "--lora-adapter", str(out))

    return argv


DROP = object()


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Inputs], list[str]]
    message: tuple[str, ...]
    """Substrings the error must contain: the input it names and the fix it offers."""
    code: int = 2
    entry: str = "rapidformer"
    """The command the case runs: ``rapidformer``, or ``export`` (python -m rapidformer.export)."""


def _bin_truncated(inputs: Inputs) -> list[str]:
    prefix = inputs.copy_of_corpus("truncated")
    data = prefix.with_suffix(".bin").read_bytes()
    prefix.with_suffix(".bin").write_bytes(data[: len(data) // 2])
    return [*PRETRAIN, *inputs.with_data_path(prefix)]


def _idx_wrong_dtype(inputs: Inputs) -> list[str]:
    prefix = inputs.copy_of_corpus("dtype")
    index = bytearray(prefix.with_suffix(".idx").read_bytes())
    index[17] = 42  # the dtype code after the 9-byte magic and the version
    prefix.with_suffix(".idx").write_bytes(bytes(index))
    return [*PRETRAIN, *inputs.with_data_path(prefix)]


def _finetune_bytes(name: str, files: dict[str, bytes]) -> Callable[[Inputs], list[str]]:
    def argv(inputs: Inputs) -> list[str]:
        directory = inputs.finetune_dir(name, {})
        for file, content in files.items():
            (directory / file).write_bytes(content)
        return _finetune(inputs, directory)

    return argv


def _blend_weight_nan(inputs: Inputs) -> list[str]:
    return [*PRETRAIN, *inputs.with_data_path(f"nan {inputs.prefix} 1 {inputs.prefix}")]


def _empty_merges(inputs: Inputs) -> list[str]:
    flags = list(inputs.data)
    merges = inputs.root / "empty_merges.txt"
    merges.write_text("")
    flags[flags.index("--merge-file") + 1] = str(merges)
    return [*PRETRAIN, *flags]


def _idx_entry(name: str, where: str, value: int) -> Callable[[Inputs], list[str]]:
    """A copy of the corpus whose index has its first sequence's size (``where="size"``) or its
    second document boundary (``"document"``) overwritten with ``value``."""

    def argv(inputs: Inputs) -> list[str]:
        prefix = inputs.copy_of_corpus(name)
        index = bytearray(prefix.with_suffix(".idx").read_bytes())
        count, documents = struct.unpack_from("<QQ", index, 18)
        if where == "size":
            struct.pack_into("<i", index, 34, value)
        else:
            struct.pack_into("<q", index, 34 + 12 * count + 8, value)
        assert documents >= 3, "the corpus needs two documents for this case"
        prefix.with_suffix(".idx").write_bytes(bytes(index))
        return [*PRETRAIN, *inputs.with_data_path(prefix)]

    return argv


def _missing(suffix: str) -> Callable[[Inputs], list[str]]:
    def argv(inputs: Inputs) -> list[str]:
        prefix = inputs.copy_of_corpus(f"missing{suffix}")
        prefix.with_suffix(suffix).unlink()
        return [*PRETRAIN, *inputs.with_data_path(prefix)]

    return argv


def _empty_corpus(inputs: Inputs) -> list[str]:
    from rapidformer.data.preprocess import main as preprocess

    corpus = inputs.root / "empty.jsonl"
    corpus.write_text("")
    flags = inputs.data
    vocab = flags[flags.index("--vocab-file") + 1]
    merges = flags[flags.index("--merge-file") + 1]
    out = inputs.root / "empty" / "corpus"
    out.parent.mkdir(exist_ok=True)
    preprocess(
        [
            *("--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type"),
            *("GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"),
        ]
    )
    return [*PRETRAIN, *inputs.with_data_path(f"{out}_text_document")]


def _ids_beyond_vocabulary(inputs: Inputs) -> list[str]:
    prefix = inputs.copy_of_corpus("ids")
    tokens = bytearray(prefix.with_suffix(".bin").read_bytes())
    tokens[0:2] = struct.pack("<H", 60000)  # uint16 tokens: one id far beyond 400 entries
    prefix.with_suffix(".bin").write_bytes(bytes(tokens))
    return [*PRETRAIN, *inputs.with_data_path(prefix)]


def _jsonl(rows: list[object]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD_ROWS = [{"text": "a cat sat", "label": "sat"}, {"text": "a dog ran", "label": "ran"}] * 4


def _finetune_files(name: str, train: str, validation: str | None = None) -> Callable:
    def argv(inputs: Inputs) -> list[str]:
        files = {"train.jsonl": train}
        if validation is not None:
            files["validation.jsonl"] = validation
        return _finetune(inputs, inputs.finetune_dir(name, files))

    return argv


def _model_dir(name: str, edit: Callable[[Path], None]) -> Callable[[Inputs], list[str]]:
    def argv(inputs: Inputs) -> list[str]:
        model = inputs.root / name
        shutil.copytree(inputs.bert, model, dirs_exist_ok=True)
        edit(model)
        flags = _finetune(inputs, inputs.finetune)
        flags[flags.index("--pretrained-model-name-or-path") + 1] = str(model)
        return flags

    return argv


def _nan_weight(model: Path) -> None:
    """One NaN in a weight of the model's safetensors."""
    from safetensors.torch import load_file, save_file

    (file,) = model.glob("*.safetensors")
    weights = load_file(file)
    name = next(k for k in weights if k.endswith("query.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, file, metadata={"format": "pt"})


def _config_edit(**changes: object) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config.update(changes)
        (model / "config.json").write_text(json.dumps(config))

    return edit


def user_script(name: str, body: str) -> Callable[[Inputs], list[str]]:
    def argv(inputs: Inputs) -> list[str]:
        script = inputs.script(name, body)
        return ["--user-script", str(script), *TINY_FLAGS, "--train-iters", "2"]

    return argv


HEADER = f"""
import torch
from rapidformer.cli import load_trainer_class
Base = load_trainer_class({str(DETERMINISTIC_SCRIPT)!r})
"""


def _config_file(name: str, text: str) -> Callable[[Inputs], list[str]]:
    def argv(inputs: Inputs) -> list[str]:
        path = inputs.root / name
        path.write_text(text)
        return [*WHITE_BOX, "--config", str(path)]

    return argv


def _damaged_progress(name: str, text: bytes) -> Callable[[Inputs], list[str]]:
    """A copy of the checkpoint whose progress.json (or, for ``latest``, pointer) holds
    ``text``, resumed from its directory."""

    def argv(inputs: Inputs) -> list[str]:
        damaged = inputs.root / f"ckpt_{name}"
        shutil.copytree(inputs.checkpoint, damaged, dirs_exist_ok=True)
        target = "latest" if name == "latest" else "iter_0000002/progress.json"
        (damaged / target).write_bytes(text)
        return [*WHITE_BOX, "--load", str(damaged)]

    return argv


def _pointer_only(name: str, text: Callable[[Inputs], bytes]) -> Callable[[Inputs], list[str]]:
    """A save directory holding nothing but a ``latest`` file of ``text``, resumed from."""

    def argv(inputs: Inputs) -> list[str]:
        directory = inputs.root / f"pointer_{name}"
        directory.mkdir(exist_ok=True)
        (directory / "latest").write_bytes(text(inputs))
        return [*WHITE_BOX, "--load", str(directory)]

    return argv


def _linked_lock(inputs: Inputs) -> list[str]:
    """A save directory whose .lock is a link to a file of the user's (the victim)."""
    save = inputs.root / "linked_lock"
    save.mkdir(exist_ok=True)
    lock = save / ".lock"
    if not lock.is_symlink():
        lock.symlink_to(inputs.victim)
    return [*WHITE_BOX, "--save", str(save)]


def argv_of(case: Case, inputs: Inputs, save: Path) -> list[str]:
    """The case's command line with ``--save save``, unless the case names its own (or is
    not a run)."""
    argv = case.argv(inputs)
    return argv if "--save" in argv or case.entry != "rapidformer" else [*argv, "--save", str(save)]


def _rewritten(inputs: Inputs, name: str, edit: Callable[[dict], None]) -> Path:
    """A copy of the checkpoint whose progress record ``edit`` changed, its manifest written
    again: the checkpoint is whole, and says what the edit says."""
    from rapidformer.checkpoint.integrity import write_manifest

    copy = inputs.root / f"ckpt_{name}"
    if not copy.exists():
        shutil.copytree(inputs.checkpoint, copy)
        progress = copy / "iter_0000002" / "progress.json"
        record = json.loads(progress.read_text())
        edit(record)
        progress.write_text(json.dumps(record))
        manifest = json.loads((copy / "iter_0000002" / "manifest.json").read_text())
        write_manifest(copy / "iter_0000002", manifest.get("required"))
    return copy


def _fine_tuned_checkpoint(inputs: Inputs) -> Path:
    """The checkpoint recorded as a fine-tuning of ``inputs.bert``."""

    def edit(record: dict) -> None:
        record["config"]["model"]["pretrained_model_name_or_path"] = str(inputs.bert)

    return _rewritten(inputs, "finetuned", edit)


def _step_far_ahead(inputs: Inputs) -> list[str]:
    copy = _rewritten(inputs, "far_ahead", lambda record: record.update(step=10**12))
    return [*WHITE_BOX, "--load", str(copy)]


def _export_into(where: Callable[[Inputs], Path], *flags: str) -> Callable[[Inputs], list[str]]:
    return lambda inputs: [str(_fine_tuned_checkpoint(inputs)), str(where(inputs)), *flags]


def _model_copy(inputs: Inputs) -> Path:
    copy = inputs.root / "someone_elses_model"
    if not copy.exists():
        shutil.copytree(inputs.llama, copy)
    return copy


def _binary_config(inputs: Inputs) -> list[str]:
    path = inputs.root / "binary.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    return [*WHITE_BOX, "--config", str(path)]


def _save_is_a_file(inputs: Inputs) -> list[str]:
    path = inputs.root / "notes.txt"
    path.write_text("not a checkpoint directory")
    return [*WHITE_BOX, "--save", str(path)]


def _flags(name: str, flags: list[str], message: tuple[str, ...]) -> Case:
    """A case of the white-box command line plus ``flags``."""
    return Case(name, lambda i: [*WHITE_BOX, *flags], message)


def _missing_checkpoint_file(inputs: Inputs) -> list[str]:
    damaged = inputs.root / "ckpt_missing"
    shutil.copytree(inputs.checkpoint, damaged, dirs_exist_ok=True)
    (damaged / "iter_0000002" / "optimizer.pt").unlink()
    return [*WHITE_BOX, "--load", str(damaged / "iter_0000002")]


def _manifest_wrong_type(inputs: Inputs) -> list[str]:
    """A manifest whose entry is a number, not {size, sha256}."""
    damaged = inputs.root / "ckpt_manifest"
    shutil.copytree(inputs.checkpoint, damaged, dirs_exist_ok=True)
    (damaged / "iter_0000002" / "manifest.json").write_text('{"files": {"model.pt": 5}}')
    return [*WHITE_BOX, "--load", str(damaged / "iter_0000002")]


class _Payload:
    """Unpickling it would run a command (a harmless one: the scan must refuse it first)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, ("true",)


def _pickled_extra_weights(inputs: Inputs) -> list[str]:
    """A Hugging Face directory of .bin weights whose index names a shard called otherwise
    than pytorch_model*.bin, holding a payload (transformers would read it)."""
    import torch

    model = inputs.root / "bert_pickled"
    shutil.copytree(inputs.bert, model, dirs_exist_ok=True)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model-00001-of-00002.bin")
    torch.save({"v": _Payload()}, model / "weights-00002.data")
    index = {"weight_map": {"w": "pytorch_model-00001-of-00002.bin", "v": "weights-00002.data"}}
    (model / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return _finetune(inputs, inputs.finetune, "--pretrained-model-name-or-path", str(model))


CASES = [
    # ---- flags and their combinations ---------------------------------------------------
    _flags(
        "unknown-flag", ["--learning-rate", "1"], ("--learning-rate", "--lr", "docs/parameters.md")
    ),
    _flags("not-a-number", ["--lr", "fast"], ("--lr", "'fast'", "float")),
    _flags("bad-choice", ["--precision", "fp8"], ("--precision", "bf16")),
    Case("no-task", lambda i: ["--train-iters", "1"], ("--task", "--user-script")),
    Case(
        "no-lr",
        lambda i: [*[f for f in PRETRAIN if f not in ("--lr", "1e-3")], *i.data],
        ("--lr", "pass --lr"),
    ),
    Case("no-length", lambda i: WHITE_BOX[:-2], ("--train-iters", "--epochs")),
    _flags("iters-and-epochs", ["--epochs", "1"], ("--epochs", "only one")),
    _flags(
        "batch-not-multiple",
        ["--micro-batch-size", "2", "--global-batch-size", "7"],
        ("--global-batch-size", "use --global-batch-size 6"),
    ),
    _flags(
        "tp-beyond-world",
        ["--tensor-model-parallel-size", "2"],
        ("--tensor-model-parallel-size", "divide"),
    ),
    _flags("warmup-fraction", ["--lr-warmup-fraction", "2"], ("--lr-warmup-fraction", "[0, 1]")),
    _flags("min-lr-above-lr", ["--min-lr", "1"], ("--min-lr", "lower")),
    _flags("lr-infinite", ["--lr", "inf"], ("--lr=inf", "finite")),
    _flags("lr-nan", ["--lr", "nan"], ("--lr=nan", "finite")),
    _flags("min-lr-nan", ["--min-lr", "nan"], ("--min-lr=nan", "finite")),
    _flags("lr-negative", ["--lr", "-1"], ("--lr=-1.0", "must be > 0")),
    _flags("weight-decay-negative", ["--weight-decay", "-5"], ("--weight-decay", "must be >= 0")),
    Case(
        "config-file-trusts",
        _config_file("shared.yaml", "trust_checkpoint: true\n"),
        ("--trust-checkpoint", "config files are shared", "on the command line"),
    ),
    Case(
        "config-file-trusts-twice",
        _config_file("twice.yaml", "trust_checkpoint: false\ntrust-checkpoint: true\n"),
        ("--trust-checkpoint", "given twice with different values", "cannot come from"),
    ),
    Case(
        "config-file-runs-a-script",
        _config_file("script.yaml", "training:\n  user_script: evil.py\n"),
        ("--user-script", "config files are shared", "on the command line"),
    ),
    Case("config-file-binary", _binary_config, ("binary.yaml", "not UTF-8", "YAML or JSON")),
    Case("save-lock-is-a-link", _linked_lock, (".lock is a symbolic link", "remove the link")),
    Case("save-is-a-file", _save_is_a_file, ("notes.txt", "is a file", "its own --save")),
    _flags(
        "heads-do-not-divide",
        ["--hidden-size", "30"],
        ("--hidden-size", "multiple of the head count"),
    ),
    _flags("save-keep-zero", ["--save-keep", "0"], ("--save-keep", "at least 1")),
    _flags("skips-zero", ["--max-skipped-steps", "0"], ("--max-skipped-steps", "at least 1")),
    _flags(
        "timeout-zero",
        ["--distributed-timeout-minutes", "0"],
        ("--distributed-timeout-minutes", "> 0"),
    ),
    _flags(
        "fp16-and-bf16",
        ["--mixed-precision", "--precision", "bf16"],
        ("--mixed-precision", "means --precision fp16, which contradicts --precision bf16"),
    ),
    _flags(
        "moe-flag-without-experts",
        ["--moe-router-topk", "1"],
        ("--moe-router-topk", "--num-experts"),
    ),
    _flags("negative-clip", ["--clip-grad", "-1"], ("--clip-grad", ">= 0")),
    # ---- YAML / JSON config files -------------------------------------------------------
    Case(
        "yaml-syntax",
        _config_file("bad.yaml", "lr: 1e-3\n  seed: [\n"),
        ("bad.yaml", "line", "fix its syntax"),
    ),
    Case(
        "json-syntax",
        _config_file("bad.json", '{"lr": 1e-3,,}'),
        ("bad.json", "line 1 column", "fix its syntax"),
    ),
    Case(
        "config-unknown-key",
        _config_file("unknown.yaml", "learning_rate: 0.1\n"),
        ("learning_rate",),
    ),
    Case("config-wrong-type", _config_file("type.yaml", "seed: many\n"), ("--seed", "many")),
    Case(
        "config-missing",
        lambda i: [*WHITE_BOX, "--config", str(i.root / "none.yaml")],
        ("none.yaml", "must exist"),
    ),
    Case(
        "config-not-a-mapping", _config_file("list.yaml", "- lr\n- 1\n"), ("list.yaml", "mapping")
    ),
    # ---- pretraining data ---------------------------------------------------------------
    Case("missing-bin", _missing(".bin"), (".bin",)),
    Case("missing-idx", _missing(".idx"), (".idx",)),
    Case("truncated-bin", _bin_truncated, ("truncated", ".bin", "Fix: copy")),
    Case("blend-weight-nan", _blend_weight_nan, ("--data-path", "finite", '"0.3 A 0.7 B"')),
    Case("merges-empty", _empty_merges, ("empty_merges.txt", "holds no merge", "Fix: pass")),
    Case(
        "idx-negative-size",
        _idx_entry("negative", "size", -3),
        ("negative/corpus_text_document.idx", "sequence 0 has size -3", "preprocess the corpus"),
    ),
    Case(
        "idx-documents-backwards",
        _idx_entry("backwards", "document", 10**6),
        ("backwards/corpus_text_document.idx", "must not decrease", "preprocess the corpus"),
    ),
    Case("wrong-dtype", _idx_wrong_dtype, (".idx", "dtype code 42", "Fix: preprocess")),
    Case("empty-corpus", _empty_corpus, ("empty/corpus_text_document", "no documents")),
    Case(
        "ids-beyond-vocabulary",
        _ids_beyond_vocabulary,
        ("ids", ".bin", "60000", "vocabulary", "--vocab-file"),
    ),
    Case(
        "no-data-path",
        lambda i: [*PRETRAIN, "--tokenizer-type", "GPT2BPETokenizer"],
        ("--data-path",),
    ),
    Case(
        "missing-vocab",
        lambda i: [
            *PRETRAIN,
            *i.data[:-4],
            "--vocab-file",
            str(i.root / "none.json"),
            "--merge-file",
            i.data[-1],
        ],
        ("none.json", "Fix: check --vocab-file"),
    ),
    # ---- fine-tuning data ---------------------------------------------------------------
    Case(
        "malformed-jsonl",
        _finetune_files("malformed", _jsonl([*GOOD_ROWS[:2], '{"text": "x",', *GOOD_ROWS[2:]])),
        ("train.jsonl", "line 3"),
    ),
    Case(
        "line-over-16-mib",  # refused by its length, before anything parses it
        _finetune_files("huge_line", _jsonl([*GOOD_ROWS[:1], {"text": "a" * 17 * 2**20}])),
        ("train.jsonl, line 2", "longer than 16 MiB", "split it into rows"),
    ),
    Case(
        "text-not-text",
        _finetune_files("numeric", _jsonl([{"text": 123, "label": "a"}, *GOOD_ROWS])),
        ("text column holds 123 (int) in row 0", "as a string"),
    ),
    Case(
        "validation-only",
        lambda i: _finetune(i, i.finetune_dir("validation_only", {"dev.jsonl": _jsonl(GOOD_ROWS)})),
        ("validation_only", "no training split (found: validation)", "train.jsonl"),
    ),
    Case(
        "csv-ragged",
        _finetune_bytes("ragged", {"train.csv": b"text,label\na cat,sat\na dog,ran,far\n"}),
        ("train.csv, line 3", "3 fields, but the header has 2", "quote fields"),
    ),
    Case(
        "jsonl-not-utf8",
        _finetune_bytes("latin1", {"train.jsonl": b'{"text": "caf\xe9", "label": "a"}\n'}),
        ("latin1/train.jsonl, line 1", "not UTF-8", "save the file as UTF-8"),
    ),
    Case(
        "labels-null",
        _finetune_files("nulls", _jsonl([{"text": "a cat", "label": None}, *GOOD_ROWS])),
        ("1 rows without a label (null)", "label them"),
    ),
    Case(
        "labels-one-class",
        _finetune_files("one_class", _jsonl([{"text": "a cat", "label": "sat"}] * 8)),
        ("single label (sat)", "other classes"),
    ),
    Case(
        "missing-label-column",
        _finetune_files("nolabel", _jsonl([{"text": "a"}] * 8)),
        ("label column", "Fix: rename the column to 'label'"),
    ),
    Case(
        "missing-text-column",
        _finetune_files("notext", _jsonl([{"label": "a"}] * 8)),
        ("text column", "Fix: rename the column to 'text'"),
    ),
    Case(
        "label-outside-set",
        _finetune_files(
            "labels", _jsonl(GOOD_ROWS), _jsonl([{"text": "a bird flew", "label": "flew"}])
        ),
        ("flew", "validation", "Fix: add"),
    ),
    Case("empty-split", _finetune_files("empty", ""), ("train",)),
    Case(
        "missing-data-dir",
        lambda i: _finetune(i, i.root / "nowhere"),
        ("--data-dir", "nowhere", "Fix"),
    ),
    # ---- models -------------------------------------------------------------------------
    Case(
        "missing-config-json",
        _model_dir("noconfig", lambda m: (m / "config.json").unlink()),
        ("config.json", "noconfig"),
    ),
    Case(
        "unknown-architecture",
        _model_dir("unknown", _config_edit(model_type="nosuchmodel")),
        ("--pretrained-model-name-or-path", "nosuchmodel"),
    ),
    Case(
        "vocabulary-mismatch",
        _model_dir("vocab", _config_edit(vocab_size=50)),
        ("vocab", "50", "tokenizer"),
    ),
    Case(
        "model-dir-missing",
        lambda i: (
            [*_finetune(i, i.finetune)[:3], str(i.root / "nomodel"), *_finetune(i, i.finetune)[4:]]
        ),
        ("--pretrained-model-name-or-path", "nomodel", "Fix: check the path"),
    ),
    # ---- adapters -----------------------------------------------------------------------
    Case(
        "lora-targets-match-nothing",
        lambda i: _finetune(i, i.finetune, "--lora-rank", "4", "--lora-target-modules", "q_proj"),
        ("--lora-target-modules='q_proj'", "matches no linear layer", "dense, key, query, value"),
    ),
    Case(
        "lora-rank-zero",
        lambda i: _finetune(i, i.finetune, "--lora-rank", "0"),
        ("--lora-rank=0", "at least 1"),
    ),
    Case(
        "lora-alpha-negative",
        lambda i: _finetune(i, i.finetune, "--lora-rank", "4", "--lora-alpha", "-2"),
        ("--lora-alpha=-2", "greater than 0"),
    ),
    Case(
        "lora-flag-while-off",
        lambda i: _finetune(i, i.finetune, "--lora-variant", "dora"),
        ("--lora-variant='dora'", "LoRA is off", "Fix: add --lora-rank"),
    ),
    Case(
        "quantize-base-without-lora",
        lambda i: _finetune(i, i.finetune, "--quantize-base", "nf4"),
        ("--quantize-base='nf4'", "LoRA is off"),
    ),
    Case(
        "lora-on-the-built-in-models-without-a-base",
        lambda i: [*PRETRAIN, *i.data, "--lora-rank", "4"],
        ("--lora-rank=4", "need a base to adapt", "Fix: pass the base as --pretrained-checkpoint"),
    ),
    Case(
        "pretrained-checkpoint-missing",
        lambda i: [*PRETRAIN, *i.data, "--pretrained-checkpoint", str(i.root / "none")],
        ("--pretrained-checkpoint", "no such directory"),
    ),
    Case(
        "quantize-base-needs-bf16",
        lambda i: _finetune(i, i.finetune, "--lora-rank", "4", "--quantize-base", "nf4"),
        ("--quantize-base='nf4'", "needs --precision bf16", "Fix: add --precision bf16"),
    ),
    Case(
        "adapter-base-holds-nan",
        lambda i: [*_model_dir("bert_nan", _nan_weight)(i), "--lora-rank", "4"],
        ("--pretrained-model-name-or-path", "holds a NaN or an infinity in", "query.weight"),
    ),
    Case(
        "model-path-mistyped",
        lambda i: _finetune(
            i,
            i.finetune,
            "--pretrained-model-name-or-path",
            str(_model_copy(i).with_name("someone_elses_modle")),
        ),
        ("no such model directory", "did you mean", "someone_elses_model"),
    ),
    Case(
        "model-is-an-adapter",
        lambda i: _finetune(
            i,
            i.finetune,
            "--pretrained-model-name-or-path",
            _adapter("as_model", {"base_model_name_or_path": "my/base"})(i)[-1],
        ),
        ("holds an adapter, not a model (its base: my/base)", "as --lora-adapter"),
    ),
    Case(
        "qlora-quantizes-nothing",  # the tiny BERT's weights are 32 x 32: no NF4 block fits
        lambda i: _finetune(
            i, i.finetune, "--lora-rank", "4", "--quantize-base", "nf4", "--precision", "bf16"
        ),
        ("--quantize-base", "none of the", "can be stored in NF4", "multiple of 16384"),
    ),
    Case(
        "adapter-rank-huge",
        _adapter("huge", {"r": 1_000_000_000}),
        ("--lora-adapter", "does not fit this model", "(1000000000, 32) for this model"),
    ),
    Case(
        "adapter-alpha-nan",
        _adapter("nan", {"lora_alpha": float("nan")}),
        ("--lora-adapter", "lora_alpha=nan", "as --lora-alpha"),
    ),
    Case(
        "adapter-alpha-negative",
        _adapter("negative", {"lora_alpha": -8}),
        ("--lora-adapter", "lora_alpha=-8", "above 0"),
    ),
    Case(
        "adapter-dropout-above-one",
        _adapter("dropout", {"lora_dropout": 1.5}),
        ("--lora-adapter", "lora_dropout=1.5", "below 1"),
    ),
    Case(
        "adapter-rank-a-word",
        _adapter("word", {"r": "four"}),
        ("--lora-adapter", "r='four'", "as --lora-rank"),
    ),
    Case(
        "adapter-rank-missing",
        _adapter("no_rank", {"r": DROP}),
        ("--lora-adapter", "r=None", "as --lora-rank"),
    ),
    Case(
        "adapter-config-a-list",
        _adapter("list", ["r", 2]),
        ("--lora-adapter", "holds a list, not the adapter's settings"),
    ),
    Case(
        "adapter-targets-a-number",
        _adapter("targets", {"target_modules": 42}),
        ("--lora-adapter", "target_modules=42", "module names"),
    ),
    Case(
        "adapter-of-another-base",
        _adapter("other_base", {}, recorded="0" * 64),
        ("--lora-adapter", "trained on another base", "another/base"),
    ),
    Case(
        "adapter-of-another-shape",
        lambda i: _finetune(i, i.finetune, "--lora-adapter", str(_foreign_adapter(i))),
        ("--lora-adapter", "does not fit this model", "lora_A.weight"),
    ),
    # ---- chat and instruction data -----------------------------------------------------
    Case(
        "chat-unknown-role",
        _chat("role", [CHAT, _turns(("narrator", "once"), ("assistant", "upon a time"))]),
        ("row 1", "unknown role 'narrator'"),
    ),
    Case(
        "chat-malformed-line",  # the Fix shows a row of the file's own format
        _chat("badline", [CHAT, '{"messages": [{"role": "user"', CHAT]),
        (
            "train.jsonl, line 2",
            "not valid JSON",
            'Fix: make every line one JSON object, like its others: {"messages": [{"role": "user"',
        ),
    ),
    Case(
        "chat-no-assistant-turn",
        _chat("noassistant", [CHAT, _turns(("user", "hello"), ("system", "be brief"))]),
        ("train.jsonl, line 2 (the train split's row 1)", "has no assistant turn", "Fix:"),
    ),
    Case(
        "chat-empty-content",
        _chat("empty", [CHAT, _turns(("user", "hello"), ("assistant", "  "))]),
        ("row 1", "messages[1] (assistant) with empty content"),
    ),
    Case(
        "chat-mixed-formats",
        _chat("mixed", [CHAT, CHAT, {"text": "a plain line"}]),
        ("row 2", "has no messages", "one format per file"),
    ),
    Case(
        "chat-model-without-template",
        _chat("notemplate", [CHAT] * 4, template=False),
        ("conversations", "Fix: pass --chat-template FILE"),
    ),
    Case(
        "chat-nothing-left-to-learn",
        _chat("short", [CHAT] * 4, "--seq-length", "6"),
        ("4 of the train split's 4 samples have no token", "--drop-unsupervised"),
    ),
    Case(
        "chat-nothing-left-after-dropping",
        _chat("all_dropped", [CHAT] * 4, "--seq-length", "6", "--drop-unsupervised"),
        ("all 4 samples of the train split have no token", "dropped every one", "Fix:"),
    ),
    Case(
        "chat-flag-on-plain-text",
        _chat("plain", [{"text": "a cat sat on the mat"}] * 4, "--train-on-inputs", template=False),
        ("--train-on-inputs set", "plain text"),
    ),
    Case(
        "chat-template-on-another-task",
        lambda i: _finetune(i, i.finetune, "--chat-template", str(i.root / "chatml.jinja")),
        ("--chat-template", "--task causal_lm", "Fix: drop it"),
    ),
    Case(
        "chat-template-file-missing",
        _chat("nofile", [CHAT] * 4, "--chat-template", "/nonexistent/chat.jinja"),
        ("--chat-template", "is no file and no template rapidformer ships", "chatml, gemma"),
    ),
    Case(
        "packing-on-another-task",
        lambda i: _finetune(i, i.finetune, "--packing"),
        ("--packing", "--task causal_lm (this run: sequence_classification)", "Fix: drop it"),
    ),
    Case(
        "packing-with-dynamic-shape-buckets",
        _chat("buckets", [CHAT] * 4, "--packing", "--data-iterator", "dynamic-shape"),
        ("--packing", "--data-iterator dynamic-shape", "no padding left", "Fix: drop one of them"),
    ),
    # ---- user scripts -------------------------------------------------------------------
    Case(
        "script-missing",
        lambda i: ["--user-script", str(i.root / "none.py"), *TINY_FLAGS],
        ("--user-script", "none.py"),
    ),
    Case("no-trainer-class", user_script("none", "x = 1\n"), ("none.py", "exactly one")),
    Case(
        "two-trainer-classes",
        user_script("two", HEADER + "class A(Base): pass\nclass B(Base): pass\n"),
        ("two.py", "found: A, B"),
    ),
    Case(
        "hook-raises",
        user_script(
            "raises",
            HEADER + "class A(Base):\n"
            "    def build_data(self):\n        raise ValueError('no such table')\n",
        ),
        ("ValueError: no such table", "build_data", "raises.py:7"),
        code=1,
    ),
    Case(
        "syntax-error",
        user_script("syntax", "def broken(:\n"),
        ("SyntaxError", "syntax.py, line 1"),
        code=1,
    ),
    Case(
        "non-scalar-loss",
        user_script(
            "vector",
            HEADER + "class A(Base):\n"
            "    def train_step(self, batch):\n        return super().train_step(batch) * "
            "torch.ones(3)\n",
        ),
        ("train_step", "scalar"),
    ),
    Case(
        "loss-without-gradient",
        user_script(
            "detached",
            HEADER + "class A(Base):\n"
            "    def train_step(self, batch):\n        return super().train_step(batch).detach()\n",
        ),
        ("train_step", "gradient"),
    ),
    Case(
        "fp8-without-a-float8-gpu",
        lambda i: [*WHITE_BOX, "--precision", "fp8"],
        ("--precision", "fp8", "compute capability 8.9", "--precision bf16"),
    ),
    # ---- export ---------------------------------------------------------------------------
    Case(
        "export-onto-the-base",
        _export_into(lambda i: i.bert, "--overwrite"),
        ("is the base model's directory", "new or empty directory"),
        entry="export",
    ),
    Case(
        "export-onto-a-model",
        _export_into(_model_copy),
        ("someone_elses_model holds a model", "config.json", "--overwrite"),
        entry="export",
    ),
    Case(
        "export-into-its-run",
        _export_into(lambda i: _fine_tuned_checkpoint(i) / "hf"),
        ("inside the run's own directory", "new or empty directory"),
        entry="export",
    ),
    Case(
        "export-unwritable-parent",
        _export_into(lambda i: i.victim / "hf"),
        ("cannot write the export", "precious.txt", "where this user may write"),
        entry="export",
    ),
    # ---- checkpoints --------------------------------------------------------------------
    Case(
        "checkpoint-other-shape",
        lambda i: [*WHITE_BOX, "--hidden-size", "64", "--load", str(i.checkpoint)],
        ("iter_0000002", "written by another run", "--hidden-size 32 there, 64 now"),
    ),
    Case(
        "checkpoint-progress-not-json",
        _damaged_progress("bad_json", b'{"step": 2,'),
        ("progress.json is not JSON", "no older complete checkpoint", "Fix:"),
    ),
    Case(
        "checkpoint-progress-a-list",
        _damaged_progress("list", b"[2]"),
        ("progress.json holds a list, not a checkpoint record", "Fix:"),
    ),
    Case(
        "checkpoint-progress-no-step",
        _damaged_progress("no_step", b'{"epoch": 0}'),
        ("progress.json has no step count", "None", "Fix:"),
    ),
    Case(
        "checkpoint-step-past-the-end",
        _step_far_ahead,
        ("is at step 1000000000000, past this run's last step 2", "start afresh"),
    ),
    Case(
        "checkpoint-progress-step-text",
        _damaged_progress("step_text", b'{"step": "two"}'),
        ("progress.json has no step count", "'two'", "Fix:"),
    ),
    Case(
        "checkpoint-latest-not-text",
        _pointer_only("garbage", lambda i: b"\xff\xfe\x00iter"),
        ("latest names no iter_* checkpoint", "no complete checkpoint", "Fix: delete it"),
    ),
    Case(
        "checkpoint-latest-foreign",  # another run's checkpoint, by its absolute path
        _pointer_only("foreign", lambda i: str(i.checkpoint / "iter_0000002").encode()),
        ("latest names no iter_* checkpoint", "no complete checkpoint", "Fix: delete it"),
    ),
    Case(
        "checkpoint-other-heads",  # the same shapes: it would load, and be read wrongly
        lambda i: [*WHITE_BOX, "--num-attention-heads", "8", "--load", str(i.checkpoint)],
        ("iter_0000002", "--num-attention-heads 4 there, 8 now", "resume it with those flags"),
    ),
    Case(
        "checkpoint-other-seed",
        lambda i: [*WHITE_BOX, "--seed", "7", "--load", str(i.checkpoint)],
        ("iter_0000002", "--seed 1234 there, 7 now", "its own --save"),
    ),
    Case(
        "checkpoint-other-task",
        lambda i: [*_finetune(i, i.finetune), "--load", str(i.checkpoint)],
        ("iter_0000002", "--task None there, 'sequence_classification' now"),
    ),
    Case("checkpoint-missing-file", _missing_checkpoint_file, ("optimizer.pt", "missing")),
    Case(
        "checkpoint-manifest-wrong-type",
        _manifest_wrong_type,
        ("manifest.json is unreadable", "Fix:"),
    ),
    Case(
        "hugging-face-shard-pickled",
        _pickled_extra_weights,
        ("weights-00002.data", "posix.system", "--trust-checkpoint"),
    ),
    Case(
        "checkpoint-none-there",
        lambda i: [*WHITE_BOX, "--load", str(i.root)],
        ("--load", "no checkpoint", "Fix: pass the --save directory"),
    ),
]
