"""Cross-field rules, checked against the world size before any process group or model exists.

:func:`validate` collects every violation and raises one :class:`ConfigError` listing them all,
each naming the flag, its value, the rule and a fix. Switches whose implementation has not
landed yet are violations too (``NOT_AVAILABLE``), so no flag is ever accepted and ignored.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator

import torch

from rapidformer.config.fields import all_fields
from rapidformer.config.schema import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.errors import ConfigError, Violation

NOT_AVAILABLE: dict[str, str] = {
    "tensor_model_parallel_size": "tensor parallelism",
    "pipeline_model_parallel_size": "pipeline parallelism",
    "num_experts": "mixture of experts",
}
"""Switches parsed and validated now but implemented by a later issue: field -> what is
missing. A value other than the field's default is rejected until the entry is removed."""

_INACTIVE = {"num_experts": (None, 1)}
"""Values of a NOT_AVAILABLE field that do not ask for the missing feature (besides the
default)."""

Rule = Callable[[RapidformerConfig, ParallelDims], Iterator[Violation]]


def validate(
    config: RapidformerConfig,
    world_size: int,
    *,
    rank: int = 0,
    builds_optimizer: bool = True,
    runs_loop: bool = True,
    extra: Iterable[Violation] = (),
) -> ParallelDims:
    """Check every rule; return the parallel degrees or raise one error listing all
    violations.

    ``builds_optimizer`` is False when the caller supplies its own optimizer, which makes
    ``--lr`` optional; ``runs_loop`` is False for a hand-written loop driving the engine, which
    makes ``--train-iters``/``--epochs`` optional; ``extra`` are a template's own violations,
    reported together with these.
    """
    dims = ParallelDims.from_config(config, world_size, rank)
    violations = [v for rule in RULES for v in rule(config, dims)]
    if runs_loop:
        violations.extend(_duration(config))
    elif config.graph.onnx_runtime_training:
        violations.append(
            Violation(
                "--onnx-runtime-training",
                True,
                "only the Trainer templates run train_step in ONNX Runtime; a hand-written "
                "loop calling the engine would train in torch and ignore the flag",
                "subclass Trainer (or Pretrainer / Finetuner), or drop the flag",
            )
        )
    violations.extend(extra)
    if builds_optimizer and config.training.lr is None:
        violations.append(
            Violation(
                "--lr",
                None,
                "a learning rate is required to build the optimizer",
                "pass --lr, e.g. --lr 1e-4",
            )
        )
    if violations:
        raise ConfigError(violations)
    return dims


def _positive_integers(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    zero_allowed = {"lr_warmup_iters", "seed"}
    for spec in all_fields():
        value = getattr(getattr(config, spec.section), spec.name)
        if (
            spec.kind is int
            and value is not None
            and value < (0 if spec.name in zero_allowed else 1)
        ):
            bound = "at least 0" if spec.name in zero_allowed else "at least 1"
            yield Violation(spec.flag, value, f"must be {bound}", "give a larger value")


def _choices(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    # Python callers bypass argparse's choices; the task rule is the one users hit most.
    for spec in all_fields():
        value = getattr(getattr(config, spec.section), spec.name)
        if spec.choices is not None and value is not None and value not in spec.choices:
            yield Violation(
                spec.flag, value, "unknown value", f"use one of: {', '.join(spec.choices)}"
            )


def _world_size(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    if dims.world_size % (dims.tp * dims.pp) != 0:
        yield Violation(
            "--tensor-model-parallel-size",
            dims.tp,
            f"data x tensor x pipeline parallel degrees must equal the world size "
            f"{dims.world_size}, but tp {dims.tp} x pp {dims.pp} does not divide it",
            "choose tensor and pipeline sizes whose product divides the number of processes",
        )


def _batch_sizes(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    micro, global_ = config.data.micro_batch_size, config.data.global_batch_size
    if global_ is None or micro < 1 or dims.world_size % (dims.tp * dims.pp):
        return
    if global_ % (micro * dims.dp) != 0:
        yield Violation(
            "--global-batch-size",
            global_,
            f"must be a multiple of --micro-batch-size ({micro}) x data-parallel size "
            f"({dims.dp}) = {micro * dims.dp}; the quotient is the gradient-accumulation steps",
            f"use --global-batch-size {max(1, global_ // (micro * dims.dp)) * micro * dims.dp}",
        )


def _memory_flags(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    memory = config.memory
    flags = memory.sharding_flags
    if len(flags) > 1:
        yield Violation(
            flags[1],
            True,
            f"at most one memory-optimization flag, got {', '.join(flags)}",
            "keep one of them",
        )
    sharders = {  # FSDP2 modes: CPUOffloadPolicy (ZeRO-1/OSS keeps whole parameters on DDP)
        "--oss-sdp-memory-optimization",
        "--zero-2-memory-optimization",
        "--zero-3-memory-optimization",
        "--fsdp-memory-optimization",
    }
    deepspeed = memory.zero_backend == "deepspeed"
    if deepspeed:
        yield from _deepspeed_rules(config, dims)
    if memory.cpu_offload and not deepspeed and not sharders.intersection(flags):
        yield Violation(
            "--cpu-offload",
            True,
            "offload needs sharded model state",
            "add --zero-2-memory-optimization, --zero-3-memory-optimization or "
            "--fsdp-memory-optimization",
        )
    param_sharding = {"--zero-3-memory-optimization", "--fsdp-memory-optimization"}
    if dims.pp > 1 and param_sharding.intersection(flags):
        yield Violation(
            next(iter(param_sharding.intersection(flags))),
            True,
            "parameter sharding cannot be combined with pipeline parallelism "
            f"(--pipeline-model-parallel-size {dims.pp}); only optimizer-state and gradient "
            "sharding can",
            "use --zero-1-memory-optimization or --zero-2-memory-optimization instead",
        )


def _deepspeed_rules(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    """What --zero-backend deepspeed needs: DeepSpeed itself, a ZeRO stage to run, and no
    switch that would fight its engine for the model or the numerics."""
    flag = "--zero-backend"
    if importlib.util.find_spec("deepspeed") is None:
        yield Violation(
            flag,
            "deepspeed",
            "DeepSpeed is not installed",
            "pip install 'rapidformer[deepspeed]', or use --zero-backend native",
        )
    if not config.memory.sharding_flags:
        yield Violation(
            flag,
            "deepspeed",
            "the DeepSpeed backend runs a ZeRO stage and none was chosen",
            "add --zero-1-memory-optimization, --zero-2-memory-optimization or "
            "--zero-3-memory-optimization",
        )
    if dims.tp > 1 or dims.pp > 1:
        yield Violation(
            flag,
            "deepspeed",
            f"DeepSpeed ZeRO is not combined with tensor ({dims.tp}) or pipeline ({dims.pp}) "
            "parallelism here",
            "use --zero-backend native, or a tensor/pipeline size of 1",
        )
    if config.optimizer.optimizers == "apex_lamb":
        yield Violation(
            "--optimizers",
            "apex_lamb",
            "DeepSpeed ZeRO flattens each parameter group into one partition per rank, so "
            "LAMB's per-tensor trust ratio would be computed per partition (not LAMB, and "
            "different for every rank count)",
            "use --optimizers apex_adam, or --zero-backend native (LAMB works there)",
        )
    if config.graph.onnx_runtime_training:
        yield Violation(
            flag,
            "deepspeed",
            "ONNX Runtime runs the forward and backward itself; DeepSpeed cannot own them too",
            "drop --onnx-runtime-training or --zero-backend deepspeed",
        )
    if config.graph.torch_compile:
        yield Violation(
            "--torch-compile",
            True,
            "compiled blocks are not run under the DeepSpeed engine (its ZeRO-3 hooks and "
            "gradient hooks are untested with them)",
            "drop --torch-compile, or use --zero-backend native",
        )
    if config.precision.resolved == "fp16" and not torch.cuda.is_available():
        precision = config.precision
        yield Violation(
            "--mixed-precision" if precision.mixed_precision else "--precision",
            True if precision.mixed_precision else "fp16",
            "DeepSpeed runs fp16 only on GPUs and none is present",
            "use --precision bf16 or fp32 on this machine",
        )


def _duration(config: RapidformerConfig) -> Iterator[Violation]:
    training = config.training
    if training.train_iters is None and training.epochs is None:
        yield Violation(
            "--train-iters",
            None,
            "the run needs a length",
            "pass --train-iters N (steps) or --epochs N (passes over the data)",
        )
    if training.train_iters is not None and training.epochs is not None:
        yield Violation(
            "--epochs",
            training.epochs,
            f"cannot be combined with --train-iters {training.train_iters}",
            "pass only one of them",
        )


def _schedule(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    training = config.training
    fraction = training.lr_warmup_fraction
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        yield Violation("--lr-warmup-fraction", fraction, "must lie in [0, 1]", "e.g. 0.01")
    if fraction is not None and training.lr_warmup_iters:
        yield Violation(
            "--lr-warmup-fraction",
            fraction,
            f"cannot be combined with --lr-warmup-iters {training.lr_warmup_iters}",
            "pass only one of them",
        )
    if training.lr is not None and training.min_lr > training.lr:
        yield Violation(
            "--min-lr", training.min_lr, f"must not exceed --lr {training.lr}", "lower --min-lr"
        )
    if training.clip_grad < 0:
        yield Violation(
            "--clip-grad", training.clip_grad, "must be >= 0 (0 disables clipping)", "e.g. 1.0"
        )


def _model_shape(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    model = config.model
    hidden, heads = model.hidden_size, model.num_attention_heads
    if hidden is not None and heads and hidden % heads:
        yield Violation(
            "--hidden-size",
            hidden,
            f"must be divisible by --num-attention-heads ({heads})",
            "choose a hidden size that is a multiple of the head count",
        )
    if hidden is not None and hidden % dims.tp:
        yield Violation(
            "--hidden-size",
            hidden,
            f"must be divisible by --tensor-model-parallel-size ({dims.tp})",
            "choose a hidden size that is a multiple of the tensor-parallel size",
        )
    if heads is not None and heads % dims.tp:
        yield Violation(
            "--num-attention-heads",
            heads,
            f"must be divisible by --tensor-model-parallel-size ({dims.tp})",
            "choose a head count that is a multiple of the tensor-parallel size",
        )
    if not 0.0 <= model.hidden_dropout < 1.0:
        yield Violation("--hidden-dropout", model.hidden_dropout, "must lie in [0, 1)", "e.g. 0.1")
    seq, positions = model.seq_length, model.max_position_embeddings
    if seq is not None and positions is not None and seq > positions:
        yield Violation(
            "--seq-length",
            seq,
            f"must not exceed --max-position-embeddings ({positions})",
            "raise --max-position-embeddings or shorten --seq-length",
        )


def _precision(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    precision = config.precision
    if precision.mixed_precision and precision.precision not in ("fp32", "fp16"):
        yield Violation(
            "--mixed-precision",
            True,
            f"means fp16 and contradicts --precision {precision.precision}",
            "pass only --precision",
        )


def _not_available(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    for spec in all_fields():
        if spec.name not in NOT_AVAILABLE:
            continue
        value = getattr(getattr(config, spec.section), spec.name)
        if value == spec.default or value in _INACTIVE.get(spec.name, ()):
            continue
        yield Violation(
            spec.flag,
            value,
            f"not available yet: {NOT_AVAILABLE[spec.name]} has not landed in this "
            "version of rapidformer",
            f"remove {spec.flag}; see docs/features.md for what works today",
        )


def _compile_flags(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    graph = config.graph
    if graph.torch_compile:
        return
    if graph.torch_compile_mode != "default":
        yield Violation(
            "--torch-compile-mode", graph.torch_compile_mode, "needs --torch-compile", "add it"
        )
    if graph.torch_compile_cache_dir is not None:
        yield Violation(
            "--torch-compile-cache-dir",
            graph.torch_compile_cache_dir,
            "needs --torch-compile",
            "add it",
        )


def _onnx_runtime(config: RapidformerConfig, dims: ParallelDims) -> Iterator[Violation]:
    """--onnx-runtime-training runs train_step's forward and backward in ONNX Runtime, torch
    steps the parameters (rapidformer.accel.onnxruntime): whole, unsharded fp32 models, on one
    process or data-parallel ranks."""
    if not config.graph.onnx_runtime_training:
        return
    flag = "--onnx-runtime-training"
    drop = f"or drop {flag}"
    memory = config.memory
    for sharding in memory.sharding_flags:
        yield Violation(
            sharding,
            True,
            f"cannot be combined with {flag}: ORT holds its own whole copy of the parameters",
            f"remove {sharding} {drop}",
        )
    exclusive = {
        "--cpu-offload": (memory.cpu_offload, "ORT keeps the parameters in its own memory"),
        "--checkpoint-activations": (
            memory.checkpoint_activations,
            "ORT's gradient graph decides what to keep; torch's checkpoint is not exported",
        ),
        "--torch-compile": (
            config.graph.torch_compile,
            "the forward and backward already run in ONNX Runtime, not in torch",
        ),
    }
    for name, (on, why) in exclusive.items():
        if on:
            yield Violation(name, True, f"cannot be combined with {flag}: {why}", f"remove {name}")
    parallel = {
        "--tensor-model-parallel-size": dims.tp,
        "--pipeline-model-parallel-size": dims.pp,
    }
    for name, size in parallel.items():
        if size > 1:
            yield Violation(
                name,
                size,
                f"must be 1 with {flag}: the exported graph is the whole model on one process",
                f"use {name} 1 {drop}",
            )
    experts = config.moe.num_experts
    if experts is not None and experts > 1:
        yield Violation(
            "--num-experts",
            experts,
            f"must be 1 with {flag}: expert routing needs all-to-all collectives in the step",
            f"remove --num-experts {drop}",
        )
    precision = config.precision.resolved
    if precision != "fp32":
        yield Violation(
            "--mixed-precision" if config.precision.mixed_precision else "--precision",
            True if config.precision.mixed_precision else precision,
            f"{flag} trains in fp32: the exported graph would not contain torch's autocast",
            f"use --precision fp32 {drop}",
        )
    if not _ort_importable():
        yield Violation(
            flag,
            True,
            "needs onnxruntime-training and onnx, which cannot be imported",
            "pip install 'rapidformer[onnx]' (onnxruntime-training has wheels for Python 3.10 "
            "and 3.11 only; it must not be installed together with the plain onnxruntime "
            "package, which provides the same module)",
        )


def _ort_importable() -> bool:
    try:
        return (
            importlib.util.find_spec("onnx") is not None
            and importlib.util.find_spec("onnxruntime.training") is not None
        )
    except ImportError:  # onnxruntime itself missing or broken
        return False


RULES: tuple[Rule, ...] = (
    _positive_integers,
    _choices,
    _world_size,
    _batch_sizes,
    _memory_flags,
    _schedule,
    _model_shape,
    _precision,
    _compile_flags,
    _onnx_runtime,
    _not_available,
)
