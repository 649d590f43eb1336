"""The Trainer template: override a few hooks, get the whole accelerated loop.

Subclass :class:`Trainer` and implement ``build_model`` and ``build_data``, and the step: either
``train_step(batch) -> loss``, or its split form ``model_inputs(batch)`` (what the model's
forward takes) and ``compute_loss(outputs, batch)``, which a pipeline needs (its first stage
sees only the inputs, its last computes the loss). Optionally ``batch_weight`` (samples or
tokens a micro-batch's loss averages over; default samples), ``build_optimizer``,
``build_lr_scheduler``, ``eval_step`` and ``compute_metrics``.

``fit()`` composes the accelerations the config enables, resumes from the last checkpoint,
trains for ``--train-iters`` steps or ``--epochs`` passes, evaluates, logs and saves.
Hooks never read acceleration flags: the same hooks run under DDP, fp16 or checkpointing.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from rapidformer.checkpoint.lock import lock_save_directory
from rapidformer.config.loading import parse_args
from rapidformer.config.root import RapidformerConfig
from rapidformer.engine.engine import RapidformerEngine
from rapidformer.errors import HookError, Preempted, Violation
from rapidformer.fatal import report_uncaught, set_debug
from rapidformer.log import log
from rapidformer.reliability.loss_watch import LossWatch
from rapidformer.reliability.peers import naming_lost_peers
from rapidformer.schedules import build_lr_scheduler, warmup_steps
from rapidformer.seeding import seed_everything
from rapidformer.state import TrainState
from rapidformer.step_io import ModelInputs, StepFunctions, StepResult, call_model
from rapidformer.templates.batches import (
    DataBundle,
    StepOutput,
    batch_size,
    batch_tokens,
    loss_of,
    move_to_device,
)
from rapidformer.templates.evaluation import evaluation_pass
from rapidformer.templates.progress import Progress, step_batches
from rapidformer.templates.resuming import resume
from rapidformer.templates.run_logging import open_logger, say_saved
from rapidformer.templates.run_saves import RunSaves, due
from rapidformer.templates.step_checks import check_first_output
from rapidformer.trackers.metrics import MetricsLogger

__all__ = ["DataBundle", "Progress", "StepOutput", "Trainer", "seed_everything"]


class Trainer(ABC):
    """Abstract training template; see the module docstring."""

    def __init__(
        self,
        config: RapidformerConfig | None = None,
        argv: Sequence[str] | None = None,
        *,
        report_to: str | Sequence[str] | None = None,
        callbacks: Sequence[Callable[[str, dict[str, Any]], None]] = (),
    ) -> None:
        """``report_to``: the trackers (``--report-to``'s names, a list or comma text) in
        place of the config's. ``callbacks``: ``callback(kind, record)`` for every logged row
        on rank 0 (kind: train or eval; metrics.jsonl's names), for another tracker."""
        report_uncaught()  # in a script, an error that ends the run is one message, as the CLI's
        set_debug(False)  # until this run's flags say: a bad flag is no earlier run's --debug
        _check_step_hooks(type(self))
        parsed = config if config is not None else parse_args(argv)
        if report_to is not None:
            names = report_to if isinstance(report_to, str) else ",".join(report_to)
            parsed = parsed.replace(report_to=names)
        self._callbacks = tuple(callbacks)
        set_debug(parsed.logging.debug)
        self.given_config = parsed  # before config_defaults filled in what it left open
        self.config = type(self).config_defaults(parsed)
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
        self._compiled_loss: Callable[..., torch.Tensor] | None = None
        self._first_output_checked = False
        self._init_template()

    def _init_template(self) -> None:  # noqa: B027 (a hook a plain Trainer leaves empty)
        """What a template sets up once the engine exists (the Pretrainer's tokenizer, the
        Finetuner's task); nothing for a plain Trainer."""

    @classmethod
    def config_defaults(cls, config: RapidformerConfig) -> RapidformerConfig:
        """The config with this template's defaults where the flags leave a choice open (the
        Finetuner's per-task learning rate and length); flags given always win."""
        return config

    @classmethod
    def config_violations(cls, config: RapidformerConfig) -> list[Violation]:
        """Rules this template adds to the general ones (reported with them, all at once)."""
        pipeline = config.parallel.pipeline_model_parallel_size
        if pipeline > 1 and not _has_split_step(cls):
            return [
                Violation(
                    "--pipeline-model-parallel-size",
                    pipeline,
                    f"a pipeline runs the model in stages, so {cls.__name__}'s step must come "
                    "split: its first stage sees only the model's inputs, its last computes the "
                    "loss; a train_step(batch) cannot be cut",
                    f"override model_inputs(batch) and compute_loss(outputs, batch) in "
                    f"{cls.__name__} instead of train_step (Pretrainer and Finetuner do)",
                )
            ]
        return []

    # ---- hooks ---------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """Return the model to train (on the CPU or the meta device; the engine places it)."""

    @abstractmethod
    def build_data(self) -> DataBundle:
        """Return the train / valid / test datasets and their collate function."""

    def train_step(self, batch: Any) -> StepOutput:
        """The mean loss of one micro-batch, computed with ``self.model``: by default
        ``compute_loss(self.model(*model_inputs(batch)), batch)``. Return the loss, or a dict
        with ``loss``."""
        assert self.model is not None
        return self._loss(call_model(self.model, self.model_inputs(batch)), batch)

    def model_inputs(self, batch: Any) -> ModelInputs:
        """What the model's forward takes for ``batch``: a tuple of positional arguments or a
        dict of keyword arguments (the split step; see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement model_inputs")

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The mean loss of ``batch`` from the model's ``outputs`` (the split step)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement compute_loss")

    def batch_weight(self, batch: Any) -> int | torch.Tensor:
        """How many units (samples or tokens) the micro-batch's mean loss averages over, from
        the batch alone: it is called before any forward of the step, so that accumulation
        weights every micro-batch exactly. Default: its samples. Return the token count
        (e.g. ``(batch["labels"] != -100).sum()``) for a loss averaged over tokens."""
        return batch_size(batch)

    def build_optimizer(self, model: nn.Module) -> Optimizer | None:
        """Return an optimizer over ``model`` (already sharded and materialised when this is
        called), or None for the one ``--optimizers`` names."""
        return None

    def _prebuilt_optimizer(self) -> Optimizer | None:
        """An optimizer that exists before compose() (compatibility layers whose users build
        it next to the model); compose() rebuilds it if sharding replaces the parameters."""
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
    def extra_log_metrics(self) -> dict[str, Any]:
        """Fields added to every logged training line; called on every rank at each logged
        step (it may reduce over ranks). Default: the MoE routing statistics and the
        compile figures, if any."""
        return self.engine.step_metrics()

    def fit(self) -> dict[str, float]:
        """Train, evaluate and save as configured; return the final metrics.

        With ``--save``, a stop signal (SIGTERM, SIGINT, SIGUSR1) on any rank ends the run
        after the step every rank agreed on, with a checkpoint there, by raising
        :class:`~rapidformer.errors.Preempted`. A collective that fails because a peer died
        raises :class:`~rapidformer.errors.PeerLostError` naming the missing rank."""
        report_uncaught()  # a script's fit() ends as the command does on an error
        # One run per --save directory, held until the run's last file is written.
        lock = lock_save_directory(self.config.checkpoint.save, self.device)
        try:
            with naming_lost_peers(self.config.parallel.distributed_timeout_minutes):
                metrics = self._fit()
                self._save_final()
        finally:
            if lock is not None:
                lock.release()
        if self.engine.is_main_process:  # a script's run and the command's alike
            log.info("final metrics: %s", json.dumps(metrics))
        return metrics

    def _save_final(self) -> None:
        """What a template writes to --save once training is done (the Finetuner: the
        Hugging Face directory), while the directory is still this run's."""
        return None

    def _fit(self) -> dict[str, float]:
        cfg, engine = self.config, self.engine
        seed_everything(cfg.training.seed)
        data = self.build_data()
        model = self.build_model()
        train_loader, valid_loader = data.loaders(cfg.data.micro_batch_size)
        total_steps = self._total_steps(train_loader)
        state = engine.compose(
            model,
            optimizer=self._prebuilt_optimizer(),
            train_dataloader=train_loader,
            eval_dataloader=valid_loader,
            lr_scheduler_fn=lambda optimizer: self.build_lr_scheduler(optimizer, total_steps),
            optimizer_fn=self.build_optimizer,
        )
        self.model = state.model
        if _has_split_step(type(self)):  # the template owns the loss: it may join the graph
            # The class's function, not the bound method: held by the instance, a bound
            # method would keep the template (and its model) alive in a cycle.
            loss = type(self).compute_loss
            compiled = engine.compiled_loss(loss)
            self._compiled_loss = None if compiled is loss else compiled
        progress = self._resume(state, total_steps)
        engine.resume_at(progress.step)
        logger = open_logger(
            cfg, engine, state, progress, total_steps, self.extra_log_metrics, self._callbacks
        )
        if cfg.checkpoint.save is None and engine.is_main_process:
            log.warning(
                "no --save: no model or checkpoint of this run will be written, and a stop "
                "signal (SIGTERM, SIGINT, SIGUSR1) ends it with nothing kept; pass --save DIR "
                "to keep the model and survive preemption"
            )
        signals = engine.watch_signals() if cfg.checkpoint.save else contextlib.nullcontext()
        saves = RunSaves(cfg, engine.request_stop)
        try:
            with signals, contextlib.closing(logger):
                metrics = self._loop(state, progress, logger, total_steps, saves)
        finally:
            saves.finish()  # a write in flight completes before the run ends
        state.forward_backward.close()  # e.g. ONNX Runtime's graphs and their files
        for monitor in state.monitors:
            monitor.close()
        return metrics

    def _loop(
        self,
        state: TrainState,
        progress: Progress,
        logger: MetricsLogger,
        total_steps: int,
        saves: RunSaves,
    ) -> dict[str, float]:
        cfg, engine = self.config, self.engine
        valid_loader = state.eval_dataloader
        step = self.step_functions()
        metrics: dict[str, float] = {}
        state.model.train()  # evaluate() switches to eval mode and back
        by_epoch = cfg.training.train_iters is None
        groups = step_batches(state, progress, total_steps, engine.accumulation_steps, by_epoch)
        path = None
        losses = LossWatch(warmup_steps(cfg, total_steps), cfg.training.lr or 0.0)
        result: StepResult | None = None
        for group in groups:
            saves.check()  # a background write that failed stops the run here
            batches = [move_to_device(batch, self.device) for batch in group]
            result = engine.run_step(batches, step)
            progress.step += 1
            evaluation: dict[str, float] = {}
            # No host read of the step's numbers here: the logger reads a window at a time.
            window = self._log_step(logger, progress.step, result, batches)
            losses.report(window or (), engine.is_main_process)
            last_step = progress.step == total_steps
            stopping = result.stop_requested and not last_step
            if valid_loader is not None and (
                last_step or due(progress.step, cfg.training.eval_interval)
            ):
                evaluation = self.evaluate(state)
                logger.write("eval", {"step": progress.step, **evaluation})
            if saves.due(progress.step, final=last_step or stopping):
                # A run that has skipped --max-skipped-steps in a row stops here, before it
                # writes a checkpoint (it would hold nothing new).
                engine.judge_skipped_steps(final=last_step)
                record = {**asdict(progress), "config": cfg.to_dict()}
                path = saves.save(progress.step, state, record, final=last_step or stopping)
            if stopping:
                raise Preempted(
                    f"stopped at step {progress.step} of {total_steps} by a stop signal "
                    f"({engine.stop_signal or 'on another rank'}); checkpoint written to {path}. "
                    "Rerun the same command to resume from it"
                )
        engine.judge_skipped_steps(final=True)  # the steps since the last --log-interval
        say_saved(cfg, path, logger)
        if result is None:
            return metrics
        return {"train_loss": result.loss, **evaluation}

    def step_functions(self) -> StepFunctions:
        """The micro-step the engine runs: this Trainer's hooks (the split form too when it
        has one, for pipelines)."""
        split = _has_split_step(type(self))
        return StepFunctions(
            train_step=self._train_loss,
            weight=self.batch_weight,
            model_inputs=self.model_inputs if split else None,
            loss=self._loss if split else None,
        )

    def _loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """``compute_loss``, compiled with the model where ``--torch-compile-scope model``
        says so."""
        if self._compiled_loss is None:
            return self.compute_loss(outputs, batch)
        return self._compiled_loss(self, outputs, batch)

    def _train_loss(self, batch: Any) -> torch.Tensor:
        output = self.train_step(batch)
        if not self._first_output_checked and torch.is_grad_enabled():
            own_weight = type(self).batch_weight is not Trainer.batch_weight
            check_first_output(type(self).__name__, output, own_weight)
            self._first_output_checked = True
        return loss_of(output, "train_step")

    def _log_step(
        self, logger: MetricsLogger, step: int, result: StepResult, batches: list[Any]
    ) -> list[tuple[int, float, bool]] | None:
        dp = self.engine.dims.dp  # equal shares per rank: global counts are dp x local ones
        tokens: torch.Tensor | int = 0
        for batch in batches:
            tokens = tokens + batch_tokens(batch)  # on the device: no host sync here
        return logger.step(
            step,
            loss=result.loss_tensor,
            lr=result.lr_tensor,
            grad_norm=result.grad_norm_tensor,
            samples=sum(batch_size(batch) for batch in batches) * dp,
            tokens=tokens * dp,
            skipped=result.skipped_tensor,
        )

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Mean eval loss (weighted by ``batch_weight``) over this rank's share of the
        validation set, summed over the data-parallel ranks, plus ``compute_metrics``. Runs the
        unwrapped model, in lockstep over the ranks where its forward is a collective
        (:mod:`rapidformer.templates.evaluation`)."""
        training_model = self.model
        self.model = state.unwrapped_model
        try:
            limit = self.config.training.eval_iters
            loss, outputs = evaluation_pass(state, self.eval_step, self.batch_weight, limit)
        finally:
            self.model = training_model
        return {"eval_loss": loss, **self.compute_metrics(outputs)}

    # ---- plumbing ------------------------------------------------------------------------
    def _total_steps(self, train_loader: DataLoader) -> int:
        training = self.config.training
        if training.train_iters is not None:
            return training.train_iters
        assert training.epochs is not None
        per_rank = len(train_loader.dataset) // self.engine.dims.dp  # type: ignore[arg-type]
        micro_batches = -(-per_rank // self.config.data.micro_batch_size)
        return training.epochs * -(-micro_batches // self.engine.accumulation_steps)

    def _resume(self, state: TrainState, total_steps: int) -> Progress:
        main = self.engine.is_main_process
        return resume(self.config, state, self.engine.dims.dp, main, total_steps)


def _has_split_step(cls: type[Trainer]) -> bool:
    """Whether ``cls`` runs its step in the split form: both split hooks, no own train_step."""
    return (
        cls.train_step is Trainer.train_step
        and cls.model_inputs is not Trainer.model_inputs
        and cls.compute_loss is not Trainer.compute_loss
    )


def _check_step_hooks(cls: type[Trainer]) -> None:
    if cls.train_step is Trainer.train_step and not _has_split_step(cls):
        raise HookError(
            f"{cls.__name__} has no step: implement train_step(batch) -> loss, or "
            "model_inputs(batch) and compute_loss(outputs, batch)"
        )
