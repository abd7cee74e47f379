"""KV transfer between two real processes whose pools live in GPU memory.

The prefill side is a spawned process with a pattern-filled pool (:mod:`tests.support.cuda_peer`);
this process is the decode side. Every pull runs with block digests on, so the digests of CUDA
memory are checked on every case too. Backends: ``tcp`` (stages CUDA bytes through pinned host
memory) and ``nixl`` (registers VRAM; skipped where NIXL does not import); pools CUDA -> CUDA,
CPU -> CUDA and CUDA -> CPU; equal layouts (zero-copy plan) and a converting pair (tokens per
block 4 -> 8, float32 -> bfloat16, staged on the GPU). ``ucx`` refuses a CUDA pool at start.

Skipped without CUDA (``torch.cuda.is_available()``).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdserve.errors import ConfigError, IntegrityError
from pdserve.protocol import KVLayout
from pdserve.transfer import create_transceiver, receiver
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry
from pdserve.transfer.integrity import mix64
from pdserve.transfer.integrity.digests import BlockDigester
from tests.support.cuda_peer import PatternPeer, empty_pool, pattern, transfer_cfg
from tests.support.transfer import TEST_KEY

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())"
    ),
]

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed")),
]
LAYOUT = KVLayout(
    model="gpu-test", num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
WIDE = LAYOUT.model_copy(update={"tokens_per_block": 8, "dtype": "bfloat16"})
NUM_BLOCKS = 32
SRC_IDS = [3, 4, 5, 9, 20, 21]  # runs of 3, 1, 2 blocks
DST_IDS = [7, 1, 2, 3, 30, 11]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def cuda_peer(backend: str) -> Iterator[PatternPeer]:
    peer = PatternPeer(backend, LAYOUT, NUM_BLOCKS, "cuda")
    yield peer
    peer.stop()


async def _pull_into(pool: torch.Tensor, layout: KVLayout, backend: str, handle, dst_ids) -> None:  # noqa: ANN001
    t = create_transceiver(
        transfer_cfg(backend),
        pool=pool,
        layout=layout,
        worker_id="gpu-decode",
        epoch=1,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    try:
        await t.pull(handle, list(dst_ids))
    finally:
        await t.close()


def _expected_blocks() -> torch.Tensor:
    return pattern(LAYOUT, NUM_BLOCKS)[:, SRC_IDS]


@pytest.mark.parametrize("dst_device", ["cuda", "cpu"])
def test_blocks_of_a_cuda_pool_land_byte_exact(
    cuda_peer: PatternPeer, backend: str, dst_device: str
) -> None:
    handle = cuda_peer.park(f"exact-{dst_device}", SRC_IDS)
    pool = empty_pool(LAYOUT, NUM_BLOCKS, dst_device)
    asyncio.run(_pull_into(pool, LAYOUT, backend, handle, DST_IDS))
    assert torch.equal(pool[:, DST_IDS].cpu(), _expected_blocks())
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    assert not pool[:, untouched].any()
    assert cuda_peer.errors() == []


def test_a_cpu_prefill_pool_lands_in_a_cuda_pool(backend: str) -> None:
    peer = PatternPeer(backend, LAYOUT, NUM_BLOCKS, "cpu")
    try:
        handle = peer.park("cpu-to-cuda", SRC_IDS)
        pool = empty_pool(LAYOUT, NUM_BLOCKS, "cuda")
        asyncio.run(_pull_into(pool, LAYOUT, backend, handle, DST_IDS))
    finally:
        peer.stop()
    assert torch.equal(pool[:, DST_IDS].cpu(), _expected_blocks())


def test_a_converting_pull_reblocks_and_narrows_on_the_gpu(
    cuda_peer: PatternPeer, backend: str
) -> None:
    src_ids = SRC_IDS[:4]  # 16 tokens of 4-token blocks -> 2 blocks of 8 tokens
    dst_ids = [5, 9]
    handle = cuda_peer.park("convert", src_ids)
    pool = empty_pool(WIDE, NUM_BLOCKS, "cuda")
    asyncio.run(_pull_into(pool, WIDE, backend, handle, dst_ids))
    src = pattern(LAYOUT, NUM_BLOCKS)
    got = pool.cpu()
    for t in range(len(src_ids) * LAYOUT.tokens_per_block):
        want = src[:, src_ids[t // 4], :, t % 4].to(torch.bfloat16)
        assert torch.equal(got[:, dst_ids[t // 8], :, t % 8], want), t
    assert cuda_peer.errors() == []


def test_the_ucx_backend_refuses_a_cuda_pool_naming_the_alternatives() -> None:
    async def open_ucx() -> None:
        create_transceiver(
            transfer_cfg("ucx"),
            pool=empty_pool(LAYOUT, NUM_BLOCKS, "cuda"),
            layout=LAYOUT,
            worker_id="gpu-decode",
            epoch=1,
            parked=None,
            key=TEST_KEY,
        )

    with pytest.raises(ConfigError, match="'nixl'.*'tcp'"):
        asyncio.run(open_ucx())


@pytest.mark.parametrize("algorithm", ["xxh3_64", "mix64"])
def test_digests_of_cuda_memory_equal_those_of_the_same_bytes_on_cpu(algorithm: str) -> None:
    src_cpu = pattern(LAYOUT, NUM_BLOCKS)
    geometry = PoolGeometry.from_pool(src_cpu, LAYOUT)
    plan = Formatter.negotiate(LAYOUT, LAYOUT, geometry, geometry).plan(SRC_IDS, DST_IDS)
    on_cpu = BlockDigester(src_cpu).source(plan, algorithm)
    assert BlockDigester(src_cpu.cuda()).source(plan, algorithm) == on_cpu
    # the receiver's side: a CUDA destination holding exactly those bytes checks clean ...
    dst = empty_pool(LAYOUT, NUM_BLOCKS, "cuda")
    dst[:, DST_IDS] = src_cpu[:, SRC_IDS].cuda()
    digester = BlockDigester(dst)
    check = {"request_id": "r", "geometry": geometry, "block_map": {}}
    digester.check(plan, on_cpu, landed=digester.landed(plan, algorithm), **check)
    # ... and one flipped byte in it is caught, naming the layer and block
    flat = dst.view(-1).view(torch.uint8)
    offset = int(plan.dst_offsets[np.flatnonzero(plan.lengths)[-1]]) + 5
    flat[offset] ^= 0x10
    with pytest.raises(IntegrityError, match=f"layer 2, decode block.*{algorithm}"):
        digester.check(plan, on_cpu, landed=digester.landed(plan, algorithm), **check)


def test_mix64_on_cuda_equals_its_definition_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    mem = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    offsets, lengths = np.array([0, 4096, 65528]), np.array([4096, 60000, 8])
    raw = mem.numpy().tobytes()
    want = [mix64.reference(raw[o : o + n]) for o, n in zip(offsets, lengths, strict=True)]
    monkeypatch.setattr(mix64, "CHUNK_WORDS", 1000)
    assert mix64.digests(mem.cuda(), offsets, lengths).tolist() == want


def test_two_gpu_pools_agree_on_mix64_and_a_mixed_pair_on_xxh3(backend: str) -> None:
    asked: list[str] = []
    real = receiver.choose_algorithm

    def spy(local: str, peer: str, *layouts: KVLayout) -> str:
        asked.append(real(local, peer, *layouts))
        return asked[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(receiver, "choose_algorithm", spy)
        for src_device, dst_device in (("cuda", "cuda"), ("cuda", "cpu")):
            peer = PatternPeer(backend, LAYOUT, NUM_BLOCKS, src_device)
            try:
                handle = peer.park(f"algo-{dst_device}", SRC_IDS)
                pool = empty_pool(LAYOUT, NUM_BLOCKS, dst_device)
                asyncio.run(_pull_into(pool, LAYOUT, backend, handle, DST_IDS))
                assert torch.equal(pool[:, DST_IDS].cpu(), _expected_blocks())
                assert peer.errors() == []
            finally:
                peer.stop()
    assert asked == ["mix64", "xxh3_64"]
