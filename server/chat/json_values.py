"""What a request's client-given text and free-form JSON must be before anything reads it:
Unicode text (no lone surrogate) and, for JSON, at most :data:`MAX_JSON_DEPTH` levels deep.

JSON may escape a lone surrogate (``"\\ud800"`` without its pair): Python decodes it into a
``str`` that is no Unicode text, and whatever encodes it later (the tokenizer, the chat
template's JSON, the response body) fails with a 500. Free-form JSON (a tool's ``parameters``
schema, a ``response_format`` schema, ``metadata``, ``chat_template_kwargs``) is rendered into
the prompt or echoed back, and serializers bound the depth they follow (pydantic's "Maximum
serialization depth exceeded"), so a deep one failed there too. The schemas
(:mod:`pdserve.server.chat.schemas`, :mod:`pdserve.server.responses.schemas`) declare each such
field with one of the types here, so a bad value is a 400 whose ``param`` names the field and
whose message says where inside it:

- :data:`Text`: a string, Unicode text.
- :data:`JSONObject` / :data:`JSONValue`: a free-form JSON object (value): every key and string
  Unicode text, at most :data:`MAX_JSON_DEPTH` deep.
- :data:`JSONText`: a string holding JSON text (a tool call's ``arguments``): Unicode text, and
  when it parses as JSON, its decoded value obeys :data:`JSONObject`'s rules (an escaped
  ``\\ud800`` inside it is refused too). Text that is no JSON passes: the field's consumer
  refuses it in its own words.

Each check is one pass, time linear in the value's size, no recursion (a hostile body cannot
exhaust the stack or hold the event loop longer than reading it did).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator

MAX_JSON_DEPTH = 64
"""Most nesting levels of a free-form JSON value in a request (the value itself is level 1, an
object or array inside it level 2, ...); a deeper one is a 400 naming the field. JSON Schemas
and tool arguments need a handful; serializers on the way (pydantic's, the chat template's,
the grammar compiler's) stop somewhere above 100."""

_SHOWN_KEY = 40
"""Longest key an error message quotes (characters)."""

_SHOWN_PATH = 120
"""Longest path (``properties.a.items[0]``) an error message quotes (characters)."""


def unicode_text(value: str) -> str:
    """``value`` unchanged when it is Unicode text; raises ValueError naming the lone surrogate
    and its character offset. One pass over the string."""
    return _unicode_at(value, "")


def _unicode_at(value: str, where: str) -> str:
    """:func:`unicode_text`, the message naming ``where`` (a place inside a JSON value)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        at = f"at {where}: " if where else ""
        raise ValueError(
            f"{at}not valid Unicode text: a lone surrogate ({value[exc.start]!r}) at character "
            f"{exc.start}; send each character outside the Basic Multilingual Plane as one "
            "surrogate pair"
        ) from None
    return value


class _Node:
    """A container's place in the value being checked: its parent and its key or index, so a
    path is built only for the error message (never per node: a long key under many items
    would make that quadratic)."""

    __slots__ = ("key", "parent")

    def __init__(self, parent: _Node | None, key: str | int) -> None:
        self.parent = parent
        self.key = key

    def path(self) -> str:
        parts: list[str] = []
        node: _Node | None = self
        while node is not None:
            key = node.key
            if isinstance(key, int):
                parts.append(f"[{key}]")
            else:
                shown = key if len(key) <= _SHOWN_KEY else key[:_SHOWN_KEY] + "..."
                parts.append(f".{shown!r}" if not shown.isidentifier() else f".{shown}")
            node = node.parent
        path = "".join(reversed(parts)).lstrip(".")
        return path if len(path) <= _SHOWN_PATH else path[:_SHOWN_PATH] + "..."


def check_json_value(value: Any) -> Any:
    """``value`` unchanged when it is a JSON value (as parsed: dicts, lists, strings, numbers,
    booleans, None) at most :data:`MAX_JSON_DEPTH` levels deep whose keys and strings are all
    Unicode text; raises ValueError saying where (``properties.a.description``) otherwise.
    Iterative, time linear in the number of nodes."""
    stack: list[tuple[Any, int, _Node | None]] = [(value, 1, None)]
    while stack:
        item, depth, node = stack.pop()
        if isinstance(item, str):
            _unicode_at(item, node.path() if node is not None else "")
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            where = node.path() if node is not None else "the top"
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (at {where})")
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str):  # always, from JSON; a key is text the model reads
                    _unicode_at(key, f"a key in {node.path() if node is not None else 'the top'}")
                if isinstance(child, str | dict | list):
                    stack.append((child, depth + 1, _Node(node, key)))
        else:
            for index, child in enumerate(item):
                if isinstance(child, str | dict | list):
                    stack.append((child, depth + 1, _Node(node, index)))
    return value


def json_text(value: str) -> str:
    """``value`` unchanged when it is Unicode text and, if it parses as JSON, its decoded value
    passes :func:`check_json_value`; raises ValueError otherwise. Text that is no JSON passes
    (the consumer of the field refuses it, naming it)."""
    unicode_text(value)
    try:
        decoded = json.loads(value)
    except RecursionError:  # deeper than the interpreter's limit, far past ours
        raise ValueError(f"JSON text nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError:
        return value
    try:
        check_json_value(decoded)
    except ValueError as exc:
        raise ValueError(f"the JSON text, decoded: {exc}") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
"""A string the model reads or the server echoes: Unicode text, else a 400 naming the field."""

JSONObject = Annotated[dict[str, Any], AfterValidator(check_json_value)]
"""A free-form JSON object (a JSON Schema, metadata, template variables): Unicode text
throughout, at most :data:`MAX_JSON_DEPTH` deep, else a 400 naming the field."""

JSONValue = Annotated[Any, AfterValidator(check_json_value)]
"""Any JSON value, checked as :data:`JSONObject`."""

JSONText = Annotated[str, AfterValidator(json_text)]
"""A string of JSON text (a tool call's ``arguments``), checked as :func:`json_text`."""
