"""Activation recomputation: transformer blocks keep less in forward and recompute in backward.

A block's forward normally keeps its intermediate activations (attention scores, the FFN's
hidden layer) until backward needs them. Recomputing keeps only what the policy says and runs
the rest of the forward again during backward: about one extra forward pass (~33% more
compute) at full granularity, for activation memory that no longer grows with the work inside
each block.

We use non-reentrant ``torch.utils.checkpoint``: it composes with DDP and autocast, works when
block inputs do not require grad, and keeps RNG state so dropout masks match on recompute.
Hugging Face models get their own ``activation_checkpointing_enable`` (called
``gradient_checkpointing_enable`` before transformers 5; same mechanism) when every layer
recomputes whole. Otherwise each chosen block's ``forward`` is patched instead of wrapping the
module, so state_dict keys do not change.

``--recompute-granularity`` (``--checkpoint-activations`` is ``full``)

* ``full``: a layer keeps only its input and runs its whole forward again in backward (what
  ``--checkpoint-activations`` does for every layer).
* ``selective``: an op-level policy through ``torch.utils.checkpoint``'s selective-checkpoint
  contexts. The outputs of the ops in :data:`SAVED_OPS` (matrix multiplications, attention and
  the MoE's grouped matmul: the expensive FLOPs) are kept from the forward; every other op
  (pointwise ops such as GELU, SiLU, adds and dropout, softmax outside fused attention, layer
  and RMS norms, casts) is recomputed in backward. Memory falls by what those ops held (the
  norms' inputs and outputs, the MLP's activation input and output, ...) for the price of
  cheap, memory-bound kernels: no matmul runs twice.

``--recompute-method`` with ``--recompute-num-layers N`` choose the layers:

* ``uniform``: all layers, in chunks of N consecutive layers; a chunk keeps only its input and
  recomputes all N layers (full granularity only: a chunk's op-level policy would be the same
  as N separate layers').
* ``block``: the first N layers of each model part (each pipeline stage) recompute; the rest
  keep everything (Megatron uses it to spend spare memory on speed).

Without a method every layer recomputes on its own. The layers are the repeated blocks
(:func:`rapidformer.models.blocks.find_blocks`), Hugging Face decoder layers included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from rapidformer.config.aliases import spellings
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.models.blocks import find_blocks
from rapidformer.models.forward_wrap import current_forward
from rapidformer.state import PlanStep, TrainState

aten = torch.ops.aten


def _existing(*names: str) -> frozenset[Any]:
    """The aten ops of these names that this torch has (attention kernels vary by release)."""
    return frozenset(getattr(aten, name) for name in names if hasattr(aten, name))


SAVED_OPS = _existing(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_grouped_mm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""Ops whose outputs selective recomputation keeps (``nn.Linear`` reaches the dispatcher as
``mm``/``addmm``, batched attention scores as ``bmm``); everything else is recomputed."""


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    saved = getattr(op, "overloadpacket", op) in SAVED_OPS  # aten.mm.default -> aten.mm
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options(granularity: str) -> dict[str, Any]:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` for a granularity."""
    options: dict[str, Any] = {"use_reentrant": False}
    if granularity == "selective":
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _selective_policy
        )
    return options


def recomputing(forward: Callable[..., Any], granularity: str) -> Callable[..., Any]:
    """``forward`` run under checkpoint with this granularity."""
    options = checkpoint_options(granularity)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **options, **kwargs)

    return run


def _pass_through(hidden: Any, *args: Any, **kwargs: Any) -> Any:
    """A layer whose work its chunk's first layer already did (uniform chunks)."""
    return hidden


def recompute_chunk(layers: list[nn.Module]) -> None:
    """Make ``layers`` (consecutive) one recomputed chunk: the first runs all of them inside one
    checkpoint (keeping only the chunk's input), the others pass its output on. Every layer must
    take the hidden states first and return them as one tensor, with the same other arguments
    (a decoder layer's mask and position embeddings are the same for every layer)."""
    forwards = [current_forward(layer) for layer in layers]  # weakly bound: see forward_wrap
    kind = type(layers[0]).__name__  # the closure must not reference the layers themselves

    def chain(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        for forward in forwards:
            hidden = forward(hidden, *args, **kwargs)
            if not isinstance(hidden, torch.Tensor):
                raise ConfigError.single(
                    "--recompute-method",
                    "uniform",
                    f"chunks of several layers need layers that return their hidden states as "
                    f"one tensor; {kind} returns {type(hidden).__name__}",
                    "use --recompute-num-layers 1, or --recompute-method block",
                )
        return hidden

    options = checkpoint_options("full")

    def run(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(chain, hidden, *args, **options, **kwargs)

    layers[0].forward = run
    for layer in layers[1:]:
        layer.forward = _pass_through


def apply_to_layers(layers: list[nn.Module], config: RapidformerConfig) -> str:
    """Recompute these layers (one model part's, in order) as the flags say; returns what was
    done, for the plan."""
    memory = config.memory
    granularity = memory.recompute_granularity
    assert granularity is not None
    method, count = memory.recompute_method, memory.recompute_num_layers
    if method is not None and count is not None and count > len(layers):
        raise ConfigError.single(
            "--recompute-num-layers",
            count,
            f"exceeds the {len(layers)} layers of this model part",
            f"use at most {len(layers)}",
        )
    if method == "uniform" and count is not None and count > 1:
        for start in range(0, len(layers), count):
            recompute_chunk(layers[start : start + count])
        return f"{len(layers)} layers in chunks of {count}"
    chosen = layers[:count] if method == "block" else layers
    for layer in chosen:
        layer.forward = recomputing(current_forward(layer), granularity)
    return f"{len(chosen)} of {len(layers)} layers"


def apply_recompute(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    """Recompute activations as the --recompute-* flags say."""
    memory = config.memory
    granularity = memory.recompute_granularity
    if granularity is None:
        return state
    model = state.model
    whole = granularity == "full" and memory.recompute_method is None
    if whole and getattr(model, "supports_gradient_checkpointing", False):
        # Every layer whole: the model's own switch (transformers >= 5 renamed the method;
        # older releases only have the second name).
        if hasattr(model, "activation_checkpointing_enable"):
            method = "activation_checkpointing_enable"
            model.activation_checkpointing_enable(  # type: ignore[operator]
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            method = "gradient_checkpointing_enable"
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        state.plan.append(
            PlanStep("activation checkpointing", "transformers", f"{method}, non-reentrant")
        )
        return state
    parts = [find_blocks(part) for part in state.model_parts]
    if not any(parts):
        raise ConfigError.single(
            "--recompute-granularity",
            granularity,
            f"found no transformer blocks in {type(model).__name__} to recompute",
            "keep the blocks in an nn.ModuleList or nn.ModuleDict (e.g. model.blocks), or drop "
            f"{spellings('recompute_granularity', granularity)}",
        )
    done = [apply_to_layers(layers, config) for layers in parts if layers]
    kind = next(type(layers[0]).__name__ for layers in parts if layers)
    policy = (
        "saves matmul and attention outputs, recomputes pointwise ops and norms"
        if granularity == "selective"
        else "each recomputed layer keeps only its input"
    )
    state.plan.append(
        PlanStep(
            "activation checkpointing",
            "torch.utils.checkpoint",
            f"{granularity} recompute, non-reentrant ({policy}): {'; '.join(done)} x {kind}",
        )
    )
    return state


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """The recompute flags fit together (Megatron's combinations)."""
    memory = config.memory
    granularity, method, count = (
        memory.recompute_granularity,
        memory.recompute_method,
        memory.recompute_num_layers,
    )
    if (method is not None or count is not None) and granularity is None:
        flag, value = (
            ("--recompute-method", method) if method else ("--recompute-num-layers", count)
        )
        yield Violation(flag, value, "needs --recompute-granularity", "add it (full or selective)")
    if method is not None and count is None:
        yield Violation(
            "--recompute-method", method, "needs --recompute-num-layers", "add it, e.g. 1"
        )
    if count is not None and method is None:
        yield Violation(
            "--recompute-num-layers", count, "needs --recompute-method", "add uniform or block"
        )
    if method == "uniform" and granularity == "selective":
        yield Violation(
            "--recompute-method",
            "uniform",
            "applies to full recomputation only (a chunk of selective layers recomputes what "
            "each layer alone would)",
            "use --recompute-granularity full, or --recompute-method block",
        )


FEATURE = Feature(
    "activation recomputation",
    flags=("--recompute-granularity", "--recompute-method", "--recompute-num-layers"),
    rules=rules,
)
