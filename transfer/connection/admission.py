"""Admission of the connections a transceiver serves: unproven peers never take a proven peer's slot.

A connection is *unproven* from accept until the peer has proven it holds the cluster secret
(:func:`pdserve.transfer.connection.auth.accept`), *proven* after. The two are capped apart::

    accept ──> UNPROVEN ──(proof checks out)──> PROVEN ──(handler ends)──> gone
                 │  at most max_unproven_per_host per address and max_unproven in all:
                 │  a new one past a cap evicts the oldest unproven one (of that address,
                 │  else of all), whose handler is cancelled before it read a proof
                 └──(no AuthHello within the start deadline, no proof within the auth
                     deadline: pdserve.transfer.sender)──> gone

    PROVEN: at most max_proven_per_host per address and max_proven in all; a proof that
            would pass a cap closes its connection (the dialler then sees it shed and dials
            again later).

Why evict rather than refuse: a decode worker dials from an address any process on its host
(or behind the same NAT) shares, and an unproven connection cannot be told from an attacker's.
Refusing new connections while the unproven slots are full hands the port to whoever keeps
them full (300 idle sockets renewed every 30 s starved every pull of a same-host decode worker).
Evicting the oldest means a flood must open more than a cap's worth of connections within one
authentication round trip (milliseconds) to cut a real peer's dial, and the dialler retries a
connection shed before the challenge (:data:`pdserve.transfer.wire.CONNECTION_SHED`). Proven
connections are counted apart, so no number of unproven ones takes their slots.

The same idea as the SYN-flood defences that drop the oldest half-open connection, and as
nginx's ``limit_conn`` zones kept per client key; this one keys on the peer address only
until the proof names the peer.

Not thread-safe: called from the transceiver's event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
"""What identifies one connection (the transceiver uses its handler task)."""

MAX_UNPROVEN_PER_HOST = 32
"""Unproven connections one peer address may hold at once: enough for a decode worker's burst
of dials (one per concurrent pull) to authenticate before any is evicted."""

MAX_UNPROVEN = 128
"""Unproven connections in all."""

MAX_PROVEN_PER_HOST = 128
"""Proven connections one peer address may hold at once (a decode worker keeps up to
``receiver.MAX_IDLE_PER_PEER`` idle ones plus one per concurrent pull)."""

MAX_PROVEN = 1024
"""Proven connections in all (each is a task and a socket)."""


@dataclass(frozen=True)
class SlotLimits:
    """The four caps of :class:`ConnectionSlots` (module constants by default)."""

    unproven_per_host: int = MAX_UNPROVEN_PER_HOST
    unproven: int = MAX_UNPROVEN
    proven_per_host: int = MAX_PROVEN_PER_HOST
    proven: int = MAX_PROVEN


class ConnectionSlots(Generic[K]):
    """Who holds a served connection slot, by state (see the module docstring).

    ``admit`` a connection when it is accepted, ``promote`` it once its peer is proven,
    ``release`` it when its handler ends (whatever state it reached; idempotent). Every call is
    O(1) amortised; memory is O(connections held).
    """

    def __init__(self, limits: SlotLimits | None = None):
        self.limits = limits or SlotLimits()
        self._unproven: OrderedDict[K, str] = OrderedDict()  # oldest first
        self._unproven_by_host: dict[str, OrderedDict[K, None]] = {}
        self._proven: dict[K, str] = {}
        self._proven_by_host: dict[str, int] = {}
        self.evicted = 0
        """Unproven connections evicted so far."""
        self.refused = 0
        """Proven connections closed at a cap so far."""

    @property
    def unproven(self) -> int:
        """Unproven connections held now."""
        return len(self._unproven)

    @property
    def proven(self) -> int:
        """Proven connections held now."""
        return len(self._proven)

    def admit(self, key: K, host: str) -> list[K]:
        """Hold ``key`` (from peer address ``host``) as unproven. Returns the connections it
        evicted (oldest first; at most two: one over the address's cap, one over the total):
        the caller ends them."""
        evicted: list[K] = []
        mine = self._unproven_by_host.setdefault(host, OrderedDict())
        if len(mine) >= self.limits.unproven_per_host:
            evicted.append(self._evict(next(iter(mine))))
        if len(self._unproven) >= self.limits.unproven:
            evicted.append(self._evict(next(iter(self._unproven))))
        self._unproven[key] = host
        mine[key] = None
        return evicted

    def promote(self, key: K) -> bool:
        """``key``'s peer proved itself: move it to the proven slots. False (and ``key`` is
        released) if its address or the total is at the proven cap, or ``key`` is not held
        as unproven (evicted meanwhile): then close it."""
        host = self._drop_unproven(key)
        if host is None:
            return False
        held = self._proven_by_host.get(host, 0)
        if held >= self.limits.proven_per_host or len(self._proven) >= self.limits.proven:
            self.refused += 1
            return False
        self._proven[key] = host
        self._proven_by_host[host] = held + 1
        return True

    def release(self, key: K) -> None:
        """``key``'s handler ended: free its slot, whichever it held (idempotent)."""
        if self._drop_unproven(key) is not None:
            return
        host = self._proven.pop(key, None)
        if host is None:
            return
        left = self._proven_by_host[host] - 1
        if left:
            self._proven_by_host[host] = left
        else:
            del self._proven_by_host[host]

    def _evict(self, key: K) -> K:
        self._drop_unproven(key)
        self.evicted += 1
        return key

    def _drop_unproven(self, key: K) -> str | None:
        host = self._unproven.pop(key, None)
        if host is None:
            return None
        mine = self._unproven_by_host[host]
        del mine[key]
        if not mine:
            del self._unproven_by_host[host]
        return host
