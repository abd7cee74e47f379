"""Client text and free-form JSON (pdserve.server.chat.json_values): Unicode text throughout, at most
MAX_JSON_DEPTH deep, checked in time linear in the value and without recursion."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pdserve.server.chat.json_values import (
    MAX_JSON_DEPTH,
    check_json_value,
    json_text,
    unicode_text,
)


def nested(levels: int, leaf: Any = 1) -> Any:
    """A value ``levels`` deep: arrays and objects in turn around ``leaf``."""
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_a_value_at_the_depth_limit_passes_and_one_level_more_is_refused() -> None:
    assert check_json_value(nested(MAX_JSON_DEPTH)) == nested(MAX_JSON_DEPTH)
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        check_json_value(nested(MAX_JSON_DEPTH + 1))
    # a string is no level: 64 containers around it pass
    assert check_json_value(nested(MAX_JSON_DEPTH, "leaf"))


def test_a_lone_surrogate_anywhere_is_refused_saying_where() -> None:
    with pytest.raises(ValueError, match=r"at properties\.a\.enum\[1\]: not valid Unicode text"):
        check_json_value({"properties": {"a": {"enum": ["ok", "x\ud800"]}}})
    with pytest.raises(ValueError, match="at a key in properties: not valid Unicode text"):
        check_json_value({"properties": {"\udfff": {}}})
    with pytest.raises(ValueError, match="lone surrogate"):
        check_json_value(["\udbff"])
    # a surrogate pair decodes to one character: fine
    assert check_json_value(json.loads('{"emoji": "\\ud83d\\ude00"}')) == {"emoji": "\U0001f600"}


def test_json_text_is_checked_as_its_decoded_value() -> None:
    escaped = '{"a": "\\ud800"}'  # Unicode text itself; its JSON decodes to a lone surrogate
    assert unicode_text(escaped) == escaped
    with pytest.raises(ValueError, match="the JSON text, decoded: at a: not valid Unicode"):
        json_text(escaped)
    with pytest.raises(ValueError, match="levels deep"):
        json_text(json.dumps(nested(MAX_JSON_DEPTH + 1)))
    with pytest.raises(ValueError, match="levels deep"):  # past the interpreter's recursion
        json_text("[" * 100_000 + "]" * 100_000)
    assert json_text("not JSON {") == "not JSON {"  # its consumer refuses it in its own words
    with pytest.raises(ValueError, match="lone surrogate"):
        json_text("\ud800")


def test_the_check_is_linear_in_the_value() -> None:
    # A long key above many items: a path built per node would copy the key once per item
    # (100k copies of 1 MB: minutes). Against the same items under a one-letter key, measured
    # alike, the long key may cost little more (a ratio, not a time: the machine may be busy).
    items = [{"x": "y"} for _ in range(100_000)]

    def took(key: str) -> float:
        t0 = time.perf_counter()
        check_json_value({key: items})
        return time.perf_counter() - t0

    # Best of three each (a busy machine stalls single runs), and a wide margin: the quadratic
    # path this guards against costs minutes, linear ones a fraction of a second.
    short = min(took("k") for _ in range(3))
    long = min(took("k" * 1_000_000) for _ in range(3))
    assert long < 10 * short + 2.0, f"{long:.2f} s with a 1 MB key, {short:.2f} s without"
    # The error message quotes a bounded path, however deep or long the keys.
    deep = nested(MAX_JSON_DEPTH + 1)
    deep["k" * 1000] = deep.pop("k")
    with pytest.raises(ValueError) as err:
        check_json_value(deep)
    assert len(str(err.value)) < 300
