"""Per-task preprocessing, batching, loss and metrics for the Finetuner: a module per task.

:mod:`~rapidformer.templates.tasks.base` holds what every task shares (:class:`Task`,
:class:`Features`); each task class implements ``prepare`` (rows -> features), ``collate``,
the split step (``inputs``, ``loss``, ``weight``), ``statistics`` of an evaluated batch and
``metrics`` over every rank's statistics.
"""

from rapidformer.labels import IGNORE_INDEX
from rapidformer.templates.tasks.base import TASKS, Features, Task, canonical_task
from rapidformer.templates.tasks.classification import SequenceClassification
from rapidformer.templates.tasks.language_modeling import CausalLM, MaskedLM, Seq2SeqLM
from rapidformer.templates.tasks.question_answering import QuestionAnswering
from rapidformer.templates.tasks.token_classification import TokenClassification, entities

TASK_CLASSES: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        SequenceClassification,
        TokenClassification,
        QuestionAnswering,
        MaskedLM,
        CausalLM,
        Seq2SeqLM,
    )
}


def task_for(name: str) -> type[Task]:
    return TASK_CLASSES[canonical_task(name)]


__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "TASK_CLASSES",
    "CausalLM",
    "Features",
    "MaskedLM",
    "QuestionAnswering",
    "Seq2SeqLM",
    "SequenceClassification",
    "Task",
    "TokenClassification",
    "canonical_task",
    "entities",
    "task_for",
]
