"""The per-step bookkeeping of MoE layers: loss scales in, expert bias and routing
statistics out.

:class:`MoEControl` is what the engine calls around each step (the train state's ``moe``
slot). Before a step it hands the layers the micro-batches' loss weights (the auxiliary losses
enter the gradients with the same weight as their micro-batch's loss). After it, with
``expert_bias`` balancing, it moves each expert's bias by ``rate x sign(mean load - load)``
from the step's assignment counts summed over dp (DeepSeek-V3's auxiliary-loss-free
balancing): one small all-reduce per step. At log intervals it reads the statistics, reduced
over dp (every rank routed its own tokens) and pipeline stages (each holds its own layers):
the only other collectives it adds. Nothing is read to the host inside a step.

With ``global_aux_loss`` it also runs :meth:`MoEControl.count_step` before each step: every
micro-batch's forward once more, without gradients and with the random state put back after,
counting each layer's expert choices; one all-reduce over dp then gives every rank the whole
global batch's counts before the first backward. That is one extra forward per step (about a
third of a step's compute): the price of a balance measured over the global batch exactly,
identically on every layout. (Megatron's ``global_aux_loss`` skips the pass and uses the
running mean of the counts of the micro-batches seen so far; its value then depends on how the
global batch is split into micro-batches and ranks.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rapidformer.distributed import process_group
from rapidformer.distributed.mesh import ParallelMesh
from rapidformer.models.moe import MoELayer
from rapidformer.models.moe_router import MoERuntime
from rapidformer.state import TrainState, loss_context
from rapidformer.step_io import StepFunctions


class MoEControl:
    """Loss scales in, expert bias and statistics out; see the module docstring."""

    def __init__(
        self, layers: list[MoELayer], runtime: MoERuntime, mesh: ParallelMesh, bias_rate: float
    ) -> None:
        self.layers = layers
        self.runtime = runtime
        self.mesh = mesh
        self.bias_rate = bias_rate
        self.steps = 0
        runtime.dp = mesh.dims.dp
        self.global_layers = [layer for layer in layers if layer.balancing == "global_aux_loss"]

    def begin_step(self, scales: torch.Tensor | None = None) -> None:
        self.runtime.begin_step(scales)

    def count_step(self, state: TrainState, batches: Sequence[Any], step: StepFunctions) -> None:
        """global_aux_loss: count the step's routing over every micro-batch and dp rank before
        its first backward (see the module docstring)."""
        if not self.global_layers:
            return
        device = state.device
        self.runtime.counting = True
        cuda = [device.index or 0] if device.type == "cuda" else []
        # The same dropout masks as the training forwards that follow: the RNG is put back.
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), loss_context(state):
            for batch in batches:
                step.train_step(batch)
        ids = [id(layer) for layer in self.global_layers]
        width = self.global_layers[0].num_experts + 1
        table = torch.stack(
            [
                self.runtime.counted.get(i, torch.zeros(width, dtype=torch.int64, device=device))
                for i in ids
            ]
        )
        table = process_group.all_reduce_sum(table.to(device), self.mesh.group("dp"))
        self.runtime.set_global_counts(dict(zip(ids, table, strict=True)))

    def set_current_scale(self, value: torch.Tensor) -> None:
        """Hand-written loops: the weight the last forward's micro-batch got at backward."""
        self.runtime.current_scale().value = value.detach()

    def after_step(self, applied: bool | torch.Tensor = True) -> None:
        """Move the expert biases (expert_bias balancing) from this step's loads, unless the
        step was skipped (``applied`` may be a device 0.0/1.0: then it masks the move)."""
        self.steps += 1
        biased = [layer for layer in self.layers if layer.router.expert_bias is not None]
        if biased and applied is not False:
            loads = torch.stack(
                [layer._stats(layer.router.gate.weight.device).step_counts for layer in biased]
            )
            loads = process_group.all_reduce_sum(loads, self.mesh.group("dp"))
            error = loads.mean(-1, keepdim=True) - loads
            with torch.no_grad():
                for layer, err in zip(biased, error, strict=True):
                    assert layer.router.expert_bias is not None
                    moved = layer.router.expert_bias + self.bias_rate * err.sign()
                    if isinstance(applied, torch.Tensor):  # skipped: keep the old biases
                        moved = torch.where(
                            applied.to(moved.device) > 0, moved, layer.router.expert_bias
                        )
                    layer.router.expert_bias.copy_(moved)
        for layer in self.layers:
            if layer.stats is not None:
                layer.stats.end_step()
        self.runtime.begin_step(None)

    def metrics(self) -> dict[str, Any]:
        """The statistics since the last call, over every rank (every rank calls it):
        ``moe_aux_loss`` (and ``moe_z_loss``: what the losses added to the objective per step,
        all MoE layers summed), ``moe_load_imbalance`` (worst layer's max / mean assignments an
        expert computed) with its per-layer list, and ``moe_dropped_fraction``."""
        steps = max(self.steps, 1)
        self.steps = 0
        rows = []
        for layer in self.layers:
            stats = layer.take_stats()
            stats.end_step()  # a step not finished by the engine (none, normally)
            counts = torch.stack(
                [stats.assigned, stats.dropped, stats.aux_total, stats.z_total]
            ).to(stats.received.device)
            rows.append(torch.cat([stats.received, counts]))
        table = _gather_layers(rows, self.layers, self.mesh)
        dp = self.mesh.dims.dp
        received, totals = table[:, :-4], table[:, -4:]
        imbalance = received.max(-1).values / received.mean(-1).clamp(min=1e-12)
        assigned = totals[:, 0].sum().clamp(min=1.0)
        result: dict[str, Any] = {
            "moe_aux_loss": float(totals[:, 2].sum()) / dp / steps,
            "moe_load_imbalance": float(imbalance.max()) if len(imbalance) else 0.0,
            "moe_load_imbalance_per_layer": [round(float(v), 4) for v in imbalance],
            "moe_dropped_fraction": float(totals[:, 1].sum() / assigned),
        }
        if any(layer.z_loss_coeff for layer in self.layers):
            result["moe_z_loss"] = float(totals[:, 3].sum()) / dp / steps
        return result


def _gather_layers(
    rows: list[torch.Tensor], layers: list[MoELayer], mesh: ParallelMesh
) -> torch.Tensor:
    """One row per MoE layer of the whole model, in layer order: summed over dp (each rank
    routed its own tokens) and over the pipeline stages, each of which fills the rows of the
    layers it holds (interleaved schedules give a rank layers that are not contiguous)."""
    indices = [layer.layer_index for layer in layers]
    device = rows[0].device if rows else torch.device("cpu")
    pp_group = mesh.group("pp")
    size = torch.tensor([max(indices, default=-1) + 1], device=device)
    if pp_group is not None:
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=pp_group)
    width = rows[0].numel() if rows else 0
    if pp_group is not None:  # a stage without MoE layers still learns the width
        known = torch.tensor([width], device=device)
        dist.all_reduce(known, op=dist.ReduceOp.MAX, group=pp_group)
        width = int(known)
    table = torch.zeros(int(size), width + 1, device=device)  # last column: held
    for index, row in zip(indices, rows, strict=True):
        table[index, :-1] = row
        table[index, -1] = 1.0
    table = process_group.all_reduce_sum(table, mesh.group("dp"))
    if pp_group is not None:
        table = process_group.all_reduce_sum(table, pp_group)
    return table[table[:, -1] > 0, :-1]
