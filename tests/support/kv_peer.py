"""A prefill worker's transfer side in its own process, with the real parked-block table.

:class:`PrefillProcess` spawns a process that runs the in-process rig's prefill side
(:class:`tests.support.transfer_inproc.LocalPrefill`: a real KV cache manager whose pool holds
the pattern, the real ``ParkedBlocks`` wired to its block generations, a real transceiver);
the test process plays the decode worker.

The child's cluster secret is a constructor argument (default: the suite's; another one plays a
prefill worker of another deployment, or an impostor). Its state reports what an authentication
test must see untouched: backend peers added (``Backend.add_peer``, which is NIXL's
``add_remote_agent`` / UCX's endpoint), lease lookups, and refused connections.

Test-only levers, all applied inside the child by commands on a pipe (none is a production
flag): the ``LocalPrefill`` ones (``skew``: expire leases without waiting; ``steal``: an
ownership bug; ``reset``), the lease table's ``reap``, and a one-shot fault hook that flips one
byte of the source between the sender's digest and the backend's move (``corrupt_next``, a
monkeypatch of ``BlockDigester.at_source``: on TCP right after segment 0's digest and before
its bytes leave; on NIXL / UCX, which digest after the WRITE, after the WRITE and before the
digest), so the digest and the landed bytes differ on every backend).

Fixture ``prefill_process``: a peer per transfer backend, shared by a test module's tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest

from pdserve.protocol import TransferHandle
from pdserve.security import ClusterKey
from tests.support.fakes import TEST_SECRET
from tests.support.servers import wait_until_sync
from tests.support.transfer import BACKENDS, SpawnedPeer, backend_cfg, serve_commands
from tests.support.transfer_inproc import LocalPrefill

PREFILL_ID = "prefill-fenced"


@dataclass(frozen=True)
class PeerState:
    """What the prefill process reports: its lease table and transfer errors."""

    parked: int
    released_total: int
    expired_total: int
    free_blocks: int
    digests_computed: int
    errors: list[tuple[str, str]]  # (error class, message), oldest first
    peers_added: int = 0  # Backend.add_peer calls (a handshake accepted)
    lookups: int = 0  # ParkedBlocks.lookup calls (a SendBlocks served or refused by the table)
    auth_failures: int = 0  # connections refused: the peer did not prove the cluster secret


def _child(pipe: Pipe, backend: str, epoch: int, port: int, secret: str) -> None:
    asyncio.run(_serve(pipe, backend, epoch, port, secret))


async def _serve(pipe: Pipe, backend: str, epoch: int, port: int, secret: str) -> None:
    from pdserve.transfer.formatter.mapping import pool_bytes
    from pdserve.transfer.integrity import digests as integrity

    prefill = LocalPrefill(
        backend_cfg(backend, port=port),
        worker_id=PREFILL_ID,
        epoch=epoch,
        key=ClusterKey(secret.encode()),
    )
    t, parked = prefill.transceiver, prefill.parked
    counts = {"add_peer": 0, "lookup": 0}

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return method(*args, **kwargs)

        return call

    backend_obj = t._local.backend  # the instance: NIXL add_remote_agent, UCX endpoint
    backend_obj.add_peer = counted("add_peer", backend_obj.add_peer)  # type: ignore[method-assign]
    parked.lookup = counted("lookup", parked.lookup)  # type: ignore[method-assign]
    digested = [0]
    corrupt = [False]
    original = integrity.BlockDigester.at_source

    def at_source(self: Any, plan: Any, *args: Any) -> Any:  # the fault hook (and a counter)
        digests = original(self, plan, *args)
        digested[0] += 1
        if not corrupt[0]:
            return digests
        corrupt[0] = False
        assert plan.source is None, "the hook corrupts the pool (identity layouts)"

        def flip() -> None:
            pool_bytes(prefill.kv.pool)[int(plan.src_offsets[0] + plan.lengths[0] // 2)] ^= 0x10

        if backend_obj.inline_bytes:  # TCP digests each group right before the socket reads it
            update = digests.update

            def update_then_flip(stop: int) -> None:
                first = digests.done == 0
                update(stop)
                if first:
                    flip()  # after segment 0's digest, before its bytes leave

            digests.update = update_then_flip
        else:  # NIXL / UCX WRITE first and digest after: flip in between
            finish = digests.finish

            def flip_then_finish() -> Any:
                flip()
                return finish()

            digests.finish = flip_then_finish
        return digests

    integrity.BlockDigester.at_source = at_source  # type: ignore[method-assign]

    async def command(cmd: str, args: list[Any]) -> Any:
        if cmd == "park":
            return prefill.park(args[0], request_id=args[1])
        if cmd == "stream":
            return prefill.stream(args[0], request_id=args[1])
        if cmd == "stream_step":
            return prefill.stream_step(args[0], args[1])
        if cmd == "stream_finish":
            return prefill.stream_finish(args[0], args[1], args[2])
        if cmd == "stream_fail":
            return parked.fail_stream(args[0], args[1])
        if cmd == "steal":
            return prefill.steal(args[0])
        if cmd == "skew":  # the lease table's clock runs ahead (leases expire; no reaper runs)
            prefill.skew = args[0]
            return None
        if cmd == "reap":
            return parked.reap()
        if cmd == "corrupt_next":
            corrupt[0] = True
            return None
        if cmd == "state":
            return PeerState(
                len(parked),
                parked.released_total,
                parked.expired_total,
                prefill.kv.get_num_free_blocks(),
                digested[0],
                [(type(e).__name__, e.message) for e in t.recent_errors],
                counts["add_peer"],
                counts["lookup"],
                t.auth_failures.total,
            )
        if cmd == "reset":  # between tests
            await prefill.reset()
            corrupt[0] = False
            counts.update(add_peer=0, lookup=0)
            return None
        raise ValueError(f"unknown command {cmd!r}")

    async with prefill:
        await serve_commands(pipe, (t.endpoint, t.backend), command)


class PrefillProcess(SpawnedPeer):
    """Handle on a spawned prefill transfer peer (see the module docstring)."""

    def __init__(self, backend: str, *, epoch: int = 7, port: int = 0, secret: str = TEST_SECRET):
        super().__init__(_child, backend, epoch, port, secret)
        self.epoch = epoch
        self.endpoint, self.backend = self.greeting

    def reset(self) -> PrefillProcess:
        """Start over (nothing parked, the pattern intact, the true clock, no recorded errors or
        counts); returns this peer."""
        self.call("reset")
        return self

    def wait_state(self, done: Callable[[PeerState], bool], timeout: float = 5.0) -> PeerState:
        """Poll :meth:`state` until ``done`` (Release travels asynchronously after a pull) and
        return that state; AssertionError after ``timeout`` seconds."""
        seen: list[PeerState] = []

        def reached() -> bool:
            seen.append(self.state())
            return done(seen[-1])

        wait_until_sync(reached, timeout, interval_s=0.01, what="the prefill peer's state")
        return seen[-1]

    def park(self, num_tokens: int, request_id: str | None = None) -> TransferHandle:
        """:meth:`LocalPrefill.park <tests.support.transfer_inproc.LocalPrefill.park>` in the
        child: the handle a prefill worker would answer with."""
        handle: TransferHandle = self.call("park", num_tokens, request_id)
        return handle

    def state(self) -> PeerState:
        state: PeerState = self.call("state")
        return state


@pytest.fixture(scope="module", params=BACKENDS)
def prefill_process(request: pytest.FixtureRequest) -> Iterator[PrefillProcess]:
    """A :class:`PrefillProcess` per transfer backend, shared by a test module's tests (a
    fixture of every test: tests/conftest.py loads this module as a plugin)."""
    peer = PrefillProcess(request.param)
    yield peer
    peer.stop()
