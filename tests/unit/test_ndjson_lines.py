"""The router reads workers' NDJSON streams split on ``\\n`` only: a chunk whose text holds a
character ``str.splitlines`` (and httpx's ``aiter_lines``) also breaks on stays one line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from pdserve.protocol import GenerationChunk
from pdserve.router.client import ndjson_lines


class Pieces(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


def lines_of(pieces: list[bytes]) -> list[bytes]:
    async def read() -> list[bytes]:
        return [line async for line in ndjson_lines(httpx.Response(200, stream=Pieces(pieces)))]

    return asyncio.run(read())


def test_separators_inside_json_strings_do_not_split_a_chunk() -> None:
    texts = ["a\x85b", "c\u2028d", "e\u2029f", "plain"]
    body = b"".join(
        GenerationChunk(request_id="r", index=0, token_ids=[i], text=t).model_dump_json().encode()
        + b"\n"
        for i, t in enumerate(texts)
    )
    # every cut of the body into two pieces, mid-character included
    for cut in range(len(body) + 1):
        lines = lines_of([body[:cut], body[cut:]])
        assert [GenerationChunk.model_validate_json(x).text for x in lines] == texts, cut


def test_a_last_line_without_newline_and_empty_pieces() -> None:
    assert lines_of([b"", b'{"a":', b"", b"1}\n{", b'"b":2}']) == [b'{"a":1}', b'{"b":2}']
    assert lines_of([]) == []


def test_buffered_says_whether_the_next_line_is_already_read() -> None:
    async def read() -> list[tuple[bytes, bool]]:
        lines = ndjson_lines(httpx.Response(200, stream=Pieces([b"a\nb\n", b"c\nd", b"e\n"])))
        seen = []
        async for line in lines:
            seen.append((line, lines.buffered()))
        return seen

    assert asyncio.run(read()) == [(b"a", True), (b"b", False), (b"c", False), (b"de", False)]
