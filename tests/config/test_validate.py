"""One test per cross-field rule; each checks the flag, the rule and the fix are named."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rapidformer import RapidformerConfig
from rapidformer.config.validate import NOT_AVAILABLE
from rapidformer.engine import validate
from rapidformer.errors import ConfigError

VALID = {"train_iters": 10, "lr": 1e-3}


def _violations(world_size: int = 1, **flat: object) -> list[str]:
    config = RapidformerConfig.from_dict({**VALID, **flat})
    try:
        validate(config, world_size)
    except ConfigError as exc:
        return [str(v) for v in exc.violations]
    return []


def _only(world_size: int = 1, **flat: object) -> str:
    found = _violations(world_size, **flat)
    assert len(found) == 1, found
    return found[0]


def test_a_valid_config_passes_and_gives_the_parallel_degrees() -> None:
    config = RapidformerConfig.from_dict({**VALID, "micro_batch_size": 2, "global_batch_size": 16})
    dims = validate(config, world_size=4)
    assert (dims.dp, dims.tp, dims.pp) == (4, 1, 1)
    assert dims.accumulation_steps(2, 16) == 2


def test_global_batch_must_be_a_multiple_of_micro_times_dp() -> None:
    message = _only(2, micro_batch_size=4, global_batch_size=12)
    assert message.startswith("--global-batch-size=12")
    assert "x data-parallel size (2) = 8" in message
    assert "use --global-batch-size 8" in message


def test_parallel_degrees_must_multiply_to_the_world_size() -> None:
    found = _violations(3, tensor_model_parallel_size=2)
    assert any("must equal the world size 3" in v for v in found)


def test_cpu_offload_needs_zero_or_fsdp() -> None:
    found = _violations(cpu_offload=True)
    assert any(v.startswith("--cpu-offload=True: offload needs sharded model state") for v in found)
    assert not any(
        "needs sharded" in v for v in _violations(cpu_offload=True, zero_3_memory_optimization=True)
    )


@pytest.mark.parametrize("flag", ["zero_3_memory_optimization", "fsdp_memory_optimization"])
def test_parameter_sharding_composes_with_pipeline_parallelism(flag: str) -> None:
    # The reference tool's limit is lifted: FSDP2 shards each stage (tests/distributed/test_3d).
    assert _violations(4, pipeline_model_parallel_size=2, **{flag: True}) == []


@pytest.mark.parametrize(
    ("field", "value", "needs"),
    [
        ("sequence_parallel", True, "--tensor-model-parallel-size"),
        ("pipeline_schedule", "ZBV", "--pipeline-model-parallel-size"),
        ("pipeline_layer_split", "1,1", "--pipeline-model-parallel-size"),
        ("num_layers_per_virtual_pipeline_stage", 2, "--pipeline-model-parallel-size"),
    ],
)
def test_model_parallel_flags_without_their_axis_are_refused(
    field: str, value: object, needs: str
) -> None:
    found = _violations(2, **{field: value})
    assert len(found) == 1 and needs in found[0], found


def test_interleaved_schedules_need_a_micro_batch_per_pipeline_rank() -> None:
    found = _violations(
        4,
        pipeline_model_parallel_size=4,
        pipeline_schedule="Interleaved1F1B",
        micro_batch_size=2,
        global_batch_size=4,
    )
    assert any("at least as many micro-batches" in v and "--global-batch-size" in v for v in found)


def test_train_iters_or_epochs_is_required_and_not_both() -> None:
    config = RapidformerConfig.from_dict({"lr": 1e-3})
    with pytest.raises(ConfigError, match="pass --train-iters N"):
        validate(config, 1)
    assert "cannot be combined with --train-iters 10" in _only(epochs=2)


def test_hidden_size_divisible_by_heads_and_tp() -> None:
    assert "divisible by --num-attention-heads (3)" in _only(hidden_size=64, num_attention_heads=3)
    found = _violations(4, hidden_size=66, num_attention_heads=3, tensor_model_parallel_size=4)
    assert any(
        "--hidden-size=66: must be divisible by --tensor-model-parallel-size (4)" in v
        for v in found
    )


def test_task_must_be_known() -> None:
    # argparse and from_dict check choices; a config built in Python is checked here.
    config = RapidformerConfig.from_dict({**VALID, "task": "sequence_classification"})
    validate(config, 1)
    bad = replace(config, training=replace(config.training, task="summarisation"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--task='summarisation': unknown value"):
        validate(bad, 1)


def test_lr_is_required_only_when_rapidformer_builds_the_optimizer() -> None:
    config = RapidformerConfig.from_dict({"train_iters": 3})
    with pytest.raises(ConfigError, match="--lr=None"):
        validate(config, 1)
    validate(config, 1, builds_optimizer=False)


def test_schedule_rules() -> None:
    assert "must lie in [0, 1]" in _only(lr_warmup_fraction=1.5)
    assert "cannot be combined with --lr-warmup-iters" in _only(
        lr_warmup_fraction=0.1, lr_warmup_iters=5
    )
    assert "must not exceed --lr" in _only(min_lr=1.0)


@pytest.mark.parametrize(
    ("flat", "expected"),
    [
        ({"lr": float("inf")}, "--lr=inf: must be a finite number"),
        ({"lr": float("nan")}, "--lr=nan: must be a finite number"),
        ({"min_lr": float("nan")}, "--min-lr=nan: must be a finite number"),
        ({"weight_decay": float("nan")}, "--weight-decay=nan: must be a finite number"),
        ({"clip_grad": float("inf")}, "--clip-grad=inf: must be a finite number"),
        ({"lr_warmup_fraction": float("nan")}, "--lr-warmup-fraction=nan: must be a finite"),
        ({"hidden_dropout": float("nan")}, "--hidden-dropout=nan: must be a finite number"),
        ({"weight_decay": -5.0}, "--weight-decay=-5.0: must be >= 0"),
        ({"min_lr": -1e-5}, "--min-lr=-1e-05: must be >= 0"),
        ({"lr": -1.0}, "--lr=-1.0: must be > 0"),  # not --min-lr's fault
        ({"lr": 0.0}, "--lr=0.0: must be > 0"),
    ],
)
def test_non_finite_and_negative_hyperparameters_are_refused_by_their_flag(
    flat: dict[str, float], expected: str
) -> None:
    """Each would otherwise train (a NaN rate writes an all-NaN checkpoint with exit 0)."""
    found = _violations(**flat)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_positive_integers() -> None:
    assert _only(micro_batch_size=0).startswith("--micro-batch-size=0: must be at least 1")


def test_seq_length_within_position_embeddings() -> None:
    assert "must not exceed --max-position-embeddings" in _only(
        seq_length=128, max_position_embeddings=64
    )


def test_every_switch_has_landed() -> None:
    assert NOT_AVAILABLE == {}  # the reference tool's switches all take effect now


def test_a_switch_not_landed_yet_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mechanism later issues use: a listed field's non-default value is refused.
    monkeypatch.setitem(NOT_AVAILABLE, "fused_lm_loss", "a future engine")
    found = _violations(1, fused_lm_loss=True)
    assert any(
        v.startswith("--fused-lm-loss=True: not available yet: a future engine") for v in found
    ), found


def test_all_violations_are_reported_at_once() -> None:
    found = _violations(
        2,
        micro_batch_size=3,
        global_batch_size=8,
        cpu_offload=True,
        clip_grad=-1.0,
        epochs=1,
        hidden_size=10,
        num_attention_heads=4,
    )
    assert len(found) >= 5


def test_deepspeed_backend_needs_a_zero_stage() -> None:
    message = _only(zero_backend="deepspeed")
    assert message.startswith("--zero-backend='deepspeed'")
    assert "--sharding zero1, zero2 or zero3" in message


def test_deepspeed_backend_refuses_model_parallelism_and_compile() -> None:
    zero = {"zero_backend": "deepspeed", "zero_2_memory_optimization": True}
    message = _only(4, tensor_model_parallel_size=2, **zero)
    assert message.startswith("--tensor-model-parallel-size=2: cannot run on --zero-backend")
    message = _only(4, pipeline_model_parallel_size=2, **zero)
    assert message.startswith("--pipeline-model-parallel-size=2: cannot run on --zero-backend")
    assert _only(torch_compile=True, **zero).startswith("--torch-compile=True")


def test_deepspeed_fp16_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    zero = {"zero_backend": "deepspeed", "zero_1_memory_optimization": True}
    assert "only on GPUs" in _only(precision="fp16", **zero)
    assert "only on GPUs" in _only(mixed_precision=True, **zero)
    assert _violations(precision="bf16", **zero) == []


def test_deepspeed_missing_is_named_with_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name)
    )
    message = _only(zero_backend="deepspeed", zero_3_memory_optimization=True)
    assert "rapidformer[deepspeed]" in message


def test_cpu_offload_under_deepspeed_is_allowed_at_every_stage() -> None:
    for stage in (1, 2, 3):
        flags = {f"zero_{stage}_memory_optimization": True, "cpu_offload": True}
        assert _violations(2, zero_backend="deepspeed", **flags) == []


def test_deepspeed_refuses_lamb_and_onnx_runtime() -> None:
    zero = {"zero_backend": "deepspeed", "zero_2_memory_optimization": True}
    message = _only(optimizers="apex_lamb", **zero)
    assert message.startswith("--optimizers='apex_lamb'") and "trust ratio" in message
    message = _only(onnx_runtime_training=True, **zero)
    assert message.startswith("--onnx-runtime-training=True: cannot run with --sharding zero2")
