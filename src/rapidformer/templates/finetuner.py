"""The Finetuner template: fine-tune a pretrained Hugging Face model on one of six tasks.

Every hook has a default built from the flags, so ``rapidformer --task TASK ...`` runs with no
user code, and a subclass overrides only what it changes:

- ``build_tokenizer``: ``AutoTokenizer`` from ``--pretrained-model-name-or-path``;
- ``build_model``: ``AutoModelFor<Task>`` from the same place, with the label set that the
  training split defines (classification tasks);
- ``build_data``: ``--data-dir`` / ``--data-name`` loaded with ``datasets``
  (:mod:`rapidformer.data.finetune_data`), tokenized to at most ``--seq-length`` tokens
  (default 128) by the task (:mod:`rapidformer.templates.tasks`);
- the step, split for pipelines: ``model_inputs`` (the task's keyword inputs), ``compute_loss``
  and ``batch_weight`` (samples, or tokens for the token-level tasks); ``eval_step`` adds the
  task's statistics;
- ``compute_metrics``: the task's metrics over every rank's share of the validation split.

``fit()`` trains by ``--epochs`` or ``--train-iters`` (gradient accumulation from the batch
sizes either way) and, with ``--save``, finally writes the model with ``save_pretrained`` and
its tokenizer into the root of ``--save`` (rank 0), next to the ``iter_*`` checkpoints, ready
for ``AutoModelFor<Task>`` to load.

Loading, saving and the errors that name a bad model directory live in
:mod:`rapidformer.models.hf`; what Hugging Face models support of the parallelism flags in
:mod:`rapidformer.templates.hf_rules`. The template composes them.

The tasks: sequence_classification, token_classification, question_answering, masked_lm,
causal_lm (also spelled casual_lm, as in the reference tool) and seq2seq_lm.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from rapidformer.accel.liger import family_violation
from rapidformer.checkpoint import gathered_model_state
from rapidformer.config.root import RapidformerConfig
from rapidformer.data.finetune_data import load_splits, located, training_split
from rapidformer.data.packing import PackedCollate
from rapidformer.distributed import process_group
from rapidformer.engine.order import FEATURES
from rapidformer.errors import DataError, Violation
from rapidformer.log import log
from rapidformer.models.hf import (
    PRETRAINED_FLAG,
    check_vocabulary,
    load_model_reporting,
    load_tokenizer,
    save_model,
)
from rapidformer.models.hf_fused_loss import FAMILIES as FUSED_FAMILIES
from rapidformer.models.packable import position_offset
from rapidformer.models.packed_attention import packed_attention_note, prepare_packed
from rapidformer.step_io import ModelInputs, call_model
from rapidformer.templates.architectures import model_kwargs_for, model_type_of, task_violation
from rapidformer.templates.families.gpt import document_violations
from rapidformer.templates.hf_rules import hf_parallel_violations
from rapidformer.templates.recipes import defaults_line, with_recipe
from rapidformer.templates.tasks import TASKS, CausalLM, Features, Task, canonical_task, task_for
from rapidformer.templates.tasks.base import Evaluated
from rapidformer.templates.tasks.supervised import chat_violations, options_of, packed
from rapidformer.templates.trainer import DataBundle, StepOutput, Trainer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_SEQ_LENGTH = 128


class Finetuner(Trainer):
    """Fine-tuning template; see the module docstring."""

    task_name: ClassVar[str | None] = None
    """A subclass may fix its task here; otherwise ``--task`` names it."""
    doc_stride: ClassVar[int | None] = None
    """Question answering: tokens shared by consecutive windows of a long context
    (default ``seq_length // 4``)."""

    @classmethod
    def config_defaults(cls, config: RapidformerConfig) -> RapidformerConfig:
        """The task's recipe (:class:`~rapidformer.templates.tasks.base.Recipe`: the Hugging
        Face examples' learning rate, epochs and warmup) for what the flags leave open."""
        return with_recipe(config, cls.task_name or config.training.task)

    @classmethod
    def config_violations(cls, config: RapidformerConfig) -> list[Violation]:
        violations = super().config_violations(config)
        task = cls.task_name or config.training.task
        if task is None or canonical_task(task) not in TASKS:
            violations.append(
                Violation(
                    "--task",
                    task,
                    "the Finetuner needs a fine-tuning task",
                    f"pass --task with one of {', '.join(TASKS)} (or casual_lm)",
                )
            )
        violations += chat_violations(config, canonical_task(task) if task else None)
        violations += document_violations(config, "fine-tuning")
        if config.checkpoint.pretrained_checkpoint is not None:
            violations.append(
                Violation(
                    "--pretrained-checkpoint",
                    config.checkpoint.pretrained_checkpoint,
                    "the Finetuner starts from --pretrained-model-name-or-path (its adapters "
                    "name that directory as their base)",
                    "export the checkpoint (python -m rapidformer.export) and pass the exported "
                    "directory as --pretrained-model-name-or-path",
                )
            )
        defaults = cls.build_model is Finetuner.build_model or (
            cls.build_data is Finetuner.build_data
            and cls.build_tokenizer is Finetuner.build_tokenizer
        )
        if defaults and config.model.pretrained_model_name_or_path is None:
            violations.append(
                Violation(
                    PRETRAINED_FLAG,
                    None,
                    "fine-tuning starts from a pretrained model and its tokenizer",
                    f"pass {PRETRAINED_FLAG} DIR (a directory written by save_pretrained)",
                )
            )
        path = config.model.pretrained_model_name_or_path
        # A feature's own output given as the model (an adapter directory) is named as such,
        # before the loader would call it a directory without config.json.
        recognized = [said for f in FEATURES if path and (said := f.recognizes(path))]
        violations += [Violation(PRETRAINED_FLAG, path, *said) for said in recognized[:1]]
        if cls.build_model is Finetuner.build_model and not recognized:
            violations += hf_parallel_violations(config)
            if path is not None and task is not None and canonical_task(task) in TASKS:
                unsupported = task_violation(path, task)
                violations += [unsupported] if unsupported else []
        if cls.build_model is Finetuner.build_model and config.graph.liger_kernel and path:
            unsupported_family = family_violation(model_type_of(path))
            violations += [unsupported_family] if unsupported_family else []
        if cls.build_model is Finetuner.build_model and config.memory.fused_lm_loss:
            model_type = model_type_of(path) if path else None
            causal = task is not None and canonical_task(task) == "causal_lm"
            if not causal or (model_type is not None and model_type not in FUSED_FAMILIES):
                violations.append(
                    Violation(
                        "--fused-lm-loss",
                        True,
                        "needs --task causal_lm with a Hugging Face model of the families "
                        f"{', '.join(FUSED_FAMILIES)} (this run: task {task}, model "
                        f"{model_type})",
                        "drop --fused-lm-loss",
                    )
                )
        if cls.build_data is Finetuner.build_data and config.data.data_dir is None:
            violations.append(
                Violation(
                    "--data-dir",
                    None,
                    "fine-tuning needs a dataset",
                    "pass --data-dir DIR (a folder of json/jsonl/csv/parquet files with "
                    "train/validation in their names, or a saved dataset) and --data-name",
                )
            )
        return violations

    def _init_template(self) -> None:
        task = self.task_name or self.config.training.task
        assert task is not None
        self.task_key = canonical_task(task)
        """The task this run fine-tunes for (``casual_lm`` spelled ``causal_lm``)."""
        if self.engine.is_main_process:
            self._say_defaults(self.given_config)
        self.seq_length = self.config.model.seq_length or DEFAULT_SEQ_LENGTH
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._task: Task | None = None
        self.data: DataBundle | None = None
        """What build_data returned (compute_metrics reads the validation features)."""
        self._router_aux_coef = 0.0
        self._aux_sum: torch.Tensor = torch.zeros(())
        self._aux_count = 0

    def _say_defaults(self, given: RapidformerConfig) -> None:
        """The run's first line: what ``config_defaults`` chose where the flags were silent
        (read from the configuration, so a subclass's own choice is said as it is)."""
        ours = type(self).config_defaults.__func__ is Finetuner.config_defaults.__func__  # type: ignore[attr-defined]
        source = None if ours else f"{type(self).__name__}.config_defaults"
        line = defaults_line(self.task_key, given, self.config, source)
        if line:
            log.info(line)

    # ---- hooks ---------------------------------------------------------------------------
    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the pretrained model."""
        path = self.config.model.pretrained_model_name_or_path
        assert path is not None
        tokenizer = load_tokenizer(path, self.config.model.trust_remote_code)
        template = options_of(self.config).chat_template
        if template is not None:  # saved with the model: inference renders as training did
            tokenizer.chat_template = template
        return tokenizer

    def build_model(self) -> nn.Module:
        path = self.config.model.pretrained_model_name_or_path
        assert path is not None
        kwargs = self.task.model_kwargs()
        if kwargs:  # a new label set replaces a pretrained classifier of another size
            kwargs["ignore_mismatched_sizes"] = True
        kwargs.update(model_kwargs_for(path, self.task_key))
        tp_mesh = self.engine.mesh.submesh("tp")
        if tp_mesh is not None:
            # The model's own plan (base_model_tp_plan), applied while loading: each rank
            # reads only its shards; the engine's tensor-parallel step then reports it.
            kwargs.update(tp_plan="auto", device_mesh=tp_mesh)
        trust = self.config.model.trust_remote_code
        model, loaded = load_model_reporting(
            path, self.task.auto_class, trust_remote_code=trust, **kwargs
        )
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "output_router_logits"):
            # An MoE family (Mixtral, Qwen-MoE ...): have it return its load-balancing loss,
            # which compute_loss adds with the model's own coefficient.
            config.output_router_logits = True
            self._router_aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        if config is not None and getattr(config, "pad_token_id", 0) is None:
            config.pad_token_id = self.task.pad_id  # e.g. GPT-2 classifying padded batches
        check_vocabulary(model, len(self.tokenizer), path)
        if self.config.data.packing:  # checked for any task; only the causal LM's passes ids
            per_sample = prepare_packed(model, self.engine.device, self.seq_length)
            if isinstance(self.task, CausalLM):
                self.task.per_sample_attention = per_sample
                self.task.position_offset = position_offset(model)
        if self.engine.is_main_process:
            parameters = sum(p.numel() for p in model.parameters())
            log.info("model: %s from %s, %s parameters%s", type(model).__name__, path,
                     f"{parameters:,}", f"; {loaded}" if loaded else "")  # fmt: skip
            if self.config.data.packing:
                log.info("packing: samples kept apart by %s", packed_attention_note(model))
        return model

    def build_data(self) -> DataBundle:

        data = self.config.data
        assert data.data_dir is not None
        splits = load_splits(data.data_dir, data.data_name)
        training_split(splits, data.data_dir)
        # The training split first: it defines the label set the others are checked against.
        try:
            prepared = {
                name: self.task.prepare(splits[name], name)
                for name in ("train", "validation", "test")
                if name in splits
            }
        except DataError as error:  # named by the file and line the row came from
            raise located(error, data.data_dir, data.data_name) from None
        collate: Any = self.task.collate
        if data.packing:
            prepared = {name: packed(f, self.seq_length) for name, f in prepared.items()}
            collate = PackedCollate(self.seq_length, self.task.pad_id)
        if self.engine.is_main_process:
            unit = "packed rows" if data.packing else "samples"
            sizes = ", ".join(f"{n} {len(d)} {unit}" for n, d in prepared.items())
            name = f" ({data.data_name})" if data.data_name else ""
            log.info("data: %s%s: %s", data.data_dir, name, sizes)
            for features in prepared.values():
                for note in features.extra.get("notes", ()):
                    log.info("data: %s", note)
        self.data = DataBundle(
            train=prepared["train"],
            valid=prepared.get("validation"),
            test=prepared.get("test"),
            collate_fn=collate,
        )
        return self.data

    def model_inputs(self, batch: Any) -> ModelInputs:
        """The task's keyword inputs of the model (token ids, masks; seq2seq: the labels; the
        causal LM under --fused-lm-loss: the labels too, for the loss in the forward)."""
        if self.config.memory.fused_lm_loss and isinstance(self.task, CausalLM):
            return self.task.loss_inputs(batch)
        return self.task.inputs(batch)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        loss = self.task.loss(outputs, batch)
        aux = getattr(outputs, "aux_loss", None)
        if self._router_aux_coef and aux is not None and self.model is not None:
            # A Hugging Face MoE model's router loss, once per micro-batch: it is scaled with
            # the micro-batch's loss by the engine, like everything this returns.
            weighted = self._router_aux_coef * aux.float()
            if self.model.training and torch.is_grad_enabled():
                self._aux_sum = self._aux_sum.to(weighted.device) + weighted.detach()
                self._aux_count += 1
            loss = loss + weighted
        return loss

    def extra_log_metrics(self) -> dict[str, float]:
        metrics = super().extra_log_metrics()
        if self._aux_count:
            # This rank's mean over its micro-batches since the last line.
            metrics["moe_aux_loss"] = float(self._aux_sum) / self._aux_count
            self._aux_sum, self._aux_count = torch.zeros(()), 0
        return metrics

    def batch_weight(self, batch: Any) -> int | torch.Tensor:
        return self.task.weight(batch)

    def eval_step(self, batch: Any) -> StepOutput:
        assert self.model is not None
        outputs = call_model(self.model, self.model_inputs(batch))
        loss = self._loss(outputs, batch)  # compiled with the model where the run is
        return {"loss": loss, **self.task.statistics(outputs, batch, loss)}

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        # Every rank calls this (it all-reduces), even one that held no validation batch.
        valid = self.data.valid if self.data is not None else None
        features = valid if isinstance(valid, Features) else None
        group = self.engine.mesh.group("dp")
        return self.task.metrics(Evaluated(outputs, features, self.device, group))

    # ---- the task and the result ---------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = self.build_tokenizer()
        return self._tokenizer

    @property
    def task(self) -> Task:
        """The task's preprocessing, batching and metrics (:mod:`rapidformer.templates.tasks`)."""
        if self._task is None:
            kwargs: dict[str, Any] = {}
            if self.task_key == "question_answering":
                kwargs["doc_stride"] = self.doc_stride
            if self.task_key == "causal_lm":
                kwargs["chat"] = options_of(self.config)
            self._task = task_for(self.task_key)(
                self.tokenizer, self.seq_length, self.config.training.seed, **kwargs
            )
        return self._task

    def _save_final(self) -> None:
        if self.config.checkpoint.save is not None:
            self.save_pretrained(self.config.checkpoint.save)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the trained model and its tokenizer for ``AutoModelFor<Task>`` to load;
        every rank calls it (a sharded model is gathered first), rank 0 writes."""
        state = self.engine.state
        model = state.unwrapped_model if state is not None else self.model
        # Under FSDP2, DeepSpeed or tensor parallelism the module holds shards (or 16-bit
        # copies): gather the whole fp32 weights (a collective) and write those.
        full = gathered_model_state(state) if state is not None else None
        adapters = state.frozen_base if state is not None else None
        if self.engine.is_main_process and adapters is not None and model is not None:
            # Adapters: PEFT's adapter directory (the base stays where it was read from).
            whole = full if full is not None else model.state_dict()
            adapters.additions.save(adapters, whole, Path(out_dir))
            self.tokenizer.save_pretrained(out_dir)
            log.info("adapter (PEFT format) and tokenizer saved to %s", out_dir)
        elif self.engine.is_main_process and model is not None:
            save_model(model, self.tokenizer, out_dir, full)
            log.info("fine-tuned model and tokenizer saved to %s", out_dir)
        process_group.barrier()  # the files exist for every rank once fit() returns
