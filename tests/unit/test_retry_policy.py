"""router/retry.py: the one rule book of the first leg, the decode leg's opening and migration
(what is retried, how often, how much deadline or lease must be left)."""

from __future__ import annotations

import time

from pdserve.errors import (
    HandleError,
    LayoutMismatchError,
    QueueFullError,
    TransferError,
    WorkerError,
    WorkerUnreachableError,
)
from pdserve.router.retry import DECODE_ATTEMPTS, MIN_LEFT_S, RetryPolicy


def later(seconds: float) -> float:
    return time.time() + seconds


def test_first_leg_retries_up_to_the_migration_limit_within_the_deadline() -> None:
    policy = RetryPolicy(migration_limit=2)
    failed = WorkerError("stream broke")
    assert policy.first_leg(failed, 0, later(30)) and policy.first_leg(failed, 1, later(30))
    assert not policy.first_leg(failed, 2, later(30))
    assert not policy.first_leg(failed, 0, later(MIN_LEFT_S / 2))


def test_a_limit_of_zero_still_retries_a_refused_connection_once() -> None:
    policy = RetryPolicy(migration_limit=0)
    refused = WorkerUnreachableError("connection refused")
    assert policy.first_leg(refused, 0, later(30))
    assert not policy.first_leg(refused, 1, later(30))
    assert not policy.first_leg(WorkerError("stream broke"), 0, later(30))
    assert not policy.migration(0, later(30))


def test_a_decode_refusal_moves_on_unless_every_worker_would_refuse_it() -> None:
    policy = RetryPolicy(migration_limit=3)
    for exc in (QueueFullError("queue full"), TransferError("pull failed")):
        assert policy.decode_refusal(exc, 1, later(30), lease_left=30)
        assert not policy.decode_refusal(exc, DECODE_ATTEMPTS, later(30), lease_left=30)
        assert not policy.decode_refusal(exc, 1, later(30), lease_left=MIN_LEFT_S / 2)
        assert not policy.decode_refusal(exc, 1, later(MIN_LEFT_S / 2), lease_left=30)
    for code in (HandleError.code, LayoutMismatchError.code):
        same_everywhere = TransferError("refused", code=code)
        assert not policy.decode_refusal(same_everywhere, 1, later(30), lease_left=30)


def test_migration_stops_at_the_limit_or_near_the_deadline() -> None:
    policy = RetryPolicy(migration_limit=1)
    assert policy.migration(0, later(30))
    assert not policy.migration(1, later(30))
    assert not policy.migration(0, later(MIN_LEFT_S / 2))
