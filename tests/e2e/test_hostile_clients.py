"""The hostile-client probe's findings, against a real stack (router + prefill + decode worker
processes on the tiny model, embedded discovery, the default transfer backend).

1. Thousands of invalid messages are refused in milliseconds, and a stream relayed meanwhile
   keeps its pace (was: 4000 + 4000 messages held the router's event loop for 54 s).
2. Hundreds of unauthenticated connections to the prefill worker's KV port, from the very
   address the decode worker dials from, hold at most their own small cap and no slot a real
   peer needs: every long-prompt request (its KV blocks pulled over new connections) succeeds
   (was: 3 of 3 got 502).
3. A lone surrogate in a message or a prompt is a 400 that keeps the connection (was: a 500
   with two tracebacks and a dropped keep-alive connection); so is one in a tool's
   ``parameters``, in an earlier call's ``arguments`` (escaped in its JSON text), in a
   Responses ``function_call``'s arguments or its ``user``, and free-form JSON nested past
   ``MAX_JSON_DEPTH`` (was: 500s, "Maximum serialization depth exceeded").
4. The embedded registry is not on the public port (404 there, even with the cluster token);
   its internal listener answers 401 without the token.
5. No public error body names a worker or an internal address, whatever failed; the router's
   log has the details under the request id the body names, and a client's ``X-Request-Id``
   that could fake log fields is replaced, never logged. (Last: it kills the decode worker.)
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.transfer.connection.admission import MAX_UNPROVEN_PER_HOST
from pdserve.transfer.connection.control import split_endpoint
from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
STREAM = {"model": MODEL, "prompt": [1, 84, 104, 101, 32], "max_tokens": 300,
          "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
INVALID = json.dumps(
    {"model": MODEL,
     "messages": [{"role": "bad"}] * 4000 + [{"role": "user", "content": 5}] * 4000}
).encode()  # fmt: skip
LONG = [1, *(40 + i % 200 for i in range(300))]
"""A prompt of 301 tokens: several KV blocks, prefilled on the prefill worker and pulled."""
FAKED_ID = 'x req chatcmpl-victim1 level="ERROR"'
"""A client ``X-Request-Id`` (printable, under 128 characters) that names another request."""
LEAK = re.compile(r"prefill-0|decode-0|127\.0\.0\.1|localhost|:\d{4,5}\b")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Once the last test kills the decode worker, each of its requests finds no worker to
    # route or migrate to: the router holds it 1 s for one (router.worker_wait_s), not 30.
    stack = start_stack(
        tiny_model_dir,
        MODEL,
        tmp_path_factory.mktemp("hostile"),
        extra_router_args=("--worker-wait-s", "1"),
    )
    yield stack
    stack.stop()


def kv_endpoint(stack: Stack, worker_id: str) -> tuple[str, int]:
    """``worker_id``'s transceiver address, from its discovery record."""
    (record,) = [w for w in stack.registry_workers() if w["worker_id"] == worker_id]
    return split_endpoint(record["communicator"]["endpoint"])


def still_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_unauthenticated_kv_connections_from_the_decode_address_starve_no_pull(
    stack: Stack,
) -> None:
    host, port = kv_endpoint(stack, "prefill-0")
    flood: list[socket.socket] = []

    def open_flood(n: int) -> None:
        for _ in range(n):  # from 127.0.0.1, the decode worker's own address
            flood.append(socket.create_connection((host, port), timeout=5))

    def long_request() -> httpx.Response:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)

    try:
        open_flood(300)
        results: list[httpx.Response] = []
        for _ in range(3):
            threads = [
                threading.Thread(target=lambda: results.append(long_request())) for _ in range(3)
            ]  # concurrent pulls: more connections than the decode worker keeps idle
            for t in threads:
                t.start()
            open_flood(100)  # and the flood renews meanwhile
            for t in threads:
                t.join(90)
        assert len(results) == 9
        assert [r.status_code for r in results] == [200] * 9, [r.text for r in results]
        # A fresh burst: within a second (well before its 2 s deadline) all but the cap's worth
        # are evicted, and the closes reach this side.
        open_flood(100)
        wait_until_sync(
            lambda: sum(still_open(s) for s in flood) <= MAX_UNPROVEN_PER_HOST,
            1.0,
            what=lambda: f"{sum(still_open(s) for s in flood)} unauthenticated sockets held",
        )
    finally:
        for s in flood:
            s.close()


def test_thousands_of_invalid_messages_are_refused_fast_beside_a_steady_stream(
    stack: Stack,
) -> None:
    def gaps(relaying: threading.Event | None = None) -> list[float]:
        times = []
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=STREAM, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    if relaying is not None and len(times) == 2:
                        relaying.set()
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    alone = max(gaps())
    beside: list[float] = []
    relaying = threading.Event()
    streamer = threading.Thread(target=lambda: beside.extend(gaps(relaying)))
    streamer.start()
    assert relaying.wait(30), "the stream never relayed a token"
    took = []
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for _ in range(5):
            t0 = time.perf_counter()
            r = client.post(
                "/v1/chat/completions",
                content=INVALID,
                headers={"content-type": "application/json"},
            )
            took.append(time.perf_counter() - t0)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        health = client.get("/health")
    streamer.join(60)
    print(f"400 in {[f'{t * 1e3:.0f} ms' for t in took]}; largest gap alone {alone * 1e3:.0f} "
          f"ms, beside {max(beside) * 1e3:.0f} ms")  # fmt: skip
    assert health.status_code == 200
    assert max(took) < 1.0, f"an invalid 196 KB body took {max(took):.2f} s"
    assert max(beside) < alone + 0.5, f"the stream stalled {max(beside):.2f} s"


def test_a_lone_surrogate_is_a_400_and_the_connection_serves_on(stack: Stack) -> None:
    bodies = {
        "/v1/chat/completions": b'{"model": "tiny-llama", "max_tokens": 2, "messages": '
        b'[{"role": "user", "content": "hi \\ud800"}]}',
        "/v1/completions": b'{"model": "tiny-llama", "max_tokens": 2, "prompt": "\\udfff"}',
    }
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for path, body in bodies.items():
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert "lone surrogate" in r.json()["error"]["message"]
            assert r.headers.get("connection") != "close"
            ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2})  # fmt: skip
            assert ok.status_code == 200, ok.text
    router_log = stack.procs["router"].log()
    assert "Traceback" not in router_log and "unexpected error" not in router_log


def _body(**fields: object) -> str:
    """A request body of ``fields`` in which ``@lone@`` is the JSON escape of a lone surrogate
    and ``@lone-in-text@`` that escape inside a JSON text held by a string (``arguments``)."""
    text = json.dumps({"model": MODEL, **fields}).replace("@lone-in-text@", "\\\\ud800")
    return text.replace("@lone@", "\\ud800")


def _deep_schema(levels: int) -> dict[str, object]:
    """A JSON Schema ``levels`` (odd) deep."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HI = [{"role": "user", "content": "hi"}]
CALL = {"name": "f", "arguments": '{"a": "@lone-in-text@"}'}
"""An earlier call whose arguments (JSON text) escape a lone surrogate."""
CALLED = [*HI, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
          "function": CALL}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]  # fmt: skip
FREE_FORM = [
    # (path, body, the param the 400 names)
    ("/v1/chat/completions", _body(messages=HI, tools=[{"type": "function", "function": {
     "name": "f", "parameters": {"description": "@lone@"}}}]), "tools[0].function.parameters"),
    ("/v1/chat/completions", _body(messages=CALLED),
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", _body(messages=HI, tools=[{"type": "function", "function": {
     "name": "f", "parameters": _deep_schema(151)}}]), "tools[0].function.parameters"),
    ("/v1/responses", _body(input="hi", user="@lone@"), "user"),
    ("/v1/responses", _body(input=[*HI, {"type": "function_call", "call_id": "c1", **CALL},
     {"type": "function_call_output", "call_id": "c1", "output": "x"}]), "input[1].arguments"),
    ("/v1/responses", _body(input="hi", tools=[{"type": "function", "name": "f",
     "parameters": _deep_schema(151)}]), "tools[0].parameters"),
]  # fmt: skip


def test_surrogates_and_deep_json_anywhere_are_400s_on_the_same_connection(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for path, body, param in FREE_FORM:
            json.loads(body)  # valid JSON: the server must refuse it for what it holds
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text
            assert r.headers.get("connection") != "close"
            peer = r.extensions["network_stream"].get_extra_info("client_addr")
            ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2})  # fmt: skip
            assert ok.status_code == 200, ok.text
            assert ok.extensions["network_stream"].get_extra_info("client_addr") == peer
    router_log = stack.procs["router"].log()
    assert "Traceback" not in router_log and "unexpected error" not in router_log


def test_the_registry_is_not_on_the_public_port_and_needs_the_cluster_token(
    stack: Stack,
) -> None:
    """The embedded registry (worker records: endpoints, NIXL metadata) is on the router's
    internal listener only: 404 on the public port even with the cluster token; 401 on the
    internal one without it, and no worker registered by a stranger."""
    assert stack.registry_url != stack.url
    auth = stack.cluster_key.http_headers()
    (record,) = [w for w in stack.registry_workers() if w["role"] == "prefill"]
    with httpx.Client(timeout=10) as client:
        for headers in ({}, auth):
            r = client.get(f"{stack.url}/registry/workers", headers=headers)
            assert r.status_code == 404, r.text
            r = client.delete(f"{stack.url}/registry/workers/{record['worker_id']}",
                              headers=headers)  # fmt: skip
            assert r.status_code in (404, 405), r.text
        assert client.get(f"{stack.registry_url}/registry/workers").status_code == 401
        rogue = {"record": {**record, "worker_id": "rogue-0"}}
        r = client.put(f"{stack.registry_url}/registry/workers/rogue-0", json=rogue)
        assert r.status_code == 401, r.text
        assert client.get(f"{stack.registry_url}/v1/models").status_code == 404
    assert record["worker_id"] in {w["worker_id"] for w in stack.registry_workers()}
    assert "rogue-0" not in {w["worker_id"] for w in stack.registry_workers()}


def test_no_public_error_names_a_worker_or_an_address(stack: Stack) -> None:
    bodies: list[dict[str, object]] = []
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        # Refusals of the router itself, then failures of the (now dead) decode worker.
        for path, body in [
            ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user"}]}),
            ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}),
        ]:
            bodies.append(client.post(path, json=body).json()["error"])
        stack.procs["decode-0"].kill(signal.SIGKILL)
        request = {"model": MODEL, "prompt": LONG, "max_tokens": 4}
        for stream in (False, True):
            r = client.post("/v1/completions", json={**request, "stream": stream},
                            headers={"X-Request-Id": FAKED_ID})  # fmt: skip
            assert r.headers["x-request-id"].startswith("req-"), r.headers
            if r.status_code == 200:  # a stream that started: its in-band error event
                events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: {")]
                bodies += [json.loads(e)["error"] for e in events if '"error"' in e]
            else:
                bodies.append(r.json()["error"])

        # Once the dead worker's record expires: no decode worker at all (not one listed and
        # skipped as unreachable, as /ready already says right after the failures above).
        def expired() -> bool:
            listed = {w["worker_id"] for w in stack.registry_workers()}
            return "decode-0" not in listed and client.get("/ready").json()["decode"] == []

        wait_until_sync(expired, 30, what="decode-0 to expire")
        bodies.append(client.post("/v1/completions", json=request).json()["error"])
    assert len(bodies) == 5, bodies
    failures = [b for b in bodies if str(b["code"]) not in ("model_not_found", "invalid_request")]
    assert len(failures) == 3 and all(b["type"] == "server_error" for b in failures), bodies
    for body in bodies:
        assert not LEAK.search(json.dumps(body)), f"an internal detail reached a client: {body}"
    # The router's log names what failed, under the request id each body names; the client's
    # id that would have faked a field is nowhere in it.
    for body in failures:
        stack.wait_logged("router", str(body["request_id"]), "decode")
    assert "victim" not in stack.procs["router"].log()
