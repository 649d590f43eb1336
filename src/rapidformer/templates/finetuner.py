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
for ``AutoModelFor<Task>.from_pretrained(save)``.

The tasks: sequence_classification, token_classification, question_answering, masked_lm,
causal_lm (also spelled casual_lm, as in the reference tool) and seq2seq_lm.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from rapidformer.accel.tensor_parallel import HF_TP_FAMILIES
from rapidformer.checkpoint import gathered_model_state
from rapidformer.config.root import RapidformerConfig
from rapidformer.data.finetune_data import hub_unreachable
from rapidformer.distributed import process_group
from rapidformer.errors import ConfigError, Violation
from rapidformer.logging import log
from rapidformer.state import ModelInputs, call_model
from rapidformer.templates.architectures import model_kwargs_for, task_violation
from rapidformer.templates.tasks import TASKS, Features, Task, canonical_task, task_for
from rapidformer.templates.trainer import DataBundle, StepOutput, Trainer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_SEQ_LENGTH = 128
_FLAG = "--pretrained-model-name-or-path"


def _hub_error(name: str, what: str, exc: BaseException) -> ConfigError:
    return ConfigError.single(
        _FLAG,
        name,
        f"is not a local directory, and loading its {what} from the hub failed (no network "
        f"access to the hub from this machine, or no such model: {type(exc).__name__})",
        "download the model where the hub is reachable (save_pretrained) and pass that "
        "local directory",
    )


def _check_local(name_or_path: str) -> bool:
    """True for a local model directory (checked to hold a model), False for a hub name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            files = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
            raise ConfigError.single(
                _FLAG,
                name_or_path,
                f"holds no model: no config.json there (found: {files})",
                "pass a directory written by save_pretrained (config.json, model weights, "
                "tokenizer files)",
            )
        return True
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ConfigError.single(_FLAG, name_or_path, "no such model directory", "check the path")
    return False


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer saved with a model (a local directory or a hub name)."""
    from transformers import AutoTokenizer

    local = _check_local(name_or_path)
    try:
        if not local and hub_unreachable():
            raise ConnectionError("the hub did not answer a connection within 3 s")
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        if not local:
            raise _hub_error(name_or_path, "tokenizer", exc) from exc
        raise ConfigError.single(
            _FLAG,
            name_or_path,
            f"holds no usable tokenizer ({str(exc).splitlines()[0]})",
            "save the tokenizer next to the model with tokenizer.save_pretrained(dir)",
        ) from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no pad token
    return tokenizer


def _model_parallel_violations(config: RapidformerConfig) -> list[Violation]:
    """Hugging Face models: no pipeline stages (the built-in models have them), and tensor
    parallelism only for a model whose config ships a plan; decided from config.json, before
    any process group or model exists."""
    parallel, path = config.parallel, config.model.pretrained_model_name_or_path
    violations = []
    moe = config.moe
    if (moe.num_experts or 1) > 1 or moe.moe_use_upcycling:
        flag = "--num-experts" if (moe.num_experts or 1) > 1 else "--moe-use-upcycling"
        violations.append(
            Violation(
                flag,
                moe.num_experts if flag == "--num-experts" else True,
                "swaps the FFNs of rapidformer's built-in GPT/BERT; a Hugging Face model keeps "
                "its own architecture",
                "fine-tune a Hugging Face MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE: its router "
                "loss is included by itself) without the flag, or pretrain the built-in GPT/BERT "
                "with --num-experts (and --moe-use-upcycling --load DENSE_CHECKPOINT)",
            )
        )
    if parallel.pipeline_model_parallel_size > 1:
        violations.append(
            Violation(
                "--pipeline-model-parallel-size",
                parallel.pipeline_model_parallel_size,
                "pipeline stages are cut from the built-in GPT/BERT, not from Hugging Face models",
                "pretrain with the built-in models (--task pretraining), or use "
                "--tensor-model-parallel-size / ZeRO for fine-tuning",
            )
        )
    if parallel.tensor_model_parallel_size > 1 and path is not None:
        plan = None
        if (Path(path).expanduser() / "config.json").is_file():
            transformers = importlib.import_module("transformers")
            hf_config = transformers.AutoConfig.from_pretrained(path)
            plan = getattr(hf_config, "base_model_tp_plan", None)
        if not plan:
            violations.append(
                Violation(
                    "--tensor-model-parallel-size",
                    parallel.tensor_model_parallel_size,
                    f"the model in {path} ships no tensor-parallel plan (base_model_tp_plan); "
                    "GPT-2, BERT, RoBERTa and T5 have none",
                    f"fine-tune a family that has one ({HF_TP_FAMILIES}), use ZeRO / FSDP "
                    "instead, or pretrain with the built-in GPT/BERT, which split themselves",
                )
            )
    return violations


def load_model(name_or_path: str, auto_class: str, **kwargs: Any) -> nn.Module:
    """``transformers.<auto_class>.from_pretrained(name_or_path, **kwargs)`` with errors that
    say what is wrong with the directory."""
    transformers = importlib.import_module("transformers")
    local = _check_local(name_or_path)
    try:
        if not local and hub_unreachable():
            raise ConnectionError("the hub did not answer a connection within 3 s")
        model: nn.Module = getattr(transformers, auto_class).from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        if not local:
            raise _hub_error(name_or_path, "model", exc) from exc
        raise ConfigError.single(
            _FLAG,
            name_or_path,
            f"holds no loadable model weights ({str(exc).splitlines()[0]})",
            "pass a directory written by model.save_pretrained(dir)",
        ) from exc
    except ValueError as exc:  # e.g. the architecture has no head for this task
        raise ConfigError.single(
            _FLAG,
            name_or_path,
            f"cannot be loaded as {auto_class} ({str(exc).splitlines()[0]})",
            "pick a model whose architecture supports the task",
        ) from exc
    return model


class Finetuner(Trainer):
    """Fine-tuning template; see the module docstring."""

    task_name: ClassVar[str | None] = None
    """A subclass may fix its task here; otherwise ``--task`` names it."""
    doc_stride: ClassVar[int | None] = None
    """Question answering: tokens shared by consecutive windows of a long context
    (default ``seq_length // 4``)."""

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
        defaults = cls.build_model is Finetuner.build_model or (
            cls.build_data is Finetuner.build_data
            and cls.build_tokenizer is Finetuner.build_tokenizer
        )
        if defaults and config.model.pretrained_model_name_or_path is None:
            violations.append(
                Violation(
                    _FLAG,
                    None,
                    "fine-tuning starts from a pretrained model and its tokenizer",
                    f"pass {_FLAG} DIR (a directory written by save_pretrained)",
                )
            )
        path = config.model.pretrained_model_name_or_path
        if cls.build_model is Finetuner.build_model:
            violations += _model_parallel_violations(config)
            if path is not None and task is not None and canonical_task(task) in TASKS:
                unsupported = task_violation(path, task)
                violations += [unsupported] if unsupported else []
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

    def __init__(
        self, config: RapidformerConfig | None = None, argv: Sequence[str] | None = None
    ) -> None:
        super().__init__(config, argv)
        task = self.task_name or self.config.training.task
        assert task is not None
        self.task_key = canonical_task(task)
        """The task this run fine-tunes for (``casual_lm`` spelled ``causal_lm``)."""
        self.seq_length = self.config.model.seq_length or DEFAULT_SEQ_LENGTH
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._task: Task | None = None
        self.data: DataBundle | None = None
        """What build_data returned (compute_metrics reads the validation features)."""
        self._router_aux_coef = 0.0
        self._aux_sum: torch.Tensor = torch.zeros(())
        self._aux_count = 0

    # ---- hooks ---------------------------------------------------------------------------
    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the pretrained model."""
        path = self.config.model.pretrained_model_name_or_path
        assert path is not None
        return load_tokenizer(path)

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
        model = load_model(path, self.task.auto_class, **kwargs)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "output_router_logits"):
            # An MoE family (Mixtral, Qwen-MoE ...): have it return its load-balancing loss,
            # which compute_loss adds with the model's own coefficient.
            config.output_router_logits = True
            self._router_aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        if config is not None and getattr(config, "pad_token_id", 0) is None:
            config.pad_token_id = self.task.pad_id  # e.g. GPT-2 classifying padded batches
        _check_vocabulary(model, len(self.tokenizer), path)
        if self.engine.is_main_process:
            parameters = sum(p.numel() for p in model.parameters())
            log.info(
                "model: %s from %s, %s parameters", type(model).__name__, path, f"{parameters:,}"
            )
        return model

    def build_data(self) -> DataBundle:
        from rapidformer.data.finetune_data import load_splits

        data = self.config.data
        assert data.data_dir is not None
        splits = load_splits(data.data_dir, data.data_name)
        # The training split first: it defines the label set the others are checked against.
        prepared = {
            name: self.task.prepare(splits[name], name)
            for name in ("train", "validation", "test")
            if name in splits
        }
        if self.engine.is_main_process:
            sizes = ", ".join(f"{n} {len(d)}" for n, d in prepared.items())
            log.info("data: %s (%s), %s features", data.data_dir, data.data_name or "-", sizes)
        self.data = DataBundle(
            train=prepared["train"],
            valid=prepared.get("validation"),
            test=prepared.get("test"),
            collate_fn=self.task.collate,
        )
        return self.data

    def model_inputs(self, batch: Any) -> ModelInputs:
        """The task's keyword inputs of the model (token ids, masks; seq2seq: the labels)."""
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
        loss = self.compute_loss(outputs, batch)
        return {"loss": loss, **self.task.statistics(outputs, batch, loss)}

    def compute_metrics(self, outputs: list[Mapping[str, Any]]) -> dict[str, float]:
        # Every rank calls this (it all-reduces), even one that held no validation batch.
        valid = self.data.valid if self.data is not None else None
        features = valid if isinstance(valid, Features) else None
        return self.task.metrics(outputs, features, self.device, self.engine.mesh.group("dp"))

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
            qa = self.task_key == "question_answering"
            kwargs = {"doc_stride": self.doc_stride} if qa else {}
            self._task = task_for(self.task_key)(
                self.tokenizer, self.seq_length, self.config.training.seed, **kwargs
            )
        return self._task

    def fit(self) -> dict[str, float]:
        metrics = super().fit()
        if self.config.checkpoint.save is not None:
            self.save_pretrained(self.config.checkpoint.save)
        return metrics

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the trained model and its tokenizer for ``from_pretrained``; every rank calls
        it (a sharded model is gathered first), rank 0 writes."""
        state = self.engine.state
        model = state.unwrapped_model if state is not None else self.model
        while isinstance(model, DistributedDataParallel):
            model = model.module
        # Under FSDP2 or DeepSpeed the module holds shards (or 16-bit copies): gather the whole
        # fp32 weights and hand them to save_pretrained.
        full = gathered_model_state(state) if state is not None else None
        if self.engine.is_main_process and model is not None:
            if full is not None and any(isinstance(p, DTensor) for p in model.parameters()):
                # transformers' save_pretrained of a tensor-parallel model runs collectives
                # (on this rank only, here): save an ordinary copy of the gathered weights.
                config = copy.deepcopy(model.config)
                if hasattr(config, "distributed_config"):
                    config.distributed_config = None  # its barrier would wait for rank 0 only
                with torch.device("meta"):
                    model = type(model)(config)
                model.load_state_dict(full, assign=True)
                model.tie_weights()  # type: ignore[operator]
            model.save_pretrained(out_dir, state_dict=full)  # type: ignore[operator]
            self.tokenizer.save_pretrained(str(out_dir))
            log.info("fine-tuned model and tokenizer saved to %s", out_dir)
        process_group.barrier()  # the files exist for every rank once fit() returns


def _check_vocabulary(model: nn.Module, tokenizer_size: int, path: str) -> None:
    """Refuse a tokenizer whose ids the model cannot embed (they would fail on the first batch
    holding one, as an IndexError naming nothing)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and tokenizer_size > rows:
        raise ConfigError.single(
            "--pretrained-model-name-or-path",
            path,
            f"its tokenizer has {tokenizer_size} entries but the model embeds only {rows} "
            "(config.json vocab_size): they do not belong together",
            "save the tokenizer the model was trained with in that directory, or resize the "
            "model's embeddings (model.resize_token_embeddings) before fine-tuning",
        )
