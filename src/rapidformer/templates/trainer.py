"""The Trainer template: override a few hooks, get the whole accelerated loop.

Subclass :class:`Trainer` and implement ``build_model``, ``build_data`` and ``train_step``;
optionally ``build_optimizer``, ``build_lr_scheduler``, ``eval_step`` and ``compute_metrics``.
``fit()`` composes the accelerations the config enables, resumes from the last checkpoint,
trains for ``--train-iters`` steps or ``--epochs`` passes, evaluates, logs and saves.
Hooks never read acceleration flags: the same hooks run under DDP, fp16 or checkpointing.
"""

from __future__ import annotations

import contextlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from rapidformer.accel.sharding import is_fsdp
from rapidformer.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from rapidformer.config.loading import parse_args
from rapidformer.config.schema import RapidformerConfig
from rapidformer.data.samplers import ResumableDistributedSampler
from rapidformer.distributed import process_group
from rapidformer.engine.engine import RapidformerEngine, StepResult
from rapidformer.engine.state import TrainState
from rapidformer.errors import CheckpointError, DataError, Violation
from rapidformer.logging import MetricsLogger, log
from rapidformer.schedules import build_lr_scheduler

if TYPE_CHECKING:
    from rapidformer.accel.onnxruntime import OrtTrainStep

StepOutput = torch.Tensor | Mapping[str, Any]


@dataclass
class DataBundle:
    """What ``build_data`` returns: map-style datasets and the function that batches them."""

    train: Dataset | None
    valid: Dataset | None = None
    test: Dataset | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0
    """Micro-batches this rank has read in the current epoch."""


class Trainer(ABC):
    """Abstract training template; see the module docstring."""

    def __init__(
        self, config: RapidformerConfig | None = None, argv: Sequence[str] | None = None
    ) -> None:
        self.config = config if config is not None else parse_args(argv)
        # A subclass that builds its own optimizer does not need --lr.
        builds_optimizer = type(self).build_optimizer is Trainer.build_optimizer
        self.engine = RapidformerEngine(
            self.config,
            builds_optimizer=builds_optimizer,
            runs_loop=True,
            extra_violations=self.config_violations(self.config),
        )
        self.device = self.engine.device
        self.model: nn.Module | None = None
        """The model train_step and eval_step call (accelerated once fit() composed it)."""
        self._ort_step: OrtTrainStep | None = None
        """--onnx-runtime-training: runs train_step's forward and backward in ONNX Runtime."""

    @classmethod
    def config_violations(cls, config: RapidformerConfig) -> list[Violation]:
        """Rules this template adds to the general ones (reported with them, all at once)."""
        return []

    # ---- hooks ---------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """Return the model to train (on the CPU; the engine moves it)."""

    @abstractmethod
    def build_data(self) -> DataBundle:
        """Return the train / valid / test datasets and their collate function."""

    @abstractmethod
    def train_step(self, batch: Any) -> StepOutput:
        """Compute the mean loss of one micro-batch with ``self.model``. Return the loss, or a
        dict with ``loss`` and optionally ``num_tokens`` (then micro-batches are weighted by
        tokens, not samples, when gradients accumulate)."""

    def build_optimizer(self, model: nn.Module) -> Optimizer | None:
        """Return an optimizer, or None for the one ``--optimizers`` names."""
        return None

    def build_lr_scheduler(self, optimizer: Optimizer, total_steps: int) -> LRScheduler:
        """Warmup and decay as ``--lr-warmup-*`` and ``--lr-decay-style`` say."""
        return build_lr_scheduler(optimizer, self.config, total_steps)

    def eval_step(self, batch: Any) -> StepOutput:
        """Evaluate one batch; by default the training loss without gradients."""
        return self.train_step(batch)

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        """Turn this rank's eval_step outputs into metrics (beyond ``eval_loss``)."""
        return {}

    # ---- the loop ------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train, evaluate and save as configured; return the final metrics."""
        cfg, engine = self.config, self.engine
        seed_everything(cfg.training.seed)
        data = self.build_data()
        model = self.build_model()
        train_loader, valid_loader = self._loaders(data)
        total_steps = self._total_steps(train_loader)
        state = engine.compose(
            model,
            self.build_optimizer(model),
            train_loader,
            valid_loader,
            lambda optimizer: self.build_lr_scheduler(optimizer, total_steps),
        )
        self.model = state.model
        if cfg.graph.onnx_runtime_training:
            from rapidformer.accel.onnxruntime import apply_onnxruntime

            self._ort_step = apply_onnxruntime(
                self, state, seed=cfg.training.seed, log_plan=engine.is_main_process
            )
        progress = self._resume(state)
        logger = MetricsLogger(
            enabled=engine.is_main_process,
            log_interval=cfg.logging.log_interval,
            total_steps=total_steps,
            save_dir=cfg.checkpoint.save,
            device=self.device,
            start_step=progress.step,
        )
        metrics: dict[str, float] = {}
        state.model.train()  # evaluate() switches to eval mode and back
        for group in self._step_batches(state, progress, total_steps):
            result, samples, tokens = self._train_one_step(group)
            progress.step += 1
            metrics = {"train_loss": result.loss}
            dp = engine.dims.dp  # equal shares per rank: global counts are dp x local ones
            logger.step(
                progress.step,
                loss=result.loss,
                lr=result.lr,
                grad_norm=result.grad_norm,
                samples=samples * dp,
                tokens=tokens * dp,
                skipped=result.skipped,
            )
            last_step = progress.step == total_steps
            if valid_loader is not None and (
                last_step or _due(progress.step, cfg.training.eval_interval)
            ):
                evaluation = self.evaluate(state)
                logger.write("eval", {"step": progress.step, **evaluation})
                metrics.update(evaluation)
            if cfg.checkpoint.save and (
                last_step or _due(progress.step, cfg.checkpoint.save_interval)
            ):
                record = {**asdict(progress), "config": cfg.to_dict(), "dp": engine.dims.dp}
                save_checkpoint(cfg.checkpoint.save, progress.step, state, record)
        logger.close()
        if self._ort_step is not None:
            self._ort_step.close()  # ORT's graphs and parameter copies, and their files
        return metrics

    def _train_one_step(self, group: list[Any]) -> tuple[StepResult, int, torch.Tensor | int]:
        """Forward and backward every micro-batch of one step, then step the optimizer."""
        samples = 0
        tokens: torch.Tensor | int = 0
        train_step = self._ort_step or self.train_step
        for index, batch in enumerate(group):
            # Declared before the forward: under DDP that is when the all-reduce is decided.
            self.engine.begin_micro_step(last=index == len(group) - 1)
            loss, num_tokens = _loss_and_tokens(train_step(move_to_device(batch, self.device)))
            size = batch_size(batch)
            samples += size
            tokens = tokens + (num_tokens if num_tokens is not None else 0)  # no host sync here
            self.engine.backward(loss, weight=num_tokens if num_tokens is not None else size)
        if self._ort_step is not None:
            self._ort_step.sync_gradients()  # what DDP's backward does in eager mode
        result = self.engine.step()
        assert result is not None, "the last micro-batch was declared, so the step must run"
        return result, samples, tokens

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Mean eval loss over this rank's share of the validation set, summed over ranks,
        plus ``compute_metrics``. Runs the unwrapped model. Ranks may hold different numbers of
        batches; when the model's forward is itself a collective (FSDP2 and DeepSpeed ZeRO-3
        gather parameters), a rank that runs out repeats forwards whose outputs it discards,
        until every rank has run as many as the rank with the most."""
        loader = state.eval_dataloader
        assert loader is not None
        training_model = self.model
        self.model = state.unwrapped_model
        self.model.eval()
        totals = torch.zeros(2, device=self.device)
        outputs: list[Mapping[str, Any]] = []
        limit = self.config.training.eval_iters
        count = len(loader) if limit is None else min(len(loader), limit)
        lockstep = _forward_is_collective(state)
        if lockstep:
            count = process_group.all_reduce_max(count)
        try:
            with torch.no_grad(), _autocast(state):
                batches = iter(loader)
                for _ in range(count):
                    batch = next(batches, None)
                    if batch is None:  # lockstep only: this rank's share is done
                        self.eval_step(move_to_device(_filler_batch(loader), self.device))
                        continue
                    output = self.eval_step(move_to_device(batch, self.device))
                    loss, num_tokens = _loss_and_tokens(output)
                    weight = float(num_tokens) if num_tokens is not None else batch_size(batch)
                    totals += torch.stack(
                        [
                            torch.tensor(float(weight), device=self.device),
                            loss.detach().float() * weight,
                        ]
                    )
                    outputs.append(output if isinstance(output, Mapping) else {"loss": output})
        finally:
            self.model = training_model
            state.model.train()
        process_group.all_reduce_sum(totals)
        weight_sum, loss_sum = totals.tolist()
        return {"eval_loss": loss_sum / max(weight_sum, 1e-12), **self.compute_metrics(outputs)}

    # ---- plumbing ------------------------------------------------------------------------
    def _loaders(self, data: DataBundle) -> tuple[DataLoader, DataLoader | None]:
        if data.train is None:
            raise DataError("build_data() returned no training dataset (DataBundle.train is None)")
        micro = self.config.data.micro_batch_size
        train = DataLoader(data.train, batch_size=micro, shuffle=True, collate_fn=data.collate_fn)
        valid = None
        if data.valid is not None:
            valid = DataLoader(
                data.valid, batch_size=micro, shuffle=False, collate_fn=data.collate_fn
            )
        return train, valid

    def _total_steps(self, train_loader: DataLoader) -> int:
        training = self.config.training
        if training.train_iters is not None:
            return training.train_iters
        assert training.epochs is not None
        per_rank = len(train_loader.dataset) // self.engine.dims.dp  # type: ignore[arg-type]
        micro_batches = -(-per_rank // self.config.data.micro_batch_size)
        return training.epochs * -(-micro_batches // self.engine.accumulation_steps)

    def _resume(self, state: TrainState) -> Progress:
        source = self.config.checkpoint.load or self.config.checkpoint.save
        if source is None:
            return Progress()
        path = find_checkpoint(source)
        if path is None:
            if self.config.checkpoint.load is not None:
                raise CheckpointError(
                    f"--load {source}: no checkpoint there (no 'latest' file and no progress.json)"
                )
            return Progress()
        saved = load_checkpoint(path, state)
        if self.engine.is_main_process:
            log.info("resumed from %s at step %d", path, saved["step"])
        consumed = self._consumed_here(saved)
        return Progress(step=saved["step"], epoch=saved["epoch"], consumed=consumed)

    def _consumed_here(self, saved: dict[str, Any]) -> int:
        """The micro-batches each rank of this run has consumed in the saved epoch. Ranks take
        every dp-th sample of the epoch's order, so resuming on another data-parallel size or
        micro-batch size starts after the same samples if the count divides evenly."""
        micro, dp = self.config.data.micro_batch_size, self.engine.dims.dp
        saved_micro = saved.get("config", {}).get("data", {}).get("micro_batch_size", micro)
        samples = saved["consumed"] * saved_micro * saved.get("dp", dp)
        if samples % (micro * dp):
            raise CheckpointError(
                f"the checkpoint's {samples} samples consumed in its epoch do not split into "
                f"micro-batches of {micro} on {dp} data-parallel ranks; resume with a "
                "--micro-batch-size and rank count whose product divides it"
            )
        return samples // (micro * dp)

    def _step_batches(
        self, state: TrainState, progress: Progress, total_steps: int
    ) -> Iterator[list[Any]]:
        """Yield the micro-batches of each optimizer step, keeping ``progress`` exact so that
        a checkpoint taken after any step resumes at the next sample."""
        loader = state.train_dataloader
        assert loader is not None and isinstance(loader.sampler, ResumableDistributedSampler)
        if loader.sampler.num_samples < self.engine.dims.dp:
            raise DataError(
                f"the training set ({loader.sampler.num_samples} samples) gives "
                f"each of the {self.engine.dims.dp} data-parallel ranks nothing"
            )
        accumulation = self.engine.accumulation_steps
        by_epoch = self.config.training.train_iters is None
        group: list[Any] = []
        while progress.step < total_steps:
            loader.sampler.set_position(
                progress.epoch, progress.consumed * (loader.batch_size or 1)
            )
            for batch in loader:
                progress.consumed += 1
                group.append(batch)
                if len(group) == accumulation:
                    yield group
                    group = []
                    if progress.step >= total_steps:
                        return
            if by_epoch and group:  # the last, shorter step of an epoch
                yield group
                group = []
            progress.epoch += 1
            progress.consumed = 0


def _forward_is_collective(state: TrainState) -> bool:
    """Whether a forward of the unwrapped model all-gathers parameters across ranks."""
    if not process_group.is_distributed():
        return False
    if state.deepspeed is not None:
        return bool(state.deepspeed.zero_optimization_stage() == 3)
    return is_fsdp(state.unwrapped_model)


def _filler_batch(loader: DataLoader) -> Any:
    """A batch of the validation set's first sample, for forwards a rank only joins."""
    return loader.collate_fn([loader.dataset[0]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to_device(value, device) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor | Mapping | list | tuple):
            return batch_size(value)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def _loss_and_tokens(output: StepOutput) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    if isinstance(output, torch.Tensor):
        return output, None
    if "loss" not in output:
        raise TypeError(
            f"train_step/eval_step returned a dict without 'loss' (keys: {list(output)})"
        )
    return output["loss"], output.get("num_tokens")


def _due(step: int, interval: int | None) -> bool:
    return interval is not None and step % interval == 0


def _autocast(state: TrainState) -> contextlib.AbstractContextManager[Any]:
    """Evaluation runs the unwrapped model, outside the autocast that wraps the training
    forward, so it enters autocast itself."""
    if state.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=state.device.type, dtype=state.autocast_dtype)
