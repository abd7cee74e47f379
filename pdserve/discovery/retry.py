"""Retry helpers of the discovery backends: capped exponential backoff with jitter, and
cancelling a background task."""

from __future__ import annotations

import asyncio
import contextlib
import random


class Backoff:
    """Exponential backoff with jitter: ``initial_s`` doubling up to ``max_s`` (seconds)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max(initial_s, max_s)
        self._next_s = initial_s
        self.failures = 0

    def next_delay(self) -> float:
        """Record a failure and return how long to wait before the next try."""
        self.failures += 1
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        return delay * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        self._next_s = self.initial_s
        self.failures = 0


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait for it to finish; its cancellation is swallowed."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
