"""Request timelines and their spans (pdserve.observability.tracing), JSON logs (pdserve.observability.logs), the
observability settings and the protocol's tracing fields."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from pydantic import ValidationError

from pdserve.config.settings import ObservabilitySettings
from pdserve.observability import logs, tracing
from pdserve.observability.tracing import Timeline
from pdserve.protocol import ContextRequest, GenerationChunk, SamplingParams

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory (the process's TRACER for the test only)."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(tracing, "TRACER", provider.get_tracer("test"))
    yield spans
    provider.shutdown()


def test_marked_phases_tile_the_request_and_peers_break_them_down() -> None:
    tl = Timeline("req", start_ns=1_000_000_000)
    tl.add("tokenize", 1_000_000_000, 1_002_000_000)
    tl.add_peer("prefill", {"queue": 0.001, "compute": 0.004}, end_ns=1_010_000_000)
    tl.add("prefill", 1_002_000_000, 1_010_000_000)
    assert tl.durations() == pytest.approx(
        {"tokenize": 0.002, "prefill.queue": 0.001, "prefill.compute": 0.004, "prefill": 0.008}
    )
    end = tl.mark("decode")
    assert tl.phases[-1][1:] == (1_000_000_000, end)  # from the last mark: the start
    tl.finish()
    assert tl.traced is False and tl.span is None  # tracing off: no span, no SDK
    tl.add("late", 0, 1)
    assert "late" not in tl.durations()  # nothing recorded after finish
    assert tl.summary().startswith("total=")
    assert "prefill.queue=1.0ms" in tl.summary()


def test_a_repeated_phase_sums_and_phases_are_bounded() -> None:
    tl = Timeline("req")
    for _ in range(tracing.MAX_PHASES + 5):
        tl.add("migration", 0, 1_000_000)
    assert len(tl.phases) == tracing.MAX_PHASES
    assert tl.durations() == {"migration": pytest.approx(tracing.MAX_PHASES * 1e-3)}


def test_spans_continue_the_parent_and_phases_become_children(
    exporter: InMemorySpanExporter,
) -> None:
    tl = Timeline("chat m", traceparent=TRACEPARENT, attributes={"gen_ai.request.model": "m"})
    assert tl.traced
    tl.mark("tokenize")
    leg = tl.begin("prefill", pdserve_worker_id="p0")
    carried = tl.traceparent(leg)
    assert carried is not None and carried.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    Timeline.end(leg, "refused", pdserve_retry=1)
    tl.set(gen_ai_usage_output_tokens=7, pdserve_migrations=0, skipped=None)
    tl.fail("first")
    tl.fail("second")
    tl.finish()
    tl.finish()  # idempotent
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, tok, pre = spans["chat m"], spans["tokenize"], spans["prefill"]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert tok.parent is not None and tok.parent.span_id == root.context.span_id
    assert pre.parent is not None and pre.parent.span_id == root.context.span_id
    assert carried.split("-")[2] == f"{pre.context.span_id:016x}"
    assert dict(root.attributes or {}) == {
        "gen_ai.request.model": "m",
        "gen_ai.usage.output_tokens": 7,
        "pdserve.migrations": 0,
    }
    assert root.status.description == "first" and pre.status.description == "refused"
    assert (pre.attributes or {})["pdserve.worker_id"] == "p0"
    assert len(spans) == 3


def test_an_unsampled_parent_makes_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    monkeypatch.setattr(tracing, "TRACER", provider.get_tracer("test"))
    tl = Timeline("req", traceparent=TRACEPARENT[:-2] + "00")
    assert not tl.traced and tl.traceparent() is None and tl.begin("leg") is None


async def test_the_transfer_records_into_the_bound_timeline() -> None:
    tl = Timeline("decode")
    with tracing.phase("outside"):
        pass
    with tracing.bind(tl):
        assert tracing.current() is tl
        with pytest.raises(RuntimeError), tracing.phase("kv_wire", pdserve_kv_blocks=3):
            raise RuntimeError("cut")  # a failed phase is recorded too
    assert tracing.current() is None
    assert [name for name, _, _ in tl.phases] == ["kv_wire"]


def test_configure_needs_an_endpoint() -> None:
    assert tracing.configure(ObservabilitySettings(), "pdserve-router", "r") is False
    assert tracing.TRACER is None


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("https://c:4318/", "https://c:4318/v1/traces"),
        ("http://c:4318/custom/path", "http://c:4318/custom/path"),
        ("", None),
        ("  ", None),
    ],
)
def test_the_endpoint_setting(given: str, stored: str | None) -> None:
    assert ObservabilitySettings(otlp_traces_endpoint=given).otlp_traces_endpoint == stored


def test_a_non_http_endpoint_is_refused() -> None:
    with pytest.raises(ValidationError, match="not an http"):
        ObservabilitySettings(otlp_traces_endpoint="grpc://c:4317")


def test_the_protocol_bounds_what_a_peer_sends() -> None:
    sampling = SamplingParams()
    with pytest.raises(ValidationError):
        ContextRequest(request_id="r", prompt_token_ids=(1,), sampling=sampling, deadline=1.0,
                       traceparent="00-zz-00")  # fmt: skip
    with pytest.raises(ValidationError):
        GenerationChunk(request_id="r", phases={f"p{i}": 0.1 for i in range(33)})
    with pytest.raises(ValidationError):
        GenerationChunk(request_id="r", phases={"x" * 65: 0.1})
    ok = ContextRequest(request_id="r", prompt_token_ids=(1,), sampling=sampling, deadline=1.0,
                        traceparent=TRACEPARENT)  # fmt: skip
    assert ContextRequest.model_validate_json(ok.model_dump_json()) == ok


@pytest.fixture
def root_logger() -> Iterator[None]:
    """Put the root logger's handlers and level back after the test."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


@pytest.mark.usefixtures("root_logger")
def test_json_logs_carry_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure_logging("info", "json")
    try:
        log = logging.getLogger("pdserve.test")
        log.info("req %s: migrating", "chatcmpl-abc123")  # named by its argument (engine thread)
        log.info("no request here")
        logs.bind_request("cmpl-77", "ab" * 16)
        log.info("bound in this context")
        assert logs.uvicorn_log_config() is None
    finally:
        logs.REQUEST.set(None)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [r["request_id"] for r in lines] == ["chatcmpl-abc123", None, "cmpl-77"]
    assert lines[2]["trace_id"] == "ab" * 16 and lines[2]["level"] == "INFO"
    assert lines[0]["message"] == "req chatcmpl-abc123: migrating"
    logs.configure_logging("info", "text")
    assert logs.uvicorn_log_config() is not None  # text: uvicorn's own format
