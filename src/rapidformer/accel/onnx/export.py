"""Exporting a Trainer's ``train_step`` to ONNX and building its ONNX Runtime gradient graph.

The build half of ``--onnx-runtime-training`` (the runtime half is
:mod:`rapidformer.accel.onnx.training`). For each distinct batch signature (input names, dtypes and
shapes) a small module whose ``forward(*batch tensors)`` calls ``train_step`` is exported with
torch's legacy (TorchScript) ONNX exporter, in TRAINING mode (in EVAL mode the exporter merges
parameters whose *values* are equal, e.g. zero biases, into one initializer), at opset 17
without constant folding; its only output is the loss. Then
``onnxruntime.training.artifacts.generate_artifacts`` builds the gradient graph (the loss is the
graph's first output, so no loss block is added) and its checkpoint, with no optimizer graph;
every generated model's ``ir_version`` is lowered to 10 (onnx 1.23 writes 14, which
onnxruntime-training 1.19 cannot read).

Graph fixes before the gradient build (:mod:`rapidformer.accel.onnx.graph`): Dropout mask and
LayerNormalization statistics outputs, training_mode inputs, explicit Expand for broadcasting
Where inputs, double-cast ArgMax. After it: the ``padding_idx`` row of an embedding's gradient
is zeroed as torch does, unless the weight is tied to another use.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rapidformer.accel.onnx.graph import add_saved_outputs, expand_where_inputs, float_argmax
from rapidformer.errors import ConfigError, RapidformerError

OPSET = 17
"""The exporter's LayerNormalization (opset 17+) is one fused op; its gradient needs the
optional outputs that :func:`rapidformer.accel.onnx.graph.add_saved_outputs` adds (at opset 14
it is decomposed)."""
MAX_IR_VERSION = 10
"""The newest ONNX IR version onnxruntime-training 1.19 reads."""

StepFn = Callable[[Any], torch.Tensor]


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


class _Traced(nn.Module):
    """What is exported: ``forward(*tensors)`` rebuilds the batch and calls ``train_step``."""

    def __init__(
        self, model: nn.Module, step: StepFn, rebuild: Callable[[tuple[Any, ...]], Any]
    ) -> None:
        super().__init__()
        self.model = model
        self.step = step
        self.rebuild = rebuild

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.step(self.rebuild(tensors))


class OrtSession:
    """One exported graph, its ORT training module and the parameter name mapping."""

    def __init__(self, module: Any, state: Any, names: list[str | None], inputs: list[int]) -> None:
        self.module = module
        self.inputs = inputs
        """Indices of the batch tensors the graph takes (in order)."""
        self.state = state
        self.names = names
        """ORT parameter name of each torch parameter (None: unused by the graph)."""
        self.versions: list[int] | None = None
        """The torch parameters' versions when last copied into ORT (None: copy again)."""
        self.padding_rows: dict[int, int] = {}
        """Parameter index -> embedding row whose gradient is zeroed (see build)."""


class OrtExporter:
    """Builds one :class:`OrtSession` per batch signature for ``model``'s parameters."""

    def __init__(self, model: nn.Module, work_dir: Path) -> None:
        self.onnx, self.artifacts, self.api = import_ort()
        import onnxruntime

        self.ort = onnxruntime
        self.model = model
        self.params: list[tuple[str, nn.Parameter]] = list(model.named_parameters())
        self.padding_rows = _padding_rows(model, self.params)
        """Parameter index -> padding_idx of an nn.Embedding: torch's embedding backward
        skips that row, the exported Gather's gradient does not (the exporter warns)."""
        self.work_dir = work_dir
        self.exports = 0
        """Graphs exported so far (one per distinct input signature)."""

    def build(
        self,
        step: StepFn,
        keys: list[str],
        tensors: list[torch.Tensor],
        rebuild: Callable[..., Any],
    ) -> OrtSession:
        """Export ``step`` on this batch signature and build its gradient graph."""
        onnx = self.onnx
        traced = _Traced(self.model, step, rebuild)
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
        session = OrtSession(module, state, names, used)
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


def flatten_batch(
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
