"""Pipeline parallelism: the model's blocks cut into stages, run by a torch pipeline schedule.

``apply_pipeline`` runs first in the canonical order, on the model as built (ideally on the
meta device): each stage this rank holds is a copy of the model pruned to its layers
(:meth:`~rapidformer.models.stages.StagedModel.keep_stage`), so every later step (checkpointing,
compile, tensor parallelism, FSDP2, materialisation, DDP, precision) works on the stages as it
would on a whole model, and checkpoints keep the whole model's parameter names.
:mod:`rapidformer.accel.pipeline.layout` decides the split and the placement, and
:mod:`rapidformer.accel.pipeline.inputs` how the step's micro-batches reach the stages.

Training runs through :class:`PipelineForwardBackward`, the forward-backward slot: one call of
``torch.distributed.pipelining``'s schedule (1F1B, GPipe, Interleaved1F1B, ZBV) per optimizer
step, with the step's micro-batches as the pipeline's micro-batches (one call per run of equal
shapes when the dynamic-shape iterator pads micro-batches differently). The loss is counted before
the forward like everywhere else: the last stage's loss function scales micro-batch ``i``'s loss
by the engine's ``scales[i]`` (and the fp16 loss scale), and schedules are built with
``scale_grads=False``, so gradients are exactly the one-process ones (torchtitan found that
letting the schedule divide by the micro-batch count broke accumulation). The losses are then
summed over the pipeline group, so every rank reports them.

The tied embedding / LM head: the first stage holds ``token_embeddings.weight``, the last its own
copy as ``lm_head.weight``; after every schedule call the two gradients are summed between the
two ranks that hold them (one rank under ZBV), so both copies take the same update and stay
equal. The gradient norm counts the pair once (:meth:`PipelineForwardBackward.norm_skips`).

Evaluation and ``state.model(...)`` go through
:class:`~rapidformer.accel.pipeline.model.PipelinedModel`, the stages callable as one model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rapidformer.accel.pipeline.inputs import (
    concatenated,
    equal_shapes,
    schedulable,
    shapes,
    stage_inputs,
)
from rapidformer.accel.pipeline.layout import (
    StageLayout,
    bubble_formula,
    build_layout,
    tied_pair_group,
)
from rapidformer.accel.pipeline.model import PipelinedModel
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import local_part
from rapidformer.errors import ConfigError, HookError, Violation
from rapidformer.models.moe_router import uncounted
from rapidformer.state import PlanStep, TrainState, loss_context
from rapidformer.step.gradients import align_gradients
from rapidformer.step_io import StepFunctions, local_loss

SCHEDULE_CLASSES = {
    "1F1B": "Schedule1F1B",
    "GPipe": "ScheduleGPipe",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBV": "ScheduleZBVZeroBubble",
}
"""``--pipeline-schedule`` -> torch's class (``torch.distributed.pipelining.schedules``), which is
imported when a pipeline is built: a run without one does not wait for it."""


def layout_of(config: RapidformerConfig, num_layers: int, pp: int) -> StageLayout:
    parallel = config.parallel
    try:
        return build_layout(
            num_layers,
            pp,
            parallel.pipeline_schedule,
            parallel.pipeline_layer_split,
            parallel.num_layers_per_virtual_pipeline_stage,
        )
    except ValueError as error:
        raise ConfigError.single(
            "--pipeline-layer-split",
            parallel.pipeline_layer_split,
            f"no pipeline of {pp} ranks with schedule {parallel.pipeline_schedule} fits a "
            f"model of {num_layers} layers: {error}",
            "adjust --pipeline-layer-split / --num-layers-per-virtual-pipeline-stage, or "
            "--pipeline-model-parallel-size",
        ) from None


class PipelineForwardBackward:
    """Runs a step's micro-batches through the pipeline schedule; see the module docstring."""

    def __init__(
        self,
        model: PipelinedModel,
        device: torch.device,
        group: dist.ProcessGroup,
        tied_group: dist.ProcessGroup | None,
    ) -> None:
        self.model = model
        self.device = device
        self.group = group
        self.schedule_name = model.layout.schedule
        self.name = f"pipeline {self.schedule_name} ({model.layout.num_stages} stages)"
        self._schedules: dict[Any, Any] = {}
        self._step: tuple[Sequence[Any], StepFunctions, torch.Tensor, torch.Tensor] | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self.tied_group = tied_group
        """The ranks holding this pipeline's first and last stage (None: one rank holds both)."""

    # ---- the slot ------------------------------------------------------------------------
    averaged_by = "stepper"  # DDP cannot follow a schedule's interleaved micro-batches
    holds_whole_model = False

    def forward_modules(self, state: TrainState) -> list[nn.Module]:
        """Each stage this rank holds (FSDP2 shards them in place; no DDP wraps them)."""
        return list(self.model.parts)

    def forward_is_collective(self, state: TrainState) -> bool:
        return True  # every hop is a broadcast over the pipeline group

    def norm_skips(self, state: TrainState) -> frozenset[int]:
        skips = set()
        for part in self.model.parts:
            for copy_name, original in getattr(part, "tied_weights", {}).items():
                params = dict(part.named_parameters(remove_duplicate=False))
                if copy_name in params and original not in params:
                    skips.add(id(params[copy_name]))  # the first stage's original counts
        return frozenset(skips)

    def run(
        self, state: TrainState, batches: Sequence[Any], step: StepFunctions, scales: torch.Tensor
    ) -> torch.Tensor:
        if step.model_inputs is None or step.loss is None:
            raise HookError(
                "pipeline parallelism runs the model's stages on different ranks and needs the "
                "split step: override model_inputs(batch) and compute_loss(outputs, batch) "
                "instead of train_step(batch)"
            )
        args, kwargs = zip(*(stage_inputs(step.model_inputs(b)) for b in batches), strict=True)
        losses = torch.zeros(len(batches), device=self.device)
        self._step = (batches, step, scales, losses)
        self._scaler = state.precision.grad_scaler
        if self._scaler is not None:
            # The scaler creates its scale at its first scale(); stages without the loss
            # never call it, yet unscale their gradients.
            self._scaler.scale(torch.zeros((), device=self.device))
        try:
            with loss_context(state):
                for run in equal_shapes(args, kwargs):
                    for chunk in schedulable(run, self.schedule_name, self.model.layout.pp):
                        self._run_schedule(chunk, args, kwargs)
        finally:
            self._step = None
        self._sum_tied_gradients(state)
        # Only the last stage computed the losses: the sum gives them to every pipeline rank.
        return process_group.all_reduce_sum(losses, self.group)

    def _run_schedule(
        self, run: list[int], args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]
    ) -> None:
        """One schedule call over the micro-batches ``run`` (indices into the step's)."""
        run_args, run_kwargs = [args[i] for i in run], [kwargs[i] for i in run]
        schedule, _ = self._schedule(len(run), run_args, run_kwargs)
        # The public step() takes a whole batch and cuts it into the schedule's micro-batches
        # along dim 0. The run's micro-batches have equal shapes, so concatenating them and
        # cutting again gives each one back exactly; the target is each one's index.
        whole_args = tuple(concatenated(list(values)) for values in zip(*run_args, strict=True))
        whole_kwargs = {key: concatenated([k[key] for k in run_kwargs]) for key in run_kwargs[0]}
        schedule.step(*whole_args, target=torch.tensor(run), return_outputs=False, **whole_kwargs)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: micro-batch ``target``'s loss, scaled (``target`` is
        the micro-batch's index, a one-element CPU tensor: reading it waits for no device)."""
        assert self._step is not None
        batches, step, scales, losses = self._step
        index = int(target)
        assert step.loss is not None
        loss = local_loss(step.loss(output, batches[index]))
        losses[index] = loss.detach().float()
        scaled = loss * scales[index]
        return self._scaler.scale(scaled) if self._scaler is not None else scaled

    def _schedule(
        self, microbatches: int, args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]
    ) -> tuple[Any, list[Any]]:
        """One schedule (and its stages) per micro-batch count and input shapes: the stages
        size their receive buffers from the first step they run. Every pipeline rank reads the
        same batches, so they agree on the key without communicating."""
        key = (
            microbatches,
            tuple(shapes(a) + shapes(k) for a, k in zip(args, kwargs, strict=True)),
        )
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, schedules

            layout = self.model.layout
            stages = [
                PipelineStage(module, index, layout.num_stages, self.device, group=self.group)
                for index, module in zip(self.model.stage_ids, self.model.parts, strict=True)
            ]
            for stage in stages:
                _uncounted_inference(stage)
            name = SCHEDULE_CLASSES[self.schedule_name]
            if name == "Schedule1F1B" and microbatches < layout.num_stages:
                name = "ScheduleGPipe"  # 1F1B needs m >= stages; GPipe computes the same grads
            cls = getattr(schedules, name)
            first = stages[0] if layout.virtual == 1 else stages
            schedule = cls(first, microbatches, loss_fn=self._loss, scale_grads=False)
            self._schedules[key] = (schedule, stages)
        return self._schedules[key]

    def _sum_tied_gradients(self, state: TrainState) -> None:
        """Sum the tied embedding / LM head copies' gradients (see the module docstring)."""
        pairs = [
            (part, name)
            for part in self.model.parts
            for pair in getattr(part, "tied_weights", {}).items()
            for name in pair
            if name in dict(part.named_parameters(remove_duplicate=False))
        ]
        held = [dict(p.named_parameters(remove_duplicate=False))[n] for p, n in pairs]
        if len({id(p) for p in held}) != len(held) or not held:
            return  # one stage holds both names (one tensor) or no stage holds either
        align_gradients(held)
        grads = [local_part(p.grad) for p in held if p.grad is not None]
        if not grads:
            return
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if self.tied_group is not None:
            process_group.all_reduce_sum(total, self.tied_group)
        for grad in grads:
            grad.copy_(total)

    def close(self) -> None:
        self._schedules.clear()


def _uncounted_inference(stage: Any) -> None:
    """A stage infers its output shapes by one extra forward on placeholder values before
    its first step: MoE layers must not count it as a micro-batch.

    torch 2.13 has no public hook for that forward, so this wraps the private method that
    runs it: the one use of a pipelining internal here. tests/test_torch_internals.py
    fails with a clear message if torch renames it."""
    infer = stage._forward_metadata_inference

    def quietly(*args: Any, **kwargs: Any) -> Any:
        with uncounted():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = quietly


def apply_pipeline(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    pp = mesh.dims.pp
    if pp == 1:
        return state
    model = state.unwrapped_model
    keep_stage = getattr(model, "keep_stage", None)
    blocks = getattr(model, "blocks", None)
    if not callable(keep_stage) or not isinstance(blocks, nn.ModuleDict):
        raise ConfigError.single(
            "--pipeline-model-parallel-size",
            pp,
            f"{type(model).__name__} cannot be cut into pipeline stages",
            "use the built-in GPT or BERT (rapidformer.models, --task pretraining), which "
            "keep their blocks in a ModuleDict and know which modules each stage keeps",
        )
    layout = layout_of(config, len(blocks), pp)
    pp_rank = mesh.dims.pp_rank
    parts = []
    for stage in layout.held(pp_rank):
        part: Any = copy.deepcopy(model)  # on the meta device: nothing is allocated
        part.keep_stage(layout.layers(stage), first=stage == 0, last=stage == layout.num_stages - 1)
        parts.append(part)
    group = mesh.group("pp")
    assert group is not None
    pipelined = PipelinedModel(parts, layout, pp_rank, group, mesh.submesh("tp"))
    state.model = pipelined
    state.model_parts = parts
    state.forward_backward = PipelineForwardBackward(
        pipelined, state.device, group, tied_pair_group(mesh, layout)
    )
    data = config.data
    microbatches = mesh.dims.accumulation_steps(data.micro_batch_size, data.global_batch_size)
    stages = "; ".join(f"pp rank {r}: {layout.describe(r)}" for r in range(pp))
    state.plan.append(
        PlanStep(
            "pipeline parallel",
            f"torch.distributed.pipelining {layout.schedule}",
            f"{pp} ranks x {layout.virtual} virtual = {layout.num_stages} stages, layers per "
            f"stage {list(layout.layers_per_stage)}; {stages}; {microbatches} micro-batches "
            f"per step, bubble {layout.bubble(microbatches):.1%} "
            f"({bubble_formula(layout)})",
        )
    )
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """Pipeline flags need a pipeline; the interleaved schedules need enough micro-batches."""
    parallel, dims = config.parallel, context.dims
    if dims.pp == 1:
        for flag, value, default in (
            ("--pipeline-schedule", parallel.pipeline_schedule, "1F1B"),
            ("--pipeline-layer-split", parallel.pipeline_layer_split, None),
            (
                "--num-layers-per-virtual-pipeline-stage",
                parallel.num_layers_per_virtual_pipeline_stage,
                None,
            ),
        ):
            if value != default:
                yield Violation(
                    flag,
                    value,
                    "only takes effect with pipeline parallelism",
                    "add --pipeline-model-parallel-size 2 (or more), or drop the flag",
                )
        return
    micro, global_ = config.data.micro_batch_size, config.data.global_batch_size
    if dims.world_size % (dims.tp * dims.pp):
        return
    steps = global_ // (micro * dims.dp) if global_ else 1
    if parallel.pipeline_schedule in ("Interleaved1F1B", "ZBV") and steps < dims.pp:
        yield Violation(
            "--pipeline-schedule",
            parallel.pipeline_schedule,
            f"needs at least as many micro-batches per step as pipeline ranks ({dims.pp}); "
            f"this run has {steps} (global / (micro x data-parallel))",
            f"raise --global-batch-size to at least {dims.pp * micro * dims.dp}",
        )


FEATURE = Feature(
    "pipeline parallel",
    flags=(
        "--pipeline-model-parallel-size",
        "--pipeline-schedule",
        "--pipeline-layer-split",
        "--num-layers-per-virtual-pipeline-stage",
    ),
    rules=rules,
    switched_on=lambda config: (
        size if (size := config.parallel.pipeline_model_parallel_size) > 1 else None
    ),
    refused_on={"deepspeed": "DeepSpeed ZeRO is not combined with pipeline parallelism here"},
)
