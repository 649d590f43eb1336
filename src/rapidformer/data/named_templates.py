"""Chat templates shipped with rapidformer, by name: ``--chat-template chatml`` (or ``llama3``,
``mistral``, ``gemma``, ``qwen``, ``phi3``) as well as ``--chat-template FILE``.

Each is written with transformers' ``{% generation %}`` tags around the assistant's turns, so
the assistant mask of a prefix rendering and of the tags agree token for token
(tests/data/test_chat_masks.py), and inference renders what training rendered.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).with_name("chat_templates")


def template_names() -> list[str]:
    """The names of the shipped templates."""
    return sorted(path.stem for path in FOLDER.glob("*.jinja"))


def template_path(value: str) -> Path | None:
    """The file ``--chat-template value`` means: the file itself, else the shipped template
    of that name; None when it is neither."""
    if Path(value).is_file():
        return Path(value)
    shipped = FOLDER / f"{value}.jinja"
    return shipped if "/" not in value and shipped.is_file() else None
