"""Every flag parses from the command line and from files, and round-trips through to_dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rapidformer import RapidformerConfig, parse_args
from rapidformer.config.aliases import ALIASES
from rapidformer.config.docs import render_parameters
from rapidformer.config.fields import FieldSpec, all_fields
from rapidformer.config.loading import CODE_FLAGS
from rapidformer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

REFERENCE_FLAGS = {
    # flag: (type, default, choices) exactly as the reference tool documents them
    "--micro-batch-size": (int, 1, None),
    "--global-batch-size": (int, None, None),
    "--tokenizer-type": (
        str,
        None,
        {"BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"},
    ),
    "--split": (str, "969, 30, 1", None),
    "--data-impl": (str, "mmap", {"lazy", "cached", "mmap", "infer"}),
    "--data-path": (str, None, None),
    "--data-dir": (str, None, None),
    "--data-name": (str, None, None),
    "--pretrained-model-name-or-path": (str, None, None),
    "--num-layers": (int, None, None),
    "--hidden-size": (int, None, None),
    "--num-attention-heads": (int, None, None),
    "--max-position-embeddings": (int, None, None),
    "--seq-length": (int, None, None),
    "--task": (
        str,
        None,
        {
            "sequence_classification",
            "token_classification",
            "question_answering",
            "masked_lm",
            "casual_lm",
            "causal_lm",
            "seq2seq_lm",
            "pretraining",
        },
    ),
    "--save": (str, None, None),
    "--lr": (float, None, None),
    "--lr-decay-style": (str, "linear", {"constant", "linear", "cosine"}),
    "--weight-decay": (float, 0.01, None),
    "--clip-grad": (float, 1.0, None),
    "--lr-warmup-fraction": (float, None, None),
    "--train-iters": (int, None, None),
    "--epochs": (int, None, None),
    "--log-interval": (int, 100, None),
    "--num-experts": (int, None, None),
    "--mixed-precision": (bool, False, None),
    "--oss-memory-optimization": (bool, False, None),
    "--oss-sdp-memory-optimization": (bool, False, None),
    "--fsdp-memory-optimization": (bool, False, None),
    "--zero-1-memory-optimization": (bool, False, None),
    "--zero-2-memory-optimization": (bool, False, None),
    "--zero-3-memory-optimization": (bool, False, None),
    "--tensor-model-parallel-size": (int, 1, None),
    "--pipeline-model-parallel-size": (int, 1, None),
    "--onnx-runtime-training": (bool, False, None),
    "--cpu-offload": (bool, False, None),
    "--checkpoint-activations": (bool, False, None),
    "--data-iterator": (str, "fixed-shape", {"dynamic-shape", "fixed-shape"}),
    "--optimizers": (str, "apex_adam", {"apex_adam", "apex_lamb"}),
    "--load": (str, None, None),
    "--save-interval": (int, None, None),
    "--eval-interval": (int, None, None),
    "--eval-iters": (int, None, None),
    "--seed": (int, 1234, None),
    "--lr-warmup-iters": (int, 0, None),
    "--min-lr": (float, 0.0, None),
    "--precision": (str, "fp32", {"fp32", "fp16", "bf16", "fp8"}),
    "--vocab-file": (str, None, None),
    "--merge-file": (str, None, None),
    "--user-script": (str, None, None),
}


def _value_for(spec: FieldSpec) -> object:
    """A valid value that differs from the default."""
    if spec.kind is bool:
        return True
    if spec.choices:
        return next(c for c in reversed(spec.choices) if c != spec.default)
    return {int: 7, float: 0.25, str: "some/path"}[spec.kind]


def _read(config: RapidformerConfig, spec: FieldSpec) -> object:
    return getattr(getattr(config, spec.section), spec.name)


def test_config_has_every_reference_flag_with_its_type_default_and_choices() -> None:
    specs = {spec.flag: spec for spec in all_fields()}
    aliases = {alias.flag for alias in ALIASES}  # boolean flags that set a typed field
    for flag, (kind, default, choices) in REFERENCE_FLAGS.items():
        if flag in aliases:
            assert (kind, default, choices) == (bool, False, None), flag
            assert parse_args([flag]) != parse_args([]), f"{flag} sets nothing"
            continue
        spec = specs[flag]
        assert spec.kind is kind, flag
        assert spec.default == default, flag
        assert (set(spec.choices) if spec.choices else None) == choices, flag
        assert spec.help, f"{flag} has no documentation"


@pytest.mark.parametrize("spec", all_fields(), ids=lambda s: s.flag)
def test_flag_parses_from_the_command_line(spec: FieldSpec) -> None:
    value = _value_for(spec)
    argv = [spec.flag] if spec.kind is bool else [spec.flag, str(value)]
    assert _read(parse_args(argv), spec) == value


def test_every_flag_at_once_from_yaml_and_json_round_trips(tmp_path: Path) -> None:
    """Every flag but the consents to run code, which a file may not give (below)."""
    files = [spec for spec in all_fields() if spec.name not in CODE_FLAGS]
    flat = {spec.flag.lstrip("-"): _value_for(spec) for spec in files}
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(yaml.safe_dump(flat))
    from_yaml = parse_args(["--config", str(yaml_file)])
    for spec in files:
        assert _read(from_yaml, spec) == _value_for(spec), spec.flag
    nested = from_yaml.to_dict()
    assert RapidformerConfig.from_dict(nested) == from_yaml
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps(nested))
    assert parse_args(["--config", str(json_file)]) == from_yaml


@pytest.mark.parametrize("name", ["trust_checkpoint", "trust_remote_code"])
def test_a_config_file_cannot_consent_to_running_code(tmp_path: Path, name: str) -> None:
    """Config files are shared: trust comes from the command line or the Python call only."""
    path = tmp_path / "shared.yaml"
    path.write_text(f"{name}: true\ntrain_iters: 3\n")
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}=True: cannot come from"):
        parse_args(["--config", str(path)])
    spelled = name.replace("_", "-")
    path.write_text(f"{spelled}: 'true'\ntrain_iters: 3\n")  # the flag's spelling, a string
    with pytest.raises(ConfigError, match=f"--{spelled}=True: cannot come from"):
        parse_args(["--config", str(path)])
    path.write_text(f"{name}: false\ntrain_iters: 3\n")  # saying no is harmless
    assert parse_args(["--config", str(path)]).to_dict()
    path.write_text("train_iters: 3\n")
    given = parse_args(["--config", str(path), f"--{name.replace('_', '-')}"])
    assert given.to_dict()["checkpoint" if name == "trust_checkpoint" else "model"][name]
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize(
    "text",
    [
        "trust_checkpoint: false\ntrust-checkpoint: true\n",
        "checkpoint: {trust_checkpoint: false}\n--trust-checkpoint: true\n",
        "model: {trust_remote_code: false}\ntrust-remote-code: yes\n",
        "training: {user_script: my_trainer.py}\n",
        "user-script: my_trainer.py\nuser_script: null\n",
    ],
)
def test_no_spelling_or_nesting_lets_a_file_run_code(tmp_path: Path, text: str) -> None:
    """Any truthy occurrence of a consent to run code is refused, and a key given twice with
    different values is refused whichever spelling comes first."""
    path = tmp_path / "shared.yaml"
    path.write_text(text + "train_iters: 3\n")
    with pytest.raises(ConfigError, match=r"cannot come from|given twice") as refused:
        parse_args(["--config", str(path)])
    assert "--trust" in str(refused.value) or "--user-script" in str(refused.value)


def test_a_key_given_twice_with_different_values_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("micro_batch_size: 2\ndata: {micro-batch-size: 4}\n")
    with pytest.raises(ConfigError, match=r"--micro-batch-size=4: is given twice"):
        parse_args(["--config", str(path)])
    path.write_text("micro_batch_size: 4\ndata: {micro-batch-size: 4}\n")  # the same: fine
    assert parse_args(["--config", str(path)]).data.micro_batch_size == 4


def test_command_line_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  micro_batch_size: 4\nlr: 1e-4\nmixed-precision: true\n")
    config = parse_args(["--config", str(path), "--micro-batch-size", "8"])
    assert config.data.micro_batch_size == 8
    assert config.training.lr == 1e-4  # YAML reads 1e-4 as a string; it is coerced
    assert config.precision.precision == "fp16"  # --mixed-precision in the file


EXPECTED_ALIASES = {
    "--oss-memory-optimization": ("memory", "sharding", "zero1"),
    "--zero-1-memory-optimization": ("memory", "sharding", "zero1"),
    "--oss-sdp-memory-optimization": ("memory", "sharding", "zero2"),
    "--zero-2-memory-optimization": ("memory", "sharding", "zero2"),
    "--fsdp-memory-optimization": ("memory", "sharding", "zero3"),
    "--zero-3-memory-optimization": ("memory", "sharding", "zero3"),
    "--checkpoint-activations": ("memory", "recompute_granularity", "full"),
    "--mixed-precision": ("precision", "precision", "fp16"),
}


@pytest.mark.parametrize("flag", sorted(EXPECTED_ALIASES))
def test_each_alias_sets_its_typed_field_from_the_command_line_yaml_and_a_dict(
    flag: str, tmp_path: Path
) -> None:
    section, name, value = EXPECTED_ALIASES[flag]
    path = tmp_path / "run.yaml"
    path.write_text(f"{flag.lstrip('-')}: true\n")
    key = flag.lstrip("-").replace("-", "_")
    for config in (
        parse_args([flag]),
        parse_args(["--config", str(path)]),
        RapidformerConfig.from_dict({key: True}),
        RapidformerConfig().replace(**{key: True}),
    ):
        assert getattr(getattr(config, section), name) == value
        # The saved form holds the typed field only, and reads back the same.
        assert key not in config.to_dict()[section]
        assert RapidformerConfig.from_dict(config.to_dict()) == config
    assert RapidformerConfig.from_dict({key: False}) == RapidformerConfig()


def test_replacing_an_alias_with_false_turns_its_choice_off() -> None:
    config = RapidformerConfig.from_dict(
        {
            "mixed_precision": True,
            "zero_2_memory_optimization": True,
            "checkpoint_activations": True,
        }
    )
    off = config.replace(
        mixed_precision=False, zero_2_memory_optimization=False, checkpoint_activations=False
    )
    assert (off.precision.precision, off.memory.sharding) == ("fp32", "none")
    assert off.memory.recompute_granularity is None
    # False for another value of the field changes nothing.
    assert config.replace(zero_1_memory_optimization=False).memory.sharding == "zero2"


def test_aliases_that_disagree_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_args(["--zero-1-memory-optimization", "--fsdp-memory-optimization"])
    assert (
        "--fsdp-memory-optimization=True: means --sharding zero3, which contradicts "
        "--zero-1-memory-optimization" in str(caught.value)
    )
    with pytest.raises(ConfigError, match="contradicts --recompute-granularity selective"):
        parse_args(["--checkpoint-activations", "--recompute-granularity", "selective"])
    with pytest.raises(ConfigError, match="means --precision fp16, which contradicts --precision"):
        RapidformerConfig.from_dict({"mixed_precision": True, "precision": "bf16"})
    # Two spellings of one choice agree.
    config = parse_args(["--oss-sdp-memory-optimization", "--zero-2-memory-optimization"])
    assert config.memory.sharding == "zero2"


def test_an_alias_on_the_command_line_overrides_the_typed_field_in_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("sharding: zero3\nrecompute_granularity: selective\n")
    config = parse_args(
        ["--config", str(path), "--zero-1-memory-optimization", "--checkpoint-activations"]
    )
    assert (config.memory.sharding, config.memory.recompute_granularity) == ("zero1", "full")


def test_a_config_saved_before_the_typed_fields_reads_back() -> None:
    """Checkpoints written before one typed sharding / recompute / precision choice stored
    every boolean, with the typed field at its default beside the one that was on."""
    saved = {
        "memory": {
            "oss_memory_optimization": False,
            "zero_2_memory_optimization": True,
            "checkpoint_activations": True,
            "recompute_granularity": None,
        },
        "precision": {"mixed_precision": True, "precision": "fp32"},
    }
    config = RapidformerConfig.from_dict(saved)
    assert config.memory.sharding == "zero2"
    assert config.memory.recompute_granularity == "full"
    assert config.precision.precision == "fp16"


def test_both_spellings_of_the_causal_lm_task_are_accepted() -> None:
    assert parse_args(["--task", "casual_lm"]).training.task == "casual_lm"
    assert parse_args(["--task", "causal_lm"]).training.task == "causal_lm"


def test_unknown_and_badly_typed_keys_are_all_reported_with_a_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        RapidformerConfig.from_dict({"micro_batch_sise": 2, "lr": "fast", "precision": "fp4"})
    message = str(caught.value)
    assert len(caught.value.violations) == 3
    assert "did you mean --micro-batch-size" in message
    assert "--lr='fast': must be a number" in message
    assert "use one of: fp32, fp16, bf16, fp8" in message


def test_unknown_choice_on_the_command_line_exits_with_usage() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--lr-decay-style", "exponential"])


def test_replace_changes_one_field() -> None:
    config = parse_args(["--lr", "0.1"]).replace(micro_batch_size=3)
    assert config.data.micro_batch_size == 3
    assert config.training.lr == 0.1


def test_parameters_doc_matches_the_config() -> None:
    committed = (ROOT / "docs" / "parameters.md").read_text()
    assert committed == render_parameters(), "docs/parameters.md is stale: run `make docs`"
    for spec in all_fields():
        assert f"`{spec.flag}`" in committed
    for alias in ALIASES:
        assert f"| `{alias.flag}` | bool | `False` | — | Alias: the same as `{alias.meaning}`" in (
            committed
        )
