"""--onnx-runtime-training: the forward and backward of ``train_step`` run in ONNX Runtime.

ORTModule (torch-ort) does not work with torch 2.13, so this uses onnxruntime-training's
on-device training API instead:

1. On the first micro-batch of each distinct set of input names, dtypes and shapes, a small
   module whose ``forward(*batch tensors)`` calls the Trainer's ``train_step`` is exported with
   torch's legacy (TorchScript) ONNX exporter, in TRAINING mode (in EVAL mode the exporter
   merges parameters whose *values* are equal, e.g. zero biases, into one initializer), at
   opset 17 without constant folding. Outputs: the loss and, when ``train_step`` returns it as
   a tensor, ``num_tokens``.
2. ``onnxruntime.training.artifacts.generate_artifacts`` builds the gradient graph (the
   exported loss is the graph's first output, so no loss block is added) and its checkpoint;
   no optimizer graph (see below). Every generated model's ``ir_version`` is lowered to 10:
   onnx 1.23 writes 14 into models it builds, which onnxruntime-training 1.19 cannot read.
3. Per micro-batch: the current torch parameter values are copied into the ORT checkpoint
   state (only after they changed, i.e. after an optimizer step), ORT runs forward and backward
   (``api.Module`` in train mode), its gradients are read from the state and its gradient
   buffers lazily reset. The loss comes back as a torch scalar attached to the torch parameters
   by :class:`_OrtLoss`, whose backward hands ORT's gradients (times the incoming gradient) to
   the parameters.

torch parameters stay the source of truth, so rapidformer's engine does what it always does
with the loss: count-weighted gradient accumulation, clipping, the optimizer step (torch's or
rapidformer's), the LR schedule, checkpoints; evaluation runs the torch model. ORT's generated
AdamW is not used: it is Hugging Face's formulation rather than torch's, and an earlier trial
saw it turn every parameter NaN (docs/onnxruntime.md has what was found).

Shapes: one ONNX graph per distinct input shape, exported without dynamic axes. The legacy
tracer can bake a shape into the graph (a ``view`` with Python ints, a Python ``num_tokens``),
which dynamic axes would then silently get wrong; with fixed-shape data that is one or two
exports (the last, shorter batch), with ``--data-iterator dynamic-shape`` one per bucket.

Graph fixes before the gradient build: every Dropout gets its mask output and every
LayerNormalization its mean and inverse-std outputs (their gradients read them; without them
the builder fails), every Dropout a training_mode input (the exporter's attention dropout
lacks it, which ONNX reads as "no dropout"); a Where input that broadcasts goes through an
explicit Expand (ORT's Where gradient does not sum a broadcast input's gradient back); int64
ArgMax/ArgMin read a double cast (ORT's CPU kernels have no int64 version). After it: the
``padding_idx`` row of an embedding's gradient is zeroed as torch does, unless the weight is
tied to another use.

Data parallel: DDP wraps the model but its forward never runs (the unwrapped model is traced),
so the Trainer calls :meth:`OrtTrainStep.sync_gradients` after a step's last backward to average
the gradients over the ranks, as DDP's hooks would have.

Limits (checked by :mod:`rapidformer.config.validate`): fp32; no sharding, offload, compile,
activation checkpointing, tensor/pipeline parallelism or experts.
``train_step`` must be traceable: tensor operations on the batch, no data-dependent Python
control flow. docs/onnxruntime.md has the details and the measurements.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from rapidformer.accel.onnx_graph import add_saved_outputs, expand_where_inputs, float_argmax
from rapidformer.distributed import process_group
from rapidformer.engine.state import PlanStep, TrainState
from rapidformer.errors import ConfigError, RapidformerError

OPSET = 17
"""The exporter's LayerNormalization (opset 17+) is one fused op; its gradient needs the
optional outputs that :func:`rapidformer.accel.onnx_graph.add_saved_outputs` adds (at opset 14
it is decomposed)."""
MAX_IR_VERSION = 10
"""The newest ONNX IR version onnxruntime-training 1.19 reads."""

StepFn = Callable[[Any], Any]


class OrtUnavailableError(RapidformerError, ImportError):
    """onnxruntime-training cannot be imported."""


class OrtBuildError(RapidformerError, RuntimeError):
    """train_step could not be exported or its gradient graph built."""


def import_ort() -> tuple[Any, Any, Any]:
    """``(onnx, onnxruntime.training.artifacts, onnxruntime.training.api)`` or a clear error."""
    try:
        import onnx
        from onnxruntime.training import api, artifacts
    except ImportError as error:
        raise OrtUnavailableError(
            "--onnx-runtime-training needs onnxruntime-training and onnx, which failed to "
            f"import ({error}). Install them with `pip install 'rapidformer[onnx]'`: "
            "onnxruntime-training has wheels for Python 3.10 and 3.11 only, and must not be "
            "installed together with the plain `onnxruntime` package (both provide the "
            "`onnxruntime` module; uninstall onnxruntime first)."
        ) from error
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # errors only: graph building logs at INFO
    return onnx, artifacts, api


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
    if ranks > 1:  # DDP's wrapper stays in the plan, but its hooks are idle
        engine += f", gradients averaged over {ranks} ranks by rapidformer instead of DDP"
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


class _Traced(nn.Module):
    """What is exported: ``forward(*tensors)`` rebuilds the batch and calls ``train_step``."""

    def __init__(
        self, model: nn.Module, step: StepFn, rebuild: Callable[[tuple[Any, ...]], Any]
    ) -> None:
        super().__init__()
        self.model = model
        self.step = step
        self.rebuild = rebuild
        self.constants: dict[str, Any] = {}
        """Non-tensor outputs seen while tracing (a Python ``num_tokens``): fixed per shape."""

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = self.step(self.rebuild(tensors))
        if isinstance(output, torch.Tensor):
            return (output,)
        loss, num_tokens = output["loss"], output.get("num_tokens")
        if num_tokens is None or isinstance(num_tokens, torch.Tensor):
            return (loss,) if num_tokens is None else (loss, num_tokens)
        self.constants["num_tokens"] = num_tokens
        return (loss,)


class _Session:
    """One exported graph, its ORT training module and the parameter name mapping."""

    def __init__(
        self,
        module: Any,
        state: Any,
        names: list[str | None],
        outputs: list[str],
        constants: dict[str, Any],
        inputs: list[int],
    ) -> None:
        self.module = module
        self.inputs = inputs
        """Indices of the batch tensors the graph takes (in order)."""
        self.state = state
        self.names = names
        """ORT parameter name of each torch parameter (None: unused by the graph)."""
        self.outputs = outputs
        self.constants = constants
        self.versions: list[int] | None = None
        self.padding_rows: dict[int, int] = {}
        """Parameter index -> embedding row whose gradient is zeroed (see _build)."""


class OrtTrainStep:
    """Replaces ``train_step(batch)`` by ORT's forward and backward; see the module docstring.

    ``step`` is the Trainer's ``train_step`` (it must use ``model``, the unwrapped module whose
    parameters the optimizer steps). Call it like ``train_step``: it returns ``{"loss",
    "num_tokens"}`` with a loss whose ``backward()`` gives the parameters ORT's gradients.
    """

    def __init__(
        self,
        step: StepFn,
        model: nn.Module,
        work_dir: str | Path | None = None,
        seed: int | None = None,
    ) -> None:
        self.onnx, self.artifacts, self.api = import_ort()
        import onnxruntime

        self.ort = onnxruntime
        if seed is not None:  # ORT's own generator draws the dropout masks
            onnxruntime.set_seed(seed)
        self.step = step
        self.model = model
        self.params: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        self.padding_rows = _padding_rows(model, self.params)
        """Parameter index -> padding_idx of an nn.Embedding: torch's embedding backward
        skips that row, the exported Gather's gradient does not (the exporter warns)."""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rapidformer-ort-")
            work_dir = self._tmp.name
        self.work_dir = Path(work_dir)
        self.sessions: dict[tuple[Any, ...], _Session] = {}
        self.exports = 0
        """Graphs exported so far (one per distinct input signature)."""

    def __call__(self, batch: Any) -> dict[str, Any]:
        keys, tensors, constants, rebuild = _flatten(batch)
        signature = tuple(
            (key, str(t.dtype), tuple(t.shape)) for key, t in zip(keys, tensors, strict=True)
        ) + tuple(constants)
        session = self.sessions.get(signature)
        if session is None:
            session = self._build(keys, tensors, rebuild)
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
        loss = _OrtLoss.apply(loss, grads, *(p for _, p in self.params))
        result: dict[str, Any] = {"loss": loss}
        if len(outputs) > 1:
            result["num_tokens"] = torch.from_numpy(np.asarray(outputs[1])).to(device)
        elif "num_tokens" in session.constants:
            result["num_tokens"] = session.constants["num_tokens"]
        return result

    def sync_gradients(self) -> None:
        """Average the accumulated gradients over the data-parallel ranks, as DDP's backward
        would (its hooks stay idle: its forward, which arms them, does not run). Call it once
        per optimizer step, after the last micro-batch's backward; a no-op on one process.
        Every rank's graph uses the same parameters, so the same gradients are present."""
        world = process_group.world_size()
        if world == 1:
            return
        grads = [p.grad for _, p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        process_group.all_reduce_sum(flat).div_(world)
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

    # ---- building ------------------------------------------------------------------------
    def _build(
        self, keys: list[str], tensors: list[torch.Tensor], rebuild: Callable[..., Any]
    ) -> _Session:
        onnx = self.onnx
        traced = _Traced(self.model, self.step, rebuild)
        input_names = [_onnx_name(key, i) for i, key in enumerate(keys)]
        buffer = io.BytesIO()
        was_training = self.model.training
        self.model.train()
        # The exporter runs the model once more while tracing: keep the RNG where eager is.
        rng = torch.random.get_rng_state()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    traced,
                    tuple(t.detach() for t in tensors),
                    buffer,  # type: ignore[arg-type]  # a file object works
                    dynamo=False,
                    training=torch.onnx.TrainingMode.TRAINING,
                    do_constant_folding=False,
                    opset_version=OPSET,
                    input_names=input_names,
                    export_params=True,
                )
        finally:
            torch.random.set_rng_state(rng)
            self.model.train(was_training)
        self.exports += 1
        model_proto = onnx.load_from_string(buffer.getvalue())
        outputs = [o.name for o in model_proto.graph.output]
        # Batch tensors train_step does not read are not graph inputs.
        graph_inputs = {i.name for i in model_proto.graph.input}
        used = [i for i, name in enumerate(input_names) if name in graph_inputs]
        initializers = {init.name for init in model_proto.graph.initializer}
        names: list[str | None] = []
        requires_grad: list[str] = []
        frozen: list[str] = []
        aliases: dict[int, list[str]] = {}  # tied weights have several names
        for torch_name, param in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append("model." + torch_name)
        for _, param in self.params:
            name = next((n for n in aliases[id(param)] if n in initializers), None)
            if name is None:
                names.append(None)  # not used by train_step (e.g. a pooler a task skips)
                continue
            names.append(name)
            (requires_grad if param.requires_grad else frozen).append(name)
        if not requires_grad:
            raise ConfigError.single(
                "--onnx-runtime-training",
                True,
                "the exported train_step uses none of the model's trainable parameters by "
                "name (they were renamed or folded into constants)",
                "make train_step call self.model on the batch, or drop the flag",
            )
        directory = self.work_dir / f"graph{self.exports}"
        directory.mkdir(parents=True, exist_ok=True)
        add_saved_outputs(model_proto)
        float_argmax(model_proto)
        expand_where_inputs(model_proto)
        with _native_stderr_to(directory / "generate_artifacts.log") as log_path:
            try:
                self.artifacts.generate_artifacts(
                    model_proto,
                    requires_grad=requires_grad,
                    frozen_params=frozen,
                    loss=None,  # the graph's first output is already the loss
                    optimizer=None,  # torch steps the parameters
                    artifact_directory=directory,
                )
            except Exception as error:
                raise OrtBuildError(
                    f"onnxruntime-training could not build the gradient graph of train_step "
                    f"({type(error).__name__}: {error}); its log is in {log_path}"
                ) from error
        for path in directory.glob("*.onnx"):
            generated = onnx.load(str(path))
            if generated.ir_version > MAX_IR_VERSION:
                generated.ir_version = MAX_IR_VERSION
                onnx.save(generated, str(path))
        state = self.api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # as many threads as torch
        try:
            module = self.api.Module(
                str(directory / "training_model.onnx"), state, session_options=options
            )
        except RuntimeError as error:
            raise OrtBuildError(
                f"onnxruntime-training could not load the gradient graph it built for "
                f"train_step ({error}); the graphs are in {directory}"
            ) from error
        module.train()
        session = _Session(module, state, names, outputs, dict(traced.constants), used)
        # Zero the padding row only where the weight feeds nothing but Gathers: a tied weight
        # (BERT's MLM decoder) gets gradient in that row from its other use too, which torch
        # keeps; there the row's Gather gradient stays (zero unless padding reaches the loss).
        users: dict[str, set[str]] = {}
        for node in model_proto.graph.node:
            for name in node.input:
                users.setdefault(name, set()).add(node.op_type)
        session.padding_rows = {
            index: row
            for index, row in self.padding_rows.items()
            if (name := names[index]) is not None and users.get(name) == {"Gather"}
        }
        return session

    def _load_parameters(self, session: _Session) -> None:
        """Copy the torch parameters into ORT when they changed since the last copy: after
        an optimizer step (see :func:`apply_onnxruntime`), or an in-place update that bumped
        a parameter's version (e.g. loading a checkpoint)."""
        versions = [p._version for _, p in self.params]
        if versions == session.versions:
            return
        parameters = session.state.parameters
        for name, (_, param) in zip(session.names, self.params, strict=True):
            if name is not None:
                parameters[name].data = np.ascontiguousarray(param.detach().cpu().numpy())
        session.versions = versions


@contextlib.contextmanager
def _native_stderr_to(path: Path) -> Iterator[Path]:
    """Send what native code writes to file descriptor 2 (ORT's graph-building INFO lines,
    which its logger settings do not silence) to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield path
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _padding_rows(model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> dict[int, int]:
    index = {id(param): i for i, (_, param) in enumerate(params)}
    rows = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, nn.Embedding)
            and module.padding_idx is not None
            and id(weight) in index
        ):
            rows[index[id(weight)]] = module.padding_idx
    return rows


def _onnx_name(key: str, index: int) -> str:
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return f"input_{index}_{cleaned}"


def _flatten(
    batch: Any,
) -> tuple[list[str], list[torch.Tensor], list[str], Callable[..., Any]]:
    """The batch's tensors, their key paths, the other values (as repr: they are fixed in the
    graph, so a new value means a new graph) and a function that puts new tensors back into
    the same structure."""
    keys: list[str] = []
    tensors: list[torch.Tensor] = []
    constants: list[str] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            keys.append(path)
            tensors.append(value)
            return len(tensors) - 1
        if isinstance(value, Mapping):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v, f"{path}.{i}") for i, v in enumerate(value))
        constants.append(f"{path}={value!r}")
        return _Constant(value)

    template = walk(batch, "batch")

    def rebuild(new: tuple[Any, ...]) -> Any:
        def fill(node: Any) -> Any:
            if isinstance(node, int) and not isinstance(node, bool):
                return new[node]
            if isinstance(node, _Constant):
                return node.value
            if isinstance(node, Mapping):
                return {k: fill(v) for k, v in node.items()}
            if isinstance(node, list | tuple):
                return type(node)(fill(v) for v in node)
            return node

        return fill(template)

    return keys, tensors, constants, rebuild


class _Constant:
    def __init__(self, value: Any) -> None:
        self.value = value


class _HasTrainStep(Protocol):
    model: nn.Module | None

    def train_step(self, batch: Any) -> Any: ...


def apply_onnxruntime(
    trainer: _HasTrainStep, state: TrainState, *, seed: int, log_plan: bool
) -> OrtTrainStep:
    """Build the ORT step for ``trainer.train_step`` and add it to the run plan (compose() has
    logged the plan already, so the step is logged as its continuation).

    ``train_step`` calls ``trainer.model``, which under DDP is the wrapper: while it is traced
    the unwrapped model takes its place, so that the graph holds the plain parameters and DDP's
    forward (which prepares its backward hooks) never runs; :meth:`OrtTrainStep.sync_gradients`
    averages the gradients over the ranks instead.
    """

    def step(batch: Any) -> Any:
        wrapped = trainer.model
        trainer.model = state.unwrapped_model
        try:
            return trainer.train_step(batch)
        finally:
            trainer.model = wrapped

    ort_step = OrtTrainStep(step, state.unwrapped_model, seed=seed)
    if state.optimizer is not None:
        # Fused/foreach optimizers update parameters in place without bumping their
        # version counters: mark them changed after every step.
        state.optimizer.register_step_post_hook(lambda *_: ort_step.parameters_changed())
    state.plan.append(plan_step(process_group.world_size()))
    if log_plan:
        from rapidformer.logging import log

        log.info("rapidformer plan, continued:\n  %d. %s", len(state.plan), state.plan[-1])
    return ort_step
