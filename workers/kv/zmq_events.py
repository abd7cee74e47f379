"""The KV pool's events in vLLM's KV event format, on ZMQ: what llm-d's and Dynamo's indexers
read from vLLM workers, so they can index pdserve workers too (``kv_cache.zmq_events``).

Wire format (vLLM's ``vllm.distributed.kv_events``, ``publisher: zmq``): a PUB socket sends one
three-frame message per batch, ``[topic, seq, payload]``: the topic (:data:`TOPIC`), the batch's
sequence number (8 bytes, big-endian, from 0 per publisher) and a msgpack ``KVEventBatch``,
encoded as arrays: ``[ts, [event, ...]]`` with each event ``[tag, fields...]``:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``:
  a run of consecutive full blocks indexed in the pool, their tokens
  (``len(block_hashes) * block_size``) and the hash of the block before the first (nil: the
  run starts its sequence);
- ``["BlockRemoved", block_hashes, medium]``: blocks evicted from the pool;
- ``["AllBlocksCleared"]``: first in the first batch (a subscriber drops what it had for
  this endpoint: a restarted worker's pool is empty).

Block hashes are pdserve's chained 128-bit block hashes (:mod:`pdserve.block_hash`) as 16
big-endian bytes (vLLM's ``ExternalBlockHash`` is bytes or int; msgpack ints stop at 64 bits);
``lora_id`` is nil and ``medium`` is ``"GPU"``, vLLM's name for the engine's own KV pool
(whatever its device). Not built: vLLM's replay socket (a subscriber that missed batches
cannot ask for them again; it sees the gap in ``seq``), and events of the KV cache
connector's tiers (the signed pdserve events, :mod:`pdserve.workers.kv.cache_events`, carry
those).

Thread-safety: the listener methods run on the engine thread under the KV manager's lock and
only append to a bounded queue (a full queue drops the batch's events and counts them in
``dropped``); one publisher thread owns the socket and sends a batch every
:data:`FLUSH_S` seconds while there are events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.workers.kv.manager import KVCacheManager

log = logging.getLogger(__name__)

TOPIC = b"kv-events"
"""The topic frame of every message (subscribe to it, or to b"" for everything)."""
FLUSH_S = 0.05
"""How often the publisher thread sends what was recorded (seconds)."""
MAX_QUEUED = 1 << 16
"""Events held between two sends; more are dropped (and counted)."""
MEDIUM = "GPU"


def _hash_bytes(h: int) -> bytes:
    return h.to_bytes(16, "big")


class ZmqKVEvents:
    """Publishes one KV pool's events in vLLM's format on a ZMQ PUB socket bound at
    ``endpoint`` (``endpoint`` is then the bound one, e.g. ``tcp://0.0.0.0:5557``). Attach it
    with :meth:`attach`; :meth:`close` stops the thread and the socket. Raises ConfigError
    when the endpoint cannot be bound."""

    def __init__(self, endpoint: str, block_size: int) -> None:
        import zmq

        from pdserve.errors import ConfigError

        self.block_size = block_size
        self.sent = 0
        self.dropped = 0
        self._queue: deque[list[Any]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ConfigError(f"kv_cache.zmq_events: cannot bind {endpoint!r}: {exc}") from exc
        bound: Any = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = bound.decode() if isinstance(bound, bytes) else str(bound)
        self._thread = threading.Thread(target=self._run, name="kv-zmq-events", daemon=True)
        self._thread.start()

    def attach(self, kv_cache: KVCacheManager) -> None:
        """Listen to ``kv_cache``'s stores (with their tokens) and evictions."""
        kv_cache.add_listener(self)
        kv_cache.add_token_listener(self)

    # -- listeners (engine thread, manager lock held) ---------------------------------------

    def blocks_stored(self, hashes: list[int], block_ids: list[int]) -> None:
        """KVCacheListener: nothing here; :meth:`blocks_stored_tokens` has the tokens."""

    def blocks_stored_tokens(
        self, hashes: list[int], parent: int | None, tokens: list[int]
    ) -> None:
        """KVTokenListener: a ``BlockStored`` event."""
        self._put(
            [
                "BlockStored",
                [_hash_bytes(h) for h in hashes],
                None if parent is None else _hash_bytes(parent),
                list(tokens),
                self.block_size,
                None,
                MEDIUM,
            ]
        )

    def blocks_evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        """KVCacheListener: a ``BlockRemoved`` event."""
        self._put(["BlockRemoved", [_hash_bytes(h) for h in hashes], MEDIUM])

    def _put(self, event: list[Any]) -> None:
        with self._lock:
            if len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return
            self._queue.append(event)

    # -- the publisher thread -------------------------------------------------------------------

    def _run(self) -> None:
        import msgspec

        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while not self._stop.wait(FLUSH_S):
            with self._lock:
                events = list(self._queue)
                self._queue.clear()
            if not events:
                continue
            if seq == 0:
                events.insert(0, ["AllBlocksCleared"])
            payload = encode([time.time(), events])
            self._socket.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
            seq += 1
            self.sent += len(events)
        self._socket.close()

    def close(self) -> None:
        """Stop publishing (what is queued is not sent); idempotent."""
        self._stop.set()
        self._thread.join(timeout=2.0)


def open_zmq_events(kv_cache: KVCacheManager, endpoint: str, stack: AsyncExitStack) -> ZmqKVEvents:
    """Start publishing ``kv_cache``'s events at ``endpoint``; closed with ``stack``."""
    events = ZmqKVEvents(endpoint, kv_cache.tokens_per_block)
    events.attach(kv_cache)
    stack.callback(events.close)
    log.info("KV events in vLLM's format on %s (ZMQ PUB, topic %r)", events.endpoint, TOPIC)
    return events
