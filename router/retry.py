"""One retry policy for every leg of a request: what counts as retryable, how many times, and
how much of the deadline must be left.

A request has three places where a failed leg is tried again, each with its own worker choice
(:func:`pdserve.router.policy.choose_route` / :func:`~pdserve.router.policy.choose_retry`)
but one rule book, here:

- **the first leg** (the prefill leg, or the one-leg stream up to its first token:
  :meth:`pdserve.router.router.Router.start`): any worker or transfer failure is routed again
  without that worker, up to ``router.migration_limit`` times (with a limit of 0, a refused
  connection, which never reached a worker, is still retried once);
- **the decode leg's opening** (:meth:`pdserve.router.transaction.Transaction._open_decode_leg`):
  a refusal another decode worker may not share (unreachable, a full queue or pool, a failed
  pull) moves to another decode worker while the prefill worker still holds the blocks, up to
  :data:`DECODE_ATTEMPTS` decode workers; a refused handle or an unmappable KV layout is the
  same everywhere and is not retried;
- **migration** (a decode leg that failed before or after its first chunk, :mod:`.migration`):
  any worker or transfer failure, up to ``router.migration_limit`` times.

None of them starts with :data:`MIN_LEFT_S` or less of the request's deadline left (nor of
the prefill worker's lease, for a decode leg that would pull from it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.errors import (
    CapacityError,
    HandleError,
    LayoutMismatchError,
    PdserveError,
    QueueFullError,
    TransferError,
    WorkerError,
    WorkerUnreachableError,
)

MIN_LEFT_S = 1.0
"""Seconds of deadline (or lease) a retry needs left: less is not worth a new leg."""

DECODE_ATTEMPTS = 3
"""Decode workers one request's decode-leg opening may try (the first and two retries)."""

LEG_FAILURES = (WorkerError, TransferError)
"""What a failed first leg or decode stream raises that a retry or migration may fix."""

DECODE_REFUSALS = (WorkerUnreachableError, QueueFullError, CapacityError, TransferError)
"""A decode worker's refusals before its stream that another decode worker may not share."""

_NOT_RETRIED = frozenset({HandleError.code, LayoutMismatchError.code})
"""Decode-leg refusals no other decode worker fixes (the handle is refused, or P's KV layout
maps to no pool of this kind), by error code (the envelope's, as the client raises it)."""


@dataclass(frozen=True)
class RetryPolicy:
    """The rule book of the module docstring. ``migration_limit``: ``router.migration_limit``.
    Times are wall-clock seconds (``time.time()``), as request deadlines are."""

    migration_limit: int

    def first_leg(self, exc: PdserveError, retries: int, deadline: float) -> bool:
        """Whether a first leg that raised ``exc`` (one of :data:`LEG_FAILURES`) is routed
        again, ``retries`` having been made."""
        limit = self.migration_limit or int(type(exc) is WorkerUnreachableError)
        return retries < limit and _left(deadline) > MIN_LEFT_S

    def decode_refusal(
        self, exc: PdserveError, tried: int, deadline: float, lease_left: float
    ) -> bool:
        """Whether a decode leg refused with ``exc`` (one of :data:`DECODE_REFUSALS`) tries
        another decode worker, ``tried`` decode workers having been tried."""
        if exc.code in _NOT_RETRIED or tried >= DECODE_ATTEMPTS:
            return False
        return min(lease_left, _left(deadline)) > MIN_LEFT_S

    def migration(self, migrations: int, deadline: float) -> bool:
        """Whether a failed decode leg is migrated, ``migrations`` having been made."""
        return migrations < self.migration_limit and _left(deadline) > MIN_LEFT_S


def _left(deadline: float) -> float:
    return deadline - time.time()
