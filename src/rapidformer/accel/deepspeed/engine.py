"""ZeRO through the DeepSpeed engine (``--zero-backend deepspeed``).

``--sharding`` chooses the stage, as on the native backend: zero1 (OSS) -> stage 1, zero2
(SDP) -> stage 2, zero3 (FSDP) -> stage 3. The DeepSpeed config is generated from our flags
(micro and global batch, accumulation steps, clipping, precision, offload), so a user never
writes one. DeepSpeed then owns the model (its engine becomes ``state.model``) and fills the
three slots of the train state:

* forward-backward (:class:`DeepSpeedForwardBackward`): its ``backward`` partitions and reduces
  the gradients in its hooks. Each micro-batch's loss comes scaled by the engine (units x dp /
  units of the global batch, counted before the forwards), so accumulation is exact with
  ``scale_wrt_gas=False`` and nothing is rescaled inside DeepSpeed afterwards;
* stepper (:class:`DeepSpeedStepper`): master weights, clipping (``--clip-grad`` is in its
  config), the update of its own partitions, fp16 overflow skips;
* checkpoint format (:class:`~rapidformer.accel.deepspeed.state.DeepSpeedFormat`): each rank
  writes its partitions through DeepSpeed's save/load.

What stays ours: the torch optimizer rapidformer built (or the user handed compose()) is what
DeepSpeed steps on its partitions (no JIT-compiled fused/CPU Adam; on a CPU DeepSpeed still
builds its shared-memory communication op once per machine), and our LR schedule sets the
learning rate on that optimizer's groups, which DeepSpeed's partitions share.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rapidformer.accel.deepspeed.state import DeepSpeedFormat, expected_state_bytes
from rapidformer.accel.optim.optimizers import apply_optimizer
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed import process_group
from rapidformer.distributed.dims import ParallelDims
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import NonFiniteError, RapidformerError, Violation
from rapidformer.memory import StateBytes
from rapidformer.state import PlanStep, TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step_io import FinishedGradients, StepResult

if TYPE_CHECKING:
    from rapidformer.reliability.guard import Decision

_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# DeepSpeed's default buckets are 500M elements: on a small model that reserves gigabytes of
# staging buffers the ZeRO formulas do not count. 50M keeps overlap without the waste.
_BUCKET = 50_000_000


def deepspeed_config(config: RapidformerConfig, dims: ParallelDims) -> dict[str, Any]:
    """The DeepSpeed config our flags mean."""
    stage = _STAGES[config.memory.sharding]  # validation requires one
    micro = config.data.micro_batch_size
    accumulation = dims.accumulation_steps(micro, config.data.global_batch_size)
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": _BUCKET,
        "allgather_bucket_size": _BUCKET,
    }
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=_BUCKET, stage3_param_persistence_threshold=0)
    if config.memory.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    precision = config.precision.precision
    clip = config.training.clip_grad
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * dims.dp,
        "gradient_clipping": clip if clip > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Our torch optimizer, not DeepSpeed's compiled ones (also under offload).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # rapidformer logs the steps
        "wall_clock_breakdown": False,
    }


class DeepSpeedForwardBackward(EagerForwardBackward):
    """DeepSpeed's engine runs every micro-batch's backward (the micro-batch loop is the eager
    one); see the module docstring."""

    name = "DeepSpeed engine"
    averaged_by = "self"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def forward_is_collective(self, state: TrainState) -> bool:
        # ZeRO-3 gathers each module's parameter partitions in its forward.
        stage3 = self.engine.zero_optimization_stage() == 3
        return bool(stage3) and process_group.is_distributed()

    def arm(self, state: TrainState, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, state: TrainState, loss: torch.Tensor) -> None:
        # The engine already weighted the loss for the whole step: no division by the
        # accumulation steps on top.
        self.engine.backward(loss, scale_wrt_gas=False)

    def rescale_gradients(self, state: TrainState, factor: torch.Tensor) -> None:
        if abs(float(factor) - 1.0) <= 1e-6:
            return  # every micro-batch weighed what the loss scale assumed: nothing to fix
        raise RapidformerError(
            "--zero-backend deepspeed: this step's micro-batches had different weights (or the "
            "step had fewer micro-batches than the accumulation steps), which engine.backward("
            "loss, weight=...) only learns after the forwards; DeepSpeed's gradients cannot be "
            "rescaled afterwards. Drive the step with engine.run_step(batches, StepFunctions("
            "train_step=..., weight=...)), which counts every micro-batch before its forward"
        )


class DeepSpeedStepper:
    """DeepSpeed clips, steps and zeroes the gradients; our schedule sets the learning rate."""

    name = "DeepSpeed engine"
    skips_on_device = False
    """DeepSpeed's step cannot take a device decision: the host decides, one read a step."""

    def __init__(self, engine: Any, fp16: bool) -> None:
        self.engine = engine
        self.fp16 = fp16

    def prepare(self, state: TrainState) -> PlanStep | None:
        return PlanStep(
            "step decision",
            "on the host, one read per step",
            "DeepSpeed's engine steps unless the host tells it otherwise",
        )

    def finish_gradients(self, state: TrainState) -> FinishedGradients:
        """Nothing to do: DeepSpeed's gradients live in its own partitioned buffers, which it
        reduces and clips in its step; the guard sees the losses only."""
        assert state.optimizer is not None
        return FinishedGradients(norm=None, overflow=None, lr=state.optimizer.param_groups[0]["lr"])

    def update(
        self, state: TrainState, gradients: FinishedGradients, decision: Decision, totals: Tensor
    ) -> StepResult:
        # DeepSpeed's step cannot be skipped from outside. fp16's loss scaler skips overflow
        # steps itself; in fp32/bf16 a non-finite loss stops the run before the step.
        assert decision.report is not None, "the engine reads a host decision first"
        why = decision.report.reason
        if why and not self.fp16:
            raise NonFiniteError(
                f"--zero-backend deepspeed: {why}; DeepSpeed cannot skip a step "
                "whose gradients it already holds, so the run stops before applying it (the "
                "parameters and the last checkpoint are intact). Fix: check the data and --lr, "
                "or use --zero-backend native, which skips such steps"
            )
        self.engine.step()
        skipped = not self.engine.was_step_applied()  # an fp16 overflow step
        if state.lr_scheduler is not None and not skipped:
            state.lr_scheduler.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        return StepResult.of(
            totals,
            grad_norm=grad_norm,
            lr=gradients.lr,
            skipped=skipped,
            stop=decision.stop,
        )

    def expected_bytes(self, state: TrainState) -> tuple[StateBytes, StateBytes]:
        return expected_state_bytes(self.engine)


def apply_deepspeed_optimizer(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """The optimizer DeepSpeed will step: ZeRO-Offload steps it on CPU partitions, so its
    states are built for the CPU (no CUDA-only kernels)."""
    device = torch.device("cpu") if config.memory.cpu_offload else None
    return apply_optimizer(state, config, mesh, device=device)


def apply_deepspeed(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    """Hand the model and the optimizer just built to ``deepspeed.initialize``."""
    import deepspeed

    assert state.optimizer is not None, "the optimizer is built before DeepSpeed takes it"
    # DeepSpeed insists on a process group, even for one process, and reads the launcher's
    # LOCAL_RANK, which a one-process run started without torchrun has not set.
    process_group.ensure_process_group(state.device)
    os.environ.setdefault("LOCAL_RANK", "0")
    # DeepSpeed logs every config key at INFO on every rank; our plan says what matters.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_config = deepspeed_config(config, mesh.dims)
    engine, _, _, _ = deepspeed.initialize(
        model=state.model,
        optimizer=state.optimizer,
        config=ds_config,
        dist_init_required=False,
    )
    stage = ds_config["zero_optimization"]["stage"]
    sharded = {1: "optimizer state", 2: "optimizer state, gradients"}.get(
        stage, "optimizer state, gradients, parameters"
    )
    detail = f"{sharded} sharded over {mesh.dims.dp} ranks; {type(engine.optimizer).__name__}"
    detail += f" stepping {type(state.optimizer).__name__}"
    if config.precision.precision != "fp32":
        detail += f"; {config.precision.precision} with fp32 master weights"
    if config.memory.cpu_offload:
        detail += "; ZeRO-Offload: optimizer state" + (" and parameters" if stage == 3 else "")
        detail += " on the CPU"
    state.plan.append(
        PlanStep(
            f"ZeRO-{stage} (DeepSpeed)",
            f"deepspeed {deepspeed.__version__} ZeRO stage {stage}",
            detail,
        )
    )
    state.model = engine
    state.forward_backward = DeepSpeedForwardBackward(engine)
    state.stepper = DeepSpeedStepper(engine, fp16=config.precision.precision == "fp16")
    state.checkpoint_format = DeepSpeedFormat(engine)
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """What --zero-backend deepspeed needs: DeepSpeed itself, a ZeRO stage to run, fp16 only
    on GPUs (checked only when the backend is chosen: engine/order.py). The switches DeepSpeed
    cannot run with say so in their own features (``refused_on``)."""
    if config.memory.zero_backend != "deepspeed":
        return
    flag = "--zero-backend"
    if context.on_this_machine and importlib.util.find_spec("deepspeed") is None:
        yield Violation(
            flag,
            "deepspeed",
            "DeepSpeed is not installed",
            "pip install 'rapidformer[deepspeed]', or use --zero-backend native",
        )
    if config.memory.sharding == "none":
        yield Violation(
            flag,
            "deepspeed",
            "the DeepSpeed backend runs a ZeRO stage and none was chosen",
            "add --sharding zero1, zero2 or zero3 (or --zero-N-memory-optimization)",
        )
    here = context.on_this_machine
    if here and config.precision.precision == "fp16" and not torch.cuda.is_available():
        yield Violation(
            flag,
            "deepspeed",
            "DeepSpeed runs fp16 (--precision fp16, --mixed-precision) only on GPUs and none "
            "is present",
            "use --precision bf16 or fp32 on this machine, or --zero-backend native",
        )


FEATURE = Feature("DeepSpeed ZeRO", flags=("--zero-backend",), rules=rules)
