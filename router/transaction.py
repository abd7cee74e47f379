"""One request's transaction, under one wall-clock deadline: the two-leg prefill -> decode
path, or one leg on a single worker.

:class:`pdserve.router.router.Router` decides the path and starts the transaction; this module
runs it.

Lifecycle of a two-leg request (``Transaction.state``)::

    1 PAIRING     Router.start(): the policy picks a compatible (P, D) pair
    2 PREFILLING  POST ContextRequest to P /internal/context; a failure (a connection
                  error, a broken connection, an error answer, P leaving discovery while the
                  router waits) routes the request again without P (another prefill worker,
                  or local prefill on a decode worker when no other P is usable), up to
                  ``router.migration_limit`` times (Router.start)
    3 PREFILLED   Router.start() returns the Transaction: the first token is known and, unless
                  it already finished the request, P holds the prompt's KV blocks under a lease
                  (streamed hand-off, ``kv_stream_min_tokens``: P named a streamed handle at
                  admission and D's leg was opened with it then, ``decode_ahead``; D pulled
                  each prefill chunk meanwhile, and if D refused, 4 hands the whole prompt off)
    4 DECODING    Transaction.events(): the first token is yielded at once (TTFT does not wait
                  for D), then POST GenerationRequest (first token + handle) to D
                  /internal/generate and relay its NDJSON chunks; a refusal before the stream
                  that another D may not share (unreachable, 429 queue full / no free KV
                  blocks, 503 capacity, a failed pull: P still holds the blocks) retries on
                  the policy's best other decode worker whose KV layout P's maps to
                  (policy.choose_retry: the KV-aware cost when on), up to 3 decode
                  workers, while the lease and the deadline last
      (4 again)   the decode leg failed, before or after its first chunk (stream broken,
                  in-band error, D draining, D leaving discovery and silent for
                  LOST_GRACE_S, a refusal no retry fixed): P's blocks are released and the
                  request continues on another decode or colocated worker with
                  GenerationRequest.resume (the tokens and text sent so far, per choice),
                  state 4 on, at most ``router.migration_limit`` times (:mod:`.migration`)
    5 FINISHED    every choice's last event carried finish_reason stop/length; D released P's
                  blocks (or, when the first token finished the request, P never parked them)
      FAILED      a typed error was raised (WorkerError, TransferError, CapacityError,
                  DeadlineExceededError)
      ABANDONED   the consumer stopped before the end (client disconnected)

Choices (``sampling.n``): every event names its choice (``TokenEvent.index``, 0..n-1). P's
first token is choice 0's. With ``n > 1`` P always parks the blocks, so the decode leg runs
whenever a choice is unfinished, even when the first token already finished choice 0; D samples
the first tokens of choices 1..n-1 and streams the choices' chunks interleaved. A finish-only
chunk for a choice that already finished (choice 0's, echoed by D) is dropped. The request
ends when all n choices finished; an error or abort chunk of any choice fails the leg, which
is migrated with all unfinished choices (or fails the request past the migration limit).

Cleanup (:meth:`Transaction.aclose`, idempotent, also run when ``events()`` ends for any
reason): close the D stream (the decode worker aborts and frees its blocks) and, unless D
finished the request (and so released them), POST ReleaseRequest to P (best effort, logged) so
its parked blocks are freed now instead of at lease expiry. Cleanup is shielded from
cancellation and bounded in time, so a client disconnect cannot skip it and cannot hang it.

Ownership: the transaction owns the D stream and the router-side in-flight counts it took; P's
parked blocks are P's, released by D (success) or by this transaction's release (failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import anyio

from pdserve.errors import (
    InvalidRequestError,
    PdserveError,
    WorkerError,
    WorkerUnreachableError,
)
from pdserve.observability.tracing import Timeline
from pdserve.protocol import (
    ContextResponse,
    FinishReason,
    GenerationChunk,
    ReleaseRequest,
    WorkerRecord,
)
from pdserve.router.client import GenerationStream
from pdserve.router.migration import (
    LOST_GRACE_S,
    MigrationParts,
    failure_reason,
    leg_request_id,
    open_resumed,
    resume_request,
    unless_lost,
)
from pdserve.router.policy import Pair, Route
from pdserve.router.request import RequestSpec, TokenEvent
from pdserve.router.retry import DECODE_REFUSALS, LEG_FAILURES
from pdserve.router.view import LOST

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pdserve.router.router_metrics import RouterMetrics

log = logging.getLogger(__name__)


class RouterParts(MigrationParts, Protocol):
    """What a transaction uses of the router that started it
    (:class:`pdserve.router.router.Router` satisfies it): what a migration uses, the
    metrics, and where a finished request's session now lives."""

    @property
    def metrics(self) -> RouterMetrics | None: ...

    def remember_session(self, spec: RequestSpec, worker: WorkerRecord, tokens: int) -> None: ...


class TxnState(StrEnum):
    PREFILLED = "prefilled"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    ABANDONED = "abandoned"


class Transaction:
    """States 3-5 of one request (or the one-leg stream after its first token); see the module
    docstring. Not reusable: iterate :meth:`events` once, then (or instead) call
    :meth:`aclose`. ``route`` is the policy's decision; ``pair`` the (P, D) pair of a two-leg
    transaction (None on a one-leg path); ``context`` P's answer (None on a one-leg path)."""

    def __init__(
        self,
        router: RouterParts,
        spec: RequestSpec,
        route: Route,
        context: ContextResponse | None,
        holds: ExitStack,
        stream: GenerationStream | None = None,
        decode_ahead: asyncio.Future[GenerationStream] | None = None,
    ) -> None:
        self._router = router
        self._retry = router.retry
        self._decode_ahead = decode_ahead  # the streamed hand-off's decode leg, opening
        self.spec = spec
        self.route = route
        self.pair = route.pair
        self.context = context
        self._holds = holds
        self._stream = stream
        self._chunks = stream.chunks() if stream is not None else None
        self._pending: list[TokenEvent] = []  # one leg: events read before start() returned
        self.finish_reason: FinishReason | None = None  # the last choice's, once all finished
        self._leg = f"{route.worker.role.value} worker {route.worker.worker_id}"
        self._closed = False
        n = spec.sampling.n
        if context is not None:
            self._unfinished = set(range(1 if context.finish_reason else 0, n))
            self.state = TxnState.PREFILLED if self._unfinished else TxnState.FINISHED
            self.num_tokens = 1  # over all choices
            self.choice_tokens = [1] + [0] * (n - 1)
        else:
            self._unfinished = set(range(n))
            self.state = TxnState.DECODING
            self.num_tokens = 0
            self.choice_tokens = [0] * n
        self.t_in = self.t_first = self.t_last = self._t_leg = time.monotonic()
        self._t_choice = [self.t_first] * n  # each choice's last token (inter-token latency)
        self._sent: list[list[int]] = [[] for _ in range(n)]  # per choice: tokens sent on
        self._sent_chars = [0] * n  # per choice: characters of text sent on
        self.migrations = 0  # decode legs run again on another worker (mid-stream migration)
        self._migrated_at: float | None = None  # monotonic: the last migration's failure
        self._released = False  # P's parked blocks were released at a migration
        self._unwatch: Callable[[], None] | None = None
        self.leg_span: Span | None = None  # the current leg's (tracing), ended with the leg
        self._leg_started = False  # the current leg's first chunk came (its phase is marked)
        if stream is not None:
            self._watch(stream, route.worker)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def finished_at_start(self) -> FinishReason | None:
        """The finish reason when the request ended before :meth:`events` (P's first token
        finished it, or a one-leg stream's first chunks did), else None."""
        if self.context is not None:
            return self.context.finish_reason
        return None if self._unfinished else self.finish_reason

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        """Yield the first token (from P, choice 0; or the one-leg stream's first events), then
        the rest of every choice. Raises a typed error on failure; always cleans up
        (``aclose``) when it ends, however it ends."""
        ctx = self.context
        try:
            if ctx is not None:
                self._sent[0].append(ctx.first_token)
                self._sent_chars[0] += len(ctx.text)
                yield TokenEvent(
                    (ctx.first_token,),
                    ctx.text,
                    (ctx.logprob,) if ctx.logprob is not None else (),
                    ctx.finish_reason,
                    index=0,
                    cached_tokens=ctx.cached_tokens,
                    prompt_logprobs=ctx.prompt_logprobs,
                )
            pending, self._pending = self._pending, []
            for event in pending:
                yield event
            if not self._unfinished:
                return
            async for event in self._decode():
                yield event
        except Exception:
            self.state = TxnState.FAILED
            raise
        finally:
            await self.aclose()

    def ready(self) -> bool:
        """Whether :meth:`events` has its next event at hand: the decode stream's next chunk is
        already read, so taking it waits on nothing. A server rendering the stream holds what
        it rendered while this is true and writes it at once when it is not (one write for the
        chunks that arrived together, never a delay)."""
        return self._stream is not None and not self._stream.closed and self._stream.buffered()

    async def first_output(self) -> None:
        """One leg: read the stream until its first token (or the end of every choice), keeping
        the events for :meth:`events`. Raises the typed error of a failed or short stream."""
        assert self._chunks is not None
        while self.num_tokens == 0 and self._unfinished:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise WorkerError(f"{self._leg} ended its stream before its first token") from None
            event = self._take(chunk)
            if event is not None:
                self._pending.append(event)

    async def discard(self) -> None:
        """Close a transaction :meth:`Router.start` did not hand out (its first leg failed):
        the stream and the in-flight counts, without recording an outcome (start does)."""
        self._closed = True
        try:
            if self._stream is not None:
                with anyio.move_on_after(self._router.client.release_timeout_s, shield=True):
                    await self._stream.aclose()
        finally:
            self._holds.close()

    async def _decode(self) -> AsyncIterator[TokenEvent]:
        """The decode leg's events; a leg that fails (before or after its first chunk) is
        migrated (:meth:`_migrate`) while the retry policy allows
        (:meth:`~pdserve.router.retry.RetryPolicy.migration`)."""
        if self._chunks is None:
            try:
                await self._open_decode_leg()
            except LEG_FAILURES as exc:
                if not self._retry.migration(self.migrations, self.spec.deadline):
                    raise
                await self._migrate(exc)
        while True:
            assert self._chunks is not None
            try:
                async for chunk in self._chunks:
                    event = self._take(chunk)
                    if event is None:
                        continue
                    yield event
                    if not self._unfinished:
                        return
                unfinished = sorted(self._unfinished)
                raise WorkerError(
                    f"{self._leg} ended its stream before choice(s) {unfinished} finished"
                )
            except LEG_FAILURES as exc:
                if not self._retry.migration(self.migrations, self.spec.deadline):
                    raise
                await self._migrate(exc)

    async def _migrate(self, exc: PdserveError) -> None:
        """Mid-stream migration: close the failed leg, release P's parked blocks (the failed
        decode worker may never have pulled them), and open the request on the policy's best
        other decode or colocated worker with ``GenerationRequest.resume``: every unfinished
        choice's tokens and text as sent on, so the new worker recomputes their KV and
        continues where the stream stopped (no token repeated or missing; seeded and greedy
        choices as undisturbed). Waits for a worker (``router.worker_wait_s``) when none is
        usable; raises ``exc`` when none comes, or a new leg's refusal that is not the
        worker's (a full queue, the deadline). Log line and metrics per migration."""
        failed = self.route.worker
        reason = failure_reason(exc)
        self.migrations += 1
        self._migrated_at = time.monotonic()
        router = self._router
        if router.metrics is not None:
            router.metrics.migrations.labels("decode", reason).inc()
        log.warning(
            "req %s: %s; migrating (%d of at most %d, %s) with %d token(s) sent",
            self.request_id,
            exc,
            self.migrations,
            router.settings.migration_limit,
            reason,
            sum(map(len, self._sent)),
        )
        await self._close_leg(str(exc))
        if isinstance(exc, WorkerUnreachableError):
            router.view.mark_unreachable(failed)
        await self._release_prefill()
        tl = self.spec.timeline
        tl.mark("migration", pdserve_reason=reason)
        self.leg_span = tl.begin("decode", pdserve_migration=self.migrations)
        base = self.spec.generation(traceparent=tl.traceparent(self.leg_span))
        req = resume_request(base, self._sent, self._sent_chars, self._unfinished, self.migrations)
        stream, target = await open_resumed(router, req, failed, exc, self.spec.deadline)
        self._holds.enter_context(router.view.track(target.worker_id))
        self.route = replace(self.route, worker=target)
        self._leg = f"{target.role.value} worker {target.worker_id}"
        self._watch(stream, target)

    def _watch(self, stream: GenerationStream, worker: WorkerRecord) -> None:
        """Make ``stream`` the current leg, given up (:meth:`GenerationStream.lose`) when this
        incarnation of ``worker`` leaves discovery (stopped or partitioned past its lease)."""
        self._stream = stream
        self._chunks = stream.chunks()
        self._leg_started = False
        view = self._router.view
        self._unwatch = view.watch_loss(worker, lambda why: stream.lose(why, LOST_GRACE_S))
        current = view.record(worker.worker_id)
        if view.follows and (current is None or current.epoch != worker.epoch):
            stream.lose(f"worker {worker.worker_id} {LOST} while its stream opened", LOST_GRACE_S)

    async def _close_leg(self, error: str | None = "closed early") -> None:
        """Stop watching and close the current leg's stream (bounded, shielded); end its span
        (``error``: its status)."""
        Timeline.end(self.leg_span, error, pdserve_worker_id=self.route.worker.worker_id)
        self.leg_span = None
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._stream is not None:
            with anyio.move_on_after(self._router.client.release_timeout_s, shield=True):
                if error is None and self.state is TxnState.FINISHED:
                    await self._stream.finish()  # keeps the connection for the next request
                else:
                    await self._stream.aclose()

    async def _release_prefill(self) -> None:
        """Ask P to free the request's parked blocks (once; best effort)."""
        handle = self.context.handle if self.context is not None else None
        if handle is None or self.pair is None or self._released:
            return
        self._released = True
        log.info(
            "req %s: %s; releasing its blocks on %s",
            self.request_id,
            self.state,
            self.pair.prefill.worker_id,
        )
        with anyio.move_on_after(self._router.client.release_timeout_s + 1.0, shield=True):
            await self._router.client.release(
                self.pair.prefill,
                ReleaseRequest(
                    request_id=self.request_id, epoch=handle.epoch, lease_id=handle.lease_id
                ),
            )

    async def _open_decode_leg(self) -> None:
        """Two legs: POST the first token + handle to D. A decode worker that refuses before
        streaming for a reason another one may not share (unreachable, no KV blocks free or
        its queue full, a failed pull: P still holds the blocks, since only a pull that landed
        releases them) is replaced by the policy's best other one that P's layout maps to
        (:func:`pdserve.router.policy.choose_retry`), up to
        :data:`~pdserve.router.retry.DECODE_ATTEMPTS` decode workers in all, while the lease and
        the deadline last (:meth:`~pdserve.router.retry.RetryPolicy.decode_refusal`)."""
        assert self.context is not None and self.context.handle is not None  # client.context()
        assert self.pair is not None
        handle = self.context.handle
        self.state = TxnState.DECODING
        self._t_leg = time.monotonic()
        if (ahead := self._decode_ahead) is not None:  # the streamed hand-off: D pulled already
            self._decode_ahead = None
            try:
                self._watch(await ahead, self.pair.decode)
                return
            except DECODE_REFUSALS as exc:
                log.warning(  # P still holds the blocks: hand the whole request off instead
                    "req %s: streamed hand-off to %s failed (%s); handing off the whole prompt",
                    self.request_id,
                    self.pair.decode.worker_id,
                    exc,
                )
        tl = self.spec.timeline
        Timeline.end(self.leg_span, "streamed hand-off failed")  # (none: not streamed)
        self.leg_span = tl.begin("decode")
        req = self.spec.generation(
            first_token=self.context.first_token,
            handle=handle,
            traceparent=tl.traceparent(self.leg_span),
        )
        tried: set[str] = set()
        while True:
            decode = self.pair.decode
            tried.add(decode.worker_id)
            try:
                call = self._router.client.generate(decode, req)
                stream = await unless_lost(self._router.view, (self.pair.prefill, decode), call)
                break
            except DECODE_REFUSALS as exc:
                if isinstance(exc, WorkerUnreachableError):
                    self._router.view.mark_unreachable(decode)
                retry = self._retry.decode_refusal(
                    exc, len(tried), self.spec.deadline, handle.lease_remaining()
                )
                other = self._other_decode(tried) if retry else None
                if other is None:
                    raise
                log.warning(
                    "req %s: %s; retrying on decode worker %s",
                    self.request_id,
                    exc,
                    other.worker_id,
                )
            self.pair = Pair(self.pair.prefill, other)
            self.route = replace(self.route, worker=other)
            self._holds.enter_context(self._router.view.track(other.worker_id))
            self._leg = f"decode worker {other.worker_id}"
        self._watch(stream, decode)

    def _take(self, chunk: GenerationChunk) -> TokenEvent | None:
        """Account for one streamed chunk and return its event (None: a chunk to drop). Raises
        WorkerError for an error or abort chunk, or a chunk of another request;
        InvalidRequestError for an error the request caused (``GenerationChunk.error_code``),
        which no other worker would fix."""
        leg = self._leg
        if chunk.error_code is not None and chunk.error is not None:  # the request's own fault
            raise InvalidRequestError(chunk.error, code=chunk.error_code)
        if chunk.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise WorkerError(f"{leg} failed the request: {chunk.error or chunk.finish_reason}")
        if chunk.request_id != leg_request_id(self.request_id, self.migrations):
            raise WorkerError(f"{leg} streamed a chunk for request {chunk.request_id!r}")
        tl = self.spec.timeline
        if chunk.phases:  # the leg's last chunk (even one dropped below): the worker's phases
            tl.add_peer(self.route.worker.role.value, chunk.phases, time.time_ns())
        if not self._accept(chunk, leg):
            return None
        i = chunk.index
        now = time.monotonic()
        m = self._router.metrics
        if not self._leg_started:  # one leg's first output, or a decode leg's first chunk
            self._leg_started = True
            tl.mark(
                "first_token" if self.context is None and not self.migrations else "decode_first"
            )
        if self.num_tokens == 0:  # one leg: the first output (TTFT), no inter-token gap yet
            self.t_first = now
            self._t_choice = [now] * len(self._t_choice)
        elif m is not None:
            m.itl.observe(now - self._t_choice[i])
        if self._migrated_at is not None:  # a migrated leg's first chunk
            if m is not None:
                m.migration_s.observe(now - self._migrated_at)
            self._migrated_at = None
        self._sent[i].extend(chunk.token_ids)
        self._sent_chars[i] += len(chunk.text)
        self.num_tokens += len(chunk.token_ids)
        self.choice_tokens[i] += len(chunk.token_ids)
        self.t_last = self._t_choice[i] = now
        first_leg = self.context is None and not self.migrations  # the worker that prefilled
        if chunk.finish_reason is not None:
            self._unfinished.discard(i)
        if not self._unfinished:  # before the yield: a consumer may stop at this event
            self.state = TxnState.FINISHED
            self.finish_reason = chunk.finish_reason
            tl.mark("decode")
            log.info(
                "req %s finished (%s): %d tokens in %d choice(s), %s leg %.1f ms",
                self.request_id,
                chunk.finish_reason,
                self.num_tokens,
                len(self.choice_tokens),
                "decode" if self.context is not None else str(self.route.path),
                (time.monotonic() - self._t_leg) * 1e3,
            )
        return TokenEvent(
            chunk.token_ids,
            chunk.text,
            chunk.logprobs,
            chunk.finish_reason,
            index=i,
            cached_tokens=chunk.cached_tokens if first_leg else None,
            prompt_logprobs=chunk.prompt_logprobs if first_leg else (),
        )

    def _other_decode(self, tried: set[str]) -> WorkerRecord | None:
        """The usable decode worker not in ``tried`` that P's KV layout maps to, by the policy's
        order (:func:`pdserve.router.policy.choose_retry`); None: no other."""
        assert self.pair is not None
        return self._router.retry_target(
            self.spec.prompt_token_ids,
            skip=lambda w: w.worker_id in tried,
            maps_from=self.pair.prefill.layout,
            salt=self.spec.sampling.cache_salt,
        )

    def _accept(self, chunk: GenerationChunk, leg: str) -> bool:
        """Whether ``chunk`` is news for its choice. A finish-only chunk of a choice that has
        already finished (choice 0's when its first token ended it on P, echoed by D) is not;
        anything else for a finished or unknown choice is a protocol error (WorkerError)."""
        if chunk.index in self._unfinished:
            return True
        n = len(self.choice_tokens)
        if chunk.index < n and not chunk.token_ids and not chunk.text:
            return False
        raise WorkerError(
            f"{leg} streamed tokens for choice {chunk.index} of a request with n={n}, "
            "which had already finished or does not exist"
        )

    async def aclose(self) -> None:
        """Close the D (or one-leg) stream and, unless D finished the request (D released them),
        release P's parked blocks. Idempotent, shielded from cancellation, bounded by the client's release
        timeout."""
        if self._closed:
            return
        self._closed = True
        if self.state in (TxnState.PREFILLED, TxnState.DECODING):
            self.state = TxnState.ABANDONED
        try:
            with anyio.move_on_after(self._router.client.release_timeout_s + 1.0, shield=True):
                if self._decode_ahead is not None:  # a streamed hand-off's unused decode leg
                    await drop_decode(self._decode_ahead)
                await self._close_leg(None if self.state is TxnState.FINISHED else self.state)
                decoded = self.state is TxnState.FINISHED and self._stream is not None
                if not decoded:
                    await self._release_prefill()
        finally:
            self._holds.close()
            self._record()

    def _record(self) -> None:
        self.spec.timeline.set(
            gen_ai_usage_output_tokens=self.num_tokens, pdserve_migrations=self.migrations
        )
        if self.state is TxnState.FINISHED and self.spec.session_id is not None:
            tokens = len(self.spec.prompt_token_ids) + max(self.choice_tokens, default=0)
            self._router.remember_session(self.spec, self.route.worker, tokens)
        m = self._router.metrics
        if m is None:
            return
        outcome = {TxnState.FINISHED: "finished", TxnState.FAILED: "failed"}
        m.requests.labels(outcome.get(self.state, "abandoned")).inc()
        m.running.dec()
        m.generation_tokens.inc(self.num_tokens)
        if self.state is TxnState.FINISHED:
            m.e2e.observe(self.t_last - self.t_in)
            longest = max(self.choice_tokens)  # per choice: the choices decode side by side
            if longest > 1:
                m.tpot.observe((self.t_last - self.t_first) / (longest - 1))


async def drop_decode(opening: asyncio.Future[GenerationStream]) -> None:
    """Give up a decode leg opened ahead (streamed hand-off): cancel the request if it is
    still being sent (the decode worker sees the connection close and aborts its pull), or
    close its stream; never raises."""
    if not opening.done():
        opening.cancel()
    try:
        stream = await opening
    except BaseException:  # cancelled or refused: nothing is open
        return
    await stream.aclose()
