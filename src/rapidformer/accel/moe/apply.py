"""Mixture of experts: MoE layers in the built-in models' FFN slots, expert parallelism, and
the per-step bookkeeping of routing.

``--num-experts E`` swaps the FFN of the layers ``--moe-layer-freq`` picks for an
:class:`~rapidformer.models.moe.MoELayer` (router, E experts, top-k). The swap is the first step
of the canonical order: the model is still on the meta device, its config gains the MoE spec
(so the whole-model reference that initialisation walks has the experts too), and pipeline
stages, tensor parallelism and sharding then see MoE blocks like any others. A built-in model
that arrives materialised is *upcycled* instead: every expert starts as a copy of the dense FFN
it replaces and the router is initialised fresh, so the model computes what it computed before.

**Expert parallelism** (``--expert-model-parallel-size P``, a sub-axis of dp): each rank of an
ep group holds E / P experts, as DTensors sharded on dim 0 over the ep mesh (checkpoints then
load on any other ep degree), and tokens reach them by all-to-all. Gradients are reduced by the
stepper, not DDP (DDP would average the different experts of the ep ranks): dense gradients are
averaged over dp, expert gradients summed over the expert-data-parallel ranks (those holding
the same experts) and divided by dp, since each already holds the contributions of the whole
ep group's tokens.

Around each step the engine calls :class:`~rapidformer.accel.moe.control.MoEControl` (loss
scales in, expert bias and statistics out); the flags' rules live in
:mod:`rapidformer.accel.moe.rules`, upcycling in :mod:`rapidformer.models.upcycling`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rapidformer.accel.moe.control import MoEControl
from rapidformer.accel.moe.rules import moe_enabled, moe_spec
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.distributed.tensors import local_part
from rapidformer.errors import ConfigError
from rapidformer.models.moe import MoELayer, MoESpec, expert_parameters, install_moe, moe_layers
from rapidformer.models.moe_router import MoERuntime
from rapidformer.models.upcycling import upcycle_in_place
from rapidformer.state import ExpertParallel, PlanStep, TrainState


def apply_moe(state: TrainState, config: RapidformerConfig, mesh: ParallelMesh) -> TrainState:
    if not moe_enabled(config):
        return state
    model = state.unwrapped_model
    model_config = getattr(model, "config", None)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or not hasattr(model_config, "moe"):
        raise ConfigError.single(
            "--num-experts",
            config.moe.num_experts,
            f"needs a model with MoE-ready FFN slots; {type(model).__name__} is not a built-in "
            "rapidformer GPT or BERT",
            "build the model with rapidformer.models (GPTModel / BertModel), fine-tune a "
            "Hugging Face MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE) without --num-experts, or "
            "drop --num-experts",
        )
    assert model_config is not None
    meta = any(p.is_meta for p in model.parameters())
    spec: MoESpec = model_config.moe or moe_spec(config, model_config.num_layers)
    if model_config.moe is None:
        model.config = dataclasses.replace(model_config, moe=spec)
        dense: dict[str, nn.Module] = {n: b.ffn for n, b in blocks.items()}  # type: ignore[misc]
        # GPT's FFN uses GELU-tanh, BERT's the erf GELU: the experts keep the dense one's.
        first = next(iter(dense.values()))
        approximate = getattr(getattr(first, "activation", None), "approximate", "tanh")
        with torch.device("meta" if meta else state.device):
            install_moe(blocks, spec, model_config.hidden_size, model_config.ffn_size, approximate)
        if not meta:
            upcycle_in_place(blocks, dense, config.training.seed)
    state.plan.append(
        PlanStep("mixture of experts", "rapidformer MoE", _describe(spec, mesh, meta))
    )
    return state


def apply_expert_parallel(
    state: TrainState, config: RapidformerConfig, mesh: ParallelMesh
) -> TrainState:
    """After the pipeline cut the model: give the layers this rank holds their shared runtime,
    and with ``--expert-model-parallel-size`` their ep group and their experts only."""
    layers = moe_layers(state.model_parts)  # also a model built with MoE layers of its own
    if not layers:
        return state
    runtime = MoERuntime()
    for layer in layers:
        layer.runtime = runtime
    _distribute_experts(layers, mesh)
    if mesh.dims.ep > 1:
        modules = tuple(layer.experts for layer in layers)
        state.experts = ExpertParallel(modules, mesh.group("edp"), mesh.dims.ep)
    state.moe = MoEControl(layers, runtime, mesh, config.moe.moe_router_bias_update_rate)
    experts = sum(_bytes(p) for p in expert_parameters(state.model_parts))
    dense = sum(_bytes(p) for p in state.parameters) - experts
    state.plan.append(
        PlanStep(
            "experts on this rank",
            f"{layers[0].num_experts // mesh.dims.ep} of {layers[0].num_experts} per layer",
            f"parameters before sharding: experts {experts / 2**20:.2f} MiB, dense "
            f"{dense / 2**20:.2f} MiB ({len(layers)} MoE layers held)",
        )
    )
    return state


def _bytes(param: torch.Tensor) -> int:
    local = local_part(param)
    return local.numel() * local.element_size()


def _describe(spec: MoESpec, mesh: ParallelMesh, meta: bool) -> str:
    if spec.capacity_factor is None:
        capacity = "dropless"
    else:
        capacity = f"capacity factor {spec.capacity_factor}, drop by {spec.drop_policy}"
    balancing: str = spec.balancing
    if balancing in ("aux_loss", "seq_aux_loss"):
        balancing += f" x {spec.aux_loss_coeff}"
    z = f", z-loss x {spec.z_loss_coeff}" if spec.z_loss_coeff else ""
    ep = mesh.dims.ep
    width = spec.ffn_hidden_size or "dense"
    return (
        f"{spec.num_experts} experts top-{spec.topk} (FFN width {width}) in layers "
        f"{list(spec.layers)}; router fp32 {spec.score}; {capacity}; balancing {balancing}{z}; "
        f"expert parallel {ep} ({spec.num_experts // ep} experts per rank"
        + (", all_to_all_single" if ep > 1 else "")
        + "); expert kernel: torch._grouped_mm for fp32/bf16 with dims multiple of 8 "
        "(bf16 on sm90+ GPUs), else a loop over experts"
        + ("" if meta else "; upcycled from the dense FFNs")
    )


def _distribute_experts(layers: list[MoELayer], mesh: ParallelMesh) -> None:
    """Expert parallelism: each ep rank keeps its E / P experts (DTensor Shard(0))."""
    ep_mesh = mesh.submesh("ep")
    if ep_mesh is None:
        return
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in layers:
        layer.ep_group = ep_mesh.get_group()
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(layer.experts, name, nn.Parameter(sharded))
