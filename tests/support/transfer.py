"""The transfer tests' shared pieces, and the process-level prefill peer.

Shared by every transfer test, in-process (:mod:`tests.support.transfer_inproc`) or between
processes (:class:`PrefillPeer` here, :mod:`tests.support.kv_peer`): the backends this machine
can run (``BACKENDS``: tcp always; nixl and ucx when they import), the cluster keys, the layout
and pool size, transfer settings (:func:`backend_cfg`), pools (zeros, the pattern, seeded random
K/V), what a plan moves (:func:`apply_plan`), the checks of what landed (:func:`assert_landed`,
:func:`token_kv`), what a router hands a decode worker (:func:`handed_generation`), and a peer
in a spawned process driven through a pipe (:class:`SpawnedPeer`, :func:`serve_commands`).

:class:`PrefillPeer` is a prefill side in a spawned process: a real transceiver over a pool
holding the pattern, with a tiny parked-block table standing in for the engine's (its levers: a
peer that dies, at once, later or mid-stream, and one whose lookup blocks its loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import HandleError
from pdserve.protocol import GenerationRequest, KVLayout, SamplingParams, TransferHandle
from pdserve.security import ClusterKey
from pdserve.transfer import create_transceiver
from pdserve.transfer.formatter.convert import torch_dtype
from pdserve.transfer.formatter.mapping import TransferPlan, pool_bytes
from tests.support.fakes import CLUSTER_KEY
from tests.support.servers import wait_until_sync

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="no nixl")),
    pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCXX, reason="no ucxx")),
]

TEST_KEY = CLUSTER_KEY
"""The key of every transceiver in the transfer tests (spawned peers included): the suite's
cluster secret's."""
OTHER_SECRET = "another-deployment-secret-0123456789abcdef"
OTHER_KEY = ClusterKey(OTHER_SECRET.encode())
"""A different, equally valid secret: a peer of another deployment, or an attacker's guess."""

LAYOUT = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
NUM_BLOCKS = 32
"""The blocks of every pool of :data:`LAYOUT`, on either side."""
PREFILL_ID = "prefill-0"
EPOCH = 7


def backend_cfg(
    backend: str, *, timeout_s: float = 10.0, integrity: bool = True, port: int = 0
) -> TransferSettings:
    """Transfer settings of a test transceiver on loopback (``ucx_devices="lo"``). ``inproc``
    is a registered backend but not a config choice: it bypasses the choice's validation."""
    fields = {"ucx_devices": "lo", "timeout_s": timeout_s, "integrity": integrity, "port": port}
    if backend == "inproc":
        return TransferSettings.model_validate(fields).model_copy(update={"backend": backend})
    return TransferSettings.model_validate({"backend": backend, **fields})


def zeros_pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """A pool ``[L, num_blocks, 2, tpb, kvh, hd]`` of ``layout.dtype``, all zeros
    (``[tp, L, num_blocks, 2, tpb, kvh_r, hd]`` when ``layout.tp_size`` > 1)."""
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.kv_heads_per_rank)
    ranks = (layout.tp_size,) if layout.tp_size > 1 else ()
    return torch.zeros((*ranks, *shape, layout.head_dim), dtype=torch_dtype(layout.dtype))


def shard_pool(full: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The rank-major pool of ``layout`` (its ``tp_size``) holding the K/V of ``full``, a pool
    ``[L, nb, 2, tpb, num_kv_heads, hd]`` with every head: each rank gets its heads
    (:meth:`KVLayout.rank_heads`). ``full`` itself when tp_size is 1."""
    if layout.tp_size == 1:
        return full
    shards = [full[..., r.start : r.stop, :] for r in map(layout.rank_heads, range(layout.tp_size))]
    return torch.stack(shards).contiguous()


def pattern_blocks(layout: KVLayout, block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks ``block_ids`` (in that order) of the pattern every prefill pool holds: every
    element distinct (exact in float32 below 2**24), so a misplaced byte shows; a block holds
    the same values whatever the size of its pool."""
    L, tpb = layout.num_layers, layout.tokens_per_block
    per_block = 2 * tpb * layout.num_kv_heads * layout.head_dim
    blocks = torch.tensor(list(block_ids), dtype=torch.int64).view(1, -1, 1)
    layers = torch.arange(L, dtype=torch.int64).view(-1, 1, 1)
    index = (blocks * L + layers) * per_block + torch.arange(per_block, dtype=torch.int64)
    values = (index % (1 << 24) + 1).to(torch.float32)
    shape = (L, len(block_ids), 2, tpb, layout.num_kv_heads, layout.head_dim)
    return values.view(shape).to(torch_dtype(layout.dtype))


def pattern_pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """A pool of ``num_blocks`` blocks of the pattern (:func:`pattern_blocks`)."""
    return pattern_blocks(layout, range(num_blocks))


def random_pool(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A pool of seeded random K/V (the same in every process for a seed), distinct enough that
    any misplaced token or K/V swap shows; a tensor parallel layout gets the same heads'
    values split over its ranks (:func:`shard_pool`)."""
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((*shape, layout.head_dim), generator=gen)
    return shard_pool(values.to(torch_dtype(layout.dtype)), layout)


def token_kv(pool: torch.Tensor, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
    """K/V of a request's first ``num_tokens`` tokens: ``[L, 2, num_tokens, kvh, hd]``."""
    L, _, _, tpb, kvh, hd = pool.shape
    seq = pool[:, list(block_ids)].permute(0, 2, 1, 3, 4, 5)
    return seq.reshape(L, 2, len(block_ids) * tpb, kvh, hd)[:, :, :num_tokens]


def apply_plan(plan: TransferPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
    """What a backend does: copy every segment of ``plan`` from its source (``plan.source``, a
    staging buffer, or else the pool ``src``) into the pool ``dst``."""
    source = pool_bytes(src if plan.source is None else plan.source)
    target = pool_bytes(dst)
    segments = zip(
        plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist(), strict=True
    )
    for s, d, n in segments:
        target[d : d + n] = source[s : s + n]


def assert_landed(
    pool: torch.Tensor, src: Sequence[int], dst: Sequence[int], layout: KVLayout = LAYOUT
) -> None:
    """The decode ``pool`` holds the pattern's blocks ``src`` at ``dst``, and zeros in every
    other block."""
    landed = pool[:, list(dst)]
    assert torch.equal(landed, pattern_blocks(layout, src)), f"blocks {dst} are not {src}"
    untouched = [b for b in range(pool.shape[1]) if b not in dst]
    assert not pool[:, untouched].any(), f"a block other than {dst} was written"


def handed_generation(
    prompt_len: int, layout: KVLayout, /, **handle_fields: object
) -> GenerationRequest:
    """What a router asks a decode worker: request ``r`` of ``prompt_len`` tokens, its first
    token sampled, with a transfer handle for as many tokens of ``layout`` in blocks 0, 1, 2 (a
    30 s lease, a TCP endpoint nobody listens on); ``handle_fields`` change the handle."""
    fields: dict[str, object] = {
        "worker_id": "p", "epoch": 1, "request_id": "r", "lease_id": "l1",
        "block_ids": (0, 1, 2), "num_tokens": prompt_len, "lease_deadline": time.time() + 30,
        "layout": layout, "backend": "tcp", "transfer_endpoint": "127.0.0.1:1",
        **handle_fields,
    }  # fmt: skip
    return GenerationRequest(
        request_id="r",
        prompt_token_ids=tuple(range(prompt_len)),
        sampling=SamplingParams(),
        deadline=time.time() + 60,
        first_token=5,
        handle=TransferHandle.model_validate(fields),
    )


class SpawnedPeer:
    """A transfer peer in a spawned process, driven through a pipe: ``target(pipe, *args)``
    runs there (under :func:`serve_commands`), sends one greeting once it serves (kept as
    ``greeting``; the peers send their endpoint and backend), then answers each command."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        if not self._pipe.poll(60):
            raise RuntimeError("prefill process did not start")
        self.greeting: Any = self._pipe.recv()

    @property
    def pid(self) -> int:
        """The process id of the peer."""
        assert self.proc.pid is not None, "started in __init__"
        return self.proc.pid

    def call(self, *cmd: Any) -> Any:
        """Run one command in the child; raises what the command raised there."""
        self._pipe.send(cmd)
        answer = self._pipe.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # it may have just died on purpose
            self._pipe.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


async def serve_commands(
    pipe: Pipe, greeting: object, command: Callable[[str, list[Any]], Awaitable[object]]
) -> None:
    """The child's side of :class:`SpawnedPeer`: send ``greeting``, then answer every command
    with what ``command(name, args)`` returns (or the exception it raised) until ``stop``."""
    pipe.send(greeting)
    loop = asyncio.get_running_loop()
    while (msg := await loop.run_in_executor(None, pipe.recv))[0] != "stop":
        try:
            pipe.send(await command(msg[0], list(msg[1:])))
        except Exception as exc:  # handed to the test, which raises it
            pipe.send(exc)


class _Parked:
    """The prefill side's parked-block table (logic around the real path)."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.blocks: dict[str, list[int]] = {}
        self.released: list[str] = []
        # request id -> exit delay (None: right now; "mid": after half of the KV bytes, tcp;
        # "posted": once the UCX sends are posted)
        self.die: dict[str, float | str | None] = {}
        self.slow: dict[str, float] = {}  # request id -> seconds lookup blocks the prefill

    def lookup(self, request_id: str, epoch: int, lease_id: str) -> list[int]:
        if epoch != self.epoch or request_id not in self.blocks:
            raise HandleError(f"no parked request {request_id} at epoch {epoch}")
        time.sleep(self.slow.get(request_id, 0.0))  # a slow peer: blocks its loop on purpose
        if request_id in self.die:
            delay = self.die[request_id]
            if delay is None:
                os._exit(3)
            if delay == "mid":
                _die_after_half_of_the_bytes()
            elif delay == "posted":
                _die_once_the_ucx_sends_are_posted()
            else:
                asyncio.get_running_loop().call_later(float(delay), os._exit, 3)
        return self.blocks[request_id]

    def release(self, request_id: str, lease_id: str | None = None) -> None:
        self.released.append(request_id)
        self.blocks.pop(request_id, None)


def _die_after_half_of_the_bytes() -> None:
    """Make this (prefill) process exit once the first half of a TCP KV stream is out: a
    death mid-stream, whatever the speed of the machine."""
    from pdserve.transfer.connection.control import Connection  # the TCP backend's

    original = Connection.send_segments

    async def half_then_exit(self, pool, offsets, lengths, header=None):  # type: ignore[no-untyped-def]
        k = max(1, len(offsets) // 2)
        await original(self, pool, offsets[:k], lengths[:k], header)
        os._exit(3)

    Connection.send_segments = half_then_exit  # type: ignore[method-assign]


def _die_once_the_ucx_sends_are_posted() -> None:
    """Make this (prefill) process exit right after the UCX backend posts a transfer's tagged
    sends: 48 MiB on the way and most of it not yet out, whatever the speed of the machine (a
    timer raced the transfer: on a loaded machine the sends sometimes completed first)."""
    from pdserve.transfer.agents.ucx import UcxBackend

    original = UcxBackend.start_send

    def post_then_exit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        os._exit(3)

    UcxBackend.start_send = post_then_exit  # type: ignore[method-assign]


def _prefill_process(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int) -> None:
    asyncio.run(_prefill_main(pipe, backend, layout, num_blocks))


async def _prefill_main(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int) -> None:
    parked = _Parked(EPOCH)
    t = create_transceiver(
        backend_cfg(backend),
        pool=pattern_pool(layout, num_blocks),
        layout=layout,
        worker_id=PREFILL_ID,
        epoch=EPOCH,
        parked=parked,
        key=TEST_KEY,
    )

    async def command(cmd: str, args: list[Any]) -> object:
        if cmd == "park":
            parked.blocks[args[0]] = args[1]
        elif cmd == "die":
            parked.die[args[0]] = args[1]
        elif cmd == "slow":
            parked.slow[args[0]] = args[1]
        elif cmd == "state":
            return list(parked.released), [(type(e).__name__, e.message) for e in t.recent_errors]
        return "ok"

    await t.start()
    await serve_commands(pipe, (t.endpoint, t.backend), command)
    await t.close()


class PrefillPeer(SpawnedPeer):
    """Handle on a spawned prefill process (see the module docstring)."""

    def __init__(self, backend: str, layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS):
        super().__init__(_prefill_process, backend, layout, num_blocks)
        self.layout = layout
        self.endpoint, self.backend = self.greeting

    def park(self, request_id: str, block_ids: list[int], epoch: int = EPOCH) -> TransferHandle:
        self.call("park", request_id, block_ids)
        return TransferHandle(
            worker_id=PREFILL_ID,
            epoch=epoch,
            request_id=request_id,
            lease_id=f"lease-{request_id}",
            block_ids=tuple(block_ids),
            num_tokens=len(block_ids) * self.layout.tokens_per_block,
            lease_deadline=time.time() + 60,
            layout=self.layout,
            backend=self.backend,
            transfer_endpoint=self.endpoint,
        )

    def state(self) -> tuple[list[str], list[tuple[str, str]]]:
        released, errors = self.call("state")
        return released, errors

    def wait_released(self, request_id: str, timeout: float = 5.0) -> list[str]:
        """The released request ids once ``request_id`` is among them (AssertionError after
        ``timeout`` seconds)."""
        released: list[str] = []

        def arrived() -> bool:
            released[:] = self.state()[0]
            return request_id in released

        wait_until_sync(arrived, timeout, interval_s=0.02, what=f"the Release of {request_id}")
        return released


BIG = LAYOUT.model_copy(update={"num_kv_heads": 4, "head_dim": 64, "tokens_per_block": 16})
BIG_BLOCKS = 512  # 3 layers * 512 blocks * 32 KiB = 48 MiB
