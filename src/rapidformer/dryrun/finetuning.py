"""The model and micro-batch of a fine-tuning dry run (``--task causal_lm``).

The model is the Hugging Face model of ``--pretrained-model-name-or-path`` built from its
``config.json`` on the meta device: no weight is read and no code from the directory runs (a
model that needs its own code is refused). The micro-batch is ``--micro-batch-size`` rows of
``--seq-length`` tokens:

* with ``--packing``, packed rows: positions restarting per sample and the additive
  block-diagonal mask ``[rows, 1, T, T]`` the task builds where the batch is, as a real step
  has them (a packed row is always ``--seq-length`` tokens long, whatever the samples);
* without, samples of ``--seq-length`` tokens with the boolean ``[rows, 1, T, T]`` mask
  transformers makes of a padded batch: the longest a batch can be (padding to the longest
  sample, or the dynamic-shape iterator's buckets, make most batches shorter).

With ``--packing`` and a ``--data-dir`` that exists, the training split is read, tokenized
(the tokenizer's files only, no code) and packed as the run packs it, and the plan says how
many rows and micro-batches an epoch holds (:func:`packed_epoch`); the data's errors stop the
plan as they would stop the run. Without packing the data is not read.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rapidformer.config.root import RapidformerConfig
from rapidformer.data.finetune_data import load_splits, training_split
from rapidformer.distributed.dims import ParallelDims
from rapidformer.dryrun.estimate import Workload
from rapidformer.errors import ConfigError
from rapidformer.models.hf import load_tokenizer
from rapidformer.models.packable import check_packable
from rapidformer.templates.architectures import model_kwargs_for
from rapidformer.templates.finetuner import DEFAULT_SEQ_LENGTH
from rapidformer.templates.tasks import CausalLM
from rapidformer.templates.tasks.supervised import options_of, packed


def finetuning_workload(
    config: RapidformerConfig, warnings: list[str], world_size: int = 1
) -> tuple[Workload, str]:
    """The causal LM the flags describe, on the micro-batch a step of it runs (packed: and
    the rows an epoch gives each of the ``world_size`` ranks' data-parallel shares)."""

    path = config.model.pretrained_model_name_or_path
    assert path is not None
    hf_config = _read_config(path)
    for name, value in model_kwargs_for(path, "causal_lm").items():
        setattr(hf_config, name, value)
    seq = config.model.seq_length or DEFAULT_SEQ_LENGTH
    rows = config.data.micro_batch_size
    work = causal_lm_workload(
        hf_config, rows, seq, packing=config.data.packing, fused=config.memory.fused_lm_loss
    )
    model = work.build()
    if config.data.packing:
        check_packable(model, seq)  # as the run refuses it: a --packing ConfigError
    parameters = sum(p.numel() for p in model.parameters())
    shape = (
        f"{rows} packed rows of {seq} tokens (positions restarting per sample, a "
        f"[{rows}, 1, {seq}, {seq}] block-diagonal mask)"
        if config.data.packing
        else f"{rows} samples padded to {seq} tokens (the longest a batch can be)"
    )
    description = (
        f"{type(model).__name__} from {path} ({getattr(hf_config, 'model_type', '?')}, "
        f"{parameters:,} parameters); micro-batch: {shape}"
    )
    data_dir = config.data.data_dir
    if data_dir is not None and not Path(data_dir).exists():
        warnings.append(f"--data-dir: {data_dir} does not exist (a real run would stop there)")
    elif data_dir is not None and config.data.packing:
        parallel = config.parallel
        dims = ParallelDims(
            world_size,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
        )
        try:
            description += f"; an epoch: {packed_epoch(config, path, seq, dims.dp)}"
        except ConfigError as exc:  # the tokenizer: the plan of the model stands without it
            reason = "; ".join(v.rule for v in exc.violations)
            warnings.append(
                "--data-dir: the rows an epoch packs into were not counted (a plan loads the "
                f"tokenizer without running code): {reason}"
            )
    return work, description


def packed_epoch(config: RapidformerConfig, path: str, seq: int, data_parallel: int) -> str:
    """The training split packed into rows of ``seq`` tokens as the run packs it (the task's
    rendering, truncation and best-fit decreasing, from the tokenizer's files: no code runs),
    and what each of the ``data_parallel`` shares takes of them, as the sampler deals them: an
    equal number of rows (the rest left out of the epoch), in micro-batches of
    ``--micro-batch-size`` rows. The data's errors are raised as the run raises them."""

    data = config.data
    assert data.data_dir is not None
    train = training_split(load_splits(data.data_dir, data.data_name), data.data_dir)
    tokenizer = load_tokenizer(path, trust_remote_code=False)
    options = options_of(config)
    if options.chat_template is not None:
        tokenizer.chat_template = options.chat_template
    task = CausalLM(tokenizer, seq, config.training.seed, chat=options)
    rows = packed(task.prepare(train, "train"), seq)
    micro, share = data.micro_batch_size, len(rows) // data_parallel
    steps = f"{-(-share // micro)} micro-batches of up to {micro} rows"
    if data_parallel > 1:
        left = len(rows) - share * data_parallel
        steps = f"{share} rows in {steps} on each of {data_parallel} data-parallel ranks" + (
            f" ({left} left out)" if left else ""
        )
    return "; ".join([*rows.extra["notes"], steps])


def causal_lm_workload(
    hf_config: Any, rows: int, seq: int, *, packing: bool, fused: bool = False
) -> Workload:
    """A transformers causal LM of ``hf_config`` (the attention transformers picks) on
    ``rows`` packed rows or padded samples of ``seq`` tokens (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    hf_config = copy.deepcopy(hf_config)  # the caller's stays as it was
    if hasattr(hf_config, "output_router_logits"):
        hf_config.output_router_logits = True  # an MoE family, as the Finetuner sets it

    def build() -> torch.nn.Module:
        # The attention transformers picks itself, as from_pretrained does: sdpa where the
        # model has it, else eager.
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)

    task: Any = CausalLM(SimpleNamespace(pad_token_id=0), seq)  # type: ignore[arg-type]
    tokens = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    batch: dict[str, torch.Tensor] = {"input_ids": tokens, "labels": tokens}
    if packing:
        batch |= {"attention_mask": tokens, "position_ids": tokens, "packed_samples": tokens}
    else:
        # The boolean mask transformers makes from a padded batch, given ready-made: it would
        # build it from the values (and look for packed samples in them), which meta tensors
        # do not have.
        batch["attention_mask"] = torch.ones(rows, 1, seq, seq, dtype=torch.bool, device="meta")
    return Workload(
        build=build,
        batch=batch,
        inputs=task.loss_inputs if fused else task.inputs,
        loss=task.loss,
        hidden_size=int(getattr(hf_config, "hidden_size", 0) or 0),
        seq_length=seq,
    )


def refuse_tensor_parallelism(config: RapidformerConfig) -> None:
    """A Hugging Face model's tensor parallelism is refused before anything reads the model
    (validation would read its plan)."""
    if config.parallel.tensor_model_parallel_size > 1:
        raise ConfigError.single(
            "--dry-run", True,
            "a Hugging Face model takes its own tensor-parallel plan while its weights load, "
            "which a dry run does not do",
            "plan the run with --tensor-model-parallel-size 1 and divide the model state by "
            "the tensor-parallel size",
        )  # fmt: skip


def _read_config(path: str) -> Any:
    """The model's configuration from ``path/config.json``, running no code from it."""
    from transformers import AutoConfig

    if not (Path(path).expanduser() / "config.json").is_file():
        raise ConfigError.single(
            "--pretrained-model-name-or-path", path,
            "a dry run reads the model's config.json from a local directory, and there is none",
            "pass the directory the model was saved to (save_pretrained)",
        )  # fmt: skip
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError) as exc:
        raise ConfigError.single(
            "--pretrained-model-name-or-path", path,
            f"its config.json cannot be read without running the model's own code ({exc})",
            "plan with a model transformers knows",
        ) from exc  # fmt: skip
