"""The adapter on one linear layer: LoRA, DoRA and rsLoRA as a forward hook.

An adapted layer stays the layer it was (an ``nn.Linear``, or a subclass of it: torchao's
``Float8Linear``, a linear whose weight is NF4). It gains two children, ``lora_A`` (rank x in)
and ``lora_B`` (out x rank), a ``lora_dropout``, for DoRA a ``lora_magnitude_vector`` (one value
per output feature), and a forward hook that adds the adapter's term to what the layer
computed. Why a hook and not a wrapping module, as PEFT's ``base_layer`` is:

* the base keeps its names (``...q_proj.weight``): checkpoints of the base, the built-in
  models' init and the Hugging Face loaders see the model they know;
* whatever the layer is (float8, NF4, a DTensor-sharded weight), its own forward runs
  unchanged, and the adapter adds to its output;
* the adapter's parameter names are PEFT's with the prefix and adapter name dropped
  (``q_proj.lora_A.weight``), so the files PEFT reads and writes map one to one
  (:mod:`rapidformer.accel.lora.peft_format`).

``lora_A``/``lora_B`` are :class:`LoraProjection`, not ``nn.Linear``: fp8's conversion, tensor
parallelism's plans and "all-linear" target selection all look for linear layers, and none of
them must take an adapter's factor for one.

The terms, with ``s = alpha / rank`` (rsLoRA: ``alpha / sqrt(rank)``) and ``d`` the dropout:

* LoRA: ``y = base(x) + s * B(A(d(x)))``;
* DoRA (PEFT's formulation, DoRA section 4.3): with ``n = ||W + s*B@A||`` per output row,
  detached from the graph, and ``g = m / n``,
  ``y = base(x) + (g - 1) * (W d(x)) + g * s * B(A(d(x)))``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rapidformer.distributed.tensors import is_dtensor, local_part
from rapidformer.models.stages import assign_piece

ADAPTER_PARAMETER = ".lora_"
"""What names an adapter's parameter (``q_proj.lora_A.weight``): no base model holds one."""

SHAPE = "lora_shape"
"""The attribute holding an adapted layer's :class:`AdapterShape`."""

HOOK = "lora_hook"
"""The attribute holding the handle of an adapted layer's forward hook."""

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class AdapterShape:
    """What every adapter of a run shares."""

    rank: int
    alpha: float
    variant: str = "lora"
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        if self.variant == "rslora":
            return self.alpha / math.sqrt(self.rank)
        return self.alpha / self.rank


class LoraProjection(nn.Module):
    """One factor of an adapter: ``x @ weight.T``, no bias (deliberately not an ``nn.Linear``;
    see the module docstring)."""

    def __init__(
        self, in_features: int, out_features: int, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear layers, weight stored in
    x out). Checked against the class itself where transformers defined it: a model can hold
    one only once its module is loaded, so nothing is imported for the check."""
    defined = sys.modules.get("transformers.pytorch_utils")
    return defined is not None and isinstance(module, defined.Conv1D)


def features(linear: nn.Module) -> tuple[int, int]:
    """(input, output) features of a linear layer or a ``Conv1D``."""
    if is_conv1d(linear):
        rows, columns = base_weight(linear).shape
        return int(rows), int(columns)
    assert isinstance(linear, nn.Linear)
    return linear.in_features, linear.out_features


def attach(linear: nn.Module, shape: AdapterShape) -> None:
    """Give ``linear`` an adapter of ``shape``; its values are set by :func:`init_adapter`
    (or loaded). Kept on the device of the layer's weight (the meta device included) and in
    float32, whatever the base's dtype: the adapters and their optimizer state stay fp32."""
    weight = base_weight(linear)
    device = weight.device
    inputs, outputs = features(linear)
    linear.add_module("lora_A", LoraProjection(inputs, shape.rank, device))
    linear.add_module("lora_B", LoraProjection(shape.rank, outputs, device))
    if is_dtensor(weight):
        _shard_factors(linear, weight)
    dropout = nn.Dropout(shape.dropout) if shape.dropout > 0 else nn.Identity()
    linear.add_module("lora_dropout", dropout)
    if shape.variant == "dora":
        magnitude = nn.Parameter(torch.empty(outputs, device=device))
        linear.register_parameter("lora_magnitude_vector", magnitude)
    setattr(linear, SHAPE, shape)  # a plain attribute: read by the hook, merge and save
    setattr(linear, HOOK, linear.register_forward_hook(_add_adapter_term))


def tensor_parallel_style(weight: torch.Tensor) -> str | None:
    """``colwise`` or ``rowwise`` for a weight sharded on the output or input features of a
    one-dimensional (tensor-parallel) mesh, ``other`` for another layout, None when whole."""
    if not is_dtensor(weight):
        return None
    if len(weight.placements) != 1:
        return "other"
    placement = weight.placements[0]
    if placement.is_shard():
        return {0: "colwise", 1: "rowwise"}.get(placement.dim, "other")  # type: ignore[attr-defined]
    return "other"


def _shard_factors(linear: nn.Module, weight: DTensor) -> None:
    """The factors as DTensors on the weight's mesh, Megatron's way: a column-parallel layer
    (output features sharded) keeps A whole and shards B's rows; a row-parallel one (input
    features sharded) shards A's columns and keeps B whole. FSDP2 then shards them over the
    data-parallel ranks like the base, and checkpoints gather them like any DTensor."""
    style = tensor_parallel_style(weight)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # loaded: a DTensor

    placements = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate())}
    if style not in placements:
        raise ValueError(f"a weight laid out as {weight.placements} takes no adapter")
    for name, placement in zip(("lora_A", "lora_B"), placements[style], strict=True):
        factor = linear.get_submodule(name)
        assert isinstance(factor, LoraProjection)
        whole = factor.weight.detach()  # its values kept: each rank takes its piece
        local = distribute_tensor(whole, weight.device_mesh, [placement])
        factor.weight = nn.Parameter(local)


def follow_tensor_parallel(linear: nn.Module) -> None:
    """Re-lay an adapter whose layer was just split by torch's tensor-parallel styles (the
    built-in models' plan, applied with the adapters set aside): its factors sharded to match
    the weight, and its hook moved after the style's, so that it sees what a Hugging Face
    tensor-parallel layer gives: the layer's local output (a column shard, or the reduced
    whole), and an input it takes the local piece of."""
    weight = base_weight(linear)
    if is_dtensor(weight):
        _shard_factors(linear, weight)
    getattr(linear, HOOK).remove()
    setattr(linear, HOOK, linear.register_forward_hook(_add_adapter_term))


@dataclass(frozen=True)
class Parts:
    """An adapted layer's adapter, typed."""

    a: torch.Tensor
    b: torch.Tensor
    magnitude: torch.Tensor | None
    dropout: nn.Module
    shape: AdapterShape


def parts(linear: nn.Module) -> Parts:
    a, b = linear.get_submodule("lora_A"), linear.get_submodule("lora_B")
    assert isinstance(a, LoraProjection) and isinstance(b, LoraProjection)
    return Parts(
        a.weight,
        b.weight,
        getattr(linear, "lora_magnitude_vector", None),
        linear.get_submodule("lora_dropout"),
        getattr(linear, SHAPE),
    )


def is_adapted(module: nn.Module) -> bool:
    return isinstance(getattr(module, SHAPE, None), AdapterShape)


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> adapted layer, in module order."""
    return {name: m for name, m in model.named_modules() if is_adapted(m)}


@torch.no_grad()
def init_adapter(linear: nn.Module, generator: torch.Generator) -> None:
    """LoRA's initialisation: A as ``nn.Linear``'s default (Kaiming uniform with a = sqrt(5),
    drawn whole from ``generator`` so that any sharding holds the same values), B zero, so the
    adapted layer starts as the base; DoRA's magnitude is the base's row norms."""
    adapter = parts(linear)
    bound = 1.0 / math.sqrt(features(linear)[0])  # kaiming_uniform_(a=sqrt(5)) on fan_in
    values = torch.empty(adapter.a.shape, device=generator.device).uniform_(
        -bound, bound, generator=generator
    )
    assign_piece(adapter.a, values)
    adapter.b.zero_()
    if adapter.magnitude is not None:
        weight = dense_weight(linear)
        whole = weight.full_tensor() if is_dtensor(weight) else weight
        assign_piece(adapter.magnitude, torch.linalg.norm(whole.float(), dim=1))


def base_weight(linear: nn.Module) -> torch.Tensor:
    weight = linear.get_parameter("weight")
    assert weight is not None
    return weight


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The base weight as a plain out x in tensor (an NF4 weight dequantised, a ``Conv1D``'s
    transposed)."""
    weight = base_weight(linear)
    original = getattr(weight, "get_original_weight", None)
    dense = original() if callable(original) else weight
    return dense.t() if is_conv1d(linear) else dense


def _magnitude_scale(linear: nn.Module, adapter: Parts, dtype: torch.dtype) -> torch.Tensor:
    """DoRA's ``g = m / ||W + s*B@A||`` per output feature, the norm detached."""
    assert adapter.magnitude is not None
    delta = adapter.shape.scaling * (adapter.b.detach().float() @ adapter.a.detach().float())
    combined = dense_weight(linear).to(dtype) + delta.to(dtype)
    norm = torch.linalg.norm(combined, dim=1).detach()
    return adapter.magnitude / norm


def _add_adapter_term(
    linear: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
) -> torch.Tensor:
    adapter = parts(linear)
    # A DTensor under torch's tensor-parallel styles: the adapter works on its local piece.
    x = adapter.dropout(local_part(args[0]))
    if is_dtensor(adapter.a):
        return output + adapter.shape.scaling * _tensor_parallel_term(adapter, x, output)
    term = F.linear(F.linear(x, adapter.a), adapter.b)
    scaling = adapter.shape.scaling
    if adapter.magnitude is None:
        return output + scaling * term
    scale = _magnitude_scale(linear, adapter, x.dtype)
    if isinstance(adapter.dropout, nn.Identity):
        bias = getattr(linear, "bias", None)
        plain = output - bias if bias is not None else output
    else:
        plain = F.linear(x, dense_weight(linear).to(x.dtype))
    # The fp32 magnitude would promote the layer's output: it stays in the base's dtype.
    return (output + (scale - 1) * plain + scale * (scaling * term)).to(output.dtype)


def _tensor_parallel_term(adapter: Parts, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``B(A(x))`` of a tensor-parallel layer, on this rank's pieces. The layer's own input and
    output are plain tensors (transformers' tensor parallelism): a column-parallel layer sees the
    whole input and gives its shard of the output, a row-parallel one sees its shard of the input
    and gives the whole (reduced) output."""
    a, b = adapter.a, adapter.b
    assert is_dtensor(a) and is_dtensor(b)
    group = a.device_mesh.get_group()
    hidden = F.linear(x, a.to_local())
    if b.placements[0].is_shard():  # column-parallel: A whole, B's rows sharded
        hidden = _CopyToRanks.apply(hidden, group)
    else:  # row-parallel: each rank's columns of A give a partial sum
        hidden = _SumOverRanks.apply(hidden, group)
    term = F.linear(hidden, b.to_local())
    if term.shape != output.shape:
        raise RuntimeError(
            f"an adapter's term is {tuple(term.shape)} on this rank and the layer's output "
            f"{tuple(output.shape)}: its tensor-parallel style is not column- or row-parallel"
        )
    return term


class _CopyToRanks(torch.autograd.Function):
    """Forward: the same tensor on every rank. Backward: each rank's gradient holds only its
    output shard's share, so they are summed (Megatron's copy to the tensor-parallel region)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """Forward: the partial sums of every rank added up. Backward: the gradient, the same on
    every rank, passes as it is (Megatron's reduce from the tensor-parallel region)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@torch.no_grad()
def merged_weight(linear: nn.Module) -> torch.Tensor:
    """The out x in weight of the plain layer that computes what the adapted one does (no
    dropout)."""
    adapter = parts(linear)
    return merge(dense_weight(linear), adapter.a, adapter.b, adapter.magnitude, adapter.shape)


@torch.no_grad()
def merge(
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    magnitude: torch.Tensor | None,
    shape: AdapterShape,
) -> torch.Tensor:
    """``W + s*B@A`` (float32, out x in); for DoRA each row scaled to its magnitude."""
    merged = base.float() + shape.scaling * (b.float() @ a.float())
    if magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1, keepdim=True)
        merged = merged * (magnitude.float().unsqueeze(1) / norm)
    return merged
