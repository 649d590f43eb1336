"""The Pretrainer's model families: one object per family, chosen by ``--tokenizer-type``.

:mod:`~rapidformer.templates.families.base` defines what a family provides
(:class:`PretrainFamily`); each other module is one family. To add one, write its module and
list an instance in :data:`FAMILIES`: the Pretrainer only ever asks :func:`family_for`.
"""

from __future__ import annotations

from rapidformer.config.root import RapidformerConfig
from rapidformer.errors import ConfigError, Violation
from rapidformer.templates.families.base import CorpusSplit, ModelShape, PretrainFamily, model_shape
from rapidformer.templates.families.bert import BertFamily
from rapidformer.templates.families.gpt import GPTFamily

FAMILIES: dict[str, PretrainFamily] = {
    family.name: family for family in (GPTFamily(), BertFamily())
}
"""Every family by name, in the order :func:`family_for` tries them."""


def family_for(tokenizer_type: str | None) -> PretrainFamily:
    """The family ``tokenizer_type`` selects; a :class:`ConfigError` naming the valid types
    when none does."""
    for family in FAMILIES.values():
        if tokenizer_type in family.tokenizer_types:
            return family
    known = [name for family in FAMILIES.values() for name in family.tokenizer_types]
    raise ConfigError.single(
        "--tokenizer-type", tokenizer_type, f"must be one of {', '.join(known)}", "pick one of them"
    )


def family_violations(config: RapidformerConfig) -> list[Violation]:
    """The flags the configured family needs; none while ``--tokenizer-type`` is missing or
    unknown, which is reported by itself (as missing, or when the tokenizer is built)."""
    try:
        family = family_for(config.data.tokenizer_type)
    except ConfigError:
        return []
    return family.config_violations(config)


__all__ = [
    "FAMILIES",
    "BertFamily",
    "CorpusSplit",
    "GPTFamily",
    "ModelShape",
    "PretrainFamily",
    "family_for",
    "family_violations",
    "model_shape",
]
