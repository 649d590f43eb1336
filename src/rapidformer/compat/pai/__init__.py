"""PAI-Rapidformer's API on rapidformer: change ``from rapidformer import ...`` to
``from rapidformer.compat.pai import ...`` and the script runs, with every switch of ours.

Mapped (see docs/migrating-from-pai.md for the side-by-side table):

* ``RapidformerEngine(extra_args_provider=fn)`` and ``get_args()``: flags from ``sys.argv``;
* ``engine.compose(model=..., optimizer=..., lr_scheduler_fn=..., ...)`` returning five
  objects, ``engine.backward(loss)`` and the loop's ``optimizer.step()``;
* ``Finetuner`` / ``PreTrainer`` subclasses with the PAI hooks, run by ``.train()``;
* ``HuggingFaceTrainer(engine=..., model=..., train_dataset=..., ...).train()``;
* ``mpu.broadcast_data`` and the rank queries of ``mpu``.

A PAI name with no counterpart raises an ImportError naming ours.
"""

from __future__ import annotations

from typing import Any

from rapidformer.compat.pai import mpu
from rapidformer.compat.pai.engine import RapidformerEngine, get_args
from rapidformer.compat.pai.templates import Finetuner, HuggingFaceTrainer, PreTrainer

__all__ = [
    "Finetuner",
    "HuggingFaceTrainer",
    "PreTrainer",
    "RapidformerEngine",
    "get_args",
    "mpu",
]

# PAI names that have no one-line counterpart, and what to use instead.
_REPLACED = {
    "build_pretrain_huggingface_bert_datasets": (
        "build Megatron .bin/.idx data with rapidformer-preprocess and run the built-in "
        "Pretrainer (--task pretraining --tokenizer-type BertWordPieceLowerCase), or return "
        "your own datasets from "
        "train_valid_test_datasets_provider"
    ),
    "build_pretrain_bert_datasets": "--task pretraining --tokenizer-type BertWordPieceLowerCase",
    "build_pretrain_gpt_datasets": "--task pretraining --tokenizer-type GPT2BPETokenizer",
    "PreTrainedModel": "a transformers or torch.nn model returned from the provider hook",
    "get_tokenizer": "transformers.AutoTokenizer.from_pretrained(a model directory)",
    "get_timers": "the step times rapidformer logs every --log-interval steps",
    "print_rank_0": "rapidformer.log.log (only rank 0 prints)",
}


def __getattr__(name: str) -> Any:
    if name in _REPLACED:
        raise ImportError(
            f"PAI-Rapidformer's {name} has no counterpart in rapidformer.compat.pai: use "
            f"{_REPLACED[name]} (docs/migrating-from-pai.md)"
        )
    raise AttributeError(f"module 'rapidformer.compat.pai' has no attribute {name!r}")
