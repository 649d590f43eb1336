"""What lets the built-in models be built on the meta device and cut into pipeline stages.

:class:`StagedModel` is the mixin GPT and BERT share:

* **Stable names.** Blocks live in an ``nn.ModuleDict`` keyed by their layer index, so a stage
  that keeps layers 4-7 still calls them ``blocks.4`` ... ``blocks.7``: checkpoints written by
  stages, by tensor-parallel ranks or by one process use the same names and load into each other.
* **Stages.** :meth:`StagedModel.keep_stage` prunes a model in place to a contiguous range of
  layers; only the first stage keeps the embeddings, only the last the final norm and the heads.
  ``forward`` takes hidden states where the embeddings are gone and returns them where the head
  is gone.
* **The tied embedding / LM head under a split** (Megatron's treatment): the first stage keeps
  ``token_embeddings.weight``, the last keeps the same tensor as ``lm_head.weight``, now its own
  copy with the same initial value. Each copy gets the gradient of its own use; the sum of the
  two is the tied weight's gradient in the whole model, so the pipeline sums them over the
  ranks that hold the two copies before every step (see :attr:`StagedModel.tied_weights`), and
  equal updates keep the copies equal. On one stage (or no split) they stay one tensor.
* **Meta-device construction.** ``build(config, device="meta")`` allocates nothing; after
  parallelisation, :func:`materialize` allocates what this rank holds and
  :meth:`StagedModel.init_weights` initialises it with the values the whole model built on one
  process has for the same seed (:func:`init_parameters`), whether this rank holds a stage, a
  tensor-parallel shard or an FSDP2 shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from rapidformer.distributed.tensors import is_dtensor, local_part
from rapidformer.models.moe import GroupedExperts, reset_buffers

INIT_STD = 0.02
Model = TypeVar("Model", bound="StagedModel")


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Allocate a meta-device ``module``'s parameters on ``device`` (values uninitialised),
    keeping every ``Parameter`` object: tied weights stay tied and an optimizer built on the
    meta module stays valid. (A plain ``to_empty`` makes new Parameters.)"""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def init_parameters(
    model: nn.Module,
    reference: nn.Module,
    seed: int,
    residual_std: float | None = None,
    std: float = INIT_STD,
) -> None:
    """Initialise every parameter ``model`` holds with the value it has in ``reference`` (the
    whole model's structure, e.g. on the meta device) initialised from ``seed``.

    The random stream walks ``reference`` in module order and draws for every parameter,
    whether ``model`` holds it or not, so a stage, a tensor-parallel shard or an FSDP2 shard
    gets exactly the values of the whole model built in one process. Linear and Embedding
    weights ~ N(0, std), biases 0, LayerNorm weight 1 and bias 0; with ``residual_std`` the
    projections that write into the residual stream (``attention.out_proj``, ``ffn.fc2``) use
    that std (GPT-2's scaled init). A parameter with several names (tied weights) is drawn once
    and given to every local parameter of any of its names. The numbers come from a generator on
    the parameters' device: the same seed gives the same weights on the same kind of device.
    """
    local = dict(model.named_parameters(remove_duplicate=False))
    if not local:
        return
    device = local_part(next(iter(local.values()))).device
    generator = torch.Generator(device=device).manual_seed(seed)
    names: dict[int, list[str]] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    done: set[str] = set()

    def fill(param: torch.Tensor | None, kind: str, scale: float = std) -> None:
        if param is None or id(param) not in names:
            return
        aliases = names.pop(id(param))  # popped: a tied weight is drawn once
        values = torch.empty(param.shape, dtype=param.dtype, device=device)
        if kind == "normal":
            values.normal_(0.0, scale, generator=generator)
        else:
            values.fill_(1.0 if kind == "ones" else 0.0)
        for alias in aliases:
            if alias in local:
                assign_piece(local[alias], values)
                done.add(alias)

    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                residual = name.endswith(("attention.out_proj", "ffn.fc2"))
                scale = residual_std if residual and residual_std is not None else std
                fill(module.weight, "normal", scale)
                fill(getattr(module, "bias", None), "zeros")
            elif isinstance(module, nn.LayerNorm):
                fill(module.weight, "ones")
                fill(module.bias, "zeros")
            elif isinstance(module, GroupedExperts):  # stacked fc1 / fc2 of every expert
                fill(module.w1, "normal")
                fill(module.b1, "zeros")
                fill(module.w2, "normal", residual_std if residual_std is not None else std)
                fill(module.b2, "zeros")
    left = sorted(set(local) - done)
    if left:
        raise TypeError(f"init_parameters does not know how to initialise {left}")


def assign_piece(param: torch.Tensor, values: torch.Tensor) -> None:
    """``param = values``, for a DTensor only this rank's piece of them."""
    if not is_dtensor(param):
        param.copy_(values)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        values.shape, param.device_mesh, param.placements
    )
    piece = values[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    param.to_local().copy_(piece)


class StagedModel(nn.Module):
    """The mixin of the built-in models; see the module docstring. A subclass names its
    embedding and head modules and keeps its blocks in ``self.blocks`` (an ``nn.ModuleDict``
    keyed by layer index)."""

    embedding_modules: ClassVar[tuple[str, ...]] = ()
    """Attributes only the first stage keeps."""
    head_modules: ClassVar[tuple[str, ...]] = ()
    """Attributes only the last stage keeps."""
    blocks: nn.ModuleDict
    config: Any
    init_seed: int = 0
    """The seed :meth:`init_weights` uses unless given another (``build``'s)."""

    @classmethod
    def build(
        cls: type[Model], config: Any, device: str | torch.device = "cpu", seed: int = 0
    ) -> Model:
        """Construct on the meta device (no memory, no init work); unless ``device`` is
        ``"meta"``, allocate on ``device`` and initialise (:meth:`init_weights`). A meta model
        is initialised the same way once it is parallelised and materialised (the engine does
        both)."""
        with torch.device("meta"):
            model = cls(config)
        model.init_seed = seed
        if torch.device(device).type != "meta":
            materialize(model, device)
            model.init_weights()
        return model

    def check_length(self, length: int) -> None:
        """Refuse sequences the position embeddings do not cover."""
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )

    @property
    def tied_weights(self) -> dict[str, str]:
        """Parameter names that are one tensor in the whole model: copy -> original. When a
        split puts them on different stages, the copies' gradients must be summed."""
        return {}

    @property
    def is_first_stage(self) -> bool:
        return all(getattr(self, name) is not None for name in self.embedding_modules)

    @property
    def is_last_stage(self) -> bool:
        return all(getattr(self, name) is not None for name in self.head_modules)

    def keep_stage(self, layers: Iterable[int], *, first: bool, last: bool) -> StagedModel:
        """Prune this model in place to one pipeline stage holding ``layers`` (the others
        are deleted, the kept ones keep their names); the embeddings stay only if ``first``,
        the final norm and heads only if ``last``. Returns the model."""
        keep = {str(layer) for layer in layers}
        unknown = keep - set(self.blocks)
        if unknown:
            held = [int(name) for name in self.blocks]
            raise ValueError(f"no such layers {sorted(int(n) for n in unknown)} in {held}")
        for name in [n for n in self.blocks if n not in keep]:
            del self.blocks[name]
        # A tied head that stays without its embedding keeps the shared Parameter object: it
        # becomes the last stage's own copy, with the same name and value as before.
        for name in () if first else self.embedding_modules:
            setattr(self, name, None)
        for name in () if last else self.head_modules:
            setattr(self, name, None)
        return self

    def whole_model_reference(self) -> nn.Module:
        """The whole unsplit model's structure, on the meta device (no memory)."""
        with torch.device("meta"):
            return type(self)(self.config)

    def residual_std(self) -> float | None:
        """The std of the residual output projections (None: the same as the others)."""
        return None

    def init_weights(self, seed: int | None = None) -> None:
        """Initialise what this model holds (a whole model, a stage, or shards) with the whole
        model's values for ``seed`` (default: the seed it was built with)."""
        init_parameters(
            self,
            self.whole_model_reference(),
            self.init_seed if seed is None else seed,
            residual_std=self.residual_std(),
        )
        reset_buffers(self)
