"""Introspection of the config schema: one :class:`FieldSpec` per flag.

The argument parser, the dict loader and ``docs/parameters.md`` are all generated from this
table, and the table from the dataclasses in ``schema.py`` (types, defaults, ``Literal`` choices
and the docstring written under each field).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import types
import typing
from dataclasses import dataclass

from rapidformer.config import schema


@dataclass(frozen=True)
class FieldSpec:
    """One configuration field and the flag that sets it."""

    section: str
    name: str
    kind: type
    """The scalar type: bool, int, float or str."""
    optional: bool
    """Whether None is a valid value (the field has no default value)."""
    default: object
    choices: tuple[str, ...] | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass, keyed by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _scalar_kind(hint: object) -> tuple[type, bool, tuple[str, ...] | None]:
    """Split a type hint like ``int | None`` or ``Literal['a', 'b']`` into
    (scalar type, optional, choices)."""
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        optional = type(None) in args
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str, optional, tuple(typing.get_args(hint))
    assert hint in (bool, int, float, str), f"unsupported config type {hint!r}"
    return typing.cast(type, hint), optional, None


@functools.cache
def all_fields() -> tuple[FieldSpec, ...]:
    """Every configuration field, in section and declaration order."""
    specs: list[FieldSpec] = []
    for section, cls in schema.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            kind, optional, choices = _scalar_kind(hints[f.name])
            if f.name not in docs:
                raise AssertionError(f"config field {section}.{f.name} has no docstring")
            specs.append(
                FieldSpec(section, f.name, kind, optional, f.default, choices, docs[f.name])
            )
    return tuple(specs)


@functools.cache
def fields_by_name() -> dict[str, FieldSpec]:
    """Fields keyed by both their Python name and their flag name without dashes prefix."""
    table: dict[str, FieldSpec] = {}
    for spec in all_fields():
        table[spec.name] = spec
        table[spec.name.replace("_", "-")] = spec
    return table
