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

KV cache events (:mod:`pdserve.discovery.kvcache`): :meth:`HttpRegistration.send_kv_event`
posts one to ``POST /registry/kvcache/{id}``; the reply may ask for a snapshot.

:class:`HttpWatcher` (for processes other than the router) polls ``GET /registry/workers``
every ``poll_interval_s`` seconds; on failure it keeps its last view and retries with backoff.

Both send ``Authorization: Bearer <ClusterKey.http_token>`` on every call (the registry's
routes are internal); the records they write are signed and the records they list are checked
(:class:`~pdserve.discovery.records.RecordTable`). A wrong secret shows as HTTP 401 in the
registration's retry warnings.

Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx

from pdserve.discovery.kvcache import KVCacheEvent, KVEventAck
from pdserve.discovery.records import BackgroundWatcher
from pdserve.discovery.registration import Registration
from pdserve.discovery.registry import RegisterBody, RegisterReply, WorkerList
from pdserve.discovery.retry import Backoff
from pdserve.protocol import PROTOCOL_HEADER, PROTOCOL_VERSION

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

_HEADERS = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
CLOSE_TIMEOUT_S = 2.0


class HttpRegistration(Registration):
    """Registers one worker with the router's embedded registry at ``base_url``, authenticated
    and signed with the cluster ``key``."""

    _task_prefix = "register"

    def __init__(self, base_url: str, *, ttl_s: float, key: ClusterKey) -> None:
        super().__init__(ttl_s, key=key)
        self.base_url = base_url
        # A request must finish well inside the refresh interval, or one slow call eats the TTL.
        timeout = httpx.Timeout(max(0.5, min(5.0, self.refresh_interval_s)))
        headers = {**_HEADERS, **key.http_headers()}
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers)

    @property
    def _where(self) -> str:
        return f"registry {self.base_url}"

    @property
    def _path(self) -> str:
        assert self._record is not None
        return f"/registry/workers/{self._record.worker_id}"

    async def _write(self, refresh_due: bool) -> None:
        """PUT the current record (the PUT is also the refresh); raise on failure."""
        record = self._record
        assert record is not None
        self._wake.clear()  # the PUT below carries the newest record
        body = RegisterBody(record=record, ttl_s=self.ttl_s)
        resp = await self._client.put(
            self._path,
            content=body.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        resp.raise_for_status()
        reply = RegisterReply.model_validate_json(resp.content)
        if reply.created:
            self._log_created(record, f"with {self.base_url}, ttl {self.ttl_s:.1f} s")

    def _failure_detail(self, exc: Exception) -> str:
        return exc.response.text[:200] if isinstance(exc, httpx.HTTPStatusError) else ""

    async def _delete(self) -> None:
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

    async def _close_client(self) -> None:
        await self._client.aclose()

    async def send_kv_event(self, event: KVCacheEvent) -> KVEventAck | None:
        """POST ``event`` to the router's ``/registry/kvcache/{id}`` (2 s at most); the ack,
        or None when it did not arrive (logged at debug: the publisher resyncs later)."""
        try:
            resp = await self._client.post(
                f"/registry/kvcache/{event.worker_id}",
                content=event.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=CLOSE_TIMEOUT_S,
            )
            resp.raise_for_status()
            return KVEventAck.model_validate_json(resp.content)
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # RuntimeError: closed client
            logger.debug("posting KV events of %s failed: %r", event.worker_id, exc)
            return None


class HttpWatcher(BackgroundWatcher[bool]):
    """Polls a remote embedded registry's ``GET /registry/workers`` (``poll_interval_s``
    seconds apart), authenticated with the cluster ``key``, which also checks the records."""

    _task_name = "registry-poll"

    def __init__(self, base_url: str, *, key: ClusterKey, poll_interval_s: float = 1.0) -> None:
        super().__init__(key=key)
        self.base_url = base_url
        self.poll_interval_s = poll_interval_s
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(5.0),
            headers={**_HEADERS, **key.http_headers()},
        )
        self._backoff = Backoff(0.1, max(poll_interval_s, 5.0))

    async def _sync(self) -> bool:
        return await self._poll_once()

    async def _release(self) -> None:
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

    async def _follow(self, first: bool) -> None:
        while True:
            ok = await self._poll_once()
            await asyncio.sleep(self.poll_interval_s if ok else self._backoff.next_delay())
