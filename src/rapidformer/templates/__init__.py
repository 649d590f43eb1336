"""Code templates: subclass one and override its hooks."""

from rapidformer.templates.trainer import DataBundle, Trainer

__all__ = ["DataBundle", "Trainer"]
