"""One request's transaction, under one wall-clock deadline: the two-leg prefill -> decode
path, or one leg on a single worker.

The policy (:func:`pdserve.router.policy.choose_route`) picks the path: ``disaggregated`` (the
two legs below), or ``local_prefill`` / ``colocated``, where one worker (a decode worker that
prefills the prompt itself, or a colocated worker) runs the whole request behind one
``POST /internal/generate`` without a handle: Router.start() opens that stream and returns once
its first token arrived (so TTFT means the same on every path), then Transaction.events()
relays the rest as in state 4. A connection error (the request never reached the worker)
retries once on another route without that worker. Each decision is logged at debug and
counted (``pdserve_router_decisions_total{path}``). With KV-aware routing
(:class:`~pdserve.router.policy.RouteWeights`, :mod:`pdserve.router.kv_index`) the router
hashes the prompt, asks its KV index how many leading tokens each candidate holds, passes that
to the policy, logs every candidate's cached tokens, load and cost at debug, and observes the
chosen workers' cached tokens (``pdserve_router_kv_overlap_tokens{path,role}``).

Lifecycle of a two-leg request (``Transaction.state``)::

    1 PAIRING     Router.start(): the policy picks a compatible (P, D) pair
    2 PREFILLING  POST ContextRequest to P /internal/context; a connection error (the request
                  never reached P) retries once on another route without P (another prefill
                  worker, or local prefill on a decode worker when no other P is usable)
    3 PREFILLED   Router.start() returns the Transaction: the first token is known and, unless
                  it already finished the request, P holds the prompt's KV blocks under a lease
    4 DECODING    Transaction.events(): the first token is yielded at once (TTFT does not wait
                  for D), then POST GenerationRequest (first token + handle) to D
                  /internal/generate and relay its NDJSON chunks; a refusal before the stream
                  that another D may not share (unreachable, 429 queue full / no free KV
                  blocks, 503 capacity, a failed pull: P still holds the blocks) retries on
                  the least loaded other decode worker whose KV layout P's maps to, up to 3
                  decode workers, while the lease and the deadline last
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
ends when all n choices finished; an error or abort chunk of any choice fails the request.

Cleanup (:meth:`Transaction.aclose`, idempotent, also run when ``events()`` ends for any
reason): close the D stream (the decode worker aborts and frees its blocks) and, unless D
finished the request (and so released them), POST ReleaseRequest to P (best effort, logged) so
its parked blocks are freed now instead of at lease expiry. Cleanup is shielded from
cancellation and bounded in time, so a client disconnect cannot skip it and cannot hang it.

Ownership: the transaction owns the D stream and the router-side in-flight counts it took; P's
parked blocks are P's, released by D (success) or by this transaction's release (failure).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

import anyio

from pdserve.errors import (
    CapacityError,
    HandleError,
    LayoutMismatchError,
    NoWorkerError,
    QueueFullError,
    TransferError,
    WorkerError,
    WorkerUnreachableError,
)
from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ReleaseRequest,
    SamplingParams,
    TokenLogprob,
    WorkerRecord,
)
from pdserve.router.client import GenerationStream, WorkerClient
from pdserve.router.kv_index import KVIndex, PromptHashes, expected_cached_tokens
from pdserve.router.policy import LEAST_LOADED, Pair, Route, RouteWeights, choose_route, load_key
from pdserve.router.view import WorkerView

if TYPE_CHECKING:
    from pdserve.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One step of output of choice ``index``: new token ids, their text and (if asked)
    logprobs. Each choice's last event in a successful transaction has ``finish_reason`` STOP
    or LENGTH."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    index: int = 0


@dataclass(frozen=True)
class RequestSpec:
    """What the router was asked to run. ``deadline`` is wall-clock UNIX seconds."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float


class TxnState(StrEnum):
    PREFILLED = "prefilled"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    ABANDONED = "abandoned"


class Router:
    """Starts transactions: routes the request (:func:`choose_route`), runs the prefill leg or
    opens the one-leg stream, hands back a :class:`Transaction` for the rest.

    ``request_timeout_s`` is the whole request's budget (both legs). ``metrics``, when given,
    records every request's outcome, TTFT, ITL, TPOT, token counts and routing decisions.
    ``local_prefill_max_tokens``: prompts with at most this many tokens left to compute are
    prefilled by the decode worker itself (0: off). ``kv_index`` + ``weights``: KV-aware
    routing (on when ``weights.kv_overlap_weight > 0`` and an index is given). Ownership: the
    router uses but does not own ``view``, ``client``, ``metrics`` and ``kv_index``.
    """

    def __init__(
        self,
        view: WorkerView,
        client: WorkerClient,
        *,
        request_timeout_s: float,
        metrics: RouterMetrics | None = None,
        local_prefill_max_tokens: int = 0,
        kv_index: KVIndex | None = None,
        weights: RouteWeights = LEAST_LOADED,
    ):
        self.view = view
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.kv_index = kv_index
        self.weights = weights

    async def start(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Transaction:
        """Run states 1-3 (or open the one-leg stream up to its first token). Raises
        NoWorkerError (503) when no worker qualifies, or the first leg's typed error; nothing
        has reached the client yet when it raises."""
        t_in = time.monotonic()
        try:
            txn = await self._start(request_id, prompt_token_ids, sampling)
        except BaseException:
            if self.metrics is not None:
                self.metrics.requests.labels("failed").inc()
            raise
        txn.t_in = t_in
        if self.metrics is not None:
            self.metrics.ttft.observe(txn.t_first - t_in)
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))
            self.metrics.running.inc()
        return txn

    def route(self, prompt_token_ids: Sequence[int], exclude: Sequence[str] = ()) -> Route:
        """The policy's decision for this prompt now, with each candidate's expected cached
        prefix when KV-aware routing is on. Raises NoWorkerError."""
        cands = self.view.candidates()
        cached: dict[str, int] | None = None
        if self.kv_index is not None and self.weights.kv_aware:
            workers = [w.record for w in (*cands.prefill, *cands.decode, *cands.colocated)]
            cached = expected_cached_tokens(self.kv_index, workers, PromptHashes(prompt_token_ids))
        return choose_route(
            cands,
            len(prompt_token_ids),
            local_prefill_max_tokens=self.local_prefill_max_tokens,
            cached=cached,
            weights=self.weights,
            exclude=exclude,
        )

    def _record_decision(self, request_id: str, route: Route) -> None:
        """Log the decision at debug and count it (path; KV-aware: cached tokens per role)."""
        log.debug(
            "req %s: route %s via %s%s (%s)%s",
            request_id,
            route.path,
            route.worker.worker_id,
            f" after prefill on {route.prefill.worker_id}" if route.prefill else "",
            route.reason,
            f"; KV-aware: {' '.join(map(str, route.scores))}" if route.scores else "",
        )
        m = self.metrics
        if m is None:
            return
        m.decisions.labels(route.path.value).inc()
        if self.weights.kv_aware and self.kv_index is not None:
            path = route.path.value
            m.kv_overlap.labels(path, route.worker.role.value).observe(route.cached_tokens)
            if route.prefill is not None:
                m.kv_overlap.labels(path, "prefill").observe(route.prefill_cached_tokens)

    async def _start(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Transaction:
        spec = RequestSpec(
            request_id, tuple(prompt_token_ids), sampling, time.time() + self.request_timeout_s
        )
        t0 = time.monotonic()
        tried: list[str] = []
        first_error: WorkerUnreachableError | None = None
        while True:
            try:
                route = self.route(spec.prompt_token_ids, tried)
            except NoWorkerError as exc:
                if first_error is None:
                    raise
                raise WorkerUnreachableError(
                    f"{first_error.message}; no other worker to retry on"
                ) from exc
            self._record_decision(request_id, route)
            holds = ExitStack()
            holds.enter_context(self.view.track(route.worker.worker_id))
            try:
                pair = route.pair
                if pair is None:
                    txn = await self._one_leg(spec, route, holds)
                else:
                    context = await self._prefill(spec, pair)
                    txn = Transaction(self, spec, route, context, holds)
            except WorkerUnreachableError as exc:
                holds.close()
                failed = route.prefill or route.worker
                self.view.mark_unreachable(failed)
                if first_error is not None:
                    raise
                log.warning("req %s: %s; retrying without %s", request_id, exc, failed.worker_id)
                first_error = exc
                tried.append(failed.worker_id)
                continue
            except BaseException:
                holds.close()
                raise
            log.info(
                "req %s: %s prompt=%d tokens, first token in %.1f ms%s",
                request_id,
                f"P={route.prefill.worker_id} D={route.worker.worker_id}"
                if route.prefill
                else f"{route.path} on {route.worker.worker_id}:",
                len(spec.prompt_token_ids),
                (time.monotonic() - t0) * 1e3,
                f" (finished: {txn.finished_at_start})" if txn.finished_at_start else "",
            )
            return txn

    async def _prefill(self, spec: RequestSpec, pair: Pair) -> ContextResponse:
        req = ContextRequest(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids,
            sampling=spec.sampling,
            deadline=spec.deadline,
        )
        with self.view.track(pair.prefill.worker_id):
            # Giving up here (deadline, client gone) closes the connection: P sees it and frees
            # blocks it parks after that itself (the release needs the lease id, which only its
            # answer would have carried); its own deadline and the lease bound the rest.
            return await self.client.context(pair.prefill, req)

    async def _one_leg(self, spec: RequestSpec, route: Route, holds: ExitStack) -> Transaction:
        """Open ``route.worker``'s stream for the whole request (no handle: it prefills the
        prompt itself) and read it up to the first token. Raises the worker's typed error
        (WorkerUnreachableError: never reached it)."""
        req = GenerationRequest(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids,
            sampling=spec.sampling,
            deadline=spec.deadline,
        )
        stream = await self.client.generate(route.worker, req)
        txn = Transaction(self, spec, route, None, holds, stream)
        try:
            await txn.first_output()
        except BaseException:
            await txn.discard()
            raise
        return txn


_NOT_RETRIED = frozenset({HandleError.code, LayoutMismatchError.code})
"""Decode-leg refusals no other decode worker fixes (the handle is refused, or P's KV layout
maps to no pool of this kind), by error code (the envelope's, as the client raises it)."""

DECODE_ATTEMPTS = 3
"""Decode workers one request's decode leg may try (the first and two retries)."""


class Transaction:
    """States 3-5 of one request (or the one-leg stream after its first token); see the module
    docstring. Not reusable: iterate :meth:`events` once, then (or instead) call
    :meth:`aclose`. ``route`` is the policy's decision; ``pair`` the (P, D) pair of a two-leg
    transaction (None on a one-leg path); ``context`` P's answer (None on a one-leg path)."""

    def __init__(
        self,
        router: Router,
        spec: RequestSpec,
        route: Route,
        context: ContextResponse | None,
        holds: ExitStack,
        stream: GenerationStream | None = None,
    ) -> None:
        self._router = router
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
                yield TokenEvent(
                    (ctx.first_token,),
                    ctx.text,
                    (ctx.logprob,) if ctx.logprob is not None else (),
                    ctx.finish_reason,
                    index=0,
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
        if self._chunks is None:
            await self._open_decode_leg()
        assert self._chunks is not None
        async for chunk in self._chunks:
            event = self._take(chunk)
            if event is None:
                continue
            yield event
            if not self._unfinished:
                return
        raise WorkerError(
            f"{self._leg} ended its stream before choice(s) {sorted(self._unfinished)} finished"
        )

    async def _open_decode_leg(self) -> None:
        """Two legs: POST the first token + handle to D. A decode worker that refuses before
        streaming for a reason another one may not share (unreachable, no KV blocks free or
        its queue full, a failed pull: P still holds the blocks, since only a pull that landed
        releases them) is replaced by the least loaded other one that P's layout maps to, up to
        :data:`DECODE_ATTEMPTS` decode workers in all, while the lease and the deadline last."""
        assert self.context is not None and self.context.handle is not None  # client.context()
        assert self.pair is not None
        handle = self.context.handle
        self.state = TxnState.DECODING
        self._t_leg = time.monotonic()
        req = GenerationRequest(
            request_id=self.request_id,
            prompt_token_ids=self.spec.prompt_token_ids,
            sampling=self.spec.sampling,
            deadline=self.spec.deadline,
            first_token=self.context.first_token,
            handle=handle,
        )
        tried: set[str] = set()
        while True:
            decode = self.pair.decode
            tried.add(decode.worker_id)
            try:
                self._stream = await self._router.client.generate(decode, req)
                break
            except (WorkerUnreachableError, QueueFullError, CapacityError, TransferError) as exc:
                if isinstance(exc, WorkerUnreachableError):
                    self._router.view.mark_unreachable(decode)
                other = self._other_decode(tried)
                final = exc.code in _NOT_RETRIED  # the handle or P's layout: same everywhere
                left = min(handle.lease_remaining(), self.spec.deadline - time.time())
                if final or other is None or len(tried) >= DECODE_ATTEMPTS or left <= 1.0:
                    raise
                log.warning("req %s: %s; retrying on decode worker %s", self.request_id, exc,
                            other.worker_id)  # fmt: skip
            self.pair = Pair(self.pair.prefill, other)
            self.route = replace(self.route, worker=other)
            self._holds.enter_context(self._router.view.track(other.worker_id))
            self._leg = f"decode worker {other.worker_id}"
        self._chunks = self._stream.chunks()

    def _take(self, chunk: GenerationChunk) -> TokenEvent | None:
        """Account for one streamed chunk and return its event (None: a chunk to drop). Raises
        WorkerError for an error or abort chunk, or a chunk of another request."""
        leg = self._leg
        if chunk.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise WorkerError(f"{leg} failed the request: {chunk.error or chunk.finish_reason}")
        if chunk.request_id != self.request_id:
            raise WorkerError(f"{leg} streamed a chunk for request {chunk.request_id!r}")
        if not self._accept(chunk, leg):
            return None
        i = chunk.index
        now = time.monotonic()
        if self.num_tokens == 0:  # one leg: the first output (TTFT), no inter-token gap yet
            self.t_first = now
            self._t_choice = [now] * len(self._t_choice)
        elif self._router.metrics is not None:
            self._router.metrics.itl.observe(now - self._t_choice[i])
        self.num_tokens += len(chunk.token_ids)
        self.choice_tokens[i] += len(chunk.token_ids)
        self.t_last = self._t_choice[i] = now
        if chunk.finish_reason is not None:
            self._unfinished.discard(i)
        if not self._unfinished:  # before the yield: a consumer may stop at this event
            self.state = TxnState.FINISHED
            self.finish_reason = chunk.finish_reason
            log.info(
                "req %s finished (%s): %d tokens in %d choice(s), %s leg %.1f ms",
                self.request_id,
                chunk.finish_reason,
                self.num_tokens,
                len(self.choice_tokens),
                "decode" if self.context is not None else str(self.route.path),
                (time.monotonic() - self._t_leg) * 1e3,
            )
        return TokenEvent(chunk.token_ids, chunk.text, chunk.logprobs, chunk.finish_reason, index=i)

    def _other_decode(self, tried: set[str]) -> WorkerRecord | None:
        """The least loaded usable decode worker not in ``tried`` that P's KV layout maps to
        (None: no other)."""
        assert self.pair is not None
        p_layout = self.pair.prefill.layout
        others = [
            d
            for d in self._router.view.candidates().decode
            if d.worker_id not in tried and p_layout.can_map_to(d.record.layout)
        ]
        return min(others, key=load_key).record if others else None

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
                if self._stream is not None:
                    await self._stream.aclose()
                handle = self.context.handle if self.context is not None else None
                decoded = self.state is TxnState.FINISHED and self._stream is not None
                if handle is not None and self.pair is not None and not decoded:
                    log.info(
                        "req %s: %s; releasing its blocks on %s",
                        self.request_id,
                        self.state,
                        self.pair.prefill.worker_id,
                    )
                    await self._router.client.release(
                        self.pair.prefill,
                        ReleaseRequest(
                            request_id=self.request_id,
                            epoch=handle.epoch,
                            lease_id=handle.lease_id,
                        ),
                    )
        finally:
            self._holds.close()
            self._record()

    def _record(self) -> None:
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
