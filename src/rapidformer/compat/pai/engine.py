"""PAI-Rapidformer's ``RapidformerEngine`` and ``get_args`` over rapidformer's engine.

A PAI script builds the engine first (flags come from ``sys.argv``), then its model, loaders and
optimizer, then calls ``engine.compose(...)`` and writes its own loop::

    engine = RapidformerEngine()
    model, optimizer, lr_scheduler, train_loader, eval_loader = engine.compose(
        model=model, train_dataloader=..., optimizer=..., lr_scheduler_fn=...)
    for batch in train_loader:
        engine.backward(model(**batch).loss)
        lr_scheduler.step(); optimizer.step(); optimizer.zero_grad()

Here the real engine (:class:`rapidformer.engine.RapidformerEngine`) is built at ``compose``,
once it is known whether the script brings an optimizer. The optimizer handed back steps
through the engine (clipping, the non-finite guard, the fp16 scaler, accumulation over
micro-batches, the learning-rate schedule), so the loop's own ``lr_scheduler.step()`` and
``optimizer.zero_grad()`` have nothing left to do and do nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.config.aliases import ALIASES
from rapidformer.config.env import LaunchEnv
from rapidformer.config.loading import ArgsProvider, parse_args_with_extras
from rapidformer.config.root import RapidformerConfig
from rapidformer.engine.engine import RapidformerEngine as _Engine
from rapidformer.step_io import StepResult
from rapidformer.templates.batches import move_to_device

_ARGS: argparse.Namespace | None = None
_ENGINES: list[_Engine] = []  # the engine built last: what mpu's rank queries read


def get_args() -> argparse.Namespace:
    """The parsed flags, as PAI's ``get_args()``: every rapidformer field by its flag's name
    (``args.micro_batch_size``), the script's own flags, and ``rank``, ``local_rank``,
    ``world_size``, ``fp16``, ``bf16``."""
    if _ARGS is None:
        raise RuntimeError(
            "get_args() before RapidformerEngine(): create the engine first; it parses the flags"
        )
    return _ARGS


def current_engine() -> _Engine:
    if not _ENGINES:
        raise RuntimeError(
            "no rapidformer engine yet: mpu's queries answer once engine.compose() ran or "
            "the Finetuner / PreTrainer was built"
        )
    return _ENGINES[-1]


def register(engine: _Engine) -> None:
    _ENGINES[:] = [engine]


def _namespace(config: RapidformerConfig, extras: dict[str, Any]) -> argparse.Namespace:
    flat = {name: value for section in config.to_dict().values() for name, value in section.items()}
    env = LaunchEnv.read()
    precision = config.precision.precision
    derived = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "world_size": env.world_size,
        "fp16": precision == "fp16",
        "bf16": precision == "bf16",
    }
    # PAI's own spellings (--mixed-precision, --zero-2-memory-optimization, ...): each true
    # where the typed field holds the value it stands for.
    derived.update({alias.name: flat[alias.target] == alias.value for alias in ALIASES})
    return argparse.Namespace(**{**flat, **derived, **extras})


class RapidformerEngine:
    """PAI's engine: parses the flags at construction; see the module docstring."""

    def __init__(
        self,
        extra_args_provider: ArgsProvider | None = None,
        *,
        argv: Sequence[str] | None = None,
    ) -> None:
        global _ARGS
        self.config, extras = parse_args_with_extras(argv, extra_args_provider)
        _ARGS = _namespace(self.config, extras)
        self.engine: _Engine | None = None
        """rapidformer's engine, once compose() built it."""

    def compose(
        self,
        model: nn.Module,
        train_dataloader: DataLoader | None = None,
        eval_dataloader: DataLoader | None = None,
        optimizer: Optimizer | None = None,
        lr_scheduler_fn: Callable[[Optimizer], LRScheduler] | None = None,
    ) -> tuple[nn.Module, LoopOptimizer, LoopScheduler | None, Any, Any]:
        """Accelerate the script's objects; returns ``(model, optimizer, lr_scheduler,
        train_dataloader, eval_dataloader)`` as PAI does (loaders yield batches on the
        engine's device). Without an optimizer, the one ``--optimizers`` names (with
        ``--lr``)."""
        if self.engine is not None:
            raise RuntimeError("compose() was already called on this engine: call it once")
        engine = _Engine(self.config, builds_optimizer=optimizer is None)
        register(engine)
        self.engine = engine
        state = engine.compose(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler_fn)
        assert state.optimizer is not None
        scheduler = None if state.lr_scheduler is None else LoopScheduler(state.lr_scheduler)
        return (
            state.model,
            LoopOptimizer(engine, state.optimizer),
            scheduler,
            _on_device(state.train_dataloader, engine.device),
            _on_device(state.eval_dataloader, engine.device),
        )

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (the loop's ``loss.backward()``)."""
        self._engine().backward(loss)

    @property
    def is_main_process(self) -> bool:
        return LaunchEnv.read().rank == 0

    def _engine(self) -> _Engine:
        if self.engine is None:
            raise RuntimeError("engine.backward() before engine.compose(): compose first")
        return self.engine


class LoopOptimizer:
    """The optimizer a PAI loop steps: ``step()`` is the engine's step (it returns None in
    the middle of an accumulation); the engine clears the gradients after applying them, so
    ``zero_grad()`` does nothing (clearing mid-accumulation would lose micro-batches)."""

    def __init__(self, engine: _Engine, optimizer: Optimizer) -> None:
        self._engine = engine
        self.optimizer = optimizer
        self.last_result: StepResult | None = None
        """The engine's result of the last applied step (loss, gradient norm, skipped)."""

    def step(self, closure: Callable[[], Any] | None = None) -> StepResult | None:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported: call engine.backward")
        result = self._engine.step()
        if result is not None:
            self.last_result = result
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: see the class docstring."""

    def __getattr__(self, name: str) -> Any:  # param_groups, state_dict, ...
        return getattr(self.optimizer, name)


class LoopScheduler:
    """The schedule a PAI loop steps: the engine advances it with each applied step (not a
    skipped one), so the loop's ``step()`` does nothing."""

    def __init__(self, scheduler: LRScheduler) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: see the class docstring."""

    def __getattr__(self, name: str) -> Any:  # get_last_lr, state_dict, ...
        return getattr(self.scheduler, name)


class _OnDevice:
    """A loader whose batches arrive on the engine's device (PAI moved them)."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield move_to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, batch_size, ...
        return getattr(self.loader, name)


def _on_device(loader: DataLoader | None, device: torch.device) -> _OnDevice | None:
    return None if loader is None else _OnDevice(loader, device)
