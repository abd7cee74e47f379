"""KV transfer between real processes whose pools differ in tokens per block or KV dtype.

A spawned prefill process runs one real transceiver per prefill layout below, over pools filled
with seeded random K/V, with the real ``ParkedBlocks`` lease table; this test process is the
decode worker, with a pool of another layout. Every backend of ``test_transfer_backends`` moves
the bytes (the prefill side re-blocks and converts them into a staging buffer first); the
decode pool is then compared with the prefill pool token by token.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from pdserve.errors import LayoutMismatchError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.settings import TransferSettings
from pdserve.transfer import Transceiver, create_transceiver
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.kv_peer import TEST_KEY
from tests.support.servers import wait_until_sync
from tests.support.transfer import BACKENDS

pytestmark = pytest.mark.timeout(90)

F32_16 = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=64, tokens_per_block=16,
    dtype="float32",
)  # fmt: skip
F32_32 = F32_16.model_copy(update={"tokens_per_block": 32})
BF16_16 = F32_16.model_copy(update={"dtype": "bfloat16"})
PREFILL_LAYOUTS = {"f32-16": F32_16, "f32-32": F32_32, "bf16-16": BF16_16}
NUM_BLOCKS = 96
EPOCH = 11


def _cfg(backend: str) -> TransferSettings:
    return TransferSettings.model_validate(
        {"backend": backend, "ucx_devices": "lo", "timeout_s": 20}
    )


def _pool(layout: KVLayout, *, seed: int | None = None) -> torch.Tensor:
    """``NUM_BLOCKS`` blocks of ``layout``: seeded random K/V (the same in every process), or
    zeros."""
    shape = (
        layout.num_layers,
        NUM_BLOCKS,
        2,
        layout.tokens_per_block,
        layout.num_kv_heads,
        layout.head_dim,
    )
    if seed is None:
        return torch.zeros(shape, dtype=getattr(torch, layout.dtype))
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))


def _tokens(pool: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """K/V of a request's first ``num_tokens`` tokens: ``[L, 2, num_tokens, kvh, hd]``."""
    L, _, _, tpb, kvh, hd = pool.shape
    seq = pool[:, block_ids].permute(0, 2, 1, 3, 4, 5).reshape(L, 2, len(block_ids) * tpb, kvh, hd)
    return seq[:, :, :num_tokens]


def _prefill_process(pipe: Pipe, backend: str) -> None:
    asyncio.run(_prefill_main(pipe, backend))


async def _prefill_main(pipe: Pipe, backend: str) -> None:
    """One transceiver + lease table per prefill layout; serves park/errors/stop commands."""
    parked: dict[str, ParkedBlocks] = {}
    transceivers: dict[str, Transceiver] = {}
    for seed, (name, layout) in enumerate(PREFILL_LAYOUTS.items()):
        parked[name] = ParkedBlocks(epoch=EPOCH, lease_s=60, free_blocks=lambda rid: None)
        transceivers[name] = t = create_transceiver(
            _cfg(backend),
            pool=_pool(layout, seed=seed),
            layout=layout,
            worker_id=f"prefill-{name}",
            epoch=EPOCH,
            parked=parked[name],
            key=TEST_KEY,
        )
        await t.start()
    pipe.send({name: (t.endpoint, t.backend) for name, t in transceivers.items()})
    loop = asyncio.get_running_loop()
    while True:
        cmd, *args = await loop.run_in_executor(None, pipe.recv)
        if cmd == "park":
            name, request_id, block_ids, num_tokens = args
            lease = parked[name].park(request_id, block_ids, num_tokens)
            pipe.send((lease.lease_id, lease.deadline))
        elif cmd == "state":
            name = args[0]
            errors = [(type(e).__name__, e.message) for e in transceivers[name].recent_errors]
            pipe.send((len(parked[name]), errors))
        elif cmd == "stop":
            break
    for t in transceivers.values():
        await t.close()


class Prefill:
    """Handle on the spawned prefill process (one per backend)."""

    def __init__(self, backend: str):
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_process, args=(child, backend), daemon=True)
        self.proc.start()
        if not self._pipe.poll(60):
            raise RuntimeError("prefill process did not start")
        self.endpoints: dict[str, tuple[str, str]] = self._pipe.recv()
        self.backend = next(iter(self.endpoints.values()))[1]

    def call(self, *cmd: Any) -> Any:
        self._pipe.send(cmd)
        return self._pipe.recv()

    def park(self, name: str, request_id: str, block_ids: list[int], num_tokens: int):
        """Park ``block_ids`` of the ``name`` transceiver; returns the handle a router passes."""
        lease_id, deadline = self.call("park", name, request_id, block_ids, num_tokens)
        return TransferHandle(
            worker_id=f"prefill-{name}",
            epoch=EPOCH,
            request_id=request_id,
            lease_id=lease_id,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            lease_deadline=deadline,
            layout=PREFILL_LAYOUTS[name],
            backend=self.backend,
            transfer_endpoint=self.endpoints[name][0],
        )

    def expected(self, name: str, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """What the prefill pool ``name`` holds for those blocks (regenerated from its seed)."""
        seed = list(PREFILL_LAYOUTS).index(name)
        return _tokens(_pool(PREFILL_LAYOUTS[name], seed=seed), block_ids, num_tokens)

    def wait_released(self, name: str, timeout: float = 5.0) -> int:
        """How many requests stay parked in pool ``name`` once none does (AssertionError after
        ``timeout`` seconds)."""
        wait_until_sync(
            lambda: not self.call("state", name)[0],
            timeout,
            interval_s=0.02,
            what=f"every Release of pool {name}",
        )
        return int(self.call("state", name)[0])

    def stop(self) -> None:
        self._pipe.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture(scope="module", params=BACKENDS)
def prefill(request: pytest.FixtureRequest) -> Iterator[Prefill]:
    peer = Prefill(request.param)
    yield peer
    peer.stop()


class Decode:
    def __init__(self, transceiver: Transceiver, pool: torch.Tensor, layout: KVLayout):
        self.t, self.pool, self.layout = transceiver, pool, layout

    def tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        return _tokens(self.pool, block_ids, num_tokens)


@pytest.fixture
async def decode_factory(prefill: Prefill) -> AsyncIterator[Any]:
    made: list[Transceiver] = []

    async def make(layout: KVLayout) -> Decode:
        pool = _pool(layout)
        t = create_transceiver(
            _cfg(prefill.backend), pool=pool, layout=layout, worker_id="decode-0", epoch=1,
            parked=None, key=TEST_KEY
        )  # fmt: skip
        made.append(t)
        await t.start()
        return Decode(t, pool, layout)

    yield make
    for t in made:
        await t.close()


def _blocks(num_tokens: int, tpb: int) -> int:
    return -(-num_tokens // tpb)


@pytest.mark.parametrize(
    ("src", "dst_layout", "num_tokens"),
    [
        ("f32-16", F32_32, 40),  # 3 blocks of 16 -> 2 blocks of 32
        ("f32-32", F32_16, 40),  # 2 blocks of 32 -> 3 blocks of 16
        ("bf16-16", F32_16, 40),  # bfloat16 prefill into float32 decode
        ("bf16-16", F32_32, 70),  # both at once
    ],
)
async def test_mixed_layouts_land_every_token_in_the_decode_layout(
    prefill, decode_factory, src, dst_layout, num_tokens
):
    decode = await decode_factory(dst_layout)
    src_ids = [40, 3, 17, 18, 60][: _blocks(num_tokens, PREFILL_LAYOUTS[src].tokens_per_block)]
    dst_ids = [9, 2, 30, 31, 5][: _blocks(num_tokens, dst_layout.tokens_per_block)]
    await decode.t.pull(prefill.park(src, f"m-{src}-{num_tokens}", src_ids, num_tokens), dst_ids)
    expected = prefill.expected(src, src_ids, num_tokens).to(decode.pool.dtype)
    assert torch.equal(decode.tokens(dst_ids, num_tokens), expected)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not decode.pool[:, untouched].any()
    assert prefill.wait_released(src) == 0


async def test_concurrent_and_growing_converting_sends_land_in_their_own_blocks(
    prefill, decode_factory
):
    decode = await decode_factory(F32_32)
    # Three at once (one staging buffer each), then one far larger (the buffer grows).
    jobs = {"c1": ([0, 1, 2], [0, 1], 33), "c2": ([5], [4], 16), "c3": ([7, 9], [6], 20)}
    handles = {rid: prefill.park("f32-16", rid, s, n) for rid, (s, _, n) in jobs.items()}
    await asyncio.gather(*(decode.t.pull(handles[rid], d) for rid, (_, d, _) in jobs.items()))
    big_src, big_dst = list(range(20, 84)), list(range(10, 42))  # 1024 tokens, 3 MiB staged
    jobs["big"] = (big_src, big_dst, 1024)
    await decode.t.pull(prefill.park("f32-16", "big", big_src, 1024), big_dst)
    for src_ids, dst_ids, n in jobs.values():
        assert torch.equal(decode.tokens(dst_ids, n), prefill.expected("f32-16", src_ids, n))
    assert prefill.wait_released("f32-16") == 0


async def test_unmappable_layout_is_refused_at_handshake_on_both_sides(prefill, decode_factory):
    decode = await decode_factory(F32_16.model_copy(update={"num_kv_heads": 4}))
    handle = prefill.park("bf16-16", "u1", [1], 10)
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 2 != 4"):
        await decode.t.pull(handle, [1])
    assert not decode.pool.any()
    _, errors = prefill.call("state", "bf16-16")
    assert any(name == "LayoutMismatchError" and "num_kv_heads" in msg for name, msg in errors)
