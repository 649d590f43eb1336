"""The canonical order of accelerations, per backend, and every acceleration's rules.

This is the only place where ordering lives, and the only place where the backend
(``--zero-backend``) is chosen: each backend yields the steps it runs, so no acceleration asks
which backend another one is. Each ``apply_*(state, config, mesh) -> state`` returns the state
unchanged when its switch is off, so one order serves every combination; why each step sits
where it does is written beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rapidformer.accel import compile as compile_rules
from rapidformer.accel import (
    deepspeed,
    fp8,
    liger,
    lm_loss,
    moe_rules,
    onnxruntime,
    pipeline,
    recompute,
    sharding,
    tensor_parallel,
)
from rapidformer.accel.checkpointing import apply_activation_checkpointing
from rapidformer.accel.compile import apply_compile
from rapidformer.accel.data import apply_data
from rapidformer.accel.data_parallel import apply_data_parallel
from rapidformer.accel.deepspeed import apply_deepspeed, apply_deepspeed_optimizer
from rapidformer.accel.fp8 import apply_fp8
from rapidformer.accel.generation_cache import apply_no_generation_cache
from rapidformer.accel.liger import apply_liger_kernel
from rapidformer.accel.lm_loss import apply_fused_lm_loss
from rapidformer.accel.materialize import apply_materialize
from rapidformer.accel.moe import apply_expert_parallel, apply_moe
from rapidformer.accel.onnxruntime import apply_onnxruntime
from rapidformer.accel.optimizers import apply_optimizer
from rapidformer.accel.pipeline import apply_pipeline
from rapidformer.accel.precision import apply_precision
from rapidformer.accel.sharding import apply_optimizer_sharding, apply_sharding
from rapidformer.accel.tensor_parallel import apply_tensor_parallel
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Rule
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.state import TrainState

Apply = Callable[[TrainState, RapidformerConfig, ParallelMesh], TrainState]

NATIVE_ORDER: tuple[Apply, ...] = (
    # A Hugging Face model's generation cache goes off first: in training it only costs, and
    # under compile it makes every layer a new guard.
    apply_no_generation_cache,
    # Liger swaps a Hugging Face model's norms, rotary embeddings and MLPs for Triton kernels
    # while the model is plain, before checkpointing and compile see its layers.
    apply_liger_kernel,
    # MoE layers replace FFNs while the model is whole and on the meta device: the stages,
    # tensor parallelism and sharding then treat MoE blocks like any other.
    apply_moe,
    # The pipeline cuts the model (still on the meta device) into this rank's stages; every
    # later step then works on each stage as on a whole model.
    apply_pipeline,
    # Expert parallelism keeps this rank's experts of the layers its stages hold (DTensors on
    # the ep mesh, before tensor parallelism and sharding see the parameters).
    apply_expert_parallel,
    # Checkpointing patches the blocks, before anything wraps them.
    apply_activation_checkpointing,
    # fp8 swaps the blocks' linear layers for float8 ones (the blocks themselves, and their
    # checkpoint patches, stay); before compile, sharding and tensor parallelism see them.
    apply_fp8,
    # The fused LM loss is a switch on the model's forward (its head and loss in chunks),
    # set before compile traces that forward.
    apply_fused_lm_loss,
    # Compile traces the checkpointed blocks (checkpoint becomes a recompute region in the
    # graph); DDP / FSDP then wrap the compiled blocks, whose parameters are unchanged.
    apply_compile,
    # ONNX Runtime takes over forward and backward of the plain module; it must be decided
    # before DDP, which then steps aside (the slot averages the gradients itself).
    apply_onnxruntime,
    # Tensor parallelism replaces parameters by DTensor shards on the tp axis (still meta: no
    # memory); FSDP2 then shards those over dp (2D), and DDP replicates them.
    apply_tensor_parallel,
    # Sharding (FSDP2 for ZeRO-2/3) must see the final blocks and takes DDP's place. On a
    # meta-device model it shards meta tensors: nothing is allocated yet.
    apply_sharding,
    # Now that what each rank holds is decided, allocate and initialise only that.
    apply_materialize,
    # DDP wraps the finished, materialised module (it broadcasts the first rank's values).
    apply_data_parallel,
    # The optimizer is built on the parameters that wrapping and sharding decided.
    apply_optimizer,
    # ZeRO-1/OSS re-partitions the optimizer just built (or supplied) over the ranks.
    apply_optimizer_sharding,
    # Autocast wraps the outermost forward so DDP's hooks and the blocks all run under it.
    apply_precision,
    # Data comes last: the sampler needs the final data-parallel degree.
    apply_data,
)

DEEPSPEED_ORDER: tuple[Apply, ...] = (
    # DeepSpeed's engine owns data parallelism, sharding and precision, so the native steps
    # for them are not here; its rules refuse MoE, pipeline, tensor parallelism, compile and
    # ONNX Runtime. Checkpointing patches the blocks before DeepSpeed wraps the model.
    apply_no_generation_cache,
    apply_liger_kernel,
    apply_activation_checkpointing,
    apply_materialize,
    # The optimizer DeepSpeed steps (built for the CPU under ZeRO-Offload).
    apply_deepspeed_optimizer,
    # DeepSpeed takes the model and the optimizer just built, and owns backward and the step.
    apply_deepspeed,
    apply_data,
)

COMMON_RULES: tuple[Rule, ...] = (
    moe_rules.rules,
    pipeline.rules,
    tensor_parallel.rules,
    sharding.rules,
    compile_rules.rules,
    recompute.rules,
    lm_loss.rules,
    fp8.rules,
    liger.rules,
    onnxruntime.rules,
)
"""Each acceleration's own rules (written next to its code), checked with the general ones."""


@dataclass(frozen=True)
class Backend:
    """What ``--zero-backend`` chooses: the steps compose() runs and the rules they add."""

    order: tuple[Apply, ...]
    rules: tuple[Rule, ...]


BACKENDS: dict[str, Backend] = {
    "native": Backend(NATIVE_ORDER, (*COMMON_RULES, sharding.native_rules)),
    "deepspeed": Backend(DEEPSPEED_ORDER, (*COMMON_RULES, deepspeed.rules)),
}


def backend(config: RapidformerConfig) -> Backend:
    """The backend the config chose (validated by the schema's choices)."""
    return BACKENDS[config.memory.zero_backend]
