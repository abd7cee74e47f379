"""NATS discovery backend (URL ``nats://host:port``): a JetStream key-value bucket with TTLs.

Records live in the bucket ``pdserve_workers`` (stream ``KV_pdserve_workers``, file storage,
history 1) under the worker id escaped by :func:`~pdserve.discovery.load_events.subject_token`, as
``WorkerRecord`` JSON. Every write carries a per-message TTL (``Nats-TTL``, ``ceil(ttl_s)``
whole seconds, minimum 1; nats-server 2.11+), so a put is also the lease refresh. When a key's
last message expires, the server places a marker (``Nats-Marker-Reason: MaxAge``, seen by
watchers as a PURGE); :meth:`NatsRegistration.close` writes a DEL marker. Both markers expire
after :data:`MARKER_TTL_S`, so the bucket does not fill with tombstones of past workers. Load
and KV block counters travel on core NATS subjects instead (:mod:`pdserve.discovery.load_events`).

:class:`NatsRegistration` (worker side) lifecycle:

1. ``start(record)``: nats-py connects in the background (and reconnects forever); wait for
   the connection (2 s at most) and put the record once. Success -> REGISTERED; failure -> a
   warning, RETRYING (the worker keeps running).
2. refresh task: re-puts the newest record every ``ttl_s / 3`` seconds, and soon after an
   ``update()`` that changed more than the load (load goes on ``pdserve.load.<key>``). Each put
   expects our last revision (compare-and-set). On a conflict the key is read: a record of a
   *newer* epoch means this incarnation was superseded (logged as an error; the task stops
   writing and the state stays RETRYING); an expired, deleted or own record is put again
   (logged as a re-registration). NATS unreachable: RETRYING, backoff 0.1 s doubling to
   ``ttl_s / 3``, cut short when the client reconnects.
3. ``close()``: cancel the task, write the DEL marker if the key still holds our revision
   (2 s max), close the connection. Idempotent. ``abandon()`` skips the DEL marker.

The router side, :class:`~pdserve.discovery.nats_watcher.NatsWatcher`, lives in
:mod:`pdserve.discovery.nats_watcher`; :class:`NatsSession` and :func:`record_of` serve both.

``nats`` (nats-py) is imported only inside this module's functions and constructors, so
importing ``pdserve.discovery`` does not load it. Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pdserve.discovery.kvcache import KVCacheEvent, KVEventAck
from pdserve.discovery.load_events import EventPublisher, subject_token
from pdserve.discovery.registration import Registration, SupersededError
from pdserve.discovery.tls import ControlPlaneTLS
from pdserve.protocol import WorkerLoad, WorkerRecord

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.js.client import JetStreamContext
    from nats.js.kv import KeyValue

    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

BUCKET = "pdserve_workers"
MARKER_TTL_S = 60
"""Seconds a DEL or expiry marker stays in the bucket (watchers see it at once)."""
CLOSE_TIMEOUT_S = 2.0
CONNECT_WAIT_S = 2.0
_WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream error codes of a failed compare-and-set
_TTL_HEADER = "Nats-TTL"
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"


class NatsSession:
    """One nats-py connection to ``server_url``, connected in the background, reconnecting
    forever (0.5 s between attempts), plus the bound key-value bucket.

    ``on_connect`` runs (on the loop) after every connect and reconnect, ``on_disconnect`` after
    every loss. ``tls`` (:class:`~pdserve.discovery.tls.ControlPlaneTLS`): TLS with its CA and
    client certificate when enabled (``tls://``; a server that does not require TLS is
    refused, never used in plaintext) and the user credentials file. Connection errors are
    logged as warnings (the first, the first TLS / authorization error, then every 20th) and
    kept in :attr:`last_error`. Ownership: the session owns the client; :meth:`close` closes it
    (bounded).
    """

    def __init__(
        self,
        server_url: str,
        *,
        op_timeout_s: float,
        on_connect: Callable[[], None] = lambda: None,
        on_disconnect: Callable[[], None] = lambda: None,
        tls: ControlPlaneTLS | None = None,
    ) -> None:
        from nats.aio.client import Client

        self.server_url = server_url
        self.op_timeout_s = op_timeout_s
        self.tls = tls or ControlPlaneTLS()
        self._ssl_context = self.tls.ssl_context()  # read once: no file access on reconnect
        self.last_error: Exception | None = None
        """The newest connection error since the last connect (a TLS or authorization error
        is kept over the resets that follow it), or None."""
        self._errors = 0
        self._refusal: asyncio.Task[None] | None = None
        self.client: NatsClient = Client()
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._up = asyncio.Event()
        self._kv: KeyValue | None = None
        self._connector: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def js(self) -> JetStreamContext:
        return self.client.jetstream(timeout=self.op_timeout_s)

    async def start(self) -> None:
        if self._connector is None:
            self._connector = asyncio.create_task(self._connect(), name="nats-connect")

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout_s)
        return self._up.is_set()

    async def kv(self) -> KeyValue:
        """The bucket, created on first use (idempotent: every creator uses the same config).
        Raises nats errors when JetStream cannot be reached."""
        if self._kv is None:
            import nats.js.errors
            from nats.js.api import KeyValueConfig, StorageType

            try:
                self._kv = await self.js.key_value(BUCKET)
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(
                    bucket=BUCKET,
                    description="pdserve worker records (WorkerRecord JSON, per-key TTL)",
                    history=1,
                    storage=StorageType.FILE,
                    limit_marker_ttl=MARKER_TTL_S,
                )
                self._kv = await self.js.create_key_value(config)
        return self._kv

    def forget_bucket(self) -> None:
        """Bind the bucket again on next use (the server lost it, e.g. a wiped store)."""
        self._kv = None

    async def close(self) -> None:
        self._closing = True
        self._up.clear()
        connector, self._connector = self._connector, None
        if connector is not None and not connector.done():
            connector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connector
        try:
            await asyncio.wait_for(self.client.close(), CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing a broken connection must not fail the caller
            logger.debug("closing the NATS client failed: %r", exc)

    async def _connect(self) -> None:
        options: dict[str, Any] = {}
        if self._ssl_context is not None:
            options["tls"] = self._ssl_context
        if self.tls.nats_credentials_file is not None:
            options["user_credentials"] = str(self.tls.nats_credentials_file)
        server = self.server_url
        if self.tls.enabled:
            server = "tls://" + server.removeprefix("nats://")
        try:
            await self.client.connect(
                servers=[server],
                name="pdserve",
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # also retries the first connect
                reconnect_time_wait=0.5,  # type: ignore[arg-type]  # nats-py annotates int
                connect_timeout=2,
                ping_interval=5,  # notice a silently dead server within ~15 s
                max_outstanding_pings=2,
                error_cb=self._error,
                disconnected_cb=self._disconnected,
                reconnected_cb=self._connected,
                **options,
            )
        except Exception as exc:  # e.g. a malformed URL; nothing more will be tried
            logger.error("NATS %s: giving up connecting: %r", self.server_url, exc)
            return
        await self._connected()

    async def _connected(self) -> None:
        if self.tls.enabled and not self._tls_in_use():
            self.last_error = ConnectionError("the server does not require TLS")
            logger.error(
                "NATS %s does not require TLS, but TLS is configured (discovery.ca_file / "
                "cert_file): refusing the plaintext connection; configure TLS on the server",
                self.server_url,
            )
            self._closing = True  # no reconnect: the server stays refused until a restart
            # Closed from a task of its own: this callback runs inside nats-py's connect or
            # reconnect task, which close() cancels.
            self._refusal = asyncio.create_task(self.client.close(), name="nats-refuse")
            return
        self.last_error, self._errors = None, 0
        logger.info("NATS %s connected (%s)", self.server_url, self.tls.describe())
        self._kv = None  # bind again: the server may have restarted without its store
        self._up.set()
        self._on_connect()

    async def _disconnected(self) -> None:
        self._up.clear()
        if not self._closing:
            logger.warning("NATS %s disconnected; reconnecting", self.server_url)
            self._on_disconnect()

    def _tls_in_use(self) -> bool:
        """Whether the current connection runs over TLS (nats-py upgrades only when the
        server's INFO asks for it, whatever the URL's scheme)."""
        info = getattr(self.client, "_server_info", {})  # nats-py has no public accessor
        return bool(isinstance(info, dict) and info.get("tls_required"))

    async def _error(self, exc: Exception) -> None:
        """nats-py's error callback: warn on the first error since the last connect, the
        first telling one (TLS, authorization), then every 20th. :attr:`last_error` keeps a
        telling error over the connection resets that follow it."""
        telling = _telling(exc)
        first_telling = telling and (self.last_error is None or not _telling(self.last_error))
        if telling or self.last_error is None or not _telling(self.last_error):
            self.last_error = exc
        self._errors += 1
        if self._closing:
            return
        if self._errors == 1 or first_telling or self._errors % 20 == 0:
            logger.warning(
                "NATS %s (%s): %s (%d errors since the last connect)",
                self.server_url,
                self.tls.describe(),
                explain_error(exc),
                self._errors,
            )
        else:
            logger.debug("NATS %s: %r", self.server_url, exc)


def _telling(exc: Exception) -> bool:
    """Whether ``exc`` says why a connection is refused (TLS or authorization), unlike the
    resets and broken pipes that follow."""
    return isinstance(exc, ssl.SSLError) or "authoriz" in str(exc).lower()


def explain_error(exc: Exception) -> str:
    """``exc`` in words, with a hint for TLS and authorization failures."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{text} (is discovery.ca_file the CA that signed the server's certificate?)"
    if isinstance(exc, ssl.SSLError) and "certificate" in str(exc).lower():
        return f"{text} (the server wants a client certificate: discovery.cert_file/key_file)"
    if "authorization" in str(exc).lower():
        return f"{text} (check discovery.nats_credentials_file)"
    return text


def _identity(record: WorkerRecord) -> WorkerRecord:
    """The record without the fields that change every second (they go on events) and the
    signature over them."""
    return record.model_copy(update={"load": WorkerLoad(), "updated_at": 0.0, "signature": ""})


def record_of(entry: KeyValue.Entry) -> WorkerRecord | None:
    """The record a bucket entry holds; None for a DEL / PURGE marker, a server-placed expiry
    marker (nats-py reads it as an entry without operation or value) or a malformed value
    (logged)."""
    if entry.operation is not None or not entry.value:
        return None
    try:
        return WorkerRecord.model_validate_json(entry.value)
    except ValidationError as exc:
        logger.warning("ignoring malformed worker record at key %r: %s", entry.key, exc)
        return None


def _is_cas_conflict(exc: Exception) -> bool:
    import nats.js.errors

    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in _WRONG_LAST_SEQUENCE


class NatsRegistration(Registration):
    """Holds one worker's record in the NATS bucket under a per-message TTL."""

    _task_prefix = "nats"

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
        self.server_url = f"nats://{host}:{port}"
        self.lease_ttl_s = max(1, math.ceil(self.ttl_s))
        self.op_timeout_s = max(0.5, min(5.0, self.refresh_interval_s))
        self.revision: int | None = None  # stream sequence of our last put
        self.events: EventPublisher | None = None
        self._session = NatsSession(
            self.server_url, op_timeout_s=self.op_timeout_s, on_connect=self._on_connect, tls=tls
        )
        # _wake (base): put soon: update() changed the identity, or reconnected
        self._reconnected = asyncio.Event()  # cuts the backoff short
        self._written: WorkerRecord | None = None

    @property
    def _where(self) -> str:
        return f"NATS {self.server_url}"

    @property
    def _subject(self) -> str:
        return f"$KV.{BUCKET}.{subject_token(self._worker_id)}"

    async def _connect(self, record: WorkerRecord) -> bool:
        """Create the event publisher, connect in the background, wait for it (bounded)."""
        self.events = EventPublisher(  # signs its events with the key that signs the record
            self._session.client, worker_id=record.worker_id, epoch=record.epoch, key=self._key
        )
        await self._session.start()
        if await self._session.wait_connected(min(CONNECT_WAIT_S, self.op_timeout_s)):
            return True
        error = self._session.last_error
        logger.warning(
            "NATS %s unreachable (%s): worker %s not registered yet; retrying",
            self.server_url,
            explain_error(error) if error is not None else "no answer",
            record.worker_id,
        )
        return False

    async def send_kv_event(self, event: KVCacheEvent) -> KVEventAck | None:
        """Publish a KV cache event on ``pdserve.kvcache.<key>``; the ack asks for a snapshot
        when a router requested one on ``pdserve.kvsync.<key>``; None when not sent."""
        if self.events is None or not await self.events.publish_kvcache(event):
            return None
        return KVEventAck(snapshot=self.events.take_sync_request())

    def take_kv_snapshot_request(self) -> bool:
        """Whether a router asked for a KV cache snapshot since the last call."""
        return self.events is not None and self.events.take_sync_request()

    def _needs_write(self, record: WorkerRecord) -> bool:
        """Only identity changes are written early; load goes on events."""
        return self._written is None or _identity(record) != _identity(self._written)

    async def _wait_backoff(self) -> None:
        """Back off, unless the client reconnects first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reconnected.wait(), timeout=self._backoff.next_delay())

    async def _close_client(self) -> None:
        await self._session.close()

    def _on_connect(self) -> None:
        self._reconnected.set()
        self._wake.set()  # the record may have expired while we were cut off

    async def _delete(self) -> None:
        """DEL marker, only over our own revision (never a successor's record)."""
        if self.revision is None:
            return
        if not self._session.client.is_connected:
            logger.warning(
                "NATS %s unreachable: record of worker %s lapses in %d s",
                self.server_url,
                self._worker_id,
                self.lease_ttl_s,
            )
            return
        headers = {
            "KV-Operation": "DEL",
            _TTL_HEADER: str(MARKER_TTL_S),
            _EXPECTED_LAST: str(self.revision),
        }
        try:
            await self._session.js.publish(
                self._subject, b"", headers=headers, timeout=CLOSE_TIMEOUT_S
            )
            logger.info("deregistered worker %s from NATS %s", self._worker_id, self.server_url)
        except Exception as exc:
            if _is_cas_conflict(exc):
                logger.info("record of worker %s was already replaced or gone", self._worker_id)
                return
            logger.warning(
                "could not deregister worker %s at NATS %s (%r); record lapses in %d s",
                self._worker_id,
                self.server_url,
                exc,
                self.lease_ttl_s,
            )

    async def _write(self, refresh_due: bool) -> None:
        """Put the newest record (the put is also the refresh, its TTL renewed); a vanished
        stream (e.g. a wiped store) makes the bucket bound again on the next try."""
        import nats.js.errors

        self._reconnected.clear()
        try:
            await self._put()
        except (nats.js.errors.NoStreamResponseError, nats.js.errors.NotFoundError):
            self._session.forget_bucket()
            raise

    async def _put(self) -> None:
        """Put the newest record (compare-and-set on ``revision``); on a conflict, take the
        key over unless a newer epoch holds it (:class:`SupersededError`)."""
        import nats.js.errors

        record = self._record
        assert record is not None
        if not self._session.client.is_connected:  # nats-py would buffer it for later: stale
            raise ConnectionError("not connected")
        kv = await self._session.kv()
        headers = {_TTL_HEADER: str(self.lease_ttl_s)}
        if self.revision is not None:
            headers[_EXPECTED_LAST] = str(self.revision)
        self._wake.clear()  # the put below carries the newest record
        payload = record.model_dump_json().encode()
        created = self.revision is None
        try:
            ack = await self._session.js.publish(self._subject, payload, headers=headers)
        except nats.js.errors.APIError as exc:
            if not _is_cas_conflict(exc):
                raise
            try:
                held = await kv.get(subject_token(record.worker_id))
            except nats.js.errors.KeyNotFoundError:  # deleted while we were away
                held = None
            # An expiry marker reads as an entry with no value (nats-py maps only KV-Operation).
            current = record_of(held) if held else None
            if current is not None and current.epoch > record.epoch:
                raise SupersededError(
                    f"worker {record.worker_id} restarted elsewhere: epoch {current.epoch} "
                    f"holds the record, this is epoch {record.epoch}"
                ) from None
            created = current is None or current.epoch != record.epoch
            del headers[_EXPECTED_LAST]
            ack = await self._session.js.publish(self._subject, payload, headers=headers)
        self.revision = ack.seq
        self._written = record
        if created:
            self._log_created(record, f"in NATS {self.server_url}, ttl {self.lease_ttl_s} s")
