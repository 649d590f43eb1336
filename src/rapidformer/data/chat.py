"""Chat and instruction samples for the causal LM: which format a split is in, and what each
conversation is made of, checked turn by turn.

Three formats, told by their columns (one per split; a row of another format is refused):

* ``messages``: a list of turns ``{"role": ..., "content": ...}`` (roles system, user,
  assistant, tool; an assistant turn may carry ``tool_calls`` instead of content);
* ``prompt`` + ``completion``: each a string (instruction data) or a list of turns (a
  conversation and the assistant turns that complete it);
* ``text``: plain text (and its other names), as before.

Rendering and the loss mask are in :mod:`rapidformer.data.chat_masks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from rapidformer.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
MESSAGES = "messages"
PROMPT, COMPLETION = "prompt", "completion"
TOOLS = "tools"


@dataclass(frozen=True)
class Sample:
    """One sample to render: a conversation (``turns``) whose turns from ``supervised_from``
    on are what the model learns (every assistant turn among them), or plain strings
    ``prompt`` and ``completion`` (instruction data: the completion is learned)."""

    turns: list[dict[str, Any]] | None = None
    supervised_from: int = 0
    prompt: str | None = None
    completion: str | None = None
    tools: list[dict[str, Any]] | None = None
    """The tool definitions the template renders (a ``tools`` column), if any."""


def data_format(columns: Sequence[str]) -> str:
    """``messages``, ``prompt_completion`` or ``text`` (any other column set)."""
    if MESSAGES in columns:
        return "messages"
    if PROMPT in columns and COMPLETION in columns:
        return "prompt_completion"
    return "text"


def samples(rows: Any, split: str) -> list[Sample]:
    """The split's rows as :class:`Sample`, each checked (DataError naming the row)."""
    kind = data_format(rows.column_names)
    if kind == "messages":
        found = [_conversation(row, i, split) for i, row in enumerate(rows[MESSAGES])]
    else:
        pairs = zip(rows[PROMPT], rows[COMPLETION], strict=True)
        found = [_prompt_completion(p, c, i, split) for i, (p, c) in enumerate(pairs)]
    if TOOLS not in rows.column_names:
        return found
    tools = [_tools(value, i, split) for i, value in enumerate(rows[TOOLS])]
    if any(s.turns is None and t for s, t in zip(found, tools, strict=True)):
        _refuse(split, tools.index(next(t for t in tools if t)),
                "has tools beside a string prompt: tools go with conversations")  # fmt: skip
    return [replace(s, tools=t) for s, t in zip(found, tools, strict=True)]


def _tools(value: Any, row: int, split: str) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        _refuse(split, row, "has tools that are not a list of tool definitions")
    return [dict(t) for t in value] or None


def _conversation(turns: Any, row: int, split: str) -> Sample:
    if turns is None:
        _refuse(split, row, "has no messages (a row of another format: one format per file)")
    checked = _turns(turns, row, split, "messages")
    if not any(turn["role"] == "assistant" for turn in checked):
        _refuse(split, row, "has no assistant turn: nothing to learn from it")
    return Sample(turns=checked)


def _prompt_completion(prompt: Any, completion: Any, row: int, split: str) -> Sample:
    if prompt is None or completion is None:
        _refuse(split, row, "lacks its prompt or completion (one format per file)")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            _refuse(split, row, "has an empty completion")
        return Sample(prompt=prompt, completion=completion)
    if isinstance(prompt, str) or isinstance(completion, str):
        _refuse(split, row, "mixes a string and a list of turns in prompt and completion")
    asked = _turns(prompt, row, split, PROMPT)
    answered = _turns(completion, row, split, COMPLETION)
    if any(turn["role"] != "assistant" for turn in answered):
        _refuse(split, row, "has a completion turn that is not the assistant's")
    return Sample(turns=asked + answered, supervised_from=len(asked))


def _turns(turns: Any, row: int, split: str, column: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        _refuse(split, row, f"has {column} that is not a list of turns")
    checked = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str):
            _refuse(split, row, f"has {column}[{number}] without a role")
        role = turn["role"]
        if role not in ROLES:
            _refuse(split, row, f"has {column}[{number}] of unknown role {role!r} "
                    f"(known: {', '.join(ROLES)})")  # fmt: skip
        content = turn.get("content")
        calls = turn.get("tool_calls")
        if content is not None and not isinstance(content, str):
            _refuse(split, row, f"has {column}[{number}] whose content is not a string")
        if not (content or "").strip() and not (role == "assistant" and calls):
            _refuse(split, row, f"has {column}[{number}] ({role}) with empty content")
        # Columns a file has for some turns only arrive as None on the others (datasets
        # unifies a JSON file's schema): dropped, so a template sees what the file said.
        checked.append({k: v for k, v in turn.items() if v is not None})
    return checked


def _refuse(split: str, row: int, what: str) -> NoReturn:
    raise DataError(
        f"the {split} split's row {row} {what}. Fix: correct that row: a conversation is a "
        'list of {"role": ..., "content": ...} turns (system, user, assistant, tool) with at '
        "least one assistant turn to learn from"
    )
