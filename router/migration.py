"""Mid-stream migration's parts (docs/reliability.md, "Migration"): giving up a leg whose
worker left discovery (:func:`unless_lost`, :data:`LOST_GRACE_S`), naming why a leg failed
(:func:`failure_reason`), the request that continues one elsewhere (:func:`resume_request`)
and opening it on another worker (:func:`open_resumed`).

:class:`pdserve.router.transaction.Transaction` migrates its decode leg with these;
:class:`pdserve.router.router.Router` retries a failed first leg with :func:`unless_lost` and
:func:`failure_reason`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from pdserve.errors import TransferError, WorkerError, WorkerUnreachableError
from pdserve.protocol import (
    DRAINING_ERROR,
    GenerationRequest,
    KVLayout,
    ResumedChoice,
    WorkerRecord,
)
from pdserve.router.client import GenerationStream, WorkerClient
from pdserve.router.view import LOST, WorkerState, WorkerView

if TYPE_CHECKING:
    from pdserve.config.settings import RouterSettings
    from pdserve.protocol import SamplingParams, TransferHandle
    from pdserve.router.retry import RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

LOST_GRACE_S = 2.0
"""A leg on a worker that left discovery is given up once it is silent this long: a stopped
or partitioned worker's lease expired (it sends nothing more), while a draining worker that
deregistered on SIGTERM still streams, or answers, within it (a decode step, a short prefill)."""


class MigrationParts(Protocol):
    """What a migration uses of the router (:class:`pdserve.router.router.Router`)."""

    @property
    def client(self) -> WorkerClient: ...

    @property
    def view(self) -> WorkerView: ...

    @property
    def settings(self) -> RouterSettings: ...

    @property
    def retry(self) -> RetryPolicy: ...

    async def wait_for_worker(self, until: float, error: Exception) -> None: ...

    def retry_target(
        self,
        prompt_token_ids: Sequence[int],
        *,
        skip: Callable[[WorkerState], bool],
        maps_from: KVLayout | None = None,
        colocated: bool = False,
        salt: str | None = None,
    ) -> WorkerRecord | None: ...

    async def lend_prefix(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        salt: str | None,
        deadline: float,
        puller: WorkerRecord,
    ) -> TransferHandle | None: ...


def leg_request_id(request_id: str, migration: int) -> str:
    """The id a request's leg runs under on its worker: ``request_id`` for the first decode leg,
    ``<request_id>~m<n>`` for the leg opened by its ``n``-th migration. A migration may land on
    the worker it left (a stopped worker that registered again) while that worker still holds
    the old leg, which it frees only once it notices the closed stream: the new leg must not
    collide with it ("request id already in use")."""
    return request_id if migration == 0 else f"{request_id}~m{migration}"


def resume_request(
    base: GenerationRequest,
    sent: Sequence[Sequence[int]],
    sent_chars: Sequence[int],
    unfinished: Collection[int],
    migration: int,
) -> GenerationRequest:
    """``base`` (the request as first sent, without handle) made the request that continues it
    on another worker after its ``migration``-th migration (under :func:`leg_request_id`): for
    each unfinished choice the tokens (``sent[i]``) and characters of text (``sent_chars[i]``)
    the client has. Prompt logprobs came with the first chunk and are not asked for again."""
    sampling: SamplingParams = base.sampling
    if sampling.prompt_logprobs is not None:
        sampling = sampling.model_copy(update={"prompt_logprobs": None})
    return GenerationRequest(
        request_id=leg_request_id(base.request_id, migration),
        prompt_token_ids=base.prompt_token_ids,
        sampling=sampling,
        deadline=base.deadline,
        traceparent=base.traceparent,
        resume=tuple(
            ResumedChoice(index=i, token_ids=tuple(sent[i]), text_chars=sent_chars[i])
            for i in sorted(unfinished)
        ),
    )


async def open_resumed(
    router: MigrationParts,
    req: GenerationRequest,
    failed: WorkerRecord,
    exc: Exception,
    deadline: float,
) -> tuple[GenerationStream, WorkerRecord]:
    """Open ``req`` (a :func:`resume_request`) on the usable decode or colocated worker the
    policy picks (:meth:`MigrationParts.retry_target`: KV-aware when the router is), with a
    peer's lease on the prompt's prefix when one is worth pulling there
    (:meth:`MigrationParts.lend_prefix`: the prompt's blocks come from wherever they still are,
    the prefill worker's cache or a peer's; only what no one holds is recomputed), leaving
    out ``failed`` when the failure ``exc`` was its own and it is still listed (one that left
    discovery is no candidate while gone, and may serve again once it registers
    again: stopped, then continued). A worker that refuses before streaming is left out too
    and the next one tried. While none is usable, waits for one (``router.worker_wait_s``,
    within ``deadline``, wall-clock seconds). Raises ``exc`` when none comes, or a refusal
    that is not the worker's (a full queue, the deadline)."""
    view = router.view
    excluded: set[tuple[str, int]] = set()
    live = view.record(failed.worker_id)
    if _decode_workers_fault(exc, failed) and live is not None and live.epoch == failed.epoch:
        excluded.add((failed.worker_id, failed.epoch))
    until: float | None = None
    while True:
        target = router.retry_target(
            req.prompt_token_ids,
            skip=lambda w: (w.worker_id, w.record.epoch) in excluded,
            colocated=True,
            salt=req.sampling.cache_salt,
        )
        if target is None:
            if until is None:
                left = deadline - time.time() - 1.0
                until = time.monotonic() + min(router.settings.worker_wait_s, left)
            await router.wait_for_worker(until, exc)
            continue
        prefix = await router.lend_prefix(req.request_id, req.prompt_token_ids,
                                          req.sampling.cache_salt, deadline, target)  # fmt: skip
        leg = req if prefix is None else req.model_copy(update={"prefix": prefix})
        try:
            stream = await unless_lost(view, (target,), router.client.generate(target, leg))
            return stream, target
        except WorkerError as again:  # never reached it, or it failed before streaming
            if isinstance(again, WorkerUnreachableError):
                view.mark_unreachable(target)
            excluded.add((target.worker_id, target.epoch))
            log.warning("req %s: migration target failed: %s", req.request_id, again)


def _decode_workers_fault(exc: BaseException, worker: WorkerRecord) -> bool:
    """Whether a failed decode leg is its worker's doing (so the migration avoids that
    incarnation): not when the KV pull failed (the prefill side's) or when the prefill worker
    it pulled from was lost; a one-worker decode pool can then take the request again."""
    if isinstance(exc, TransferError):
        return False
    return not (isinstance(exc, WorkerLostError) and exc.worker_id != worker.worker_id)


def failure_reason(exc: BaseException) -> str:
    """The ``reason`` label of a failed leg (``pdserve_router_migrations_total``)."""
    if isinstance(exc, TransferError):
        return "transfer"
    if isinstance(exc, WorkerUnreachableError):
        return "unreachable"
    text = str(exc)
    if DRAINING_ERROR in text:
        return "draining"
    if LOST in text:
        return "lease_lost"
    return "worker_error"


async def unless_lost(view: WorkerView, workers: tuple[WorkerRecord, ...], call: Awaitable[T]) -> T:
    """Await ``call`` unless one of ``workers`` (these incarnations) leaves discovery and
    ``call`` does not end within :data:`LOST_GRACE_S` after: then cancel it and raise
    :class:`WorkerError` saying so. A stopped (SIGSTOP) or partitioned worker keeps its
    connections open, so only its lost registration lease tells the router to stop waiting on
    it. Without discovery events (``view.follows`` false) ``call`` is just awaited."""
    if not view.follows:
        return await call
    task = asyncio.ensure_future(call)
    lost: list[tuple[str, str]] = []  # (why, worker id)

    def on_loss(reason: str, worker_id: str) -> None:
        if not lost:
            lost.append((reason, worker_id))
            asyncio.get_running_loop().call_later(LOST_GRACE_S, task.cancel)

    unwatch = [
        view.watch_loss(w, functools.partial(on_loss, worker_id=w.worker_id)) for w in workers
    ]
    try:
        return await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if lost and (me is None or not me.cancelling()):
            raise WorkerLostError(lost[0][0], worker_id=lost[0][1]) from None
        raise
    finally:
        for stop in unwatch:
            stop()


class WorkerLostError(WorkerError):
    """A leg given up because worker ``worker_id`` left discovery (:func:`unless_lost`): the
    decode leg's own worker, or the prefill worker it was pulling from."""

    def __init__(self, message: str, *, worker_id: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id
