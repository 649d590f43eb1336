"""The canonical order of accelerations, per backend, and every acceleration's rules.

This is the only place where ordering lives, and the only place where the backend
(``--zero-backend``) is chosen: each backend yields the steps it runs, so no acceleration asks
which backend another one is. Each ``apply_*(state, config, mesh) -> state`` returns the state
unchanged when its switch is off, so one order serves every combination; why each step sits
where it does is written beside it, with how a dry run (which composes every rank on the meta
device) treats it.

Adding a switch: its module (``apply_*``, its rules and its :class:`Feature`), its field in
the schema, its place here, and its docs page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rapidformer.accel import compile as compiling
from rapidformer.accel import (
    data,
    data_parallel,
    deepspeed,
    fp8,
    liger,
    lm_loss,
    lora,
    materialize,
    moe,
    onnx,
    optim,
    pipeline,
    precision,
    recompute,
    sharding,
    tensor_parallel,
)
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, Rule, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import Violation
from rapidformer.state import FrozenBaseExport, TrainState

Apply = Callable[[TrainState, RapidformerConfig, ParallelMesh], TrainState]


@dataclass(frozen=True)
class Step:
    """One step of the canonical order, and how a dry run treats it."""

    apply: Apply
    not_simulated: str = ""
    """Why a dry run leaves the step out ("" where it runs it): it would allocate, read data,
    or trace, and it changes neither what a rank holds nor its activations."""
    shapes_activations: bool = False
    """Whether it changes what one micro-batch's forward and backward keep on a rank: the dry
    run's activation pass runs it."""


NATIVE_ORDER: tuple[Step, ...] = (
    # A Hugging Face model's generation cache goes off first: in training it only costs, and
    # under compile it makes every layer a new guard.
    Step(compiling.apply_no_generation_cache),
    # Liger swaps a Hugging Face model's norms, rotary embeddings and MLPs for Triton kernels
    # while the model is plain, before recomputation and compile see its layers.
    Step(liger.apply_liger_kernel, not_simulated="Liger's kernels are not swapped in"),
    # MoE layers replace FFNs while the model is whole and on the meta device: the stages,
    # tensor parallelism and sharding then treat MoE blocks like any other.
    Step(moe.apply_moe),
    # The pipeline cuts the model (still on the meta device) into this rank's stages; every
    # later step then works on each stage as on a whole model.
    Step(pipeline.apply_pipeline, shapes_activations=True),
    # Expert parallelism keeps this rank's experts of the layers its stages hold (DTensors on
    # the ep mesh, before tensor parallelism and sharding see the parameters).
    Step(moe.apply_expert_parallel),
    # Recomputation patches the blocks, before anything wraps them.
    Step(recompute.apply_recompute, shapes_activations=True),
    # fp8 swaps the blocks' linear layers for float8 ones (the blocks themselves, and their
    # recompute patches, stay); before compile, sharding and tensor parallelism see them.
    Step(fp8.apply_fp8, not_simulated="float8 layers are estimated as bf16"),
    # Adapters freeze the base and sit on its linear layers (float8 ones too) while the model
    # is whole; compile then traces them with their block, and FSDP2 shards frozen and
    # trainable parameters of a block in one unit.
    Step(lora.apply_lora),
    # The fused LM loss is a switch on the model's forward (its head and loss in chunks),
    # set before compile traces that forward.
    Step(lm_loss.apply_fused_lm_loss, shapes_activations=True),
    # Compile traces the recomputed blocks (a checkpoint becomes a recompute region in the
    # graph); DDP / FSDP then wrap the compiled blocks, whose parameters are unchanged.
    Step(
        compiling.apply_compile,
        not_simulated="compile changes speed, not what a rank holds (not traced)",
    ),
    # ONNX Runtime takes over forward and backward of the plain module; it must be decided
    # before DDP, which then steps aside (the slot averages the gradients itself).
    Step(onnx.apply_onnxruntime, not_simulated="ONNX Runtime's graphs are not built"),
    # Tensor parallelism replaces parameters by DTensor shards on the tp axis (still meta: no
    # memory); FSDP2 then shards those over dp (2D), and DDP replicates them.
    Step(tensor_parallel.apply_tensor_parallel, shapes_activations=True),
    # Sharding (FSDP2 for ZeRO-2/3) must see the final blocks and takes DDP's place. On a
    # meta-device model it shards meta tensors: nothing is allocated yet.
    Step(sharding.apply_sharding),
    # Now that what each rank holds is decided, allocate and initialise only that.
    Step(materialize.apply_materialize, not_simulated="nothing is allocated"),
    # DDP wraps the finished, materialised module (it broadcasts the first rank's values),
    # and the gradient sync the step is left with is decided, once sharding decided its own.
    Step(
        data_parallel.apply_data_parallel,
        not_simulated="DDP would broadcast real values; its buckets are the gradients",
    ),
    # The optimizer is built on the parameters that wrapping and sharding decided.
    Step(optim.apply_optimizer),
    # ZeRO-1 re-partitions the optimizer just built (or supplied) over the ranks.
    Step(sharding.apply_optimizer_sharding),
    # Autocast wraps the outermost forward so DDP's hooks and the blocks all run under it.
    Step(precision.apply_precision),
    # Data comes last: the sampler needs the final data-parallel degree.
    Step(data.apply_data, not_simulated="no data is read"),
)

DEEPSPEED_ORDER: tuple[Step, ...] = (
    # DeepSpeed's engine owns data parallelism, sharding and precision, so the native steps
    # for them are not here; the switches it cannot run with say so (Feature.refused_on).
    # Recomputation patches the blocks before DeepSpeed wraps the model.
    Step(compiling.apply_no_generation_cache),
    Step(liger.apply_liger_kernel),
    Step(recompute.apply_recompute),
    Step(materialize.apply_materialize),
    # The optimizer DeepSpeed steps (built for the CPU under ZeRO-Offload).
    Step(deepspeed.apply_deepspeed_optimizer),
    # DeepSpeed takes the model and the optimizer just built, and owns backward and the step.
    Step(deepspeed.apply_deepspeed),
    Step(data.apply_data),
)

FEATURES: tuple[Feature, ...] = (
    moe.FEATURE,
    pipeline.FEATURE,
    tensor_parallel.FEATURE,
    sharding.FEATURE,
    compiling.FEATURE,
    recompute.FEATURE,
    lm_loss.FEATURE,
    lora.FEATURE,
    fp8.FEATURE,
    liger.FEATURE,
    onnx.FEATURE,
    optim.FEATURE,
    deepspeed.FEATURE,
)
"""Every acceleration that owns flags and rules (each declared next to its code)."""

FROZEN_BASE_EXPORT: FrozenBaseExport = lora.EXPORT
"""How export writes a checkpoint of parameters added onto a frozen base (adapters)."""


@dataclass(frozen=True)
class Backend:
    """What ``--zero-backend`` chooses: the steps compose() runs and the rules it adds."""

    name: str
    order: tuple[Step, ...]
    own_rules: tuple[Rule, ...] = ()

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every feature's rules, the backend's own, and the refusal of each switch that
        says it cannot run on this backend."""
        return (*(f.rules for f in FEATURES), *self.own_rules, self._refusals)

    def _refusals(self, config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
        for feature in FEATURES:
            why = feature.refused_on.get(self.name)
            value = feature.switched_on(config)
            if why and value is not None:
                flag = feature.flags[0]
                yield Violation(
                    flag,
                    value,
                    f"cannot run on --zero-backend {self.name}: {why}",
                    f"use --zero-backend native, or run without {flag} {value}",
                )


BACKENDS: dict[str, Backend] = {
    "native": Backend("native", NATIVE_ORDER, (sharding.native_rules,)),
    "deepspeed": Backend("deepspeed", DEEPSPEED_ORDER),
}


def backend(config: RapidformerConfig) -> Backend:
    """The backend the config chose (validated by the schema's choices)."""
    return BACKENDS[config.memory.zero_backend]
