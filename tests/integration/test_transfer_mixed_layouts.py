"""KV transfer between real processes whose pools differ in tokens per block, KV dtype or
tensor parallel split (``tp_size``: the pool holds one shard of KV heads per rank).

A spawned prefill process runs one real transceiver per prefill layout below, over pools filled
with seeded random K/V, with the real ``ParkedBlocks`` lease table; this test process is the
decode worker, with a pool of another layout. Every backend of ``test_transfer_backends`` moves
the bytes (the prefill side re-blocks and converts them into a staging buffer first); the
decode pool is then compared with the prefill pool token by token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import LayoutMismatchError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.transfer import Transceiver, create_transceiver
from pdserve.workers.kv.manager import blocks_for_tokens
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.servers import wait_until_sync
from tests.support.transfer import (
    BACKENDS,
    TEST_KEY,
    SpawnedPeer,
    backend_cfg,
    random_pool,
    serve_commands,
    token_kv,
)
from tests.support.transfer_inproc import DecodeSide, decode_transceiver

pytestmark = pytest.mark.timeout(90)

F32_16 = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=64, tokens_per_block=16,
    dtype="float32",
)  # fmt: skip
F32_32 = F32_16.model_copy(update={"tokens_per_block": 32})
BF16_16 = F32_16.model_copy(update={"dtype": "bfloat16"})
TP2_16 = KVLayout(**{**F32_16.model_dump(), "tp_size": 2})  # one KV head per rank
TP4_32 = KVLayout(**{**F32_32.model_dump(), "tp_size": 4})  # each KV head on two ranks
FP8_16 = F32_16.model_copy(update={"dtype": "fp8_e4m3"})  # one byte a value
PREFILL_LAYOUTS = {
    "f32-16": F32_16, "f32-32": F32_32, "bf16-16": BF16_16, "tp2-16": TP2_16, "fp8-16": FP8_16,
}  # fmt: skip
NUM_BLOCKS = 96
EPOCH = 11


def _cfg(backend: str) -> TransferSettings:
    return backend_cfg(backend, timeout_s=20)


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
            pool=random_pool(layout, NUM_BLOCKS, seed),
            layout=layout,
            worker_id=f"prefill-{name}",
            epoch=EPOCH,
            parked=parked[name],
            key=TEST_KEY,
        )
        await t.start()

    async def command(cmd: str, args: list[Any]) -> object:
        if cmd == "park":
            name, request_id, block_ids, num_tokens = args
            lease = parked[name].park(request_id, block_ids, num_tokens)
            return lease.lease_id, lease.deadline
        assert cmd == "state", cmd
        name = args[0]
        errors = [(type(e).__name__, e.message) for e in transceivers[name].recent_errors]
        return len(parked[name]), errors

    endpoints = {name: (t.endpoint, t.backend) for name, t in transceivers.items()}
    await serve_commands(pipe, endpoints, command)
    for t in transceivers.values():
        await t.close()


class Prefill(SpawnedPeer):
    """Handle on the spawned prefill process (one per backend)."""

    def __init__(self, backend: str):
        super().__init__(_prefill_process, backend)
        self.endpoints: dict[str, tuple[str, str]] = self.greeting
        self.backend = next(iter(self.endpoints.values()))[1]

    def park(
        self, name: str, request_id: str, block_ids: list[int], num_tokens: int
    ) -> TransferHandle:
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
        """What the prefill pool ``name`` holds for those blocks, regenerated from its seed,
        every KV head side by side whatever the pool's rank split (``[L, 2, num_tokens,
        num_kv_heads, hd]``: random_pool draws the same values for every split and gives each
        rank its heads)."""
        whole = KVLayout(**{**PREFILL_LAYOUTS[name].model_dump(), "tp_size": 1})
        seed = list(PREFILL_LAYOUTS).index(name)
        return token_kv(random_pool(whole, NUM_BLOCKS, seed), block_ids, num_tokens)

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


@pytest.fixture(scope="module", params=BACKENDS)
def prefill(request: pytest.FixtureRequest) -> Iterator[Prefill]:
    peer = Prefill(request.param)
    yield peer
    peer.stop()


DecodeFactory = Callable[[KVLayout], Awaitable[DecodeSide]]
"""Opens a decode side of a layout (closed after the test)."""


@pytest.fixture
async def decode_factory(prefill: Prefill) -> AsyncIterator[DecodeFactory]:
    made: list[Transceiver] = []

    async def make(layout: KVLayout) -> DecodeSide:
        side = await decode_transceiver(_cfg(prefill.backend), layout, NUM_BLOCKS)
        made.append(side.transceiver)
        return side

    yield make
    for t in made:
        await t.close()


@pytest.mark.parametrize(
    ("src", "dst_layout", "num_tokens"),
    [
        ("f32-16", F32_32, 40),  # 3 blocks of 16 -> 2 blocks of 32
        ("f32-32", F32_16, 40),  # 2 blocks of 32 -> 3 blocks of 16
        ("bf16-16", F32_16, 40),  # bfloat16 prefill into float32 decode
        ("bf16-16", F32_32, 70),  # both at once
        ("fp8-16", F32_32, 40),  # an FP8 prefill cache widened (exactly) and re-blocked
        ("f32-16", TP2_16, 40),  # TP 1 -> 2: split, each decode rank gets its own head
        ("tp2-16", F32_16, 40),  # TP 2 -> 1: merge
        ("tp2-16", TP4_32, 70),  # TP 2 -> 4 (replicated heads) and 16 -> 32 tokens per block
        ("tp2-16", TP2_16, 40),  # equal rank layouts: shard by shard, zero-copy
    ],
)
async def test_mixed_layouts_land_every_token_in_each_decode_rank(
    prefill: Prefill, decode_factory: DecodeFactory, src: str, dst_layout: KVLayout, num_tokens: int
) -> None:
    """Every token's K/V lands in the decode layout, each decode rank holding exactly its KV
    heads (the whole pool when the decode side is one rank); no other block is written."""
    decode = await decode_factory(dst_layout)
    src_ids = [40, 3, 17, 18, 60][
        : blocks_for_tokens(num_tokens, PREFILL_LAYOUTS[src].tokens_per_block)
    ]
    dst_ids = [9, 2, 30, 31, 5][: blocks_for_tokens(num_tokens, dst_layout.tokens_per_block)]
    rid = f"m-{src}-{dst_layout.tp_size}-{dst_layout.tokens_per_block}-{num_tokens}"
    await decode.transceiver.pull(prefill.park(src, rid, src_ids, num_tokens), dst_ids)
    full = prefill.expected(src, src_ids, num_tokens).to(decode.pool.dtype)
    shards = decode.pool.unbind(0) if dst_layout.tp_size > 1 else (decode.pool,)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    for rank, shard in enumerate(shards):
        heads = dst_layout.rank_heads(rank)
        want = full[..., heads.start : heads.stop, :]
        assert torch.equal(token_kv(shard, dst_ids, num_tokens), want), f"decode rank {rank}"
        assert not shard[:, untouched].any()
    assert prefill.wait_released(src) == 0


async def test_concurrent_and_growing_converting_sends_land_in_their_own_blocks(
    prefill: Prefill, decode_factory: DecodeFactory
) -> None:
    decode = await decode_factory(F32_32)
    # Three at once (one staging buffer each), then one far larger (the buffer grows).
    jobs = {"c1": ([0, 1, 2], [0, 1], 33), "c2": ([5], [4], 16), "c3": ([7, 9], [6], 20)}
    handles = {rid: prefill.park("f32-16", rid, s, n) for rid, (s, _, n) in jobs.items()}
    pulls = (decode.transceiver.pull(handles[rid], d) for rid, (_, d, _) in jobs.items())
    await asyncio.gather(*pulls)
    big_src, big_dst = list(range(20, 84)), list(range(10, 42))  # 1024 tokens, 3 MiB staged
    jobs["big"] = (big_src, big_dst, 1024)
    await decode.transceiver.pull(prefill.park("f32-16", "big", big_src, 1024), big_dst)
    for src_ids, dst_ids, n in jobs.values():
        landed = token_kv(decode.pool, dst_ids, n)
        assert torch.equal(landed, prefill.expected("f32-16", src_ids, n))
    assert prefill.wait_released("f32-16") == 0


async def test_unmappable_layout_is_refused_at_handshake_on_both_sides(
    prefill: Prefill, decode_factory: DecodeFactory
) -> None:
    decode = await decode_factory(F32_16.model_copy(update={"num_kv_heads": 4}))
    handle = prefill.park("bf16-16", "u1", [1], 10)
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 2 != 4"):
        await decode.transceiver.pull(handle, [1])
    assert not decode.pool.any()
    _, errors = prefill.call("state", "bf16-16")
    assert any(name == "LayoutMismatchError" and "num_kv_heads" in msg for name, msg in errors)
