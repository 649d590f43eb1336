"""torch.compile per transformer block, or of the whole model (``--torch-compile-scope``).

TorchDynamo traces a forward into a graph and TorchInductor generates fused kernels for it
(C++/OpenMP on CPU, Triton on CUDA), and for the backward that AOTAutograd derives.

* ``blocks`` (default): each repeated block is compiled. The first compile stays short (the
  blocks share one class, so one graph serves all of them); the embedding, the head, the loss
  and anything data-dependent stay eager.
* ``model``: every part this rank holds is compiled whole, head included; a template that owns
  its loss (``compute_loss``: the Pretrainer, the Finetuner) compiles that too, so the logits'
  upcast and the cross-entropy fuse instead of running as separate kernels.

Hugging Face models train with ``use_cache=False``
(:mod:`rapidformer.accel.compile.generation_cache`): their generation cache made every layer a
new guard and sent most blocks to eager. Whatever still recompiles past dynamo's limit is
reported loudly (:mod:`rapidformer.accel.compile.watch`).

Shapes: a graph is specialised to its input shapes (``dynamic=False``); a new shape costs one
more compile. With ``--data-iterator dynamic-shape`` the batches come in a bounded set of
bucket lengths, so the number of compiles is bounded by the number of buckets (and batch sizes),
not by the number of batches; the recompile limit is raised to cover every bucket so that no
bucket silently falls back to eager. ``--torch-compile-mode`` passes inductor's mode through
(``reduce-overhead`` adds CUDA graphs on GPUs; ``max-autotune`` benchmarks kernel choices).
``--torch-compile-cache-dir`` sets inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``), so a
second run of the same model skips most of the cold compile (~45 s on this project's CPUs).

Order: after activation checkpointing (the compiled graph contains the checkpoint, which
dynamo turns into a recompute region) and before DDP / sharding (which wrap the compiled
blocks). ``nn.Module.compile`` compiles in place: state_dict keys do not change.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import cast

import torch

from rapidformer.accel.compile.watch import CompileWatch
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.data.dynamic_shape import bucket_lengths
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.errors import ConfigError, Violation
from rapidformer.models.blocks import find_blocks
from rapidformer.state import PlanStep, TrainState

SPARE_COMPILES = 8
"""Compiles allowed beyond one per bucket (short last batches, train and eval modes)."""
LossFunction = Callable[..., torch.Tensor]
"""A template's ``compute_loss`` (its class's function: ``(template, outputs, batch)``)."""
BACKEND = "inductor"
"""torch.compile's backend (tests swap in ``"eager"``: the same graphs, no kernel generation)."""


def apply_compile(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    graph = config.graph
    if not graph.torch_compile:
        return state
    whole = graph.torch_compile_scope == "model"
    blocks = list(state.model_parts) if whole else _blocks(state)
    if not blocks:
        raise ConfigError.single(
            "--torch-compile",
            True,
            f"found no transformer blocks in {type(state.model).__name__} to compile",
            "keep the blocks in an nn.ModuleList or nn.ModuleDict (e.g. model.blocks), or drop "
            "the flag",
        )
    if graph.torch_compile_cache_dir is not None:
        os.makedirs(graph.torch_compile_cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(graph.torch_compile_cache_dir)
    shapes = "one shape per distinct input shape"
    if config.data.data_iterator == "dynamic-shape":
        model = config.model
        longest = model.seq_length or model.max_position_embeddings or 4096  # bounds the data
        buckets = len(bucket_lengths(longest))
        limit = max(torch._dynamo.config.recompile_limit, buckets + SPARE_COMPILES)
        torch._dynamo.config.recompile_limit = limit
        shapes = f"one graph per bucket: {buckets} buckets, recompile limit {limit}"
    mode = graph.torch_compile_mode if BACKEND == "inductor" else None
    for block in blocks:
        block.compile(backend=BACKEND, mode=mode, dynamic=False)
    state.monitors.append(CompileWatch(graph.torch_compile_scope))
    cache = graph.torch_compile_cache_dir or "inductor's default cache"
    what = "whole model" if whole else "blocks"
    state.plan.append(
        PlanStep(
            "compile",
            f"torch.compile ({BACKEND})",
            f"scope {graph.torch_compile_scope} ({what}: {len(blocks)} x "
            f"{type(blocks[0]).__name__}), mode {graph.torch_compile_mode}, {shapes}, cache "
            f"{cache}; graphs counted after the first step, eager fallbacks logged",
        )
    )
    return state


def compiled_loss(config: RapidformerConfig, loss: LossFunction) -> LossFunction:
    """``loss`` compiled where ``--torch-compile-scope model`` asks for the whole step's
    graph (a template that owns its loss calls this), else ``loss`` itself."""
    graph = config.graph
    if not graph.torch_compile or graph.torch_compile_scope != "model":
        return loss
    mode = graph.torch_compile_mode if BACKEND == "inductor" else None
    return cast(LossFunction, torch.compile(loss, backend=BACKEND, mode=mode, dynamic=False))


def _blocks(state: TrainState) -> list[torch.nn.Module]:
    return [block for part in state.model_parts for block in find_blocks(part)]


def rules(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
    """--torch-compile-mode, --torch-compile-cache-dir and --torch-compile-scope only mean
    something with --torch-compile."""
    graph = config.graph
    if graph.torch_compile:
        return
    if graph.torch_compile_mode != "default":
        yield Violation(
            "--torch-compile-mode", graph.torch_compile_mode, "needs --torch-compile", "add it"
        )
    if graph.torch_compile_cache_dir is not None:
        yield Violation(
            "--torch-compile-cache-dir",
            graph.torch_compile_cache_dir,
            "needs --torch-compile",
            "add it",
        )
    if graph.torch_compile_scope != "blocks":
        yield Violation(
            "--torch-compile-scope", graph.torch_compile_scope, "needs --torch-compile", "add it"
        )


FEATURE = Feature(
    "torch.compile",
    flags=(
        "--torch-compile",
        "--torch-compile-mode",
        "--torch-compile-cache-dir",
        "--torch-compile-scope",
    ),
    rules=rules,
    switched_on=lambda config: True if config.graph.torch_compile else None,
    refused_on={
        "deepspeed": "compiled blocks are not run under the DeepSpeed engine (its ZeRO-3 "
        "hooks and gradient hooks are untested with them)"
    },
)
