"""PAI-Rapidformer's ``Finetuner``, ``PreTrainer`` and ``HuggingFaceTrainer`` on rapidformer's
:class:`~rapidformer.templates.trainer.Trainer`.

The PAI hooks map onto ours, so every switch and the loop (resume, evaluation, checkpoints,
stop signals) are rapidformer's:

=========================================================  ==================================
PAI hook                                                   rapidformer
=========================================================  ==================================
``train_valid_test_datasets_provider()`` (4-tuple)         ``build_data`` -> ``DataBundle``
``model_optimizer_lr_scheduler_provider()``                ``build_model`` (+ the optimizer
                                                           and schedule, when not None)
``run_forward_step(batch, model)`` -> loss or              ``train_step(batch)``
``(output_tensor, loss_func)``
``run_compute_metrics(model, eval_dataloader)``            ``evaluate`` (after eval_loss)
``self.gather(tensor)``                                    an all-gather over data parallel
``.train()``                                               ``fit()``
=========================================================  ==================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from rapidformer.compat.pai.engine import RapidformerEngine, _on_device, register
from rapidformer.errors import HookError
from rapidformer.state import TrainState
from rapidformer.templates.trainer import DataBundle, Trainer

Provided = tuple[nn.Module, Optimizer | None, LRScheduler | None]


class _PaiTemplate(Trainer):
    """What PAI's Finetuner and PreTrainer share: built from a PAI engine, run by train()."""

    def __init__(self, engine: RapidformerEngine) -> None:
        if not isinstance(engine, RapidformerEngine):
            raise TypeError(
                f"{type(self).__name__}(engine=...) takes rapidformer.compat.pai's "
                f"RapidformerEngine(), not {type(engine).__name__}"
            )
        self.pai_engine = engine
        self._provided: Provided | None = None
        super().__init__(config=engine.config)
        register(self.engine)

    # ---- the PAI hooks -------------------------------------------------------------------
    def model_optimizer_lr_scheduler_provider(self) -> Provided:
        raise HookError(
            f"{type(self).__name__} must implement model_optimizer_lr_scheduler_provider(self) "
            "returning (model, optimizer or None, lr_scheduler or None)"
        )

    def run_forward_step(self, batch_or_data_iterator: Any, model: nn.Module) -> Any:
        raise HookError(
            f"{type(self).__name__} must implement run_forward_step(self, batch, model) "
            "returning the loss, or (output_tensor, loss_func)"
        )

    def run_compute_metrics(self, model: list[nn.Module], eval_dataloader: Any) -> dict[str, Any]:
        """Metrics beyond eval_loss; the model arrives as a list (``model[0]``)."""
        return {}

    def train(self) -> dict[str, float]:
        """Train as the flags say (PAI's name for :meth:`fit`)."""
        return self.fit()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from every data-parallel rank, concatenated along dim 0."""
        return gather_over_data_parallel(tensor, self)

    # ---- rapidformer's hooks, from the PAI ones ------------------------------------------
    def _provide(self) -> Provided:
        if self._provided is None:
            provided = self.model_optimizer_lr_scheduler_provider()
            if not (isinstance(provided, tuple) and len(provided) == 3):
                raise HookError(
                    f"{type(self).__name__}.model_optimizer_lr_scheduler_provider must return "
                    f"(model, optimizer or None, lr_scheduler or None), not {provided!r:.80}"
                )
            self._provided = provided
        return self._provided

    def build_model(self) -> nn.Module:
        return self._provide()[0]

    def _prebuilt_optimizer(self) -> Optimizer | None:
        return self._provide()[1]

    def build_lr_scheduler(self, optimizer: Optimizer, total_steps: int) -> LRScheduler:
        scheduler = self._provide()[2]
        if scheduler is None:
            return super().build_lr_scheduler(optimizer, total_steps)
        # Sharding may have rebuilt the optimizer over new parameters: same groups, same order.
        scheduler.optimizer = optimizer
        return scheduler

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        return _loss(self.run_forward_step(self._forward_input(batch), self.model), self)

    def _forward_input(self, batch: Any) -> Any:
        return batch

    def evaluate(self, state: TrainState) -> dict[str, float]:
        metrics = super().evaluate(state)
        model = state.unwrapped_model
        model.eval()
        try:
            with torch.no_grad():
                extra = self.run_compute_metrics(
                    [model], _on_device(state.eval_dataloader, self.device)
                )
        finally:
            state.model.train()
        return {**metrics, **{key: _number(value, key) for key, value in dict(extra).items()}}


class Finetuner(_PaiTemplate):
    """PAI's Finetuner: ``train_valid_test_datasets_provider(self)`` returns ``(train, valid,
    test, collate_fn)``; ``run_forward_step(self, batch, model)`` gets a batch."""

    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        raise HookError(
            f"{type(self).__name__} must implement train_valid_test_datasets_provider(self) "
            "returning (train_dataset, valid_dataset, test_dataset, collate_fn)"
        )

    def build_data(self) -> DataBundle:
        provided = self.train_valid_test_datasets_provider()
        if not (isinstance(provided, tuple) and len(provided) == 4):
            raise HookError(
                f"{type(self).__name__}.train_valid_test_datasets_provider must return "
                "(train_dataset, valid_dataset, test_dataset, collate_fn)"
            )
        train, valid, test, collate_fn = provided
        return DataBundle(train, valid, test, collate_fn)


class PreTrainer(_PaiTemplate):
    """PAI's PreTrainer: ``train_valid_test_datasets_provider(self, train_val_test_num_samples)``
    returns three datasets (Megatron's sample counts); ``run_forward_step(self,
    data_iterator, model)`` draws its micro-batch with ``next(data_iterator)``."""

    def train_valid_test_datasets_provider(
        self, train_val_test_num_samples: list[int]
    ) -> tuple[Any, Any, Any]:
        raise HookError(
            f"{type(self).__name__} must implement train_valid_test_datasets_provider(self, "
            "train_val_test_num_samples) returning (train_dataset, valid_dataset, test_dataset)"
        )

    def build_data(self) -> DataBundle:
        provided = self.train_valid_test_datasets_provider(self.num_samples())
        if not (isinstance(provided, tuple) and len(provided) == 3):
            raise HookError(
                f"{type(self).__name__}.train_valid_test_datasets_provider must return "
                "(train_dataset, valid_dataset, test_dataset)"
            )
        return DataBundle(*provided)

    def num_samples(self) -> list[int]:
        """Megatron's counts: train for every step, valid for each evaluation, test once."""
        training, data = self.config.training, self.config.data
        batch = data.global_batch_size or data.micro_batch_size * self.engine.dims.dp
        iters = training.train_iters or 0
        eval_iters = training.eval_iters or 0
        evaluations = iters // training.eval_interval + 1 if training.eval_interval else 1
        return [iters * batch, evaluations * eval_iters * batch, eval_iters * batch]

    def _forward_input(self, batch: Any) -> Iterator[Any]:
        return iter([batch])


class HuggingFaceTrainer(Trainer):
    """PAI's HuggingFaceTrainer: a transformers model whose forward returns its loss, datasets
    of tokenized examples, and ``compute_metrics``: a ``datasets``/``evaluate`` metric (its
    ``compute(predictions=, references=)`` gets the argmax of the logits) or a function of a
    ``transformers.EvalPrediction``."""

    def __init__(
        self,
        engine: RapidformerEngine,
        model: nn.Module,
        train_dataset: Dataset,
        eval_dataset: Dataset | None = None,
        compute_metrics: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise TypeError(
                f"HuggingFaceTrainer got {sorted(unsupported)}: pass training settings as "
                "rapidformer flags (rapidformer --help), e.g. --lr, --epochs, --save"
            )
        self.pai_engine = engine
        self._model, self._train, self._eval = model, train_dataset, eval_dataset
        self._metric, self._collate = compute_metrics, data_collator
        super().__init__(config=engine.config)
        register(self.engine)

    def build_model(self) -> nn.Module:
        return self._model

    def build_data(self) -> DataBundle:
        return DataBundle(self._train, self._eval, None, self._collate)

    def train(self) -> dict[str, float]:
        return self.fit()

    def train_step(self, batch: Any) -> torch.Tensor:
        assert self.model is not None
        outputs = self.model(**batch)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise HookError(
                "HuggingFaceTrainer's model returned no loss: its batches need 'labels' "
                "(rename the label column to 'labels')"
            )
        return loss

    def eval_step(self, batch: Any) -> dict[str, Any]:
        assert self.model is not None
        outputs = self.model(**batch)
        return {"loss": outputs["loss"], "logits": outputs["logits"], "labels": batch["labels"]}

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        if self._metric is None or not outputs:
            return {}
        predictions = torch.cat([o["logits"].argmax(-1) for o in outputs])
        labels = torch.cat([o["labels"] for o in outputs])
        predictions, labels = self.gather(predictions), self.gather(labels)
        if hasattr(self._metric, "compute"):
            result = self._metric.compute(
                predictions=predictions.cpu().numpy(), references=labels.cpu().numpy()
            )
        else:
            from transformers import EvalPrediction

            result = self._metric(
                EvalPrediction(
                    predictions=predictions.cpu().numpy(), label_ids=labels.cpu().numpy()
                )
            )
        return {key: _number(value, key) for key, value in dict(result).items()}

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from every data-parallel rank, concatenated along dim 0."""
        return gather_over_data_parallel(tensor, self)


def gather_over_data_parallel(tensor: torch.Tensor, trainer: Trainer) -> torch.Tensor:
    """``tensor`` from every data-parallel rank, concatenated along dim 0 in rank order
    (shards may differ in length: each is padded to the longest for the all-gather)."""
    group = trainer.engine.mesh.group("dp")
    if group is None or not dist.is_initialized():
        return tensor
    world = dist.get_world_size(group)
    length = torch.tensor([tensor.shape[0]], device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def _loss(output: Any, trainer: Trainer) -> torch.Tensor:
    """The loss of ``run_forward_step``: a tensor, a dict's 'loss', or Megatron's
    ``(output_tensor, loss_func)`` where ``loss_func(output_tensor)`` returns
    ``(loss, {"lm loss": ...})``."""
    if isinstance(output, tuple) and len(output) == 2 and callable(output[1]):
        output_tensor, loss_func = output
        output = loss_func(output_tensor)
        if isinstance(output, tuple):
            output = output[0]
    if isinstance(output, Mapping) and "loss" in output:
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise HookError(
            f"{type(trainer).__name__}.run_forward_step returned {type(output).__name__}: "
            "return the loss tensor, or (output_tensor, loss_func) with loss_func(output_tensor) "
            "returning (loss, stats)"
        )
    return output


def _number(value: Any, key: str) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise HookError(f"metric {key!r} is {type(value).__name__}, not a number") from exc
