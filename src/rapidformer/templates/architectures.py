"""Which fine-tuning tasks a Hugging Face architecture can run, decided from its config.json
alone (no weights, no process group), so that a model without a head for ``--task`` is refused
with the validation of the other flags, naming the tasks it does support.

A task is supported when ``transformers`` maps the model type to a class for the task's Auto
class (``AutoModelForTokenClassification`` has no BART, ``AutoModelForMaskedLM`` no decoder-only
model, ``AutoModelForSeq2SeqLM`` no encoder-only one). One mapping needs a setting to be right:
an encoder loaded for causal LM (``BertLMHeadModel``, ``RobertaForCausalLM``) attends in both
directions unless its config says ``is_decoder``, and would then read the token it is asked to
predict; :func:`model_kwargs_for` sets it. One mapping is refused: causal LM on an
encoder-decoder (``BartForCausalLM``) is its decoder alone, without the encoder, and loaded from
a ``save_pretrained`` checkpoint of the whole model it finds no embeddings (they are saved under
the shared name) and starts them from random; seq2seq_lm is the task for these models.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from rapidformer.errors import Violation
from rapidformer.templates.tasks import TASKS, canonical_task, task_for

# The Auto class of each task (tasks/*.py) -> transformers' table of model type -> class name.
_MAPPINGS = {
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSeq2SeqLM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
}


def model_type_of(path: str | Path) -> str | None:
    """``model_type`` from ``path/config.json``; None where there is no such file (a hub name,
    which is checked when it loads)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # loading the model names what is wrong with the file
    return value if isinstance(value, str) else None


def _mapping(auto_class: str) -> dict[str, str]:
    names = importlib.import_module("transformers.models.auto.modeling_auto")
    return dict(getattr(names, _MAPPINGS[auto_class]))


def head_class(model_type: str, auto_class: str) -> str | None:
    """The class ``auto_class`` would load for ``model_type``, or None: no head for the task."""
    value = _mapping(auto_class).get(model_type)
    return value if isinstance(value, str) else None  # a few map to tuples (no such task here)


def _known(model_type: str) -> bool:
    names = importlib.import_module("transformers.models.auto.configuration_auto")
    return model_type in names.CONFIG_MAPPING_NAMES


def _encoder_decoder(model_type: str) -> bool:
    return head_class(model_type, "AutoModelForSeq2SeqLM") is not None


def supports(model_type: str, task: str) -> bool:
    """Whether fine-tuning ``model_type`` for ``task`` is right (see the module docstring)."""

    if canonical_task(task) == "causal_lm" and _encoder_decoder(model_type):
        return False
    return head_class(model_type, task_for(task).auto_class) is not None


def supported_tasks(model_type: str) -> list[str]:
    """The fine-tuning tasks ``model_type`` supports, in the order of ``TASKS``."""

    return [task for task in TASKS if supports(model_type, task)]


def task_violation(path: str, task: str) -> Violation | None:
    """A violation when the model in ``path`` has no head for ``task``."""

    model_type = model_type_of(path)
    if model_type is None or not _known(model_type) or supports(model_type, task):
        return None  # an architecture transformers does not know: loading it says so
    auto_class = task_for(task).auto_class
    if head_class(model_type, auto_class):
        why = (
            f"the {model_type} model in {path} is an encoder-decoder: causal LM would fine-tune "
            "its decoder alone, without the encoder (and from a save_pretrained checkpoint, "
            "with new random embeddings)"
        )
    else:
        why = (
            f"the {model_type} model in {path} has no head for it (transformers' {auto_class} "
            f"has no {model_type} class)"
        )
    supported = ", ".join(supported_tasks(model_type)) or "none"
    return Violation(
        "--task",
        task,
        why,
        f"pick one of the tasks {model_type} supports: {supported}; or a model of another "
        "architecture",
    )


def model_kwargs_for(path: str, task: str) -> dict[str, Any]:
    """Settings ``from_pretrained`` needs for ``task`` to be right: ``is_decoder=True`` for an
    encoder-only model loaded for causal LM (causal attention, else it sees the targets)."""

    model_type = model_type_of(path)
    if canonical_task(task) != "causal_lm" or model_type is None:
        return {}
    encoder_only = head_class(model_type, "AutoModelForMaskedLM") and not _encoder_decoder(
        model_type
    )
    return {"is_decoder": True} if encoder_only else {}
