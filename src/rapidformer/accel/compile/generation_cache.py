"""Hugging Face models train without their generation cache.

Most transformers decoders default to ``config.use_cache = True``, and then build a
``DynamicCache`` in every training forward: memory and time spent on nothing, and under
``torch.compile`` each layer's cache object is a new guard, so the block graph recompiles per
layer until dynamo's recompile limit sends the remaining layers to eager. This step turns the
cache off before anything wraps the model; the plan says so, and saving
(:func:`rapidformer.models.hf.save_model`) and generation
(:func:`rapidformer.models.hf.generation_cache`) get the model's own setting back.
"""

from __future__ import annotations

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.models.hf import disable_generation_cache
from rapidformer.state import PlanStep, TrainState


def apply_no_generation_cache(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    changed = [part for part in state.model_parts if disable_generation_cache(part)]
    if changed:
        state.plan.append(
            PlanStep(
                "generation cache",
                "config.use_cache=False",
                f"{type(changed[0]).__name__} trains without its generation cache (saved "
                "models keep their own setting)",
            )
        )
    return state
