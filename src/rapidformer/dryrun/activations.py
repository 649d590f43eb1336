"""Activation memory of one micro-batch, measured by running it on the meta device.

The dry run does not guess activations from a formula: it runs the forward and backward of one
micro-batch through the model parts this rank holds, on the meta device (shapes and dtypes, no
memory, no arithmetic), and counts the bytes of every tensor the dispatcher hands out while it
is alive (:class:`LiveBytes`). What autograd saves, what recomputation recomputes in backward
and the transient tensors of the backward (the gradients flowing between layers) are therefore
those of the real model with the real switches (tensor-parallel shards, checkpointed layers,
the fused LM loss), counted exactly.

Two things differ between the meta device and a real one, and are put right here:

* **Attention.** On the meta device ``F.scaled_dot_product_attention`` takes torch's math path,
  which materialises the ``[batch, heads, seq, seq]`` scores; the GPU and CPU kernels (flash
  attention) keep only the output and a ``[batch, heads, seq]`` log-sum-exp. The attention call
  is routed to the fused kernel's own meta implementation.
* **Autocast** does not exist on the meta device. Under fp16/bf16 it is emulated where it
  matters for memory: matrix multiplications and attention run in 16 bits (so 16-bit copies are
  what they save), norms, softmax and the loss in fp32 (CUDA autocast's lists, in short).

Gradients of parameters are model state, counted elsewhere (:mod:`rapidformer.memory`): they
leave the activation count as soon as they are accumulated, and are followed apart, so that a
step of one micro-batch (whose gradients appear while its activations are freed) can be
estimated at its real peak.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from rapidformer.distributed.tensors import local_part


@dataclass(frozen=True)
class MicroBatchActivations:
    """Bytes one micro-batch costs a model part, apart from the parameters and their
    gradients."""

    kept: int
    """Alive once its forward is done: what it holds while it waits for its backward (what a
    pipeline stage holds per micro-batch in flight)."""
    peak: int
    """The most alive at once during its forward and backward (with the backward's transient
    gradients and any recomputation), parameters' gradients apart."""
    peak_with_gradients: int
    """The same, counting the parameters' gradients as they appear: a step's first
    micro-batch, which starts without any."""
    gradients: int
    """The parameters' gradients once its backward is done."""

    @property
    def beyond_gradients(self) -> int:
        """What a step of this one micro-batch holds at its peak beyond the whole gradients
        (the gradients appear while the activations are freed)."""
        return max(self.peak_with_gradients - self.gradients, 0)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage created under it while that storage lives."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.gradients = 0
        self.peak_with_gradients = 0
        self._sizes: dict[int, int] = {}
        self._gradients: set[int] = set()
        self._existing: set[int] = set()
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(local_part(tensor).untyped_storage())
        self.peak = max(self.peak, self.live)
        self.peak_with_gradients = max(self.peak_with_gradients, self.live + self.gradients)
        return out

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that exist already (parameters, buffers, inputs): a view of them (a
        weight's transpose) is no new memory."""
        for tensor in tensors:
            self._existing.add(local_part(tensor).untyped_storage()._cdata)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes or key in self._existing:  # a view of a storage we know
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def _freed(self, key: int, _: object) -> None:
        self.forget(key)

    def forget(self, key: int) -> None:
        """A storage was freed."""
        size = self._sizes.pop(key, 0)
        if key in self._gradients:
            self._gradients.discard(key)
            self.gradients -= size
        else:
            self.live -= size
        self._refs.pop(key, None)

    def as_gradient(self, tensor: torch.Tensor) -> None:
        """``tensor`` became a parameter's gradient: model state from now on."""
        key = local_part(tensor).untyped_storage()._cdata
        if key in self._sizes and key not in self._gradients:
            self._gradients.add(key)
            self.live -= self._sizes[key]
            self.gradients += self._sizes[key]


_LOW_PRECISION: tuple[tuple[Any, str], ...] = (
    (F, "linear"), (torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "addmm"),
    (torch, "baddbmm"), (F, "scaled_dot_product_attention"),
)  # fmt: skip
_FULL_PRECISION: tuple[tuple[Any, str], ...] = (
    (F, "layer_norm"), (F, "rms_norm"), (F, "softmax"), (F, "log_softmax"),
    (F, "cross_entropy"), (F, "nll_loss"),
)  # fmt: skip


@contextlib.contextmanager
def meta_kernels(dtype: torch.dtype | None) -> Iterator[None]:
    """Attention through the fused kernel's meta implementation, and autocast to ``dtype``
    (None: fp32, no autocast); see the module docstring.

    The functions are replaced in their modules for the duration (the models look them up at
    each call), not intercepted by a mode: a mode is not active where autograd recomputes a
    checkpointed layer in backward, and the recomputation must see the same kernels."""
    originals = {(owner, name): getattr(owner, name) for owner, name in _LOW_PRECISION}
    originals.update({(owner, name): getattr(owner, name) for owner, name in _FULL_PRECISION})
    attention = originals[(F, "scaled_dot_product_attention")]

    def casting(function: Any, target: torch.dtype | None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if target is not None:
                args, kwargs = _cast((args, kwargs), target)
            return function(*args, **kwargs)

        return call

    originals[(torch, "autocast")] = autocast = torch.autocast

    def meta_autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        # Models that switch autocast off around a region name their tensors' device, which
        # autocast does not know on the meta device; the CPU's has no effect there either.
        return autocast("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    try:
        torch.autocast = meta_autocast  # type: ignore[misc,assignment]
        for (owner, name), function in originals.items():
            if function is autocast:
                continue
            low = (owner, name) in _LOW_PRECISION
            if function is attention:
                function = functools.partial(_fused_attention, fallback=attention)
            target = (dtype if low else torch.float32) if dtype is not None else None
            setattr(owner, name, casting(function, target))
        yield
    finally:
        for (owner, name), function in originals.items():
            setattr(owner, name, function)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return tree_map(cast, tree)


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    fallback: Any,
    **extra: Any,
) -> torch.Tensor:
    """The fused kernel's output (it saves the output and a log-sum-exp, not the scores)."""
    if extra or not all(local_part(t).device.type == "meta" for t in (query, key, value)):
        return fallback(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return output


def measure_micro_batch(
    run: Callable[[], Any], module: nn.Module, inputs: Any, dtype: torch.dtype | None
) -> MicroBatchActivations:
    """Run ``run`` (one micro-batch's forward through ``module``, returning what ``backward``
    needs: a loss, or ``(output, gradient)`` for a stage that passes its output on) on meta
    tensors and count what it allocates (``module``'s parameters and buffers and the tensors in
    ``inputs`` exist already)."""
    parameters = list(module.parameters())
    counter = LiveBytes()
    existing = [*parameters, *module.buffers()]
    counter.ignore(
        [*existing, *(t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor))]
    )
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: counter.as_gradient(p.grad))
        for p in parameters
        if p.requires_grad
    ]
    try:
        with counter, meta_kernels(dtype):
            result = run()
            kept = counter.live
            if isinstance(result, tuple):
                output, gradient = result
                torch.autograd.backward(output, gradient)
            else:
                result.backward()
            del result
        figures = MicroBatchActivations(
            kept=kept,
            peak=counter.peak,
            peak_with_gradients=counter.peak_with_gradients,
            gradients=counter.gradients,
        )
    finally:
        for hook in hooks:
            hook.remove()
        for p in parameters:
            p.grad = None
    return figures
