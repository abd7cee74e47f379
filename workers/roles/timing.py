"""A worker's side of a request's timeline (:mod:`pdserve.observability.tracing`): the leg's span, joined to
the router's trace by the request's ``traceparent``, and the phases the worker sends back to
the router (``ContextResponse.phases``, the last ``GenerationChunk.phases``).

Phases, in order (each a child span when traced):

- prefill worker: ``queue`` (engine queue: submitted until first admitted into the running
  batch), ``compute`` (admitted until the first token: the prompt's forward passes),
  ``park`` (parking the blocks under a lease, answering); ``grammar`` before them when a
  structured output's grammar was compiled;
- decode worker, two legs: ``admit`` (the grammar, if any, and finding the prefill worker
  in this worker's discovery view), ``reserve`` (KV blocks for the prompt, waiting while the pool is
  full), ``kv_pull`` (the KV transfer, with ``kv_handshake``, ``kv_wire``, ``kv_integrity``,
  ``kv_release`` inside it from :mod:`pdserve.transfer.receiver`), ``queue``, ``first_step``
  (admitted until its first decode step's token), ``steps`` (first until last token);
- a worker that prefills the prompt itself (one leg, or a migrated request): ``queue``,
  ``compute`` (prompt forward and first token), ``steps``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pdserve.observability.logs import bind_request
from pdserve.observability.tracing import Timeline
from pdserve.protocol import ContextRequest, GenerationRequest

if TYPE_CHECKING:
    from pdserve.workers.engine.requests import EngineOutput

log = logging.getLogger(__name__)


def leg_timeline(role: str, worker_id: str, req: ContextRequest | GenerationRequest) -> Timeline:
    """The timeline of ``req`` on this worker (span ``role``, a child of the router leg's span
    named by ``req.traceparent``), started now; also names the request on this task's log
    lines (:func:`pdserve.observability.logs.bind_request`)."""
    timeline = Timeline(
        role,
        traceparent=req.traceparent,
        attributes={
            "pdserve.request_id": req.request_id,
            "pdserve.worker_id": worker_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        },
    )
    span = timeline.span
    trace_id = f"{span.get_span_context().trace_id:032x}" if span is not None else None
    bind_request(req.request_id, trace_id)
    return timeline


class EngineClock:
    """Turns one request's engine outputs into phases of ``timeline``: ``queue`` (submitted,
    i.e. constructed just before ``Engine.add_request``, until the engine first admitted a
    sequence of it: ``EngineOutput.admitted_s``), ``first`` (admitted until the first sampled
    output), ``steps`` (first until last sampled output, at :meth:`finish`; with the output
    tokens and preemptions as attributes). Event loop only."""

    __slots__ = ("_first", "_last", "_mono", "_name", "_submitted", "preemptions", "timeline",
                 "tokens")  # fmt: skip

    def __init__(self, timeline: Timeline | None, first: str) -> None:
        self.timeline = timeline
        self._name = first
        self._submitted = time.time_ns()
        self._mono = time.monotonic()
        self._first: int | None = None
        self._last = 0
        self.tokens = 0
        self.preemptions = 0

    def observe(self, out: EngineOutput) -> None:
        """Account for one output (outputs without tokens are ignored)."""
        if self.timeline is None or not out.token_ids:
            return
        now = time.time_ns()
        if self._first is None:
            waited = max(0.0, (out.admitted_s or self._mono) - self._mono)
            admitted = min(now, self._submitted + int(waited * 1e9))
            self.timeline.add("queue", self._submitted, admitted)
            self.timeline.add(self._name, admitted, now, pdserve_cached_tokens=out.cached_tokens)
            self._first = now
        self._last = now
        self.tokens += len(out.token_ids)
        self.preemptions = max(self.preemptions, out.preemptions)

    @property
    def last_ns(self) -> int:
        """When the last sampled output came (``time.time_ns()``; submission before one)."""
        return self._last or self._submitted

    def finish(self) -> None:
        """Record ``steps`` and the totals (call once, after the last output)."""
        timeline = self.timeline
        if timeline is None:
            return
        if self._first is not None and self._last > self._first:
            timeline.add(
                "steps",
                self._first,
                self._last,
                gen_ai_usage_output_tokens=self.tokens,
                pdserve_preemptions=self.preemptions,
            )
        timeline.set(gen_ai_usage_output_tokens=self.tokens, pdserve_preemptions=self.preemptions)


def end_leg(timeline: Timeline | None, error: str | None = None) -> None:
    """Finish the leg's timeline and log its phase line at debug."""
    if timeline is None or timeline.finished_ns is not None:
        return
    timeline.finish(error)
    if log.isEnabledFor(logging.DEBUG):
        rid = timeline.attributes.get("pdserve.request_id")
        log.debug("req %s: phases here %s%s", rid, timeline.summary(), f" ({error})" * bool(error))
