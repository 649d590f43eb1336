"""Code templates: subclass one and override its hooks."""

from rapidformer.templates.pretrainer import Pretrainer
from rapidformer.templates.trainer import DataBundle, Trainer

__all__ = ["DataBundle", "Pretrainer", "Trainer"]
