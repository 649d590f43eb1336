"""Materialise a model built on the meta device, once it is parallelised.

The built-in models are built on the meta device (no memory, no init work). Sharding (FSDP2),
tensor parallelism and pipeline stages then decide what each rank holds, and only that is
allocated here (``to_empty``, keeping every ``Parameter`` object, so ties and optimizers built
on the meta model stay valid) and initialised by the model's ``init_weights()``, which gives
each piece the value it has in the whole model built in one process for the same seed
(:func:`rapidformer.models.stages.init_parameters`). A rank never holds more than its share,
not even for a moment.

It sits after sharding (and tensor/pipeline parallelism) and before DDP (which broadcasts real
values from the first rank) and the optimizer (a fused optimizer refuses meta tensors). A model
that arrives materialised passes through unchanged.
"""

from __future__ import annotations

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError
from rapidformer.memory import held_bytes
from rapidformer.models.stages import materialize
from rapidformer.state import PlanStep, TrainState, base_alone


def apply_materialize(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    meta = [part for part in state.model_parts if any(p.is_meta for p in part.parameters())]
    if not meta:
        return state
    for part in meta:
        init = getattr(part, "init_weights", None)
        if not callable(init):
            raise ConfigError.single(
                "build_model()",
                type(part).__name__,
                "returned a model on the meta device that has no init_weights() method to "
                "initialise it once it is parallelised",
                "build the model on a real device, or give it an init_weights() that fills "
                "every parameter (and buffer)",
            )
        materialize(part, state.device)
        with base_alone(state, part):  # the model's init knows only its base
            init()
        if state.frozen_base is not None:
            state.frozen_base.additions.start(part)
    held = sum(held_bytes(p) for part in meta for p in part.parameters())
    state.plan.append(
        PlanStep(
            "materialise",
            f"meta device -> {state.device}",
            f"{held / 2**20:.2f} MiB of parameters allocated on this rank after "
            "parallelisation; init_weights() gives them the whole model's values for its seed",
        )
    )
    return state
