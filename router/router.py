"""The router: picks each request's path and starts its transaction.

The policy (:func:`pdserve.router.policy.choose_route`) picks the path: ``disaggregated`` (the
two legs of :mod:`pdserve.router.transaction`), or ``local_prefill`` / ``colocated``, where one worker (a decode worker that
prefills the prompt itself, or a colocated worker) runs the whole request behind one
``POST /internal/generate`` without a handle: Router.start() opens that stream and returns once
its first token arrived (so TTFT means the same on every path), then Transaction.events()
relays the rest as in its state 4 (DECODING). A first leg that fails (a connection error, a
broken connection, an error answer, its worker leaving discovery while the router waits on it:
:func:`~pdserve.router.migration.unless_lost`) routes the request again without that worker
incarnation, up to ``router.migration_limit`` times (0: only a refused connection, once). While
no route exists (every worker of a role restarting) the request is held for a discovery change,
up to ``router.worker_wait_s`` (:meth:`Router.wait_for_worker`). Each decision is logged at debug and
counted (``pdserve_router_decisions_total{path}``). With KV-aware routing
(:class:`~pdserve.router.policy.RouteWeights`, :mod:`pdserve.router.kv_index`) the router
hashes the prompt, asks its KV index how many leading tokens each candidate holds, passes that
to the policy, logs every candidate's cached tokens, load and cost at debug, and observes the
chosen workers' cached tokens (``pdserve_router_kv_overlap_tokens{path,role}``). A request
with a session id credits the worker of the session's last turn with that turn's tokens
(:mod:`pdserve.router.sessions`) before the policy decides, and a finished request records
where its session now lives. With a fair queue (:mod:`pdserve.router.admission`), a request
first waits for a slot, by tenant and priority, while the workers are saturated.

The transaction that runs the legs after the start is
:class:`pdserve.router.transaction.Transaction`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

import anyio

from pdserve.errors import (
    NoWorkerError,
    PdserveError,
    QueueFullError,
    WorkerUnreachableError,
)
from pdserve.observability.tracing import Timeline
from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    KVLayout,
    ReleaseRequest,
    SamplingParams,
    Share,
    TransferHandle,
    WorkerRecord,
)
from pdserve.router.admission import FairQueue, Ticket
from pdserve.router.client import GenerationStream, WorkerClient
from pdserve.router.kv_index import KVIndex, PromptHashes, expected_cached_tokens
from pdserve.router.migration import failure_reason, unless_lost
from pdserve.router.peer_pull import PeerPull
from pdserve.router.policy import (
    Pair,
    Route,
    RouteWeights,
    choose_retry,
    choose_route,
    route_attributes,
)
from pdserve.router.request import RequestSpec
from pdserve.router.retry import LEG_FAILURES, RetryPolicy
from pdserve.router.sessions import SessionTable
from pdserve.router.transaction import Transaction, drop_decode
from pdserve.router.view import Candidates, WorkerState, WorkerView
from pdserve.security import DEFAULT_TENANT, Tenant

if TYPE_CHECKING:
    from pdserve.config.settings import RouterSettings
    from pdserve.router.router_metrics import RouterMetrics

log = logging.getLogger(__name__)


class Router:
    """Starts transactions: routes the request (:func:`choose_route`), runs the prefill leg or
    opens the one-leg stream, hands back a :class:`Transaction` for the rest.

    ``settings``: the router section, read whole: ``request_timeout_s`` is the whole request's
    budget (both legs); ``local_prefill_max_tokens``: prompts with at most this many tokens
    left to compute are prefilled by the decode worker itself (0: off);
    ``kv_overlap_weight``/``load_weight``: KV-aware routing (on when ``kv_overlap_weight > 0``
    and ``kv_index`` is given); ``session_ttl_s``/``max_sessions``: session affinity (its
    :class:`SessionTable`, owned here; off with ``max_sessions`` 0). ``admission``: the fair
    queue requests wait in while the workers are saturated (None: none). ``metrics``, when
    given, records every request's outcome, TTFT, ITL, TPOT, token counts and routing
    decisions. ``peer_pull_min_tokens``: peer prefix pull (:mod:`pdserve.router.peer_pull`,
    needs ``kv_index``; 0: off). Ownership: the router uses but does not own ``view``,
    ``client``, ``metrics``, ``kv_index`` and ``admission``.
    """

    def __init__(
        self,
        view: WorkerView,
        client: WorkerClient,
        settings: RouterSettings,
        *,
        metrics: RouterMetrics | None = None,
        kv_index: KVIndex | None = None,
        admission: FairQueue | None = None,
    ):
        self.view = view
        self.admission = admission
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.kv_index = kv_index
        self.weights = RouteWeights(settings.kv_overlap_weight, settings.load_weight)
        self.peer_pull = PeerPull(kv_index, client, settings.peer_pull_min_tokens, metrics)
        self._last_hashes: tuple[Sequence[int], str | None, PromptHashes] | None = None
        self.retry = RetryPolicy(settings.migration_limit)
        self.sessions = (
            SessionTable(ttl_s=settings.session_ttl_s, max_sessions=settings.max_sessions)
            if settings.max_sessions > 0
            else None
        )
        self._waiting = 0  # requests held by wait_for_worker

    async def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        timeline: Timeline | None = None,
        session_id: str | None = None,
        tenant: Tenant | None = None,
        priority: int = 0,
    ) -> Transaction:
        """Run states 1-3 (or open the one-leg stream up to its first token), routing a failed
        first leg again and holding the request while no worker qualifies (see the module
        docstring). Raises NoWorkerError (503) when still none qualifies after
        ``worker_wait_s``, QueueFullError (429) when too many requests are held, or the first
        leg's typed error past the retries; nothing has reached the client yet when it
        raises. ``timeline``: the request's (the HTTP handler's; default a new one), which
        gets the phases ``route``, ``prefill`` / ``first_token``, the workers' phases and
        each leg's span (module :mod:`pdserve.observability.tracing`). ``session_id``: the
        conversation the request continues (session affinity, module docstring). ``tenant``
        and ``priority`` (lower is earlier): its place in the fair queue, when there is one;
        :class:`~pdserve.router.admission.TenantQueueFullError` and
        :class:`~pdserve.router.admission.QueueTimeoutError` (429) come from there. The
        client's ``sampling.cache_salt`` is replaced by the request's namespaced salt, the
        tenant's included (:func:`cache_salt`), before anything routes or hashes the prompt."""
        t_in = time.monotonic()
        if timeline is None:
            timeline = Timeline("request", attributes={"pdserve.request_id": request_id})
        ticket: Ticket | None = None
        salt = cache_salt(tenant, sampling.cache_salt)
        if salt != sampling.cache_salt:
            sampling = sampling.model_copy(update={"cache_salt": salt})
        tenant = tenant or Tenant()
        try:
            if self.admission is not None:
                deadline = time.time() + self.settings.request_timeout_s
                prefill = self.needs_prefill(prompt_token_ids, session_id, salt)
                ticket = await self.admission.admit(tenant, priority, deadline, prefill)
                share = Share(tenant=tenant.name, weight=tenant.weight, priority=priority)
                sampling = sampling.model_copy(update={"share": share})  # workers' schedulers
            txn = await self._start(
                request_id, prompt_token_ids, sampling, timeline, session_id, ticket
            )
            if ticket is not None:
                ticket.prefill_done()  # the first token is out
        except BaseException:
            if ticket is not None:
                ticket.release()
            if self.metrics is not None:
                self.metrics.requests.labels("failed").inc()
            raise
        txn.t_in = t_in
        if self.metrics is not None:
            self.metrics.ttft.observe(txn.t_first - t_in)
            if ticket is not None:
                self.metrics.tenant_ttft.labels(tenant.name).observe(txn.t_first - t_in)
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))
            self.metrics.running.inc()
        return txn

    def route(
        self,
        prompt_token_ids: Sequence[int],
        exclude: Sequence[str] = (),
        session_id: str | None = None,
        salt: str | None = None,
    ) -> Route:
        """The policy's decision for this prompt now, with each candidate's expected cached
        prefix when KV-aware routing is on (of the prompt's blocks salted with ``salt``, the
        request's ``sampling.cache_salt``), the session's last worker credited with its last
        turn's tokens (``session_id``). Raises NoWorkerError."""
        route, sticky, sessions = self._decide(prompt_token_ids, exclude, session_id, salt)
        if sessions is not None and self.metrics is not None:
            outcome = "new" if sticky is None else "kept"
            if sticky is not None and sticky != route.worker.worker_id:
                outcome = "moved"
            self.metrics.session_routes.labels(outcome).inc()
        return route

    def _decide(
        self,
        prompt_token_ids: Sequence[int],
        exclude: Sequence[str],
        session_id: str | None,
        salt: str | None = None,
    ) -> tuple[Route, str | None, SessionTable | None]:
        """:meth:`route`'s decision, the session's worker it credited (if any) and the session
        table it consulted (None: none)."""
        cands = self.view.candidates()
        cached = self._cached(cands, prompt_token_ids, salt)
        sticky = None
        sessions = self.sessions if session_id is not None and self.weights.kv_aware else None
        if sessions is not None and session_id is not None:
            cached = {} if cached is None else cached
            n = len(prompt_token_ids)
            sticky = sessions.cached(session_id, n, self.view.record, cached)
        route = choose_route(
            cands,
            len(prompt_token_ids),
            local_prefill_max_tokens=self.settings.local_prefill_max_tokens,
            cached=cached,
            weights=self.weights,
            exclude=exclude,
        )
        return route, sticky, sessions

    def needs_prefill(
        self, prompt_token_ids: Sequence[int], session_id: str | None, salt: str | None = None
    ) -> bool:
        """Whether the request would take a prefill worker now (the disaggregated path: its
        uncached tokens past ``local_prefill_max_tokens``), as the fair queue asks; False
        when no worker can serve it."""
        try:
            route, _, _ = self._decide(prompt_token_ids, (), session_id, salt)
        except NoWorkerError:
            return False
        return route.prefill is not None

    def remember_session(self, spec: RequestSpec, worker: WorkerRecord, tokens: int) -> None:
        """A finished request of session ``spec.session_id`` left ``tokens`` tokens (prompt
        + generated) in ``worker``'s cache: its next turn prefers that worker."""
        if spec.session_id is not None and self.sessions is not None:
            self.sessions.remember(spec.session_id, worker, tokens)

    def retry_target(
        self,
        prompt_token_ids: Sequence[int],
        *,
        skip: Callable[[WorkerState], bool],
        maps_from: KVLayout | None = None,
        colocated: bool = False,
        salt: str | None = None,
    ) -> WorkerRecord | None:
        """The worker a failed leg moves to now (:func:`choose_retry`, with the prompt's
        expected cached prefix per worker when KV-aware routing is on); None: none usable."""
        cands = self.view.candidates()
        return choose_retry(
            cands,
            len(prompt_token_ids),
            skip=skip,
            maps_from=maps_from,
            colocated=colocated,
            cached=self._cached(cands, prompt_token_ids, salt),
            weights=self.weights,
        )

    def _cached(
        self, cands: Candidates, prompt_token_ids: Sequence[int], salt: str | None = None
    ) -> dict[str, int] | None:
        """Per candidate, the prompt tokens (salted with ``salt``) its KV index entry says it
        holds (None: KV-aware routing is off)."""
        if self.kv_index is None or not self.weights.kv_aware:
            return None
        workers = [w.record for w in (*cands.prefill, *cands.decode, *cands.colocated)]
        return expected_cached_tokens(self.kv_index, workers, self._hashes(prompt_token_ids, salt))

    def _hashes(self, prompt_token_ids: Sequence[int], salt: str | None) -> PromptHashes:
        """The prompt's block hashes, shared by a request's KV-aware cost and peer pull plan (a
        one-entry memo keyed by the prompt object itself, which it holds, and the salt)."""
        last = self._last_hashes
        if last is not None and last[0] is prompt_token_ids and last[1] == salt:
            return last[2]
        hashes = PromptHashes(prompt_token_ids, salt)
        self._last_hashes = (prompt_token_ids, salt, hashes)
        return hashes

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
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        timeline: Timeline,
        session_id: str | None,
        ticket: Ticket | None,
    ) -> Transaction:
        spec = RequestSpec(
            request_id,
            tuple(prompt_token_ids),
            sampling,
            time.time() + self.settings.request_timeout_s,
            timeline,
            session_id,
        )
        t0 = time.monotonic()
        failed: list[WorkerRecord] = []  # listed incarnations whose first leg failed here
        retries = 0
        last_error: PdserveError | None = None
        until: float | None = None  # how long to hold the request while no worker serves it
        while True:
            try:
                route = self.route(spec.prompt_token_ids, self._excluded(failed), session_id,
                                   spec.sampling.cache_salt)  # fmt: skip
            except NoWorkerError as exc:
                if until is None:
                    left = spec.deadline - time.time() - 1.0
                    until = time.monotonic() + min(self.settings.worker_wait_s, left)
                    if self.settings.worker_wait_s > 0:
                        log.info("req %s: %s; waiting for a worker", request_id, exc)
                error: PdserveError = exc
                if isinstance(last_error, WorkerUnreachableError):
                    error = WorkerUnreachableError(f"{last_error}; no other worker to retry on")
                elif last_error is not None:  # the leg's own failure
                    error = last_error
                await self.wait_for_worker(until, error)
                continue
            self._record_decision(request_id, route)
            timeline.mark("route", **route_attributes(route))
            holds = ExitStack()
            holds.enter_context(self.view.track(route.worker.worker_id))
            if ticket is not None:
                ticket.routed()  # the worker's load shows the request from here on
            try:
                spec = await self._lent_prefix(replace(spec, prefix=None), route)
                pair = route.pair
                if pair is None:
                    txn = await self._one_leg(spec, route, holds)
                elif self._streams_kv(spec):
                    txn = await self._streamed(spec, route, holds)
                else:
                    with self.view.prefilling(route.worker.worker_id):
                        context = await self._prefill(spec, pair)
                    if self.admission is not None:  # the prefill worker has room again
                        self.admission.pump()
                    txn = Transaction(self, spec, route, context, holds)
            except LEG_FAILURES as exc:
                holds.close()
                worker = route.prefill or route.worker
                if isinstance(exc, WorkerUnreachableError):
                    self.view.mark_unreachable(worker)
                if not self.retry.first_leg(exc, retries, spec.deadline):
                    raise
                retries += 1
                reason = failure_reason(exc)
                log.warning(
                    "req %s: %s; retrying without %s (%s)",
                    request_id,
                    exc,
                    worker.worker_id,
                    reason,
                )
                if self.metrics is not None:
                    self.metrics.migrations.labels("prefill", reason).inc()
                timeline.mark("retry", pdserve_reason=reason, pdserve_worker_id=worker.worker_id)
                live = self.view.record(worker.worker_id)
                if live is not None and live.epoch == worker.epoch:  # (see Transaction._migrate)
                    failed.append(worker)
                last_error = exc
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
            if ticket is not None:
                holds.callback(ticket.release)  # the slot goes with the transaction
            return txn

    async def _lent_prefix(self, spec: RequestSpec, route: Route) -> RequestSpec:
        """``spec`` with a peer's lease on its prompt's prefix for the worker that prefills it
        (:meth:`lend_prefix`), if one is worth pulling; else ``spec``."""
        puller = route.prefill or route.worker
        handle = await self.lend_prefix(spec.request_id, spec.prompt_token_ids,
                                        spec.sampling.cache_salt, spec.deadline, puller)  # fmt: skip
        return spec if handle is None else replace(spec, prefix=handle)

    async def lend_prefix(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        salt: str | None,
        deadline: float,
        puller: WorkerRecord,
    ) -> TransferHandle | None:
        """A peer's lease on the prompt's prefix for ``puller``, the worker that will prefill
        it (a first leg or a migrated one), when the KV index shows one worth pulling
        (:mod:`pdserve.router.peer_pull`); None otherwise or when the lend fails."""
        if len(prompt_token_ids) <= self.peer_pull.min_tokens or self.kv_index is None:
            return None
        hashes = self._hashes(prompt_token_ids, salt)
        plan = self.peer_pull.plan(self.view.candidates(), puller, hashes)
        if plan is None:
            return None
        handle = await self.peer_pull.lend(plan, deadline)
        log.debug("req %s: %d prefix blocks lent by %s to %s (it had %d)", request_id,
                  plan.blocks if handle else 0, plan.lender.worker_id, puller.worker_id,
                  plan.have)  # fmt: skip
        return handle

    def _excluded(self, failed: list[WorkerRecord]) -> list[str]:
        """Ids of the workers whose incarnation in ``failed`` is still the live one (one that
        restarted since, with a higher epoch, may serve the request again; one that had left
        discovery when it failed was never put in ``failed``)."""
        out = []
        for worker in failed:
            live = self.view.record(worker.worker_id)
            if live is not None and live.epoch == worker.epoch:
                out.append(worker.worker_id)
        return out

    async def wait_for_worker(self, until: float, error: Exception) -> None:
        """Hold a request while no worker can serve it (all restarting): return at the next
        discovery change, so the caller routes again. Raises ``error`` once ``until``
        (monotonic seconds) has passed, :class:`QueueFullError` (429) when
        ``worker_wait_max_requests`` requests wait already."""
        left = until - time.monotonic()
        if left <= 0:
            raise error
        if self._waiting >= self.settings.worker_wait_max_requests:
            raise QueueFullError(
                f"{self._waiting} requests wait for a worker already "
                "(router.worker_wait_max_requests); retry later"
            ) from error
        self._waiting += 1
        if self.metrics is not None:
            self.metrics.waiting.inc()
        try:
            await self.view.changed(left)
        finally:
            self._waiting -= 1
            if self.metrics is not None:
                self.metrics.waiting.dec()

    async def _prefill(self, spec: RequestSpec, pair: Pair) -> ContextResponse:
        tl = spec.timeline
        span = tl.begin("prefill", pdserve_worker_id=pair.prefill.worker_id)
        req = context_request(spec, tl.traceparent(span))
        error: str | None = "failed"
        try:
            with self.view.track(pair.prefill.worker_id):
                # Giving up here (deadline, client gone, P lost) closes the connection: P sees
                # it and frees blocks it parks after that itself (the release needs the lease
                # id, which only its answer would have carried); its own deadline and the
                # lease bound the rest.
                call = self.client.context(pair.prefill, req)
                resp = await unless_lost(self.view, (pair.prefill,), call)
            error = None
        finally:
            Timeline.end(span, error)
        prefilled(tl, resp)
        return resp

    def _streams_kv(self, spec: RequestSpec) -> bool:
        """Whether this two-leg request uses the streamed hand-off (``kv_stream_min_tokens``)."""
        least = self.settings.kv_stream_min_tokens
        return 0 < least <= len(spec.prompt_token_ids) and spec.sampling.n == 1

    async def _streamed(self, spec: RequestSpec, route: Route, holds: ExitStack) -> Transaction:
        """The streamed hand-off: open P's context stream, and as soon as it names the handle
        (at admission) open D's decode leg with it, so D pulls each prefill chunk's blocks
        while P computes the next; the transaction starts with P's answer (the first token)
        and D's leg already open (or opening). Raises the prefill leg's typed error (D's leg
        is then dropped: its pull ends with the prefill)."""
        pair = route.pair
        assert pair is not None
        tl = spec.timeline
        span = tl.begin("prefill", pdserve_worker_id=pair.prefill.worker_id, pdserve_streamed=True)
        decode_span = tl.begin("decode", pdserve_streamed=True)
        req = context_request(spec, tl.traceparent(span))
        decode: asyncio.Future[GenerationStream] | None = None
        handle: TransferHandle | None = None
        with self.view.track(pair.prefill.worker_id):
            try:
                stream = await self.client.context_stream(pair.prefill, req)
            except BaseException as exc:
                Timeline.end(span, repr(exc))
                Timeline.end(decode_span, repr(exc))
                raise
            try:
                handle = await stream.started()
                ahead = spec.generation(handle=handle, traceparent=tl.traceparent(decode_span))
                decode = asyncio.ensure_future(self.client.generate(pair.decode, ahead))
                context = await stream.response()
                Timeline.end(span)
            except BaseException as exc:
                Timeline.end(span, repr(exc))
                Timeline.end(decode_span, repr(exc))
                with anyio.move_on_after(self.client.release_timeout_s, shield=True):
                    if decode is not None:
                        await drop_decode(decode)
                    if handle is not None:  # P may have parked already: free it now
                        await self.client.release(
                            pair.prefill,
                            ReleaseRequest(
                                request_id=spec.request_id,
                                epoch=handle.epoch,
                                lease_id=handle.lease_id,
                            ),
                        )
                raise
            finally:
                await stream.aclose()
        prefilled(tl, context)
        txn = Transaction(self, spec, route, context, holds, decode_ahead=decode)
        txn.leg_span = decode_span
        return txn

    async def _one_leg(self, spec: RequestSpec, route: Route, holds: ExitStack) -> Transaction:
        """Open ``route.worker``'s stream for the whole request (no handle: it prefills the
        prompt itself) and read it up to the first token. Raises the worker's typed error
        (WorkerUnreachableError: never reached it)."""
        tl = spec.timeline
        span = tl.begin(route.worker.role.value, pdserve_worker_id=route.worker.worker_id)
        req = spec.generation(traceparent=tl.traceparent(span))
        try:
            call = self.client.generate(route.worker, req)
            stream = await unless_lost(self.view, (route.worker,), call)
        except BaseException as exc:
            Timeline.end(span, repr(exc))
            raise
        txn = Transaction(self, spec, route, None, holds, stream)
        txn.leg_span = span
        try:
            await txn.first_output()
        except BaseException:
            await txn.discard()
            raise
        return txn


def context_request(spec: RequestSpec, traceparent: str | None) -> ContextRequest:
    """The prefill leg's request for ``spec``, continuing the leg's span ``traceparent``."""
    return ContextRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        sampling=spec.sampling,
        deadline=spec.deadline,
        traceparent=traceparent,
        prefix=spec.prefix,
    )


def prefilled(timeline: Timeline, resp: ContextResponse) -> None:
    """Mark the ``prefill`` phase done with P's answer, and add P's own phases."""
    end = timeline.mark("prefill", gen_ai_usage_cache_read_input_tokens=resp.cached_tokens)
    timeline.add_peer("prefill", resp.phases, end)


def cache_salt(tenant: Tenant | None, client_salt: str | None) -> str | None:
    """The salt of a request's KV block hashes (:mod:`pdserve.block_hash`): its tenant's when
    the API key names one (not :data:`~pdserve.security.DEFAULT_TENANT`), joined with the
    client's ``cache_salt`` (vLLM's field), each kind in its own namespace so that no client
    salt can equal a tenant's; None: neither (the hashes every request shares)."""
    if tenant is not None and tenant.name != DEFAULT_TENANT:
        return f"tenant\x00{tenant.name}\x00{client_salt or ''}"
    return None if client_salt is None else f"client\x00{client_salt}"
