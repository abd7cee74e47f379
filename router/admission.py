"""The router's fair queue: when the workers are saturated, requests wait here and are let in
by tenant (deficit round robin by weight) and, within a tenant, by priority.

Without it every request goes straight to a worker, whose scheduler queues it first come,
first served: one tenant's burst delays everyone behind it. With it (``router.
max_requests_per_worker`` > 0, or API keys that name tenants: :class:`~pdserve.security.Tenant`)
the router admits a request only while the workers it needs have room: fewer than
``max_requests_per_worker`` requests each, counting this router's in-flight requests or the
worker's reported running + waiting, whichever is larger (so other router replicas' requests
count too, a second late).

Resources: a request the policy would send to a prefill worker (its tokens left to compute,
past what the chosen decode worker holds cached, are more than
``router.local_prefill_max_tokens``: :meth:`pdserve.router.router.Router.needs_prefill`) needs a
prefill worker with room, fewer than ``router.max_prefills_per_worker``
(default 2) requests on it: a prefill is compute-bound, so requests queued inside a prefill
worker would be served first come, first served; they wait here instead. A shorter prompt,
which the decode worker prefills itself, needs only a decode (or colocated) worker. A request in its prefill leg counts
against its prefill worker, not yet against its decode worker, so a flood of long prompts
queued at the prefill workers does not hold the decode slots that short requests need (a
first measurement, which counted it on both, made a short request wait for the flood's
prefills: docs/benchmarks.md). One exception to the prefill cap: a tenant none of whose
requests is in its prefill leg may send one past it (:meth:`FairQueue._fits`), and every
admitted request carries its tenant's :class:`~pdserve.protocol.Share`, by which the prefill
worker's scheduler gives that request's chunks the turn before the flooding tenant's next
chunk: without both, a quiet tenant waited for the prefills in flight and the one queued.

The waiters wait in one queue per tenant, and each freed slot goes to the next tenant in
deficit round robin (Shreedhar and Varghese, "Efficient fair queuing using deficit
round robin", SIGCOMM 1995): each visit adds the tenant's ``weight`` to its deficit, a request
costs 1, so over time waiting tenants are let in in proportion to their weights whatever their
arrival rates; a tenant whose queue empties forfeits its deficit. Within a tenant the request
with the lowest ``priority`` goes first (vLLM's field: lower is earlier), then the oldest. A
tenant none of whose waiters the free slots fit (its requests need a prefill worker, and none
has room) is passed over without credit, so the queue stays work-conserving.
Design origin: llm-d's flow control and Dynamo's policy classes, which put the same discipline
in front of inference workers.

Bounds (input from clients costs bounded memory): a tenant has at most ``max_queued`` requests
waiting (its key's ``max_queued``, else ``router.tenant_max_queued``); one more is refused at
once with 429 ``tenant_queue_full`` and ``Retry-After``. A request waits at most
``router.max_queue_wait_s`` (and never past its deadline), then gets 429 ``queue_timeout``. A
waiting request whose client leaves is cancelled and skipped. When no decode or colocated
worker is usable at all, nothing waits here: the request goes on to the router's wait for a
worker (``router.worker_wait_s``), which answers it as before.

Lifecycle of a :class:`Ticket` (one per admitted request): 1 GRANTED (counted as *pending*: a
slot promised, not yet visible in any worker's load) -> 2 ROUTED (:meth:`Ticket.routed`, once
the router tracks it on a worker: the load shows it now) -> 3 RELEASED (:meth:`Ticket.release`,
when the transaction ends; the next waiter is let in). Not thread-safe: the router's event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.errors import QueueFullError
from pdserve.router.policy import worker_load
from pdserve.security import APIKeys, Tenant

if TYPE_CHECKING:
    from pdserve.config.settings import RouterSettings
    from pdserve.router.router_metrics import RouterMetrics
    from pdserve.router.view import WorkerState, WorkerView

log = logging.getLogger(__name__)

DEFAULT_REQUESTS_PER_WORKER = 32
"""``router.max_requests_per_worker`` when API keys name tenants and it is unset: the engine's
default batch (``scheduler.max_num_seqs``; a test keeps the two equal)."""
NO_WORKER_ROOM = 1 << 30
"""What ``room()`` answers when no decode or colocated worker is usable: requests go on, to
the router's wait for a worker."""
PUMP_INTERVAL_S = 0.05
"""While requests wait, how often the queue looks again at the workers' load (which changes
with their reports, not only with this router's releases)."""


class TenantQueueFullError(QueueFullError):
    """A tenant has as many requests waiting in the router's fair queue as its cap allows
    (HTTP 429 with ``Retry-After``)."""

    code = "tenant_queue_full"
    public_text = (
        "too many of your requests are waiting for a worker (your tenant's max_queued); retry "
        "after the Retry-After delay"
    )


class QueueTimeoutError(QueueFullError):
    """A request waited ``router.max_queue_wait_s`` in the fair queue (HTTP 429 with
    ``Retry-After``)."""

    code = "queue_timeout"
    public_text = "the workers stayed saturated while the request waited; retry later"


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    needs_prefill: bool = field(default=False, compare=False)


@dataclass
class _TenantQueue:
    tenant: Tenant
    cap: int
    heaps: dict[bool, list[_Waiter]] = field(default_factory=lambda: {False: [], True: []})
    """Waiters by whether they need a prefill worker (module docstring, *resources*)."""
    deficit: float = 0.0
    credited: bool = False  # this visit's quantum added

    @property
    def waiting(self) -> int:
        return sum(1 for h in self.heaps.values() for w in h if not w.future.done())

    def drop_cancelled(self) -> bool:
        """Pop cancelled waiters off the heaps' tops; whether any waiter is left."""
        for heap in self.heaps.values():
            while heap and heap[0].future.done():
                heapq.heappop(heap)
        return any(not w.future.done() for h in self.heaps.values() for w in h)

    def best(self, eligible: dict[bool, bool]) -> list[_Waiter] | None:
        """The heap holding this tenant's next waiter among the eligible classes, if any."""
        heaps = [h for cls, h in self.heaps.items() if h and eligible[cls]]
        return min(heaps, key=lambda h: h[0]) if heaps else None


class Ticket:
    """An admitted request's slot (module docstring, lifecycle). Idempotent methods."""

    def __init__(self, queue: FairQueue, tenant: str, needs_prefill: bool = False) -> None:
        self._queue = queue
        self.tenant = tenant
        self._pending = True
        self._released = False
        self._prefilling = needs_prefill  # counted in the queue's prefills of its tenant

    def prefill_done(self) -> None:
        """The request's prefill leg is over (its first token is out, or it failed): it no
        longer counts among its tenant's prefills."""
        if self._prefilling:
            self._prefilling = False
            self._queue.prefill_ended(self.tenant)

    def routed(self) -> None:
        """The router now tracks the request on a worker: its slot shows in the load."""
        if self._pending:
            self._pending = False
            self._queue.pending -= 1

    def release(self) -> None:
        """The request ended: let the next waiter in."""
        self.routed()
        self.prefill_done()
        if not self._released:
            self._released = True
            self._queue.pump()


class FairQueue:
    """The fair queue (module docstring). ``room(needs_prefill)``: slots free now for a request
    that needs a prefill worker (True) or only a decode or colocated worker (False; a large
    number when none is usable); ``max_queued``: the default cap per tenant; ``max_wait_s``:
    the longest wait, seconds. ``on_queued(tenant, n)``, ``on_admitted(tenant, waited_s)`` and
    ``on_rejected(tenant)``: metrics hooks."""

    def __init__(
        self,
        room: Callable[[bool], int],
        *,
        max_queued: int,
        max_wait_s: float,
        on_queued: Callable[[str, int], None] | None = None,
        on_admitted: Callable[[str, float], None] | None = None,
        on_rejected: Callable[[str], None] | None = None,
    ) -> None:
        self._room = room
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._on_queued = on_queued or (lambda t, n: None)
        self._on_admitted = on_admitted or (lambda t, s: None)
        self._on_rejected = on_rejected or (lambda t: None)
        self.pending = 0
        """Slots granted whose request no worker's load shows yet."""
        self._prefilling: dict[str, int] = {}  # tenant -> its granted requests in prefill
        self._queues: dict[str, _TenantQueue] = {}
        self._active: deque[_TenantQueue] = deque()  # tenants with waiters, in DRR order
        self._seq = itertools.count()
        self._pumper: asyncio.Task[None] | None = None

    def waiting(self, tenant: str | None = None) -> int:
        """Requests waiting now (of ``tenant``, or of all)."""
        queues = [self._queues[tenant]] if tenant in self._queues else []
        return sum(q.waiting for q in (queues if tenant is not None else self._queues.values()))

    def _free(self, needs_prefill: bool) -> int:
        return self._room(needs_prefill) - self.pending

    def _fits(self, tenant: str, needs_prefill: bool) -> bool:
        """Whether a request of ``tenant`` of that class may go now: the workers have room, or
        it needs a prefill worker, none of ``tenant``'s requests is in prefill and a decode
        worker has room (a tenant is never shut out of the prefill workers by another's flood:
        their schedulers give its chunks the turn, :class:`~pdserve.protocol.Share`)."""
        if self._free(needs_prefill) > 0:
            return True
        return needs_prefill and not self._prefilling.get(tenant) and self._free(False) > 0

    def prefill_ended(self, tenant: str) -> None:
        """One of ``tenant``'s requests left its prefill leg (:meth:`Ticket.prefill_done`)."""
        left = self._prefilling.get(tenant, 0) - 1
        if left > 0:
            self._prefilling[tenant] = left
        else:
            self._prefilling.pop(tenant, None)
        self.pump()

    async def admit(
        self, tenant: Tenant, priority: int, deadline: float, needs_prefill: bool = False
    ) -> Ticket:
        """Wait for a slot (at once when nothing waits and a worker has room). ``deadline``:
        the request's, wall-clock UNIX seconds; ``needs_prefill``: whether it will need a
        prefill worker (the policy's path for it now). Raises
        :class:`TenantQueueFullError` when the tenant's cap is reached,
        :class:`QueueTimeoutError` after ``max_wait_s`` (or at the deadline); cancelled with
        the request (its client left), it leaves the queue."""
        name = tenant.name
        if not self._active and self._fits(name, needs_prefill):
            return self._grant(name, 0.0, needs_prefill)
        q = self._queues.get(name)
        if q is None:
            cap = tenant.max_queued if tenant.max_queued is not None else self.max_queued
            q = self._queues[name] = _TenantQueue(tenant, cap)
        if q.waiting >= q.cap:
            self._on_rejected(name)
            raise TenantQueueFullError(
                f"tenant {name!r} has {q.waiting} requests waiting for a worker already "
                f"(max_queued {q.cap}); retry later"
            )
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority, next(self._seq), future, needs_prefill)
        heapq.heappush(q.heaps[needs_prefill], waiter)
        if q not in self._active:
            self._active.append(q)
        self._on_queued(name, q.waiting)
        self._ensure_pumper()
        self.pump()  # eligible now if only waiters of the other kind are ahead
        t0 = time.monotonic()
        wait_s = max(0.0, min(self.max_wait_s, deadline - time.time()))
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except TimeoutError:
            if not waiter.future.done():
                waiter.future.cancel()
                self._on_queued(name, q.waiting)
                self._on_rejected(name)
                raise QueueTimeoutError(
                    f"waited {time.monotonic() - t0:.1f} s for a worker with room in the "
                    f"router's fair queue (router.max_queue_wait_s {self.max_wait_s:g}); "
                    "retry later"
                ) from None
        except BaseException:  # cancelled with its request (the client left)
            if not waiter.future.done():
                waiter.future.cancel()
            elif not waiter.future.cancelled():  # granted as it was cancelled: give it back
                self.pending -= 1
                if needs_prefill:
                    self.prefill_ended(name)  # pumps
                self.pump()
            self._on_queued(name, q.waiting)
            raise
        self._on_queued(name, q.waiting)
        return self._ticket(name, time.monotonic() - t0, needs_prefill)

    def _grant(self, name: str, waited_s: float, needs_prefill: bool) -> Ticket:
        self.pending += 1
        if needs_prefill:
            self._prefilling[name] = self._prefilling.get(name, 0) + 1
        return self._ticket(name, waited_s, needs_prefill)

    def _ticket(self, name: str, waited_s: float, needs_prefill: bool) -> Ticket:
        self._on_admitted(name, waited_s)
        return Ticket(self, name, needs_prefill)

    def pump(self) -> None:
        """Let waiters in while the workers have room, by deficit round robin."""
        while self._active:
            found = self._next()
            if found is None:
                return
            name, waiter = found
            self.pending += 1  # the waiter's Ticket takes it over
            if waiter.needs_prefill:
                self._prefilling[name] = self._prefilling.get(name, 0) + 1
            waiter.future.set_result(None)

    def _next(self) -> tuple[str, _Waiter] | None:
        """The next waiter (and its tenant) by DRR among those the workers have room for now
        (module docstring, :meth:`_fits`), or None: no room, or no waiter it fits. A tenant
        none of whose waiters fits is passed over without credit (the discipline stays
        work-conserving)."""
        if self._free(False) <= 0:  # every request needs a decode or colocated slot
            return None
        for q in list(self._active):  # forget tenants whose waiters all left
            if not q.drop_cancelled():
                q.deficit, q.credited = 0.0, False
                self._active.remove(q)
        eligible = {
            q.tenant.name: {cls: self._fits(q.tenant.name, cls) for cls in (False, True)}
            for q in self._active
        }
        if not any(q.best(eligible[q.tenant.name]) is not None for q in self._active):
            return None
        while True:  # ends: some tenant has a fitting waiter and a weight > 0
            q = self._active[0]
            heap = q.best(eligible[q.tenant.name])
            if heap is None:
                q.credited = False
                self._active.rotate(-1)
                continue
            if not q.credited:
                q.deficit += q.tenant.weight
                q.credited = True
            if q.deficit >= 1.0:
                q.deficit -= 1.0
                waiter = heapq.heappop(heap)
                if not q.drop_cancelled():
                    q.deficit, q.credited = 0.0, False
                    self._active.popleft()
                return q.tenant.name, waiter
            q.credited = False  # this visit is over: the next tenant's turn
            self._active.rotate(-1)

    def _ensure_pumper(self) -> None:
        if self._pumper is None or self._pumper.done():
            self._pumper = asyncio.create_task(self._pump_loop(), name="fair-queue-pump")

    async def _pump_loop(self) -> None:
        while self._active:
            await asyncio.sleep(PUMP_INTERVAL_S)
            self.pump()

    async def close(self) -> None:
        """Stop the pump task (waiters left time out or are cancelled with their requests)."""
        task, self._pumper = self._pumper, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


def admission_load(worker: WorkerState) -> int:
    """A decode or colocated worker's requests as the fair queue counts them: this router's
    in-flight ones past their prefill leg, or the worker's reported running + waiting,
    whichever is larger."""
    load = worker.record.load
    return max(worker.in_flight - worker.prefilling, load.running + load.waiting)


def fair_queue(
    settings: RouterSettings, api_keys: APIKeys, view: WorkerView, metrics: RouterMetrics
) -> FairQueue | None:
    """The router's fair queue (:mod:`pdserve.router.admission`), or None when it is off:
    ``router.max_requests_per_worker`` 0, or unset while no API key names a tenant."""
    limit = settings.max_requests_per_worker
    if limit is None:
        limit = DEFAULT_REQUESTS_PER_WORKER if api_keys.names_tenants else 0
    if limit == 0:
        return None

    def room(needs_prefill: bool) -> int:
        c = view.candidates()
        streaming = [*c.decode, *c.colocated]
        if not streaming:  # nothing can serve it: the router's wait for a worker answers
            return NO_WORKER_ROOM
        free = sum(max(0, limit - admission_load(w)) for w in streaming)
        if needs_prefill and c.prefill:
            prefill_limit = settings.max_prefills_per_worker
            free = min(free, sum(max(0, prefill_limit - worker_load(p)) for p in c.prefill))
        return free

    def admitted(tenant: str, waited_s: float) -> None:
        metrics.tenant_admitted.labels(tenant).inc()
        metrics.tenant_queue_wait.labels(tenant).observe(waited_s)

    log.info(
        "fair queue on: %d requests per decode or colocated worker, %d per prefill worker, "
        "tenants %s",
        limit,
        settings.max_prefills_per_worker,
        ", ".join(f"{t.name} (weight {t.weight:g})" for t in api_keys.tenants.values()) or "-",
    )
    return FairQueue(
        room,
        max_queued=settings.tenant_max_queued,
        max_wait_s=settings.max_queue_wait_s,
        on_queued=lambda t, n: metrics.tenant_queued.labels(t).set(n),
        on_admitted=admitted,
        on_rejected=lambda t: metrics.tenant_rejected.labels(t).inc(),
    )
