"""etcd discovery backend (URL ``etcd://host:port``), on the asyncio client ``aetcd``.

Records live at ``/pdserve/workers/<worker_id>`` as ``WorkerRecord`` JSON, attached to a lease
whose TTL is ``ceil(ttl_s)`` seconds (etcd leases have whole-second TTLs, minimum 1).

:class:`EtcdRegistration` (worker side) lifecycle:

1. ``start(record)``: grant a lease, put the record with it (inline, once). Success ->
   REGISTERED; failure -> a warning, RETRYING (the worker keeps running).
2. keepalive task: refreshes the lease every ``ttl_s / 3`` seconds and puts the newest record
   soon after each ``update()``. If etcd answers that the lease is gone (it expired while the
   worker was cut off, or etcd lost its data), a new lease is granted and the record re-put
   (logged as a re-registration). If etcd is unreachable: RETRYING, backoff 0.1 s doubling to
   ``ttl_s / 3``, a warning on the first failure and every 10th. etcd restores leases when it
   restarts with its data, so a short outage usually needs no re-registration.
3. ``close()``: cancel the task, revoke the lease (which deletes the record at once; 2 s max),
   close the client. Idempotent.

:class:`EtcdWatcher` (router side): ``get_prefix`` then ``watch_prefix`` from the next revision.
If the watch breaks (etcd stopped, connection lost, revision compacted) it keeps its last view,
reconnects with backoff (0.1 s doubling to 5 s), re-lists (emitting only the differences) and
watches again. ``connected`` tells whether the view is currently following etcd.

KV cache events (:mod:`pdserve.discovery.kvcache`): :meth:`EtcdRegistration.send_kv_event`
puts each event at ``/pdserve/kvcache/<worker_id>`` under the worker's lease (so it goes with
the worker); the watcher lists and watches ``/pdserve/`` (records and events in one watch, in
revision order) and hands every event put to :meth:`EtcdWatcher.subscribe_kv_events`'s
handlers. The listing after a reconnect shows only each worker's last event: the index sees a
gap and waits for that worker's next periodic snapshot (etcd has no way to ask for one).
Events are signed by the worker with the cluster key and put as they are; the router's index
checks the signature (:meth:`pdserve.router.kv_index.KVIndex.apply`, keyed by the watcher's
``key``), so write access to etcd is not enough to skew routing.

``aetcd`` is imported only inside this module's functions, so importing ``pdserve.discovery``
does not load gRPC. Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pdserve.discovery.kvcache import (
    ETCD_KVCACHE_PREFIX,
    KVCacheEvent,
    KVEventAck,
    KVEventHandler,
)
from pdserve.discovery.records import BackgroundWatcher
from pdserve.discovery.registration import Registration, RegistrationState
from pdserve.discovery.retry import Backoff
from pdserve.discovery.tls import ControlPlaneTLS
from pdserve.protocol import WorkerRecord

if TYPE_CHECKING:
    import aetcd

    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

PREFIX = "/pdserve/workers/"
ROOT = "/pdserve/"
CLOSE_TIMEOUT_S = 2.0
# Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s) and detect a
# silently dead connection (pings every 10 s; etcd refuses pings more often than every 5 s).
_GRPC_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}


def worker_key(worker_id: str) -> bytes:
    return f"{PREFIX}{worker_id}".encode()


def _new_client(
    host: str, port: int, timeout_s: float, tls: ControlPlaneTLS | None = None
) -> aetcd.Client:
    """An aetcd client for ``host:port`` (operations bounded by ``timeout_s`` seconds); with
    ``tls`` enabled over a TLS channel (CA, client certificate), with its etcd user if set."""
    import aetcd  # lazy: gRPC loads only when etcd is used

    if tls is None or not (tls.enabled or tls.etcd_username):
        return aetcd.Client(host=host, port=port, timeout=timeout_s, options=dict(_GRPC_OPTIONS))
    from pdserve.discovery.etcd_client import SecureClient

    return SecureClient(tls, host=host, port=port, timeout_s=timeout_s, options=dict(_GRPC_OPTIONS))


async def _close_client(client: aetcd.Client) -> None:
    """Close a client, bounded by ``CLOSE_TIMEOUT_S``; errors are logged, never raised."""
    try:
        await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)
    except Exception as exc:  # closing a broken channel must not fail the caller
        logger.debug("closing the etcd client failed: %r", exc)


def etcd_hint(exc: Exception, tls: ControlPlaneTLS) -> str:
    """A hint for a failure that TLS or credentials settings explain ("" otherwise)."""
    text = str(exc).lower()
    if "authentication failed" in text or "invalid user" in text:
        return "(etcd refused the user: check discovery.etcd_username / etcd_password_file)"
    if "permission denied" in text:
        if tls.etcd_username is None:
            return (
                "(etcd has authentication on: set discovery.etcd_username / "
                "etcd_password_file, or give the client certificate's CN a role)"
            )
        return f"(etcd user {tls.etcd_username} lacks read-write on {PREFIX})"
    if "token" in text and "invalid" in text and tls.etcd_username:
        return "(etcd forgot the login, e.g. it restarted: logging in again)"
    if "user name is empty" in text or ("token" in text and "invalid" in text):
        return "(etcd has authentication on: set discovery.etcd_username / etcd_password_file)"
    if not tls.enabled and any(s in text for s in ("ssl", "tls", "socket closed")):
        return "(does etcd serve TLS? set discovery.ca_file / cert_file / key_file)"
    if tls.enabled and any(s in text for s in ("ssl", "handshake", "certificate", "tls")):
        return (
            "(TLS failed: is discovery.ca_file the CA of etcd's certificate, and does etcd "
            "accept discovery.cert_file?)"
        )
    return ""


def _token_expired(exc: Exception) -> bool:
    """Whether etcd refused our auth token (it forgets tokens when it restarts)."""
    from aetcd.exceptions import UnauthenticatedError

    return isinstance(exc, UnauthenticatedError) and "token" in str(exc)


class LeaseLostError(Exception):
    """etcd no longer knows our lease (expired or etcd lost its data)."""


class EtcdRegistration(Registration):
    """Holds one worker's record in etcd under a lease, refreshed by a background task."""

    _task_prefix = "etcd"
    _write_refreshes = False  # a put does not renew the lease

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ttl_s: float,
        key: ClusterKey,
        tls: ControlPlaneTLS | None = None,
    ) -> None:
        super().__init__(ttl_s, key=key)  # key: signs every record put
        self.tls = tls or ControlPlaneTLS()
        self.endpoint = f"{host}:{port}"
        self.lease_ttl_s = max(1, math.ceil(self.ttl_s))
        self.lease_id: int | None = None
        self._host, self._port = host, port
        self._op_timeout_s = max(0.5, min(5.0, self.refresh_interval_s))
        self._client = _new_client(host, port, self._op_timeout_s, self.tls)

    @property
    def _where(self) -> str:
        return f"etcd {self.endpoint}"

    def _failure_detail(self, exc: Exception) -> str:
        return etcd_hint(exc, self.tls)

    async def _write(self, refresh_due: bool) -> None:
        """Register when there is no lease; put after update(); refresh the lease when due.
        A lost lease (etcd forgot it) leads to a fresh lease and put."""
        try:
            if self.lease_id is None:
                await self._register()
                return
            if self._wake.is_set():
                self._wake.clear()
                try:
                    await self._put_record()
                except Exception:
                    self._wake.set()  # the newest record is still to be put on the retry
                    raise
            if refresh_due:
                await self._refresh()
        except LeaseLostError:
            logger.info("lease of worker %s is gone; registering again", self._worker_id)
            self.lease_id = None
            await self._register()
        except Exception as exc:
            if _token_expired(exc):  # etcd restarted (tokens are in memory): log in again
                await _close_client(self._client)
                self._client = _new_client(self._host, self._port, self._op_timeout_s, self.tls)
            raise

    async def _delete(self) -> None:
        """Revoke the lease, which deletes the record at once."""
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is None:
            return
        try:
            await asyncio.wait_for(self._client.revoke_lease(lease_id), CLOSE_TIMEOUT_S)
            logger.info("deregistered worker %s (lease revoked)", self._worker_id)
        except Exception as exc:
            logger.warning(
                "could not revoke lease of worker %s at %s (%r); record lapses in %d s",
                self._worker_id,
                self.endpoint,
                exc,
                self.lease_ttl_s,
            )

    async def _close_client(self) -> None:
        await _close_client(self._client)

    async def send_kv_event(self, event: KVCacheEvent) -> KVEventAck | None:
        """Put ``event`` at ``/pdserve/kvcache/<id>`` under this worker's lease; None when
        not registered or etcd failed (logged at debug: the publisher resyncs later)."""
        if self.lease_id is None or self.state is not RegistrationState.REGISTERED:
            return None
        key = f"{ETCD_KVCACHE_PREFIX}{event.worker_id}".encode()
        try:
            await self._client.put(key, event.model_dump_json().encode(), self.lease_id)
        except Exception as exc:
            logger.debug("putting KV events of %s failed: %r", event.worker_id, exc)
            return None
        return KVEventAck()

    async def _register(self) -> None:
        """Grant a fresh lease and put the record under it. ``lease_id`` is set only once the
        put succeeded, so a failure in between leads to a full retry (the orphan lease lapses).
        """
        record = self._record
        assert record is not None
        self.lease_id = None
        lease = await self._client.lease(self.lease_ttl_s)
        self._wake.clear()  # the put below carries the newest record
        await self._client.put(
            worker_key(record.worker_id), record.model_dump_json().encode(), lease
        )
        self.lease_id = lease.id
        self._log_created(
            record, f"in etcd {self.endpoint}, lease {lease.id:x} ttl {self.lease_ttl_s} s"
        )

    async def _put_record(self) -> None:
        import aetcd

        record = self._record
        assert record is not None and self.lease_id is not None
        try:
            await self._client.put(
                worker_key(record.worker_id), record.model_dump_json().encode(), self.lease_id
            )
        except aetcd.ClientError as exc:
            if "lease not found" in str(exc):
                raise LeaseLostError from exc
            raise

    async def _refresh(self) -> None:
        assert self.lease_id is not None
        reply = await self._client.refresh_lease(self.lease_id)
        if reply is None or reply.TTL <= 0:
            raise LeaseLostError


class EtcdWatcher(BackgroundWatcher[Any]):
    """Follows ``/pdserve/workers/`` in etcd: list, then watch; re-list after reconnecting."""

    _task_name = "etcd-watch"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: ClusterKey,
        op_timeout_s: float = 5.0,
        tls: ControlPlaneTLS | None = None,
    ) -> None:
        super().__init__(key=key)  # key: the view drops records not signed with it
        self.key = key  # and the KV index (follow_kv_events) drops events not signed with it
        self.tls = tls or ControlPlaneTLS()
        self.host, self.port = host, port
        self.endpoint = f"{host}:{port}"
        self.op_timeout_s = op_timeout_s
        self.connected = False
        self._client: aetcd.Client | None = None
        self._backoff = Backoff(0.1, 5.0)
        self._kv_handlers: list[KVEventHandler] = []

    def subscribe_kv_events(self, handler: KVEventHandler) -> None:
        """Hand every KV cache event put in etcd to ``handler`` (on the event loop)."""
        self._kv_handlers.append(handler)

    async def _sync(self) -> Any | None:
        """List and open the watch inline; if etcd is unreachable, log a warning (the view
        starts empty) and the task keeps retrying."""
        return await self._connect()

    async def _release(self) -> None:
        await self._drop_client()

    async def _drop_client(self) -> None:
        self.connected = False
        client, self._client = self._client, None
        if client is not None:
            await _close_client(client)

    async def _connect(self) -> Any | None:
        """(Re)list the prefix into the view and open a watch from the next revision; return
        the watch, or None after logging a failure."""
        await self._drop_client()  # a fresh client: no state left over from a broken stream
        self._client = client = _new_client(self.host, self.port, self.op_timeout_s, self.tls)
        try:
            listing = await client.get_prefix(ROOT.encode())
            workers = [kv for kv in listing if kv.key.startswith(PREFIX.encode())]
            records = [r for r in (self._decode(kv.key, kv.value) for kv in workers) if r]
            self.view.replace_all(records, reason="gone from etcd while disconnected")
            for kv in listing:
                self._kv_event(kv.key, kv.value)
            watch = await client.watch_prefix(
                ROOT.encode(), start_revision=listing.header.revision + 1
            )
        except Exception as exc:  # etcd down, timeout, compaction: keep the last view, retry
            if self._backoff.failures % 10 == 0:
                logger.warning(
                    "etcd %s: listing/watching workers failed (%r%s); keeping the last view "
                    "(%d workers) and retrying",
                    self.endpoint,
                    exc,
                    f" {hint}" if (hint := etcd_hint(exc, self.tls)) else "",
                    len(self.view),
                )
            return None
        if self._backoff.failures:
            logger.info("etcd %s: watching workers again (%d live)", self.endpoint, len(self.view))
        self._backoff.reset()
        self.connected = True
        return watch

    async def _follow(self, watch: Any | None) -> None:
        while True:
            if watch is not None:
                try:
                    async for event in watch:
                        self._apply(event)
                    logger.warning("etcd %s: watch stream ended; reconnecting", self.endpoint)
                except Exception as exc:
                    logger.warning(
                        "etcd %s: watch broke (%r); keeping the last view and reconnecting",
                        self.endpoint,
                        exc,
                    )
                self.connected = False
            await asyncio.sleep(self._backoff.next_delay())
            watch = await self._connect()

    def _apply(self, event: Any) -> None:
        if not event.kv.key.startswith(PREFIX.encode()):
            if event.kind != "DELETE":  # an event key goes with its lease: nothing to do
                self._kv_event(event.kv.key, event.kv.value)
            return
        worker_id = event.kv.key.decode(errors="replace").removeprefix(PREFIX)
        if event.kind == "DELETE":
            self.view.delete(worker_id, "deleted in etcd: lease expired or revoked")
            return
        record = self._decode(event.kv.key, event.kv.value)
        if record is not None:
            self.view.put(record)

    def _kv_event(self, key: bytes, value: bytes) -> None:
        """Hand a KV cache event at ``key`` to the handlers (other keys are ignored)."""
        if not key.startswith(ETCD_KVCACHE_PREFIX.encode()) or not self._kv_handlers:
            return
        try:
            event = KVCacheEvent.model_validate_json(value)
        except ValidationError:
            logger.debug("ignoring a malformed KV cache event at %r", key)
            return
        for handler in list(self._kv_handlers):
            try:
                handler(event)  # a wanted snapshot comes with the worker's periodic one
            except Exception:
                logger.exception("KV event subscriber %r failed on %s", handler, event.worker_id)

    @staticmethod
    def _decode(key: bytes, value: bytes) -> WorkerRecord | None:
        try:
            return WorkerRecord.model_validate_json(value)
        except ValidationError as exc:
            logger.warning("ignoring malformed worker record at %r: %s", key, exc)
            return None
