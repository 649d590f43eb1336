"""Every rank's memory for a config: model state, communication buffers and activations.

Per rank, the device holds at its peak:

* **model state**: parameters, gradients and optimizer state, exactly as the rank's memory
  report counts them (:mod:`rapidformer.dryrun.simulate`); under ``--cpu-offload`` part of
  it in host memory (all of it natively, the optimizer state under DeepSpeed, and the
  parameters too at its stage 3);
* **buffers**: FSDP2's gathered parameters (ZeRO-2 gathers a rank's whole model for the
  forward and keeps it until the backward ends, as ZeRO-3 does under a pipeline; otherwise
  ZeRO-3 gathers one block at a time, with the next one prefetched) and one block's unsharded
  gradients before their reduce-scatter. DDP's buckets are the gradients themselves
  (``gradient_as_bucket_view``), held from one step to the next;
* **activations**: one micro-batch's, counted on the meta device
  (:mod:`rapidformer.dryrun.activations`), times the micro-batches a pipeline stage holds at
  once: with ``m`` micro-batches per step, GPipe holds ``m``, 1F1B ``min(m, pp - r)`` on
  pipeline rank ``r``, and the interleaved schedules ``(v - 1) pp + 2 (pp - 1 - r) + 1`` forwards
  of one virtual stage each (torch's warm-up; ZBV is estimated like Interleaved1F1B).

Allocator slack, the CUDA context and the kernels' workspaces are not in these figures: the fit
check keeps a margin for them (:mod:`rapidformer.dryrun.fit`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidformer.accel.pipeline.inputs import stage_inputs
from rapidformer.config.root import RapidformerConfig
from rapidformer.data.documents import DOCUMENT_INPUTS, DocumentCollate
from rapidformer.distributed.dims import ParallelDims
from rapidformer.distributed.tensors import local_part
from rapidformer.dryrun.activations import MicroBatchActivations, measure_micro_batch
from rapidformer.dryrun.simulate import (
    ACTIVATION_STEPS,
    ModelBuilder,
    compose_on_meta,
    fake_world,
)
from rapidformer.memory import StateBytes
from rapidformer.models.blocks import shard_units
from rapidformer.models.gpt import GPTConfig, GPTModel
from rapidformer.state import TrainState, loss_context
from rapidformer.step_io import ModelInputs, call_model

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class Workload:
    """What one micro-batch is, for the activation pass: the whole model's builder, an empty
    micro-batch and the step's split form."""

    build: ModelBuilder
    batch: Any
    inputs: Any  # (batch) -> ModelInputs
    loss: Any  # (outputs, batch) -> loss tensor
    hidden_size: int
    seq_length: int


def gpt_workload(
    shape: GPTConfig, micro_batch: int, documents: DocumentCollate | None = None
) -> Workload:
    """The built-in GPT of ``shape`` on micro-batches of ``micro_batch`` full-length sequences,
    with the next-token loss (what the benchmarks estimate); with ``documents``, the positions
    and document mask its flags add."""
    seq = shape.max_position_embeddings
    ids = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids}
    if documents is not None:
        batch = documents.add_parts(batch)
    return Workload(
        build=lambda: GPTModel.build(shape, "meta"),
        batch=batch,
        inputs=lambda batch: {key: batch[key] for key in DOCUMENT_INPUTS if key in batch},
        loss=lambda out, batch: F.cross_entropy(
            out.flatten(0, 1).float(), batch["labels"].flatten()
        ),
        hidden_size=shape.hidden_size,
        seq_length=seq,
    )


@dataclass(frozen=True)
class RankMemory:
    """One rank's figures, in bytes."""

    rank: int
    position: dict[str, int]
    state: StateBytes
    offloaded: int
    """Model-state bytes in host memory under ``--cpu-offload``."""
    buffers: int
    buffers_what: str
    micro_batch: MicroBatchActivations
    in_flight: int
    activations: int
    plan: list[str] = field(default_factory=list)
    gradients_kept: bool = False
    """Whether the gradients stay allocated between steps (DDP's buckets); otherwise each step
    frees them."""

    @property
    def device_state(self) -> int:
        return self.state.total - self.offloaded

    @property
    def total(self) -> int:
        """Bytes on the device at the peak."""
        return self.device_state + self.buffers + self.activations

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = {**asdict(self.state), "total": self.state.total}
        out["total"] = self.total
        return out


def in_flight(schedule: str, pp: int, pp_rank: int, virtual: int, micro_batches: int) -> int:
    """Forwards (of one stage each) a pipeline rank holds at once; see the module docstring."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return micro_batches
    if virtual == 1:
        return min(micro_batches, pp - pp_rank)
    warmup = (virtual - 1) * pp + 2 * (pp - 1 - pp_rank)
    return min(micro_batches * virtual, warmup + 1)


@dataclass(frozen=True)
class StageProfile:
    """What every rank at one pipeline position shares: its activations and the sizes FSDP2
    gathers (tensor-parallel shards included, data-parallel sharding not)."""

    micro_batch: MicroBatchActivations
    activations: int
    in_flight: int
    elements: int
    """Parameter elements of the rank's model parts."""
    largest_unit: int
    """Elements of its largest FSDP2 unit (a block)."""
    in_units: int
    """Elements in FSDP2's units (the rest is the root's: embeddings, final norm, head)."""


def rank_memory(
    config: RapidformerConfig,
    dims: ParallelDims,
    work: Workload,
    profiles: dict[int, StageProfile] | None = None,
) -> RankMemory:
    """``dims.rank``'s figures. ``profiles``: per pipeline rank, the stage profiles already
    measured (ranks at the same pipeline position share them)."""
    with fake_world(dims.world_size, dims.rank):
        state = compose_on_meta(config, dims, work.build)
        held, _ = state.stepper.expected_bytes(state)
        plan = [str(step) for step in state.plan]
        profile = (profiles or {}).get(dims.pp_rank)
        if profile is None:
            profile = stage_profile(config, dims, work)
            if profiles is not None:
                profiles[dims.pp_rank] = profile
        buffers, what = _buffers(config, state, held, profile)
        kept = _ddp(config, state)
    return RankMemory(
        rank=dims.rank,
        position={"tp": dims.tp_rank, "pp": dims.pp_rank, "dp": dims.dp_rank},
        state=held,
        offloaded=_offloaded(config, dims, held),
        buffers=buffers,
        buffers_what=what,
        micro_batch=profile.micro_batch,
        in_flight=profile.in_flight,
        activations=profile.activations,
        plan=plan,
        gradients_kept=kept,
    )


def stage_profile(config: RapidformerConfig, dims: ParallelDims, work: Workload) -> StageProfile:
    """One micro-batch through each stage ``dims.rank`` holds (call inside its fake world)."""
    state = compose_on_meta(config, dims, work.build, ACTIVATION_STEPS)
    dtype = _LOW.get(config.precision.precision)
    parts = state.model_parts
    if dtype is not None and _computes_in_low_precision_weights(config, dims):
        # FSDP2's MixedPrecisionPolicy gathers the weights in 16 bits (DeepSpeed keeps them
        # so): autocast then makes no copy of them (those weights are in the buffers).
        for part in parts:
            part.to(dtype)
    measured = [_measure_part(state, part, work, dtype) for part in parts]
    kept = sum(m.kept for m in measured) / len(measured)
    peak = max(m.peak for m in measured)
    count = _in_flight_of(config, state, dims)
    # Forwards in flight: the oldest is in its backward (its peak), the others wait (kept).
    total = math.ceil((count - 1) * kept) + peak
    if _one_micro_batch(config, dims) and not _ddp(config, state):
        # The step's gradients appear while its one micro-batch's activations are freed.
        total = max(m.beyond_gradients for m in measured)
    units = [_local_elements(unit) for part in parts for unit in shard_units(part)]
    return StageProfile(
        micro_batch=max(measured, key=lambda m: m.peak),
        activations=total,
        in_flight=count,
        elements=sum(_local_elements(part) for part in parts),
        largest_unit=max(units, default=0),
        in_units=sum(units),
    )


def zero_stage(config: RapidformerConfig) -> int:
    """The ZeRO stage --sharding asks for (0 for none)."""
    sharding = config.memory.sharding
    return 0 if sharding == "none" else int(sharding[-1])


def _offloaded(config: RapidformerConfig, dims: ParallelDims, held: StateBytes) -> int:
    """What ``--cpu-offload`` keeps in host memory: natively (FSDP2's CPUOffloadPolicy) all
    the sharded state; DeepSpeed's ZeRO-Offload the optimizer state, and at stage 3 the
    parameters too."""
    if not config.memory.cpu_offload:
        return 0
    if config.memory.zero_backend == "deepspeed":
        return held.optimizer + (held.parameters if zero_stage(config) == 3 else 0)
    return held.total if _fsdp(config, dims) else 0


def _fsdp(config: RapidformerConfig, dims: ParallelDims) -> bool:
    """Whether FSDP2 shards the model (ZeRO-2/3 on more than one data-parallel rank; on one,
    the plan says nothing is sharded)."""
    return zero_stage(config) >= 2 and dims.dp > 1


def _computes_in_low_precision_weights(config: RapidformerConfig, dims: ParallelDims) -> bool:
    return config.memory.zero_backend == "deepspeed" or _fsdp(config, dims)


def _one_micro_batch(config: RapidformerConfig, dims: ParallelDims) -> bool:
    """Whether a step is one micro-batch whose backward starts without gradients: several
    micro-batches (accumulation, a pipeline) meet the previous ones' gradients, and FSDP2's
    gradients are sharded as each block's backward ends."""
    accumulation = dims.accumulation_steps(
        config.data.micro_batch_size, config.data.global_batch_size
    )
    return accumulation == 1 and dims.pp == 1 and not _fsdp(config, dims)


def _ddp(config: RapidformerConfig, state: TrainState) -> bool:
    """Whether DDP averages this rank's gradients (``accel/data_parallel.py``'s condition): its
    buckets then hold the gradients from one step to the next (``gradient_as_bucket_view``), so
    a step's backward starts with them allocated."""
    dims = state.mesh.dims
    return (
        dims.dp > 1
        and dims.tp == 1
        and dims.ep == 1
        and state.forward_backward.averaged_by == "ddp"
        and not _fsdp(config, dims)
    )


def _in_flight_of(config: RapidformerConfig, state: TrainState, dims: ParallelDims) -> int:
    micro_batches = dims.accumulation_steps(
        config.data.micro_batch_size, config.data.global_batch_size
    )
    virtual = len(state.model_parts)
    schedule = config.parallel.pipeline_schedule
    return in_flight(schedule, dims.pp, dims.pp_rank, virtual, micro_batches)


def _measure_part(
    state: TrainState, part: nn.Module, work: Workload, dtype: torch.dtype | None
) -> MicroBatchActivations:
    batch = work.batch
    first = bool(getattr(part, "is_first_stage", True))
    last = bool(getattr(part, "is_last_stage", True))
    micro = next(iter(batch.values())).shape[0]
    hidden = torch.empty(
        micro, work.seq_length, work.hidden_size, device="meta", requires_grad=True
    )
    inputs: ModelInputs = work.inputs(batch)
    later: dict[str, Any] = {}
    if not first:  # as the schedule gives them: the hidden states, and the keyword inputs
        inputs, later = (hidden,), stage_inputs(inputs)[1]  # (a mask every stage reads)
    part.train()

    def run() -> Any:
        outputs = part(*inputs, **later) if later else call_model(part, inputs)
        if last:
            return work.loss(outputs, batch)
        return outputs, torch.ones_like(outputs)

    with loss_context(state):  # the backward runs in it too
        return measure_micro_batch(run, part, (inputs, batch), dtype)


def _buffers(
    config: RapidformerConfig, state: TrainState, held: StateBytes, profile: StageProfile
) -> tuple[int, str]:
    """Communication buffers beside the model state; see the module docstring."""
    dims = state.mesh.dims
    if dims.dp == 1:
        return 0, "none (one data-parallel rank)"
    if _fsdp(config, dims):
        size = 2 if config.precision.precision in _LOW else 4
        largest = profile.largest_unit
        if zero_stage(config) == 2 or dims.pp > 1:
            # ZeRO-2 keeps the gathered parameters until the backward; under a pipeline
            # ZeRO-3 does too (sharding.py: no resharding between a stage's micro-batches).
            gathered = profile.elements * size
            what = "FSDP2: every parameter of this rank gathered from forward to backward"
        else:
            # The root unit (embeddings, head) and two blocks (one prefetched).
            root = profile.elements - profile.in_units
            gathered = (max(root, 0) + 2 * largest) * size
            what = "FSDP2 (ZeRO-3): the root's and two blocks' parameters gathered"
        return gathered + 4 * largest, what + ", one block's unsharded fp32 gradients"
    if _ddp(config, state):
        return 0, "none (the gradients are views of DDP's buckets)"
    return 0, "none (gradients averaged in place)"


def _local_elements(module: nn.Module) -> int:
    """Elements of ``module``'s parameters this rank holds (its tensor-parallel shards)."""
    return sum(local_part(p).numel() for p in module.parameters())
