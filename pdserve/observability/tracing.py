"""Per-request timelines and distributed tracing (OpenTelemetry).

Every request, in every process it crosses, has a :class:`Timeline`: its phases (name, start,
end; wall-clock nanoseconds), recorded always at the cost of a clock read each. Two things are
made from it:

- the **phase line**: one log line per finished request (``observability.phase_log``); the
  router's includes the phases the workers sent back (``ContextResponse.phases``,
  ``GenerationChunk.phases``), so one line answers where a slow request spent its time;
- **spans**, when tracing is on (:func:`configure`, ``observability.otlp_traces_endpoint``):
  the timeline is a span and each phase a child span, exported over OTLP/HTTP. The router's
  span continues a client's W3C ``traceparent``; each leg's span travels to the worker in the
  internal request's ``traceparent`` field (and header), where the worker's timeline becomes
  its child, so one trace holds router, prefill, KV transfer and decode. Phases are recorded as
  they happen and become spans when they end (retroactive start times), so the hot path never
  touches the SDK; only spans whose context crosses a process (:meth:`Timeline.begin`) exist
  while they run.

With tracing off nothing here imports the OpenTelemetry SDK; :data:`TRACER` stays None and a
timeline is a list of tuples. Attribute names follow OpenTelemetry's GenAI semantic
conventions (``gen_ai.*``) where one exists, else ``pdserve.*``.

The KV transfer records into the timeline of the request it serves without being handed one:
:func:`current` / :func:`phase` read a context variable that the decode worker sets around
the pull (:func:`bind`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from pdserve.config.settings import ObservabilitySettings

log = logging.getLogger(__name__)

TRACER: Tracer | None = None
"""The process's tracer once :func:`configure` turned tracing on; None: off."""

Attributes = Mapping[str, str | int | float | bool | tuple[str, ...]]

MAX_PHASES = 64
"""Phases a timeline keeps (a migrated or retried request adds a few; a peer's phase map is cut
to this many too)."""


def configure(settings: ObservabilitySettings, service: str, instance: str) -> bool:
    """Turn tracing on for this process when ``settings.otlp_traces_endpoint`` is set: a
    tracer provider named ``service`` (``service.instance.id`` = ``instance``), sampling
    parent-based with ``trace_sample_ratio`` for new traces, exporting in batches over
    OTLP/HTTP (protobuf). Spans still queued at exit are flushed. Returns whether tracing is
    on. Idempotent per process (a second call changes nothing)."""
    global TRACER
    endpoint = settings.otlp_traces_endpoint
    if endpoint is None or TRACER is not None:
        return TRACER is not None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from pdserve import __version__

    resource = Resource.create(
        {"service.name": service, "service.instance.id": instance, "service.version": __version__}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio))
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    TRACER = provider.get_tracer("pdserve", __version__)
    log.info(
        "tracing on: %s as %s (%s), sampling %.2f of new traces",
        endpoint,
        service,
        instance,
        settings.trace_sample_ratio,
    )
    return True


def _parent(traceparent: str | None) -> Context | None:
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Span) -> str | None:
    """The W3C ``traceparent`` header value naming ``span`` (None for a span that is not
    sampled: the peer then starts no trace of its own for it)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not span.is_recording():
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class Timeline:
    """One request's phases in one process, and (tracing on) its span.

    ``name``: the span name; ``traceparent``: the parent's W3C header value (a client's, or the
    router leg's), None for a new trace; ``server``: span kind SERVER (else INTERNAL).
    ``start_ns``: when the request arrived (``time.time_ns()``; default now). Phases are kept
    in the order they end, at most :data:`MAX_PHASES`. Event loop (or one thread) only; the
    owner calls :meth:`finish` once, after which recording does nothing.
    """

    __slots__ = ("_marked", "attributes", "error", "finished_ns", "phases", "span", "start_ns")

    def __init__(
        self,
        name: str,
        *,
        traceparent: str | None = None,
        server: bool = True,
        attributes: Attributes | None = None,
        start_ns: int | None = None,
    ) -> None:
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self._marked = self.start_ns
        self.phases: list[tuple[str, int, int]] = []
        self.attributes: dict[str, Any] = dict(attributes or {})
        self.finished_ns: int | None = None
        self.error: str | None = None  # the request failed: :meth:`fail`
        self.span: Span | None = None
        if TRACER is not None:
            from opentelemetry.trace import SpanKind

            span = TRACER.start_span(
                name,
                context=_parent(traceparent),
                kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                start_time=self.start_ns,
            )
            self.span = span if span.is_recording() else None

    @property
    def traced(self) -> bool:
        """Whether this request's spans are exported (tracing on and sampled)."""
        return self.span is not None

    def traceparent(self, span: Span | None = None) -> str | None:
        """The ``traceparent`` a peer continues from: ``span``'s (a live phase from
        :meth:`begin`), else this timeline's; None when not traced."""
        target = span or self.span
        return None if target is None else traceparent_of(target)

    def set(self, **attributes: Any) -> None:
        """Attributes of the whole request (span attributes; ``gen_ai_x`` is ``gen_ai.x``)."""
        for key, value in attributes.items():
            if value is not None:
                self.attributes[_key(key)] = value

    def mark(self, name: str, **attributes: Any) -> int:
        """End phase ``name`` now: it began where the previous mark (or the start) left off, so
        marked phases tile the request. Returns now (ns)."""
        now = time.time_ns()
        self.add(name, self._marked, now, **attributes)
        self._marked = now
        return now

    def add(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
        """Record a finished phase ``[start_ns, end_ns]`` (and, traced, its child span)."""
        if self.finished_ns is not None or len(self.phases) >= MAX_PHASES:
            return
        self.phases.append((name, start_ns, end_ns))
        if self.span is not None and TRACER is not None:
            from opentelemetry.trace import set_span_in_context

            child = TRACER.start_span(
                name,
                context=set_span_in_context(self.span),
                start_time=start_ns,
                attributes={_key(k): v for k, v in attributes.items() if v is not None},
            )
            child.end(end_time=end_ns)

    def add_peer(self, prefix: str, phases: Mapping[str, float], end_ns: int) -> None:
        """A peer's phase durations (``name -> seconds``, as :meth:`durations` gives; from a
        worker's answer) for the phase line, as phases ending at ``end_ns`` back to back and
        named ``prefix.name``. Spans: none (the peer exported its own)."""
        if self.finished_ns is not None:
            return
        for name, seconds in list(phases.items())[: MAX_PHASES - len(self.phases)]:
            self.phases.append((f"{prefix}.{name}", end_ns - int(seconds * 1e9), end_ns))

    def begin(self, name: str, **attributes: Any) -> Span | None:
        """A live child span whose context goes to a peer (a leg): end it with :meth:`end`.
        None when not traced (nothing to end then)."""
        if self.span is None or TRACER is None or self.finished_ns is not None:
            return None
        from opentelemetry.trace import SpanKind, set_span_in_context

        return TRACER.start_span(
            name,
            context=set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes={_key(k): v for k, v in attributes.items() if v is not None},
        )

    @staticmethod
    def end(span: Span | None, error: str | None = None, **attributes: Any) -> None:
        """End a span from :meth:`begin` (None: nothing), with ``error`` as its status."""
        if span is None:
            return
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(_key(key), value)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def event(self, name: str, **attributes: Any) -> None:
        """A point event on the request's span (a retry, a migration); kept in no phase."""
        if self.span is not None:
            self.span.add_event(name, {_key(k): v for k, v in attributes.items() if v is not None})

    def fail(self, error: str) -> None:
        """Record that the request failed (its span's status at :meth:`finish`); the first
        failure recorded stays."""
        if self.error is None:
            self.error = error

    def finish(self, error: str | None = None) -> None:
        """End the request (its span with the attributes set and ``error``, else the one
        :meth:`fail` recorded, as the status). Idempotent: a second call does nothing."""
        if self.finished_ns is not None:
            return
        self.finished_ns = time.time_ns()
        error = self.error = error or self.error
        if self.span is not None:
            self.span.set_attributes(self.attributes)
            if error is not None:
                from opentelemetry.trace import Status, StatusCode

                self.span.set_status(Status(StatusCode.ERROR, error))
            self.span.end(end_time=self.finished_ns)

    @property
    def elapsed_s(self) -> float:
        """Seconds from the start to :meth:`finish` (or now)."""
        return ((self.finished_ns or time.time_ns()) - self.start_ns) / 1e9

    def durations(self) -> dict[str, float]:
        """Seconds per phase name (a name recorded twice, e.g. after a migration, sums)."""
        out: dict[str, float] = {}
        for name, start, end in self.phases:
            out[name] = out.get(name, 0.0) + max(0, end - start) / 1e9
        return out

    def summary(self) -> str:
        """The phase line's body: ``total=12.3ms name=1.2ms ...`` in the phases' order."""
        parts = [f"{name}={s * 1e3:.1f}ms" for name, s in self.durations().items()]
        return " ".join([f"total={self.elapsed_s * 1e3:.1f}ms", *parts])


def _key(name: str) -> str:
    """``gen_ai_usage_input_tokens`` -> ``gen_ai.usage.input_tokens``; ``pdserve_x`` ->
    ``pdserve.x``; a name with a dot stays."""
    if "." in name:
        return name
    for prefix in ("gen_ai_usage_", "gen_ai_request_", "gen_ai_response_", "gen_ai_"):
        if name.startswith(prefix):
            return "gen_ai." + prefix[7:].replace("_", ".") + name[len(prefix) :]
    return name.replace("_", ".", 1) if name.startswith("pdserve_") else name


_CURRENT: contextvars.ContextVar[Timeline | None] = contextvars.ContextVar(
    "pdserve_timeline", default=None
)


def current() -> Timeline | None:
    """The timeline bound in this context (:func:`bind`), if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def bind(timeline: Timeline | None) -> Iterator[None]:
    """Make ``timeline`` the :func:`current` one inside the block (tasks started inside
    inherit it)."""
    token = _CURRENT.set(timeline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def phase(name: str, **attributes: Any) -> Iterator[None]:
    """Record the block as phase ``name`` of the :func:`current` timeline (nothing without
    one). A block that raises is recorded too."""
    timeline = _CURRENT.get()
    if timeline is None:
        yield
        return
    start = time.time_ns()
    try:
        yield
    finally:
        timeline.add(name, start, time.time_ns(), **attributes)
