"""Tensor parallelism: each layer's matrices split over the mesh's ``tp`` axis (DTensor).

The built-in models declare a plan (``model.tp_plan``: module-name patterns -> a
:data:`~rapidformer.models.layers.TPStyle`); this module turns it into
``torch.distributed.tensor.parallel`` styles and applies them to every part this rank holds
(a whole model, or its pipeline stages):

* Q/K/V and ``fc1`` column-parallel, ``out_proj`` and ``fc2`` row-parallel: two reductions per
  block forward (Megatron's layout);
* the token embedding vocab-parallel (each rank looks up its rows; the partial lookups are
  summed);
* the LM head column-parallel over the vocabulary with its output kept *sharded* (a DTensor
  ``Shard(-1)``): the loss runs under ``loss_parallel()``, a cross-entropy on the vocabulary
  shards that exchanges only per-token maxima and sums, never the full logits. The
  forward-backward slot enters that context around each micro-batch's loss and backward.

``--sequence-parallel`` adds Megatron's sequence parallelism: between the tensor-parallel
regions, activations (LayerNorms, dropout, the residual stream) are sharded along the sequence,
each row-parallel reduction becomes a reduce-scatter onto that shard, and each column-parallel
region starts with an all-gather of it (``sequence_input``). Position embeddings are looked up
sequence-sharded too. A pipeline stage then sends and receives the sequence shard.

Parallelising replaces Parameters by DTensor ones, which unties a tied embedding and LM head;
the model's ``tie_weights()`` ties them again (both are sharded on the vocabulary the same way).

Hugging Face models bring their own plan (``base_model_tp_plan``): the Finetuner loads them
with ``tp_plan="auto"`` on the tp mesh, and this step only reports it. A model without a plan is
refused before anything is built.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import is_dtensor
from rapidformer.errors import ConfigError, Violation
from rapidformer.state import PlanStep, TrainState, base_alone

HF_TP_FAMILIES = "Llama, Qwen2/Qwen3, Mistral, Mixtral, Gemma, Phi-3, OLMo2, GPT-NeoX"
"""Hugging Face families whose configs ship a ``base_model_tp_plan`` (transformers 5)."""

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def _style(kind: str, sequence_parallel: bool) -> ParallelStyle | None:
    """The torch style of one plan entry (None: the module stays replicated)."""
    # torch's DTensor packages are imported where a plan is applied: a run without tensor
    # parallelism does not wait for them.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)  # [batch, sequence, hidden]: the sequence dimension
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
    if kind == "vocab_parallel":
        output = seq if sequence_parallel else Replicate()
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=output)
    if kind == "vocab_logits":
        return ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,  # a DTensor: loss_parallel() reads the vocabulary shards
        )
    if not sequence_parallel:
        return None
    if kind == "position":
        # [positions, hidden] lookups of one sequence: dim 0 is the sequence.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if kind == "sequence_norm":
        return SequenceParallel()
    if kind == "sequence_input":
        return PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    raise ValueError(f"unknown tensor-parallel style {kind!r}")


def resolve_plan(
    model: nn.Module, plan: dict[str, str], sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The plan's patterns matched against the modules ``model`` holds (a pipeline stage holds
    only some of them)."""
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, ParallelStyle] = {}
    for pattern, kind in plan.items():
        for name in fnmatch.filter(names, pattern):
            style = _style(kind, sequence_parallel)
            if style is not None:
                styles[name] = style
    return styles


def has_tp_plan(model: nn.Module) -> bool:
    return isinstance(getattr(model, "tp_plan", None), dict)


def is_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> bool:
    """Whether ``model`` already holds DTensor parameters on ``tp_mesh`` (a Hugging Face model
    loaded with ``tp_plan="auto"``)."""
    return any(is_dtensor(p) and p.device_mesh == tp_mesh for p in model.parameters())


def _refuse(model: nn.Module) -> ConfigError:
    return ConfigError.single(
        "--tensor-model-parallel-size",
        "> 1",
        f"{type(model).__name__} declares no tensor-parallel plan (tp_plan)",
        "use the built-in GPT/BERT (rapidformer.models, --task pretraining), a Hugging Face "
        f"model whose config ships a base_model_tp_plan ({HF_TP_FAMILIES}), or give the "
        "model a tp_plan property",
    )


def apply_tensor_parallel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    tp_mesh = mesh.submesh("tp")
    if tp_mesh is None:
        return state
    from torch.distributed.tensor.parallel import parallelize_module

    sequence_parallel = config.parallel.sequence_parallel
    loss_parallel = False
    for part in state.model_parts:
        if is_tensor_parallel(part, tp_mesh):
            state.plan.append(
                PlanStep(
                    "tensor parallel",
                    "transformers tp_plan",
                    f"{mesh.dims.tp} ranks; the model's base_model_tp_plan, applied at load",
                )
            )
            return state
        if not has_tp_plan(part):
            raise _refuse(part)
        plan: dict[str, str] = part.tp_plan  # type: ignore[assignment]
        if sequence_parallel and "sequence_norm" not in plan.values():
            raise ConfigError.single(
                "--sequence-parallel",
                True,
                f"{type(part).__name__}'s tensor-parallel plan has no sequence-parallel regions",
                "drop --sequence-parallel (the built-in GPT supports it)",
            )
        # Parameters added onto the base (adapters) are split by their own rule, not the
        # weight's: torch's styles would split every parameter under a layer.
        with base_alone(state, part):
            parallelize_module(part, tp_mesh, resolve_plan(part, plan, sequence_parallel))
        if state.frozen_base is not None:
            state.frozen_base.additions.follow_split(part)
        tie = getattr(part, "tie_weights", None)
        if callable(tie):
            tie()  # DTensor Parameters replaced the tied one
        loss_parallel = loss_parallel or "vocab_logits" in plan.values()
    if loss_parallel:
        state.loss_parallel = True
    sharded = sum(1 for part in state.model_parts for p in part.parameters() if _is_sharded(p))
    detail = (
        f"{mesh.dims.tp} ranks; column/row-parallel attention and FFN, vocab-parallel "
        f"embedding; {sharded} parameter tensors sharded"
    )
    if loss_parallel:
        detail += "; vocab-parallel loss (loss_parallel, logits never gathered)"
    if sequence_parallel:
        detail += "; sequence parallel (norms and dropout sharded along the sequence)"
    state.plan.append(PlanStep("tensor parallel", "torch DTensor parallelize_module", detail))
    return state


def _is_sharded(param: Any) -> bool:
    return is_dtensor(param) and any(p.is_shard() for p in param.placements)


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """--sequence-parallel needs a tensor-parallel axis."""
    if config.parallel.sequence_parallel and context.dims.tp == 1:
        yield Violation(
            "--sequence-parallel",
            True,
            "sequence parallelism shards the tensor-parallel regions' activations and needs "
            "--tensor-model-parallel-size > 1",
            "add --tensor-model-parallel-size 2 (or more), or drop --sequence-parallel",
        )


FEATURE = Feature(
    "tensor parallel",
    flags=("--tensor-model-parallel-size", "--sequence-parallel"),
    rules=rules,
    switched_on=lambda config: (
        size if (size := config.parallel.tensor_model_parallel_size) > 1 else None
    ),
    refused_on={"deepspeed": "DeepSpeed ZeRO is not combined with tensor parallelism here"},
)
