"""One rank of a run, composed on the meta device over a fake process group.

A rank's model state is decided by the same code a real run executes: :func:`compose_on_meta`
runs the canonical order (:mod:`rapidformer.engine.order`) on a model built on the meta device,
inside torch's ``fake`` process group (collectives return at once and move nothing), and stops
short of the steps that would allocate or need data: materialisation, DDP's wrapping (it
broadcasts real values) and the data loaders. The parameters each rank holds, its gradients and
its optimizer's partition are then those of the real run, and :meth:`Stepper.expected_bytes`
(the memory report a real run logs at start) counts them, to the byte.

Steps that change neither what a rank holds nor its activations, and cannot run on the meta
device, are left out and named in the report: compile (it would trace on meta tensors), ONNX
Runtime, fp8's float8 layers (estimated as bf16) and Liger's kernels. The DeepSpeed backend is
estimated with the native layout of the same ZeRO stage.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.dims import ParallelDims
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.engine.order import NATIVE_ORDER, Step
from rapidformer.state import TrainState
from rapidformer.step.forward_backward import EagerForwardBackward
from rapidformer.step.optimizer_step import TorchStepper

NOT_SIMULATED: dict[str, str] = {
    step.apply.__name__: step.not_simulated for step in NATIVE_ORDER if step.not_simulated
}
"""Steps of the native order a dry run skips, and why (declared in the order)."""

ACTIVATION_STEPS: tuple[Step, ...] = tuple(s for s in NATIVE_ORDER if s.shapes_activations)
"""The steps that change what one micro-batch's forward and backward keep on a rank (the
activation pass runs the model unsharded: FSDP's gathered parameters are counted apart). MoE
layers are left dense: their routing depends on the values, which the meta device has not."""

ModelBuilder = Callable[[], nn.Module]
"""Builds the whole model on the meta device."""


_GROUP_STATE = (
    "_pg_map",
    "_pg_names",
    "_pg_group_ranks",
    "_pg_backend_config",
    "_group_count",
    "_tags_to_pg",
    "_pg_to_tag",
)
"""torch.distributed's module-level group registries (its ``_world`` object reads them)."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """torch's ``fake`` process group as ``rank`` of ``world_size`` (none for one rank): no
    network, no peers, collectives return at once.

    A process that already has a process group (a notebook that trained, a DeepSpeed engine's
    group of one, which stays for the process's lifetime) keeps it: torch.distributed's group
    state is set aside for the simulation and put back after it, with the groups' names
    registered again (tearing the fake group down unregisters every name)."""
    # Each init wraps sys.excepthook to prefix "[rankN]: " to tracebacks; the simulated ranks
    # must not stack their prefixes on this process's.
    excepthook = sys.excepthook
    outer = _set_aside_groups() if dist.is_initialized() else None
    try:
        if world_size > 1:
            # No store: torch then uses its fake store (and registers the fake backend).
            dist.init_process_group("fake", rank=rank, world_size=world_size)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if outer is not None:
            _restore_groups(outer)
        sys.excepthook = excepthook


def _set_aside_groups() -> tuple[Any, dict[str, Any]]:
    saved = {name: getattr(c10d, name) for name in _GROUP_STATE}
    for name in saved["_pg_names"].values():  # the fake groups take the same names
        c10d._unregister_process_group(name)
    world = c10d._world
    c10d._world = c10d._World()
    for name, value in saved.items():
        setattr(c10d, name, 0 if isinstance(value, int) else type(value)())
    return world, saved


def _restore_groups(outer: tuple[Any, dict[str, Any]]) -> None:
    world, saved = outer
    c10d._world = world
    for name, value in saved.items():
        setattr(c10d, name, value)
    for group, name in c10d._pg_names.items():
        # The fake groups were named as the process's own are ("0", "1", ...): the names
        # must resolve to the process's groups again.
        try:
            registered = c10d._resolve_process_group(name)
        except (RuntimeError, ValueError):
            registered = None
        if registered is not group:
            if registered is not None:
                c10d._unregister_process_group(name)
            c10d._register_process_group(name, group)


def simulated_config(config: RapidformerConfig) -> RapidformerConfig:
    """The config the simulation composes: the native backend for DeepSpeed's ZeRO stage."""
    if config.memory.zero_backend == "deepspeed":
        return config.replace(zero_backend="native")
    return config


def compose_on_meta(
    config: RapidformerConfig,
    dims: ParallelDims,
    build: ModelBuilder,
    steps: tuple[Step, ...] = NATIVE_ORDER,
) -> TrainState:
    """Run ``steps`` (less those a dry run skips) for ``dims.rank`` on a meta-device model;
    call inside :func:`fake_world`."""
    mesh = ParallelMesh.build(dims, "cpu")
    config = simulated_config(config)
    state = TrainState(
        model=build(),
        device=torch.device("cpu"),
        mesh=mesh,
        forward_backward=EagerForwardBackward(),
        stepper=TorchStepper(config.training.clip_grad),
    )
    for step in steps:
        if not step.not_simulated:
            state = step.apply(state, config, mesh)
    return state
