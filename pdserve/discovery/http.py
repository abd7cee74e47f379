"""HTTP client side of the embedded registry (URL ``http://host:port``, the router's base URL).

:class:`HttpRegistration` (worker side) lifecycle:

1. ``start(record)``: one inline ``PUT /registry/workers/{id}`` (body: record + ``ttl_s``).
   Success -> REGISTERED; failure -> a warning, RETRYING (the worker keeps running).
2. refresh task: re-PUTs the newest record every ``ttl_s / 3`` seconds, and soon after each
   ``update()``. A failed PUT -> RETRYING, retried with backoff (0.1 s doubling, capped at
   ``ttl_s / 3``), a warning on the first failure and every 10th. The registry answers
   ``created=true`` when it had no live record (the router restarted or the record lapsed
   while the worker was cut off): logged as a re-registration.
3. ``close()``: cancels the task, ``DELETE /registry/workers/{id}`` (best effort, 2 s max),
   closes the HTTP client. Idempotent.

:class:`HttpWatcher` (for processes other than the router) polls ``GET /registry/workers``
every ``poll_interval_s`` seconds; on failure it keeps its last view and retries with backoff.

Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from pdserve.discovery.base import Backoff, Registration, RegistrationState, Watcher
from pdserve.discovery.registry import RegisterBody, RegisterReply, WorkerList
from pdserve.protocol import PROTOCOL_HEADER, PROTOCOL_VERSION, WorkerRecord

logger = logging.getLogger(__name__)

_HEADERS = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
CLOSE_TIMEOUT_S = 2.0


class HttpRegistration(Registration):
    """Registers one worker with the router's embedded registry at ``base_url``."""

    def __init__(self, base_url: str, *, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.base_url = base_url
        # A request must finish well inside the refresh interval, or one slow call eats the TTL.
        timeout = httpx.Timeout(max(0.5, min(5.0, self.refresh_interval_s)))
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_HEADERS)
        self._wake = asyncio.Event()
        self._ever_registered = False

    @property
    def _path(self) -> str:
        assert self._record is not None
        return f"/registry/workers/{self._record.worker_id}"

    async def start(self, record: WorkerRecord) -> None:
        self._accept(record, starting=True)
        self.state = RegistrationState.RETRYING
        await self._put_once()
        self._task = asyncio.create_task(self._refresh_loop(), name=f"register-{record.worker_id}")

    async def update(self, record: WorkerRecord) -> None:
        self._accept(record, starting=False)
        self._wake.set()

    async def close(self) -> None:
        if self.state is RegistrationState.CLOSED:
            return
        was_started = self.state is not RegistrationState.IDLE
        self.state = RegistrationState.CLOSED
        await self._cancel_task()
        if was_started:
            await self._deregister()
        await self._client.aclose()

    async def abandon(self) -> None:
        if self.state is RegistrationState.CLOSED:
            return
        self.state = RegistrationState.CLOSED
        await self._cancel_task()
        await self._client.aclose()

    async def _deregister(self) -> None:
        assert self._record is not None
        try:
            resp = await self._client.delete(self._path, timeout=CLOSE_TIMEOUT_S)
            resp.raise_for_status()
            logger.info("deregistered worker %s from %s", self._record.worker_id, self.base_url)
        except httpx.HTTPError as exc:
            logger.warning(
                "could not deregister worker %s from %s (%r); its record lapses in %.1f s",
                self._record.worker_id,
                self.base_url,
                exc,
                self.ttl_s,
            )

    async def _put_once(self) -> bool:
        """PUT the current record; update ``state``; return whether it succeeded."""
        record = self._record
        assert record is not None
        body = RegisterBody(record=record, ttl_s=self.ttl_s)
        try:
            resp = await self._client.put(
                self._path,
                content=body.model_dump_json(),
                headers={"content-type": "application/json"},
            )
            resp.raise_for_status()
            reply = RegisterReply.model_validate_json(resp.content)
        except (httpx.HTTPError, ValueError) as exc:
            self._on_failure(exc)
            return False
        if reply.created:
            verb = "re-registered" if self._ever_registered else "registered"
            logger.info(
                "%s worker %s (epoch %d) with %s, ttl %.1f s",
                verb,
                record.worker_id,
                record.epoch,
                self.base_url,
                self.ttl_s,
            )
        elif self._backoff.failures:
            logger.info("registry %s reachable again", self.base_url)
        self._ever_registered = True
        self._backoff.reset()
        if self.state is not RegistrationState.CLOSED:
            self.state = RegistrationState.REGISTERED
        return True

    def _on_failure(self, exc: Exception) -> None:
        detail = exc.response.text[:200] if isinstance(exc, httpx.HTTPStatusError) else ""
        self._note_failure(f"registry {self.base_url}", exc, detail)

    async def _refresh_loop(self) -> None:
        ok = self.state is RegistrationState.REGISTERED  # outcome of start()'s inline PUT
        while True:
            if ok:  # refresh on schedule, or sooner after update()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.refresh_interval_s)
            else:  # updates do not shorten the backoff
                await asyncio.sleep(self._backoff.next_delay())
            self._wake.clear()
            ok = await self._put_once()


class HttpWatcher(Watcher):
    """Polls a remote embedded registry's ``GET /registry/workers``."""

    def __init__(self, base_url: str, *, poll_interval_s: float = 1.0) -> None:
        super().__init__()
        self.base_url = base_url
        self.poll_interval_s = poll_interval_s
        self._client = httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(5.0), headers=_HEADERS
        )
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(0.1, max(poll_interval_s, 5.0))

    async def start(self) -> None:
        """One inline poll (a failure is logged, not raised), then the polling task."""
        if self._task is not None:
            return
        await self._poll_once()
        self._task = asyncio.create_task(self._poll_loop(), name="registry-poll")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.aclose()

    async def _poll_once(self) -> bool:
        try:
            resp = await self._client.get("/registry/workers")
            resp.raise_for_status()
            listing = WorkerList.model_validate_json(resp.content)
        except (httpx.HTTPError, ValueError) as exc:
            if self._backoff.failures % 10 == 0:
                logger.warning(
                    "listing workers at %s failed (%r); keeping the last view", self.base_url, exc
                )
            return False
        self.view.replace_all(listing.workers, reason="gone from the registry")
        self._backoff.reset()
        return True

    async def _poll_loop(self) -> None:
        while True:
            ok = await self._poll_once()
            await asyncio.sleep(self.poll_interval_s if ok else self._backoff.next_delay())
