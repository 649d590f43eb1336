"""Activation checkpointing: recompute each transformer block in the backward pass.

A block's forward normally keeps its intermediate activations (attention scores, the FFN's
hidden layer) until backward needs them. Checkpointing keeps only the block's inputs and
re-runs its forward during backward, trading about one extra forward pass (~33% more compute)
for activation memory that no longer grows with the work inside each block.

We use non-reentrant ``torch.utils.checkpoint``: it composes with DDP and autocast, works when
block inputs do not require grad, and keeps RNG state so dropout masks match on recompute.
Hugging Face models get their own ``activation_checkpointing_enable`` (called
``gradient_checkpointing_enable`` before transformers 5; same mechanism). We patch
each block's ``forward`` instead of wrapping the module, so state_dict keys do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError
from rapidformer.state import PlanStep, TrainState


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: children of every ``nn.ModuleList`` or ``nn.ModuleDict``
    (the built-in models keep a dict, so that a pipeline stage holding some layers keeps their
    names) whose members all share one class (outermost containers only)."""
    blocks: list[nn.Module] = []
    taken: set[str] = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or len(module) == 0:
            continue
        children = list(module.children())
        if len({type(child) for child in children}) == 1:
            blocks.extend(children)
            taken.add(name)
    return blocks


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    if not config.memory.checkpoint_activations:
        return state
    model = state.model
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers >= 5 renamed the method; older releases only have the first name.
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
    blocks = [block for part in state.model_parts for block in find_blocks(part)]
    if not blocks:
        raise ConfigError.single(
            "--checkpoint-activations",
            True,
            f"found no transformer blocks in {type(model).__name__} to checkpoint",
            "keep the blocks in an nn.ModuleList or nn.ModuleDict (e.g. model.blocks), or drop "
            "the flag",
        )
    for block in blocks:
        block.forward = _checkpointed(block.forward)
    state.plan.append(
        PlanStep(
            "activation checkpointing",
            "torch.utils.checkpoint",
            f"non-reentrant, {len(blocks)} x {type(blocks[0]).__name__}",
        )
    )
    return state
