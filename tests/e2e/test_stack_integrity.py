"""A KV block corrupted between the prefill and the decode worker is never used: the decode
worker's digest check refuses it, and the router continues the request by migration (the
decode worker recomputes the prompt), so the client gets the right answer; the router's log
names the corrupted block. Router + prefill + decode as real processes (tiny model, default
backend). Without migration the error reaches the client: tests/unit/test_server_public_errors.py,
tests/integration/test_transfer_corruption.py.

The fault is injected by a test-only ``sitecustomize`` on the workers' ``PYTHONPATH``: in the
prefill process it wraps ``BlockDigester.at_source`` so that, while a flag file exists, one byte
of the source is flipped between the digest and the move (TCP digests each group right before
sending it: the flip follows the first group's digest; NIXL / UCX digest after the WRITE: the
flip precedes the digest). No production code knows about it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

HOOK = """
import os, sys

if "prefill" in sys.argv:  # python -m pdserve.cli ... prefill ...
    from pdserve.transfer.integrity import digests as integrity
    from pdserve.transfer.formatter.mapping import pool_bytes

    _at_source = integrity.BlockDigester.at_source

    def _corrupting_at_source(self, plan, *args):
        digests = _at_source(self, plan, *args)
        if not os.path.exists(os.environ["PDSERVE_TEST_CORRUPT_FLAG"]):
            return digests
        view = self._bytes if plan.source is None else pool_bytes(plan.source)
        flipped = []
        update, finish = digests.update, digests.finish

        def flip():
            if not flipped:
                flipped.append(True)
                view[int(plan.src_offsets[0] + plan.lengths[0] // 2)] ^= 0x10

        def update_then_flip(stop):  # TCP: right after the first digests, before those bytes go
            update(stop)
            flip()

        def flip_then_finish():  # NIXL / UCX: after the WRITE, before the digests
            flip()
            return finish()

        digests.update, digests.finish = update_then_flip, flip_then_finish
        return digests

    integrity.BlockDigester.at_source = _corrupting_at_source
"""

PROMPT = list(range(40, 90))  # several KV blocks


@pytest.fixture(scope="module")
def corrupting_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Path]]:
    hook_dir = tmp_path_factory.mktemp("hook")
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    flag = hook_dir / "corrupt"
    with pytest.MonkeyPatch.context() as mp:  # inherited by the stack's processes only
        mp.setenv("PYTHONPATH", str(hook_dir))
        mp.setenv("PDSERVE_TEST_CORRUPT_FLAG", str(flag))
        stack = start_stack(tiny_model_dir, "tiny-llama", tmp_path_factory.mktemp("stack"))
    yield stack, flag
    stack.stop()


@pytest.fixture
def corrupting(corrupting_stack: tuple[Stack, Path]) -> Iterator[Stack]:
    stack, flag = corrupting_stack
    flag.touch()
    yield stack
    flag.unlink(missing_ok=True)


def _body(stream: bool) -> dict[str, object]:
    return {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": stream}  # fmt: skip


def _parked_on_prefill(stack: Stack) -> int:
    workers = stack.registry_workers()
    (prefill,) = [w for w in workers if w["role"] == "prefill"]
    return int(httpx.get(f"{prefill['http_url']}/load", timeout=5).json()["parked"])


@pytest.fixture(scope="module")
def expected(corrupting_stack: tuple[Stack, Path]) -> str:
    """The request's greedy text, moved without corruption."""
    stack, _ = corrupting_stack
    r = httpx.post(f"{stack.url}/v1/completions", json=_body(False), timeout=60)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    assert text
    return text


def test_corrupted_blocks_are_refused_and_the_request_recomputed(
    expected: str, corrupting: Stack
) -> None:
    r = httpx.post(f"{corrupting.url}/v1/completions", json=_body(False), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    # The corrupted block is named in the router's log, with the migration it caused.
    rid = r.headers["x-request-id"]
    corrupting.wait_logged("router", rid, "decode block")
    corrupting.wait_logged("router", rid, "migrating (1 of at most 3, transfer)")


def test_a_started_stream_goes_on_without_an_error_event(expected: str, corrupting: Stack) -> None:
    with httpx.stream(
        "POST", f"{corrupting.url}/v1/completions", json=_body(True), timeout=60
    ) as r:
        assert r.status_code == 200  # the first token was streamed before the decode leg
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == expected


def test_after_a_corrupted_request_no_blocks_stay_parked(
    expected: str, corrupting_stack: tuple[Stack, Path]
) -> None:
    stack, flag = corrupting_stack
    flag.touch()
    try:
        r = httpx.post(f"{stack.url}/v1/completions", json=_body(False), timeout=60)
        assert r.status_code == 200, r.text
    finally:
        flag.unlink()
    wait_until_sync(
        lambda: _parked_on_prefill(stack) == 0,
        10,
        interval_s=0.1,
        what="the router's release to reach the prefill worker",
    )
    r = httpx.post(f"{stack.url}/v1/completions", json=_body(False), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
