"""Code templates: subclass one and override its hooks."""

from rapidformer.templates.finetuner import Finetuner
from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.templates.trainer import DataBundle, Trainer

__all__ = ["DataBundle", "Finetuner", "Pretrainer", "Trainer"]
