"""Token ids -> the strings and bytes OpenAI logprobs report.

OpenAI's ``token`` is the token's text and ``bytes`` its UTF-8 bytes. A byte-level BPE token
(GPT-2, Llama 3, SmolLM2) may hold part of a multi-byte character: its text then decodes to
U+FFFD, but its bytes are exact, read through the byte-level alphabet. SentencePiece byte
fallback tokens (``<0xE2>``) give their one byte. Other tokens give the bytes of their text.

Thread-safety: the cache is a plain dict filled on first use; concurrent writers on the event
loop cannot interleave inside a call (no awaits), so no lock is needed.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte-level alphabet: byte value (0-255) -> the printable character that
    stands for it in byte-level BPE vocabularies (the ``ByteLevel`` pre-tokenizer's alphabet).
    The one definition of the table in pdserve (the tests' tiny tokenizer builds on it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@cache
def _byte_decoder() -> dict[str, int]:
    """:func:`bytes_to_unicode` inverted: printable stand-in character -> byte value."""
    return {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenRenderer:
    """Cached ``token id -> (text, bytes)`` for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._format(token_id)
        return hit

    def _format(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and token_id not in self._tokenizer.all_special_ids:
                table = _byte_decoder()
                if all(c in table for c in piece):
                    return text, [table[c] for c in piece]
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return text, [int(match.group(1), 16)]
        return text, list(text.encode("utf-8"))
