"""The two-leg prefill -> decode transaction, under one wall-clock deadline.

Lifecycle of one request (``Transaction.state``)::

    1 PAIRING     Router.start(): the policy picks a compatible (P, D) pair
    2 PREFILLING  POST ContextRequest to P /internal/context; a connection error (the request
                  never reached P) retries once on another prefill worker
    3 PREFILLED   Router.start() returns the Transaction: the first token is known and, unless
                  it already finished the request, P holds the prompt's KV blocks under a lease
    4 DECODING    Transaction.events(): the first token is yielded at once (TTFT does not wait
                  for D), then POST GenerationRequest (first token + handle) to D
                  /internal/generate and relay its NDJSON chunks; a connection error (the
                  request never reached D, P still holds the blocks) retries once on another
                  decode worker whose KV layout P's maps to
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

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import anyio

from pdserve.errors import (
    DeadlineExceededError,
    NoWorkerError,
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
from pdserve.router.policy import Pair, choose_pair, load_key
from pdserve.router.view import WorkerView

if TYPE_CHECKING:
    from pdserve.metrics import RouterMetrics

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
    """Starts transactions: pairs workers, runs the prefill leg, hands back a
    :class:`Transaction` for the decode leg.

    ``request_timeout_s`` is the whole request's budget (both legs). ``metrics``, when given,
    records every request's outcome, TTFT, ITL, TPOT and token counts. Ownership: the router
    uses but does not own ``view``, ``client`` and ``metrics``.
    """

    def __init__(
        self,
        view: WorkerView,
        client: WorkerClient,
        *,
        request_timeout_s: float,
        metrics: RouterMetrics | None = None,
    ):
        self.view = view
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics

    async def start(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Transaction:
        """Run states 1-3. Raises NoWorkerError (503) when no pair qualifies, or the prefill
        leg's typed error; nothing has reached the client yet when it raises."""
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
                pair = choose_pair(self.view.candidates(), exclude_prefill=tried)
            except NoWorkerError as exc:
                if first_error is None:
                    raise
                raise WorkerUnreachableError(
                    f"{first_error.message}; no other prefill worker to retry on"
                ) from exc
            holds = ExitStack()
            holds.enter_context(self.view.track(pair.decode.worker_id))
            try:
                context = await self._prefill(spec, pair)
            except WorkerUnreachableError as exc:
                holds.close()
                self.view.mark_unreachable(pair.prefill)
                if first_error is not None:
                    raise
                log.warning("req %s: %s; retrying on another prefill worker", request_id, exc)
                first_error = exc
                tried.append(pair.prefill.worker_id)
                continue
            except BaseException:
                holds.close()
                raise
            log.info(
                "req %s: P=%s D=%s prompt=%d tokens, first token in %.1f ms%s",
                request_id,
                pair.prefill.worker_id,
                pair.decode.worker_id,
                len(spec.prompt_token_ids),
                (time.monotonic() - t0) * 1e3,
                f" (finished: {context.finish_reason})" if context.finish_reason else "",
            )
            return Transaction(self, spec, pair, context, holds)

    async def _prefill(self, spec: RequestSpec, pair: Pair) -> ContextResponse:
        req = ContextRequest(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids,
            sampling=spec.sampling,
            deadline=spec.deadline,
        )
        with self.view.track(pair.prefill.worker_id):
            try:
                return await self.client.context(pair.prefill, req)
            except BaseException as exc:
                # Gave up waiting (deadline, client gone): P may still park the blocks, free them.
                if isinstance(exc, DeadlineExceededError | asyncio.CancelledError):
                    await self._release(pair, spec.request_id, pair.prefill.epoch)
                raise

    async def _release(self, pair: Pair, request_id: str, epoch: int) -> None:
        """Best-effort release on P, shielded from cancellation and bounded in time."""
        with anyio.move_on_after(self.client.release_timeout_s + 1.0, shield=True):
            await self.client.release(
                pair.prefill, ReleaseRequest(request_id=request_id, epoch=epoch)
            )


class Transaction:
    """States 3-5 of one request; see the module docstring. Not reusable: iterate
    :meth:`events` once, then (or instead) call :meth:`aclose`."""

    def __init__(
        self,
        router: Router,
        spec: RequestSpec,
        pair: Pair,
        context: ContextResponse,
        holds: ExitStack,
    ) -> None:
        self._router = router
        self.spec = spec
        self.pair = pair
        self.context = context
        self._holds = holds
        self._stream: GenerationStream | None = None
        self._closed = False
        n = spec.sampling.n
        self._unfinished = set(range(1 if context.finish_reason else 0, n))
        self.state = TxnState.PREFILLED if self._unfinished else TxnState.FINISHED
        self.num_tokens = 1  # over all choices
        self.choice_tokens = [1] + [0] * (n - 1)
        self.t_in = self.t_first = self.t_last = time.monotonic()
        self._t_choice = [self.t_first] * n  # each choice's last token (inter-token latency)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        """Yield the first token (from P, choice 0), then D's tokens of every choice. Raises a
        typed error on failure; always cleans up (``aclose``) when it ends, however it ends."""
        ctx = self.context
        try:
            yield TokenEvent(
                (ctx.first_token,),
                ctx.text,
                (ctx.logprob,) if ctx.logprob is not None else (),
                ctx.finish_reason,
                index=0,
            )
            if not self._unfinished:
                return
            async for event in self._decode():
                yield event
        except Exception:
            self.state = TxnState.FAILED
            raise
        finally:
            await self.aclose()

    async def _decode(self) -> AsyncIterator[TokenEvent]:
        assert self.context.handle is not None  # client.context() guarantees it
        self.state = TxnState.DECODING
        t0 = time.monotonic()
        leg = f"decode worker {self.pair.decode.worker_id}"
        req = GenerationRequest(
            request_id=self.request_id,
            prompt_token_ids=self.spec.prompt_token_ids,
            sampling=self.spec.sampling,
            deadline=self.spec.deadline,
            first_token=self.context.first_token,
            handle=self.context.handle,
        )
        try:
            self._stream = await self._router.client.generate(self.pair.decode, req)
        except WorkerUnreachableError as exc:
            self._router.view.mark_unreachable(self.pair.decode)
            other = self._other_decode()
            if other is None:
                raise
            log.warning("req %s: %s; retrying on decode worker %s", self.request_id, exc,
                        other.worker_id)  # fmt: skip
            self.pair = Pair(self.pair.prefill, other)
            self._holds.enter_context(self._router.view.track(other.worker_id))
            leg = f"decode worker {other.worker_id}"
            try:
                self._stream = await self._router.client.generate(other, req)
            except WorkerUnreachableError:
                self._router.view.mark_unreachable(other)
                raise
        async for chunk in self._stream.chunks():
            if chunk.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise WorkerError(f"{leg} failed the request: {chunk.error or chunk.finish_reason}")
            if chunk.request_id != self.request_id:
                raise WorkerError(f"{leg} streamed a chunk for request {chunk.request_id!r}")
            if not self._accept(chunk, leg):
                continue
            i = chunk.index
            self.num_tokens += len(chunk.token_ids)
            self.choice_tokens[i] += len(chunk.token_ids)
            now = time.monotonic()
            if self._router.metrics is not None:
                self._router.metrics.itl.observe(now - self._t_choice[i])
            self.t_last = self._t_choice[i] = now
            if chunk.finish_reason is not None:
                self._unfinished.discard(i)
            if not self._unfinished:  # before the yield: a consumer may stop at this event
                self.state = TxnState.FINISHED
                log.info(
                    "req %s finished (%s): %d tokens in %d choice(s), decode leg %.1f ms",
                    self.request_id,
                    chunk.finish_reason,
                    self.num_tokens,
                    len(self.choice_tokens),
                    (time.monotonic() - t0) * 1e3,
                )
            yield TokenEvent(
                chunk.token_ids, chunk.text, chunk.logprobs, chunk.finish_reason, index=i
            )
            if not self._unfinished:
                return
        raise WorkerError(
            f"{leg} ended its stream before choice(s) {sorted(self._unfinished)} finished"
        )

    def _other_decode(self) -> WorkerRecord | None:
        """The least loaded usable decode worker, other than the current one, that P's KV
        layout maps to (None: no other)."""
        p_layout = self.pair.prefill.layout
        others = [
            d
            for d in self._router.view.candidates().decode
            if d.worker_id != self.pair.decode.worker_id and p_layout.can_map_to(d.record.layout)
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
        """Close the D stream and, unless D finished the request (D released them), release P's
        parked blocks. Idempotent, shielded from cancellation, bounded by the client's release
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
                handle = self.context.handle
                decoded = self.state is TxnState.FINISHED and self._stream is not None
                if handle is not None and not decoded:
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
