"""Activation checkpointing: recompute transformer blocks in the backward pass.

A block's forward normally keeps its intermediate activations (attention scores, the FFN's
hidden layer) until backward needs them. Checkpointing keeps only the block's inputs and
re-runs its forward during backward, trading about one extra forward pass (~33% more compute)
for activation memory that no longer grows with the work inside each block.

We use non-reentrant ``torch.utils.checkpoint``: it composes with DDP and autocast, works when
block inputs do not require grad, and keeps RNG state so dropout masks match on recompute.
Hugging Face models get their own ``activation_checkpointing_enable`` (called
``gradient_checkpointing_enable`` before transformers 5; same mechanism) when every layer
recomputes whole. Otherwise we patch each chosen block's ``forward`` instead of wrapping the
module, so state_dict keys do not change; selective recomputation and the choice of layers
are in :mod:`rapidformer.accel.recompute`.
"""

from __future__ import annotations

from torch import nn

from rapidformer.accel.recompute import apply_to_layers
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


def apply_activation_checkpointing(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """Recompute activations as --checkpoint-activations / --recompute-* say
    (:mod:`rapidformer.accel.recompute`)."""
    memory = config.memory
    granularity = memory.recompute
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
        flag = (
            "--recompute-granularity"
            if memory.recompute_granularity
            else ("--checkpoint-activations")
        )
        raise ConfigError.single(
            flag,
            memory.recompute_granularity or True,
            f"found no transformer blocks in {type(model).__name__} to recompute",
            "keep the blocks in an nn.ModuleList or nn.ModuleDict (e.g. model.blocks), or drop "
            "the flag",
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
