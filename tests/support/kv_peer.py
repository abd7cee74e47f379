"""A prefill worker's transfer side in its own process, with the real parked-block table.

:class:`PrefillProcess` spawns a process that runs what a prefill worker runs on the transfer
path, minus the model: a real :class:`~pdserve.workers.kv.manager.KVCacheManager` (its pool
filled with a known pattern), a real :class:`~pdserve.workers.roles.parking.ParkedBlocks` wired to the
manager's block generations, and a real transceiver. The test process plays the decode worker.

The child's cluster secret is a constructor argument (default: the suite's; another one plays a
prefill worker of another deployment, or an impostor). Its state reports what an authentication
test must see untouched: backend peers added (``Backend.add_peer``, which is NIXL's
``add_remote_agent`` / UCX's endpoint), lease lookups, and refused connections.

Test-only levers, all applied inside the child by commands on a pipe (none is a production
flag): a clock skew for the lease table (expire leases without waiting), an ownership bug that
frees parked blocks and hands them to another request (``steal``), and a one-shot fault hook that
flips one byte of the source right after the sender digested it and before the backend moves it
(``corrupt_next``, a monkeypatch of ``BlockDigester.source``; it works the same on every backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey
from pdserve.settings import TransferSettings
from tests.support.fakes import TEST_SECRET
from tests.support.servers import wait_until_sync

TEST_KEY = ClusterKey(TEST_SECRET.encode())
"""The key of every transceiver in the transfer tests (this module's spawned peers included),
from the suite's cluster secret."""
OTHER_SECRET = "another-deployment-secret-0123456789abcdef"
OTHER_KEY = ClusterKey(OTHER_SECRET.encode())
"""A different, equally valid secret: a peer of another deployment, or an attacker's guess."""

LAYOUT = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
NUM_BLOCKS = 32
PREFILL_ID = "prefill-fenced"


def cfg(backend: str, *, integrity: bool = True, port: int = 0, timeout_s: float = 10.0) -> Any:
    return TransferSettings.model_validate(
        {
            "backend": backend,
            "ucx_devices": "lo",
            "integrity": integrity,
            "port": port,
            "timeout_s": timeout_s,
        }
    )


def pattern(num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """The prefill pool's content: every element distinct (exact in float32 below 2**24)."""
    pool = empty_pool(num_blocks)
    pool.view(-1).copy_(torch.arange(pool.numel(), dtype=torch.float32) % (1 << 24) + 1)
    return pool


def empty_pool(num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    shape = (LAYOUT.num_layers, num_blocks, 2, LAYOUT.tokens_per_block, LAYOUT.num_kv_heads)
    return torch.zeros((*shape, LAYOUT.head_dim), dtype=torch.float32)


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
    from pdserve.transfer import create_transceiver, integrity
    from pdserve.transfer.formatter import pool_bytes
    from pdserve.workers.kv.manager import KVCacheManager
    from pdserve.workers.roles.parking import ParkedBlocks

    kv = KVCacheManager(LAYOUT, NUM_BLOCKS)
    kv.pool.copy_(pattern())
    skew = [0.0]
    parked = ParkedBlocks(
        epoch=epoch,
        lease_s=60.0,
        free_blocks=kv.free,
        generations=kv.generations,
        send_grace_s=0.0,
        clock=lambda: time.time() + skew[0],
    )
    t = create_transceiver(
        cfg(backend, port=port),
        pool=kv.pool,
        layout=LAYOUT,
        worker_id=PREFILL_ID,
        epoch=epoch,
        parked=parked,
        key=ClusterKey(secret.encode()),
    )
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
    original = integrity.BlockDigester.source

    def source(self: Any, plan: Any) -> str:  # the fault hook (and a call counter)
        digests = original(self, plan)
        digested[0] += 1
        if corrupt[0]:
            corrupt[0] = False
            assert plan.source is None, "the hook corrupts the pool (identity layouts)"
            pool_bytes(kv.pool)[int(plan.src_offsets[0] + plan.lengths[0] // 2)] ^= 0x10
        return digests

    integrity.BlockDigester.source = source  # type: ignore[method-assign]

    async def command(cmd: str, args: list[Any]) -> Any:
        if cmd == "park":
            request_id, num_tokens = args
            blocks = kv.allocate(request_id, num_tokens)
            lease = parked.park(request_id, blocks, num_tokens)
            return blocks, lease.lease_id, lease.deadline - skew[0]
        if cmd == "steal":  # an ownership bug: the parked blocks go to another request
            kv.free(args[0])
            stolen = kv.allocate(f"thief-{args[0]}", kv.get_num_free_blocks() * 4)
            kv.pool[:, stolen] = -1.0
            return stolen
        if cmd == "skew":  # the lease table's clock runs ahead (leases expire; no reaper runs)
            skew[0] = args[0]
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
                kv.get_num_free_blocks(),
                digested[0],
                [(type(e).__name__, e.message) for e in t.recent_errors],
                counts["add_peer"],
                counts["lookup"],
                t.auth_failures.total,
            )
        if cmd == "reset":  # between tests: nothing parked, pattern intact, true clock
            await parked.close()
            for holder in kv.holders():
                kv.free(holder)
            kv.pool.copy_(pattern())
            skew[0], corrupt[0] = 0.0, False
            t.recent_errors.clear()
            counts.update(add_peer=0, lookup=0)
            t.auth_failures.total = 0
            return None
        raise ValueError(f"unknown command {cmd!r}")

    await t.start()
    pipe.send((t.endpoint, t.backend))
    loop = asyncio.get_running_loop()
    while (msg := await loop.run_in_executor(None, pipe.recv))[0] != "stop":
        try:
            pipe.send(await command(msg[0], list(msg[1:])))
        except Exception as exc:  # handed to the test, which raises it
            pipe.send(exc)
    await t.close()


class PrefillProcess:
    """Handle on a spawned prefill transfer peer (see the module docstring)."""

    def __init__(self, backend: str, *, epoch: int = 7, port: int = 0, secret: str = TEST_SECRET):
        self.epoch = epoch
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(child, backend, epoch, port, secret), daemon=True
        )
        self.proc.start()
        if not self._pipe.poll(60):
            raise RuntimeError("prefill process did not start")
        self.endpoint, self.backend = self._pipe.recv()

    def call(self, *cmd: Any) -> Any:
        """Run one command in the child; raises what the command raised there."""
        self._pipe.send(cmd)
        answer = self._pipe.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def wait_state(self, done: Callable[[PeerState], bool], timeout: float = 5.0) -> PeerState:
        """Poll :meth:`state` until ``done`` (Release travels asynchronously after a pull) and
        return that state; AssertionError after ``timeout`` seconds."""
        seen: list[PeerState] = []

        def reached() -> bool:
            seen.append(self.state())
            return done(seen[-1])

        wait_until_sync(reached, timeout, interval_s=0.01, what="the prefill peer's state")
        return seen[-1]

    def park(self, request_id: str, num_tokens: int) -> TransferHandle:
        """Allocate and park blocks for ``num_tokens`` tokens; the handle a prefill worker
        would answer with."""
        blocks, lease_id, deadline = self.call("park", request_id, num_tokens)
        return TransferHandle(
            worker_id=PREFILL_ID,
            epoch=self.epoch,
            request_id=request_id,
            lease_id=lease_id,
            block_ids=tuple(blocks),
            num_tokens=num_tokens,
            lease_deadline=deadline,
            layout=LAYOUT,
            backend=self.backend,
            transfer_endpoint=self.endpoint,
        )

    def state(self) -> PeerState:
        return self.call("state")

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self._pipe.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
