"""One trace per request across router, prefill worker, KV transfer and decode worker, exported
over OTLP/HTTP to a real receiver; the router's phase line; JSON logs with the request id, every
line of them JSON.

The 1+1 stack on the tiny model runs with ``--otlp-traces-endpoint`` (the in-process receiver of
:mod:`tests.support.otlp`) and ``--log-format json``; the span processors flush every 100 ms
(``OTEL_BSP_SCHEDULE_DELAY``), so the test waits for the spans rather than for a timer."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.otlp import OTLPReceiver, ReceivedSpan, otlp_receiver
from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, OTLPReceiver]]:
    with otlp_receiver() as receiver, pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        flags = ("--otlp-traces-endpoint", receiver.url, "--log-format", "json")
        stack = start_stack(
            tiny_model_dir,
            "tiny-llama",
            tmp_path_factory.mktemp("traced"),
            extra_router_args=flags,
            extra_worker_args=flags,
        )
        try:
            yield stack, receiver
        finally:
            stack.stop()


def _chat(
    stack: Stack, client: httpx.Client, headers: dict[str, str], tokens: int = 24
) -> tuple[str, float]:
    """One chat request of exactly ``tokens`` tokens; its id and the E2E latency the client
    saw."""
    t0 = time.perf_counter()
    resp = client.post(
        f"{stack.url}/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "tell me about the sea " * 6}],
            "max_tokens": tokens,
            "min_tokens": tokens,
            "temperature": 0,
        },
        headers=headers,
    )
    e2e = time.perf_counter() - t0
    resp.raise_for_status()
    assert resp.json()["usage"]["completion_tokens"] == tokens
    return resp.headers["x-request-id"], e2e


def _spans(
    receiver: OTLPReceiver, trace_id: str, needed: set[tuple[str, str]]
) -> list[ReceivedSpan]:
    def arrived() -> bool:
        got = {(s.service, s.name) for s in receiver.trace(trace_id)}
        return needed <= got

    wait_until_sync(arrived, 20.0, what=f"spans {sorted(needed)} of trace {trace_id}")
    return receiver.trace(trace_id)


def test_one_trace_holds_router_prefill_transfer_and_decode(
    traced: tuple[Stack, OTLPReceiver],
) -> None:
    stack, receiver = traced
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with httpx.Client(timeout=60) as client:
        rid, _ = _chat(stack, client, {"traceparent": traceparent})
    router = {("pdserve-router", n) for n in ("tokenize", "route", "prefill", "decode_first")}
    router |= {("pdserve-router", "decode"), ("pdserve-router", "chat tiny-llama")}
    prefill = {("pdserve-prefill", n) for n in ("prefill", "queue", "compute", "park")}
    decode = {("pdserve-decode", n) for n in ("decode", "reserve", "kv_pull", "kv_handshake")}
    decode |= {("pdserve-decode", n) for n in ("kv_wire", "kv_integrity", "queue", "steps")}
    decode |= {("pdserve-decode", "first_step")}
    spans = _spans(receiver, CLIENT_TRACE, router | prefill | decode)
    by_id = {s.span_id: s for s in spans}

    # The router's request span continues the client's; GenAI attributes on it.
    (root,) = [s for s in spans if s.name == "chat tiny-llama"]
    assert root.parent_span_id == CLIENT_SPAN
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == "tiny-llama"
    assert root.attributes["gen_ai.response.id"] == rid
    assert root.attributes["gen_ai.usage.output_tokens"] == 24
    assert root.attributes["gen_ai.usage.input_tokens"] >= 20
    route = next(s for s in spans if s.name == "route")
    assert route.attributes["pdserve.route_path"] == "disaggregated"

    # Each worker's span is a child of the router's span of its leg (CLIENT kind = 3).
    legs = {s.name: s for s in spans if s.service == "pdserve-router" and s.kind == 3}
    p_root = next(s for s in spans if s.service == "pdserve-prefill" and s.name == "prefill")
    d_root = next(s for s in spans if s.service == "pdserve-decode" and s.name == "decode")
    assert p_root.parent_span_id == legs["prefill"].span_id
    assert d_root.parent_span_id == legs["decode"].span_id
    assert by_id[legs["prefill"].parent_span_id] is root
    assert by_id[legs["decode"].parent_span_id] is root
    assert p_root.attributes["pdserve.request_id"] == d_root.attributes["pdserve.request_id"] == rid

    # The transfer's phases lie inside the KV pull, which moved real blocks.
    pull = next(s for s in spans if s.name == "kv_pull")
    assert pull.attributes["pdserve.kv_blocks"] >= 1 and pull.attributes["pdserve.kv_bytes"] > 0
    for name in ("kv_handshake", "kv_wire", "kv_integrity"):
        part = next(s for s in spans if s.name == name)
        assert part.parent_span_id == d_root.span_id
        assert pull.start_ns <= part.start_ns <= part.end_ns <= pull.end_ns, name
    steps = next(s for s in spans if s.service == "pdserve-decode" and s.name == "steps")
    assert steps.attributes["gen_ai.usage.output_tokens"] == 23  # the first came from prefill

    # Every span under the request's ends within it (clocks: one host). (FastAPI's own spans,
    # if it emits any, hang off the client's span beside it.)
    def under_root(s: ReceivedSpan) -> bool:
        while s.parent_span_id in by_id:
            s = by_id[s.parent_span_id]
            if s is root:
                return True
        return False

    ours = [s for s in spans if under_root(s)]
    assert {(s.service, s.name) for s in ours} >= (router | prefill | decode) - {
        ("pdserve-router", "chat tiny-llama")
    }
    for s in ours:
        assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, s.name


_PHASE = re.compile(r"(\S+)=([\d.]+)ms")


def _phase_line(stack: Stack, rid: str) -> dict[str, float]:
    """The router's phase line for ``rid`` (a JSON log record), as name -> ms."""
    stack.wait_logged("router", rid, "phases total=")
    for line in stack.procs["router"].log().splitlines():
        if rid in line and "phases total=" in line:
            record = json.loads(line)
            assert record["request_id"] == rid
            return {k: float(v) for k, v in _PHASE.findall(record["message"])}
    raise AssertionError("no phase line")


def test_the_phase_line_tiles_the_request(traced: tuple[Stack, OTLPReceiver]) -> None:
    """The router's top-level phases add up to its total, within 5 % of the E2E latency the
    client measured; the workers' phases are in the same line."""
    stack, _ = traced
    with httpx.Client(timeout=60) as client:
        _chat(stack, client, {})  # opens the connection
        rid, e2e = _chat(stack, client, {}, tokens=64)
    phases = _phase_line(stack, rid)
    total = phases.pop("total")
    top = {k: v for k, v in phases.items() if "." not in k}
    assert set(top) == {"tokenize", "route", "prefill", "decode_first", "decode", "respond"}
    assert {"prefill.queue", "prefill.compute", "decode.kv_pull", "decode.steps"} <= set(phases)
    assert sum(top.values()) == pytest.approx(total, rel=0.01, abs=0.3)
    assert sum(top.values()) == pytest.approx(e2e * 1e3, rel=0.05)
    assert phases["decode.kv_pull"] <= phases["decode_first"] + 0.1


def test_json_logs_name_the_request_on_every_process(traced: tuple[Stack, OTLPReceiver]) -> None:
    stack, _ = traced
    with httpx.Client(timeout=60) as client:
        rid, _ = _chat(stack, client, {})
    stack.wait_logged("router", rid, "phases total=")
    stack.wait_logged("decode-0", rid, "phases here")
    for name in ("router", "prefill-0", "decode-0"):
        # Every line is a JSON object, libraries' own writes to stderr included (issue 39: 29
        # lines were not), and every record naming the request carries its id as a field.
        lines = stack.procs[name].log().splitlines()
        everything = [json.loads(line) for line in lines]
        assert all(isinstance(r, dict) for r in everything), name
        records = [r for r, line in zip(everything, lines, strict=True) if rid in line]
        assert records, name
        for record in records:
            assert record["request_id"] == rid, (name, record)
            assert {"time", "level", "logger", "process", "message"} <= set(record)
