"""Which workers a worker pulls KV blocks from: only those discovery lists (a decode worker's
prefill hand-off: prefill workers; a lent prefix, :mod:`pdserve.workers.roles.lending`: any).

A transfer handle names its prefill worker (worker id, epoch) and that worker's transceiver
endpoint, and the handle arrives in a request. A decode worker that dialled the endpoint as
such could be made to connect anywhere and report what it found (an internal port scanner,
sending its own NIXL/UCX Hello there). So it never does: :class:`PrefillDirectory` looks the
prefill worker up in this worker's own view of discovery (the signed records the router sees,
:func:`pdserve.discovery.open_watcher`) and answers the endpoint that record publishes. A
handle whose worker is not a registered prefill worker at that epoch, or whose endpoint is not
the record's, is refused (:class:`~pdserve.errors.HandleError`) before any connection.

A prefill worker that registered a moment ago may not be in this worker's view yet (the
embedded registry is polled every second): the lookup waits for it up to ``wait_s`` (and never
past the handle's lease) before refusing.

Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from pdserve.errors import HandleError
from pdserve.protocol import Role, TransferHandle

if TYPE_CHECKING:
    from pdserve.discovery import Watcher

log = logging.getLogger(__name__)


class PrefillDirectory:
    """The registered prefill workers' transfer endpoints, from ``watcher`` (owned: started
    and closed with the directory).

    ``wait_s``: how long a lookup waits for a prefill worker not listed yet (seconds);
    ``poll_s``: how often it looks again meanwhile.
    """

    def __init__(self, watcher: Watcher, *, wait_s: float = 3.0, poll_s: float = 0.05) -> None:
        self._watcher = watcher
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.refused = 0

    async def start(self) -> None:
        """Start watching discovery (the first listing happens here)."""
        await self._watcher.start()

    async def close(self) -> None:
        """Stop watching; idempotent."""
        await self._watcher.close()

    async def endpoint(
        self, handle: TransferHandle, roles: Collection[Role] = (Role.PREFILL,)
    ) -> str:
        """The transfer endpoint of the worker ``handle`` names, as its discovery record
        publishes it; ``roles``: the roles it may have (a prefill hand-off: prefill; a lent
        prefix, :mod:`pdserve.workers.roles.lending`: any). Raises HandleError (nothing was
        dialled) when no registered worker of those roles has that worker id and epoch within
        ``wait_s`` (or the lease), or when the handle's endpoint is not the record's."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + max(0.0, min(self.wait_s, handle.lease_remaining()))
        while True:
            record = self._watcher.workers().get(handle.worker_id)
            if record is not None and record.role in roles and record.epoch == handle.epoch:
                listed = record.communicator.get("endpoint", "")
                if listed != handle.transfer_endpoint:
                    return self._refuse(
                        handle,
                        f"its endpoint {handle.transfer_endpoint!r} is not the one discovery "
                        f"lists for {handle.worker_id} ({listed!r})",
                    )
                return listed
            if loop.time() >= give_up:
                what = "prefill worker" if tuple(roles) == (Role.PREFILL,) else "worker"
                return self._refuse(
                    handle, f"{handle.worker_id} epoch {handle.epoch} is not a registered {what}"
                )
            await asyncio.sleep(self.poll_s)

    def _refuse(self, handle: TransferHandle, why: str) -> str:
        self.refused += 1
        log.warning("refused the handle of request %s: %s", handle.request_id, why)
        raise HandleError(
            f"handle of request {handle.request_id} refused: {why}; a worker pulls only "
            "from workers that discovery lists"
        )
