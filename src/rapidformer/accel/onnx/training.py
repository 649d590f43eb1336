"""--onnx-runtime-training: the forward and backward of ``train_step`` run in ONNX Runtime.

ORTModule (torch-ort) does not work with torch 2.13, so this uses onnxruntime-training's
on-device training API instead. :mod:`rapidformer.accel.onnx.export` exports ``train_step`` per
batch signature and builds its gradient graph; this module runs it. Per micro-batch: the
current torch parameter values are copied into the ORT checkpoint state (once per optimizer
step), ORT runs forward and backward (``api.Module`` in train mode), its gradients are read from
the state and its gradient buffers lazily reset. The loss comes back as a torch scalar attached
to the torch parameters by :class:`_OrtLoss`, whose backward hands ORT's gradients (times the
incoming gradient) to the parameters.

torch parameters stay the source of truth, so everything else is unchanged: the engine's exact,
count-weighted accumulation (the loss is scaled before its backward), clipping, the optimizer
step (torch's or rapidformer's), the LR schedule, checkpoints; evaluation runs the torch model.
ORT's generated AdamW is not used: it is Hugging Face's formulation rather than torch's, and an
earlier trial saw it turn every parameter NaN (docs/onnxruntime.md has what was found).

It is the forward-backward slot (:class:`OrtForwardBackward`) of the train state. The exported
graph holds the plain module, so no DDP wraps it: with several data-parallel ranks the slot
averages the gradients over the data-parallel group itself after a step's last backward.

Shapes: one ONNX graph per distinct input shape, exported without dynamic axes. The legacy
tracer can bake a shape into the graph (a ``view`` with Python ints), which dynamic axes would
then silently get wrong; with fixed-shape data that is one or two exports (the last, shorter
batch), with ``--data-iterator dynamic-shape`` one per bucket.

Limits (checked by :func:`rules`): fp32; no sharding, offload, compile, activation
checkpointing, tensor/pipeline parallelism or experts; only the Trainer templates.
``train_step`` must be traceable: tensor operations on the batch, no data-dependent Python
control flow. docs/onnxruntime.md has the details and the measurements.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rapidformer.accel.onnx.export import OrtExporter, OrtSession, StepFn, flatten_batch
from rapidformer.config.aliases import spellings
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import Violation
from rapidformer.state import PlanStep, TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step_io import StepFunctions

FLAG = "--onnx-runtime-training"


def ort_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onnxruntime-training")
    except PackageNotFoundError:  # e.g. a source build
        import onnxruntime

        return str(onnxruntime.__version__)


def plan_step(ranks: int = 1) -> PlanStep:
    engine = (
        f"onnxruntime-training {ort_version()} training API (forward+backward), torch optimizer"
    )
    if ranks > 1:
        engine += f", gradients averaged over {ranks} data-parallel ranks by rapidformer"
    # The onnxruntime-training wheel is a CPU build: say so, above all on a GPU machine, where
    # every step copies parameters and gradients between the devices.
    detail = "CPU execution provider"
    if torch.cuda.is_available():
        detail += "; the model's parameters are on CUDA: each step copies them to the CPU"
    return PlanStep("ONNX Runtime training", engine, detail)


class _OrtLoss(torch.autograd.Function):
    """The loss ORT computed, attached to the torch parameters: backward returns ORT's
    gradients times the incoming gradient (None for parameters the graph does not use)."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, grads: list[torch.Tensor | None], *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grads = [None if g is None else g * grad_output.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (None, None, *grads)


class OrtTrainStep:
    """Replaces ``step(batch) -> loss`` by ORT's forward and backward.

    ``step`` must compute the loss with ``model``, the unwrapped module whose parameters the
    optimizer steps. Calling the instance returns a loss whose ``backward()`` gives the
    parameters ORT's gradients.
    """

    def __init__(
        self,
        step: StepFn,
        model: nn.Module,
        work_dir: str | Path | None = None,
        seed: int | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rapidformer-ort-")
            work_dir = self._tmp.name
        self.exporter = OrtExporter(model, Path(work_dir))
        self.ort = self.exporter.ort
        if seed is not None:  # ORT's own generator draws the dropout masks
            self.ort.set_seed(seed)
        self.step = step
        self.params = self.exporter.params
        self.sessions: dict[tuple[Any, ...], OrtSession] = {}

    @property
    def exports(self) -> int:
        """Graphs exported so far (one per distinct input signature)."""
        return self.exporter.exports

    def __call__(self, batch: Any) -> torch.Tensor:
        keys, tensors, constants, rebuild = flatten_batch(batch)
        signature = tuple(
            (key, str(t.dtype), tuple(t.shape)) for key, t in zip(keys, tensors, strict=True)
        ) + tuple(constants)
        session = self.sessions.get(signature)
        if session is None:
            session = self.exporter.build(self.step, keys, tensors, rebuild)
            self.sessions[signature] = session
        self._load_parameters(session)
        # ORT's own generator draws the dropout masks: seed it from torch's, whose state every
        # checkpoint saves per rank, so a resumed run draws the masks an uninterrupted one would.
        self.ort.set_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        inputs = [np.ascontiguousarray(tensors[i].detach().cpu().numpy()) for i in session.inputs]
        outputs = session.module(*inputs)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        parameters = session.state.parameters
        grads: list[torch.Tensor | None] = []
        for name, (_, param) in zip(session.names, self.params, strict=True):
            view = parameters[name].grad if name is not None else None
            if view is None:
                grads.append(None)
                continue
            # A copy: the array views ORT's gradient buffer, which its next call overwrites.
            grad = torch.tensor(view, device=param.device)
            if len(grads) in session.padding_rows:
                grad[session.padding_rows[len(grads)]] = 0.0
            grads.append(grad)
        session.module.lazy_reset_grad()
        device = self.params[0][1].device if self.params else torch.device("cpu")
        loss = torch.from_numpy(np.asarray(outputs[0], dtype=np.float32)).to(device)
        result: torch.Tensor = _OrtLoss.apply(loss, grads, *(p for _, p in self.params))
        return result

    def sync_gradients(self, group: process_group.Group) -> None:
        """Average the accumulated gradients over ``group`` (the data-parallel ranks), as
        DDP's backward would. Call it once per optimizer step, after the last micro-batch's
        backward; a no-op for a group of one. Every rank's graph uses the same parameters, so
        the same gradients are present."""
        if group is None:
            return
        grads = [p.grad for _, p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        process_group.all_reduce_sum(flat, group).div_(torch.distributed.get_world_size(group))
        chunks = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(chunks, grads, strict=True)])

    def parameters_changed(self) -> None:
        """Copy the torch parameters into ORT before the next forward (an optimizer step,
        a checkpoint load or any other update changed them)."""
        for session in self.sessions.values():
            session.versions = None

    def close(self) -> None:
        self.sessions.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _load_parameters(self, session: OrtSession) -> None:
        """Copy the torch parameters into ORT when they changed since the last copy: after
        an optimizer step (see :meth:`OrtForwardBackward.run`), or an in-place update that
        bumped a parameter's version."""
        versions = [p._version for _, p in self.params]
        if versions == session.versions:
            return
        parameters = session.state.parameters
        for name, (_, param) in zip(session.names, self.params, strict=True):
            if name is not None:
                parameters[name].data = np.ascontiguousarray(param.detach().cpu().numpy())
        session.versions = versions


class OrtForwardBackward(EagerForwardBackward):
    """The forward-backward slot under ``--onnx-runtime-training``: the eager micro-batch loop
    with ORT computing each loss and its gradients; see the module docstring."""

    name = "ONNX Runtime training"
    averaged_by = "self"

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model = model
        self.seed = seed
        self.ort_step: OrtTrainStep | None = None
        """Built around the step function at the first step (one per run)."""
        self._closed_exports = 0

    @property
    def exports(self) -> int:
        """Graphs exported so far (one per distinct batch signature)."""
        return self._closed_exports + (self.ort_step.exports if self.ort_step else 0)

    def forward_is_collective(self, state: TrainState) -> bool:
        return False

    def run(
        self, state: TrainState, batches: Sequence[Any], step: StepFunctions, scales: torch.Tensor
    ) -> torch.Tensor:
        if self.ort_step is None:
            self.ort_step = OrtTrainStep(step.train_step, self.model, seed=self.seed)
        # The parameters changed since the last step (the optimizer stepped, a checkpoint was
        # loaded): ORT gets the new values before this step's first forward.
        self.ort_step.parameters_changed()
        ort = dataclasses.replace(step, train_step=self.ort_step)
        losses = super().run(state, batches, ort, scales)
        self.ort_step.sync_gradients(state.mesh.group("dp"))  # what DDP's backward would do
        return losses

    def close(self) -> None:
        """Drop ORT's graphs and parameter copies, and their files."""
        if self.ort_step is not None:
            self._closed_exports += self.ort_step.exports
            self.ort_step.close()
            self.ort_step = None


def apply_onnxruntime(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """Make ONNX Runtime the forward-backward slot (no DDP around the model follows)."""
    if not config.graph.onnx_runtime_training:
        return state
    state.forward_backward = OrtForwardBackward(state.unwrapped_model, config.training.seed)
    state.plan.append(plan_step(mesh.dims.dp))
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """--onnx-runtime-training runs train_step's forward and backward in ONNX Runtime, torch
    steps the parameters (rapidformer.accel.onnx.training): whole, unsharded fp32 models, on one
    process or data-parallel ranks."""
    if not config.graph.onnx_runtime_training:
        return
    flag, dims, drop = FLAG, context.dims, f"drop {FLAG}"
    if not context.runs_loop:
        yield Violation(
            flag,
            True,
            "only the Trainer templates run train_step in ONNX Runtime; a hand-written "
            "loop calling the engine would train in torch and ignore the flag",
            "subclass Trainer (or Pretrainer / Finetuner), or drop the flag",
        )
    memory, precision = config.memory, config.precision.precision
    # Each switch ORT cannot run with, and why; the refusal names this flag.
    # Each switch ORT cannot run with: (on, spelled as the user may have typed it, why, fix).
    # The refusal names this flag, the other switch in its text.
    recompute = memory.recompute_granularity
    conflicts = [
        (
            memory.sharding != "none",
            spellings("sharding", memory.sharding),
            "ORT holds its own whole copy of the parameters",
            "--sharding none",
        ),
        (memory.cpu_offload, "--cpu-offload", "ORT keeps the parameters in its own memory", ""),
        (
            recompute is not None,
            spellings("recompute_granularity", recompute),
            "ORT's gradient graph decides what to keep; torch's checkpoint is not exported",
            "",
        ),
        (
            config.graph.torch_compile,
            "--torch-compile",
            "the forward and backward already run in ONNX Runtime, not in torch",
            "",
        ),
        (
            dims.tp > 1,
            f"--tensor-model-parallel-size {dims.tp}",
            "the exported graph is the whole model on one process",
            "--tensor-model-parallel-size 1",
        ),
        (
            dims.pp > 1,
            f"--pipeline-model-parallel-size {dims.pp}",
            "the exported graph is the whole model on one process",
            "--pipeline-model-parallel-size 1",
        ),
        (
            (config.moe.num_experts or 1) > 1,
            f"--num-experts {config.moe.num_experts}",
            "expert routing needs all-to-all collectives in the step",
            "",
        ),
        (
            precision != "fp32",
            spellings("precision", precision),
            "ORT trains in fp32: the exported graph would not contain torch's autocast",
            "--precision fp32",
        ),
    ]
    for on, other, why, fix in conflicts:
        if on:
            change = f"use {fix}" if fix else f"drop {other.split(' (')[0]}"
            yield Violation(flag, True, f"cannot run with {other}: {why}", f"{change}, or {drop}")
    if context.on_this_machine and not _ort_importable():
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


FEATURE = Feature("ONNX Runtime training", flags=(FLAG,), rules=rules)
