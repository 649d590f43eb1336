"""Checking a configuration: every rule, every violation reported at once.

:func:`check` runs a list of rules and raises one :class:`ConfigError` listing every violation,
each naming the flag, its value, the rule and a fix. The rules that only need the config and
the parallel degrees live here (:data:`GENERAL_RULES`); each acceleration keeps its own rules
next to its code (``rules`` in ``rapidformer/accel/*.py``), and the engine hands both lists to
:func:`check` (:func:`rapidformer.engine.validate`). Switches whose implementation has not
landed yet are violations too (:data:`NOT_AVAILABLE`), so no flag is ever accepted and ignored.

Nothing here builds a process group or reads the environment: the world size comes in as a
number, inside the run's :class:`Degrees`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rapidformer.config.fields import all_fields
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.trackers import tracker_violations
from rapidformer.errors import ConfigError, Violation

NOT_AVAILABLE: dict[str, str] = {}
"""Switches parsed and validated now but implemented by a later issue: field -> what is
missing. A value other than the field's default is rejected until the entry is removed."""

_INACTIVE: dict[str, tuple[object, ...]] = {}
"""Values of a NOT_AVAILABLE field that do not ask for the missing feature (besides the
default)."""


class Degrees(Protocol):
    """The parallel degrees of a run (:class:`rapidformer.distributed.ParallelDims`)."""

    @property
    def world_size(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def ep(self) -> int: ...


@dataclass(frozen=True)
class RunContext:
    """What the rules know besides the config."""

    dims: Degrees
    builds_optimizer: bool = True
    """rapidformer builds the optimizer (False when the caller supplies one): needs --lr."""
    runs_loop: bool = True
    """rapidformer's loop decides the run length (False for a hand-written loop driving the
    engine): needs --train-iters or --epochs."""
    on_this_machine: bool = True
    """The run happens here (False for a dry run, which plans a run on other machines: rules
    about this machine's devices and installed packages do not apply)."""


Rule = Callable[[RapidformerConfig, RunContext], Iterator[Violation]]


def no_rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """A feature that refuses nothing."""
    return iter(())


@dataclass(frozen=True)
class Feature:
    """An acceleration as validation sees it: the flags it owns and what it refuses.

    ``rules`` name only the feature's own ``flags``: where it cannot run with another switch,
    the violation names this feature's flag and the other switch in its text (``--fused-lm-loss:
    cannot run with --pipeline-model-parallel-size 2``). Everything a feature cannot do is
    then in its own module, and adding a switch never edits another switch's rules
    (tests/test_layering.py checks both). ``refused_on`` says which ``--zero-backend`` engines
    cannot run it and why; the backend's choice (:mod:`rapidformer.engine.order`) refuses it
    there, so that no feature asks which backend runs.
    """

    name: str
    flags: tuple[str, ...]
    """The flags it owns (``--flag`` spelling); the first one switches it on."""
    rules: Rule = no_rules
    switched_on: Callable[[RapidformerConfig], object] = lambda config: None
    """The value of its first flag where the config switches it on, else None."""
    refused_on: Mapping[str, str] = field(default_factory=dict)
    """``--zero-backend`` value -> why the feature cannot run on that engine."""
    recipe: Mapping[str, object] = field(default_factory=dict)
    """Fine-tuning recipe values the feature changes where the flags leave them open, when it
    is on (adapters start at zero and take a larger learning rate)."""
    recognizes: Callable[[str], tuple[str, str] | None] = lambda path: None
    """(rule, fix) when a directory given as the model is really this feature's output (an
    adapter directory, say), so that the refusal can point to the feature's own flag."""
    late_weight_rules: Callable[[RapidformerConfig], Iterator[Violation]] = lambda config: iter(())
    """What the feature refuses for a model built on the meta device that gets its weights
    only once materialised (the Pretrainer's built-in GPT and BERT): a template asks before
    any model exists, so the refusal comes with the flags'."""


def check(
    config: RapidformerConfig,
    context: RunContext,
    rules: Sequence[Rule],
    extra: Iterable[Violation] = (),
) -> None:
    """Run every rule; raise one error listing all violations (and ``extra``, a template's
    own), or return when there are none."""
    violations = [v for rule in rules for v in rule(config, context)]
    violations.extend(extra)
    # A NaN or an infinity breaks every range rule of its flag too: say it once.
    non_finite = {v.flag for v in violations if v.rule == FINITE}
    violations = [v for v in violations if v.flag not in non_finite or v.rule == FINITE]
    if violations:
        raise ConfigError(violations)


def _positive_integers(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
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


def _choices(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    # Python callers bypass argparse's choices; the task rule is the one users hit most.
    for spec in all_fields():
        value = getattr(getattr(config, spec.section), spec.name)
        if spec.choices is not None and value is not None and value not in spec.choices:
            yield Violation(
                spec.flag, value, "unknown value", f"use one of: {', '.join(spec.choices)}"
            )


def _world_size(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    dims = context.dims
    if dims.tp >= 1 and dims.pp >= 1 and dims.world_size % (dims.tp * dims.pp) != 0:
        yield Violation(
            "--tensor-model-parallel-size",
            dims.tp,
            f"data x tensor x pipeline parallel degrees must equal the world size "
            f"{dims.world_size}, but tp {dims.tp} x pp {dims.pp} does not divide it",
            "choose tensor and pipeline sizes whose product divides the number of processes",
        )


def _batch_sizes(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    dims = context.dims
    micro, global_ = config.data.micro_batch_size, config.data.global_batch_size
    if global_ is None or micro < 1 or dims.tp < 1 or dims.pp < 1:
        return
    if dims.world_size % (dims.tp * dims.pp):
        return
    if global_ % (micro * dims.dp) != 0:
        yield Violation(
            "--global-batch-size",
            global_,
            f"must be a multiple of --micro-batch-size ({micro}) x data-parallel size "
            f"({dims.dp}) = {micro * dims.dp}; the quotient is the gradient-accumulation steps",
            f"use --global-batch-size {max(1, global_ // (micro * dims.dp)) * micro * dims.dp}",
        )


def _duration(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    if not context.runs_loop:
        return
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


def _learning_rate(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    training = config.training
    if context.builds_optimizer and training.lr is None:
        yield Violation(
            "--lr",
            None,
            "a learning rate is required to build the optimizer",
            "pass --lr, e.g. --lr 1e-4",
        )
    # A non-finite rate passes a finite first step and turns every weight into NaN at the
    # next; a negative one climbs the loss. Non-finite values are _finite_numbers' to name.
    if training.lr is not None and math.isfinite(training.lr) and training.lr <= 0:
        yield Violation("--lr", training.lr, "must be > 0", "e.g. --lr 1e-4")
    for flag, value in (("--min-lr", training.min_lr), ("--weight-decay", training.weight_decay)):
        if math.isfinite(value) and value < 0:
            yield Violation(flag, value, "must be >= 0", f"e.g. {flag} 0")


FINITE = "must be a finite number"


def _async_save(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """Background writes (checkpoint/background.py) of the native formats, on any number of
    ranks; DeepSpeed's engine writes its own format, synchronously."""
    checkpoint, memory = config.checkpoint, config.memory
    if not checkpoint.async_save:
        return
    problem = ""
    if checkpoint.save is None:
        problem = "there is nothing to save without --save"
    elif memory.zero_backend == "deepspeed":
        problem = (
            "DeepSpeed's engine writes its own checkpoint format, synchronously; background "
            "writes are built for rapidformer's formats (consolidated and DCP shards)"
        )
    if problem:
        fix = "drop --async-save (saves are then synchronous)"
        if memory.zero_backend == "deepspeed" and checkpoint.save is not None:
            fix += ", or use the native ZeRO (--zero-backend native)"
        yield Violation("--async-save", True, problem, fix)


def _report_to(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    return tracker_violations(config)


def _finite_numbers(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """No flag takes NaN or infinity (argparse's float() accepts both)."""
    for spec in all_fields():
        value = getattr(getattr(config, spec.section), spec.name)
        if isinstance(value, float) and not math.isfinite(value):
            yield Violation(spec.flag, value, FINITE, "give a finite value")


def _schedule(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
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
    if training.lr is not None and 0 < training.lr < training.min_lr < math.inf:
        yield Violation(
            "--min-lr", training.min_lr, f"must not exceed --lr {training.lr}", "lower --min-lr"
        )
    timeout = config.parallel.distributed_timeout_minutes
    if not timeout > 0:
        yield Violation(
            "--distributed-timeout-minutes", timeout, "must be > 0", "e.g. 10 (minutes)"
        )
    if training.clip_grad < 0:
        yield Violation(
            "--clip-grad", training.clip_grad, "must be >= 0 (0 disables clipping)", "e.g. 1.0"
        )
    peak = config.logging.peak_tflops
    if peak is not None and not peak > 0:
        yield Violation(
            "--peak-tflops", peak, "must be > 0", "e.g. 989 (an H100's dense bf16), or drop it"
        )


def _model_shape(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    model, tp = config.model, context.dims.tp
    hidden, heads = model.hidden_size, model.num_attention_heads
    if hidden is not None and heads and hidden % heads:
        yield Violation(
            "--hidden-size",
            hidden,
            f"must be divisible by --num-attention-heads ({heads})",
            "choose a hidden size that is a multiple of the head count",
        )
    if hidden is not None and tp >= 1 and hidden % tp:
        yield Violation(
            "--hidden-size",
            hidden,
            f"must be divisible by --tensor-model-parallel-size ({tp})",
            "choose a hidden size that is a multiple of the tensor-parallel size",
        )
    if heads is not None and tp >= 1 and heads % tp:
        yield Violation(
            "--num-attention-heads",
            heads,
            f"must be divisible by --tensor-model-parallel-size ({tp})",
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


def _not_available(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
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


def _planning(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    planning = config.planning
    if planning.dry_run:
        return
    for flag, value in (
        ("--dry-run-world-size", planning.dry_run_world_size),
        ("--device-memory", planning.device_memory),
    ):
        if value is not None:
            yield Violation(
                flag,
                value,
                "only a dry run reads it; this run would ignore it",
                "add --dry-run to see the plan and memory, or drop the flag",
            )


def _trust(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The consent flags must have something to consent to (else they would do nothing)."""
    model, checkpoint = config.model, config.checkpoint
    if model.trust_remote_code and model.pretrained_model_name_or_path is None:
        yield Violation(
            "--trust-remote-code",
            True,
            "only a Hugging Face model (--pretrained-model-name-or-path) ships code to run",
            "drop --trust-remote-code",
        )
    loads = (
        checkpoint.load,
        checkpoint.save,
        checkpoint.pretrained_checkpoint,
        model.pretrained_model_name_or_path,
    )
    if checkpoint.trust_checkpoint and all(source is None for source in loads):
        yield Violation(
            "--trust-checkpoint",
            True,
            "this run loads no checkpoint (no --load, --save, --pretrained-checkpoint or "
            "--pretrained-model-name-or-path)",
            "drop --trust-checkpoint",
        )


def _pretrained_checkpoint(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The weights a fresh run starts from: read by the Trainer, which owns resuming."""
    source = config.checkpoint.pretrained_checkpoint
    if source is None:
        return
    if not context.runs_loop:
        yield Violation(
            "--pretrained-checkpoint", source,
            "only a Trainer's fit() reads it; a hand-written loop would ignore it",
            "load the weights yourself, or train through a Trainer",
        )  # fmt: skip
    if config.moe.moe_use_upcycling:
        yield Violation(
            "--pretrained-checkpoint", source,
            "cannot be combined with --moe-use-upcycling, which starts from the dense "
            "checkpoint at --load", "pass the dense checkpoint as --load only",
        )  # fmt: skip
    if context.on_this_machine and not Path(source).is_dir():
        yield Violation(
            "--pretrained-checkpoint", source, "no such directory",
            "pass the --save directory of a finished run, or one of its iter_* directories",
        )  # fmt: skip


GENERAL_RULES: tuple[Rule, ...] = (
    _positive_integers,
    _finite_numbers,
    _async_save,
    _report_to,
    _choices,
    _world_size,
    _batch_sizes,
    _duration,
    _learning_rate,
    _schedule,
    _model_shape,
    _not_available,
    _planning,
    _trust,
    _pretrained_checkpoint,
)
"""The rules that concern no single acceleration."""
