"""Incremental detokenizer: whole characters, stop strings cut and never emitted."""

from __future__ import annotations

import pytest

from pdserve.workers.engine.sequence import IncrementalDetokenizer
from tests.support.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def stream(tok, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, stop)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = []
    for i, token in enumerate(ids):
        detok.append(token)
        final = detok.stopped is not None or i == len(ids) - 1
        deltas.append(detok.delta(final=final))
        if detok.stopped is not None:
            break
    return deltas, detok


def test_deltas_concatenate_to_the_decoded_text(tok) -> None:
    deltas, _ = stream(tok, "héllo, wörld ✓")
    assert "".join(deltas) == "héllo, wörld ✓"


def test_multibyte_characters_are_emitted_whole(tok) -> None:
    deltas, _ = stream(tok, "a✓b")  # ✓ is three byte tokens
    assert deltas == ["a", "", "", "✓", "b"]


def test_stop_string_is_cut_and_never_emitted(tok) -> None:
    deltas, detok = stream(tok, "one two STOP three", stop=("STOP",))
    assert "".join(deltas) == "one two "
    assert detok.stopped == "STOP"
    assert not any("S" in d for d in deltas)


def test_text_that_may_start_a_stop_string_is_held_back_until_final(tok) -> None:
    detok = IncrementalDetokenizer(tok, ("xyz",))
    for token in tok.encode("abxy", add_special_tokens=False):
        detok.append(token)
    assert detok.delta() == "ab"  # "xy" could still become "xyz"
    assert detok.delta(final=True) == "xy"


def test_earliest_of_several_stop_strings_wins(tok) -> None:
    deltas, detok = stream(tok, "a END b HALT", stop=("HALT", "END"))
    assert "".join(deltas) == "a "
    assert detok.stopped == "END"


def test_special_tokens_produce_no_text(tok) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.append(tok.convert_tokens_to_ids("<|eos|>"))
    assert detok.delta(final=True) == ""
