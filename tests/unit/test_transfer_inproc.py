"""The transfer logic on the in-process backend: two real transceivers in this process (the
control messages on loopback connections, the KV bytes copied between the pools), a real
KV cache manager and lease table on the prefill side. The subprocess suites
(tests/integration/test_transfer_fencing.py, test_transfer_corruption.py) run the same checks
on the real backends; these cover the logic in milliseconds.

Fencing (epoch, lease id, expiry, block generations), corruption (digest mismatch), a stalled
peer, and release (a pulled park is freed; a refused one is kept; an expired one is freed).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdserve.errors import HandleError, IntegrityError, TransferError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.settings import TransferSettings
from pdserve.transfer import Transceiver, create_transceiver
from pdserve.transfer.backend import _REGISTRY
from pdserve.transfer.formatter import TransferPlan
from pdserve.transfer.inproc import FABRIC, InprocBackend
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.kv_peer import TEST_KEY
from tests.support.servers import wait_until

pytestmark = pytest.mark.timeout(20)

LAYOUT = KVLayout(
    model="tiny-test", num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float32"
)
EPOCH = 7


def settings(timeout_s: float = 2.0, integrity: bool = True) -> TransferSettings:
    """``inproc`` is registered but not a config choice: bypass the Literal's validation."""
    return TransferSettings().model_copy(
        update={"backend": "inproc", "timeout_s": timeout_s, "integrity": integrity}
    )


@dataclass
class Prefill:
    kv: KVCacheManager
    parked: ParkedBlocks
    transceiver: Transceiver
    skew: list[float]

    def park(self, num_tokens: int, rid: str | None = None) -> TransferHandle:
        """Allocate and park ``num_tokens`` tokens' blocks (filled with a pattern)."""
        rid = rid or f"r-{uuid.uuid4().hex[:6]}"
        blocks = self.kv.allocate(rid, num_tokens)
        for b in blocks:
            self.kv.pool[:, b] = float(b + 1)
        lease = self.parked.park(rid, blocks, num_tokens)
        return TransferHandle(
            worker_id="prefill-0",
            epoch=EPOCH,
            request_id=rid,
            lease_id=lease.lease_id,
            block_ids=tuple(blocks),
            num_tokens=num_tokens,
            lease_deadline=lease.deadline,
            layout=LAYOUT,
            backend="inproc",
            transfer_endpoint=self.transceiver.endpoint,
        )


@pytest.fixture(autouse=True)
def _clean_fabric() -> Iterator[None]:
    FABRIC.reset()
    yield
    FABRIC.reset()


@pytest.fixture
async def prefill() -> AsyncIterator[Prefill]:
    kv = KVCacheManager(LAYOUT, 16)
    skew = [0.0]
    parked = ParkedBlocks(
        epoch=EPOCH,
        lease_s=30.0,
        free_blocks=kv.free,
        generations=kv.generations,
        send_grace_s=0.0,
        clock=lambda: time.time() + skew[0],
    )
    t = create_transceiver(
        settings(),
        pool=kv.pool,
        layout=LAYOUT,
        worker_id="prefill-0",
        epoch=EPOCH,
        parked=parked,
        key=TEST_KEY,
    )
    await t.start()
    yield Prefill(kv, parked, t, skew)
    await t.close()
    await parked.close()


async def _decode(timeout_s: float = 2.0) -> tuple[Transceiver, torch.Tensor]:
    pool = KVCacheManager(LAYOUT, 16).pool
    t = create_transceiver(
        settings(timeout_s),
        pool=pool,
        layout=LAYOUT,
        worker_id="decode-0",
        epoch=1,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    return t, pool


@pytest.fixture
async def decode() -> AsyncIterator[tuple[Transceiver, torch.Tensor]]:
    t, pool = await _decode()
    yield t, pool
    await t.close()


def test_inproc_is_a_registered_backend_that_never_writes_late() -> None:
    assert _REGISTRY["inproc"] == "pdserve.transfer.inproc:InprocBackend"
    assert InprocBackend.inline_bytes is False


async def test_a_pull_copies_the_parked_blocks_and_releases_the_park(prefill, decode) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=7)
    await t.pull(handle, [9, 3])
    src = list(handle.block_ids)
    assert torch.equal(pool[:, [9, 3]], prefill.kv.pool[:, src])
    assert FABRIC.copies >= 1
    await _until(lambda: len(prefill.parked) == 0)
    assert prefill.parked.released_total == 1
    assert prefill.kv.get_num_free_blocks() == 16, "the released park went back to the pool"


# --- fencing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": EPOCH - 1}, "epoch"),
        ({"lease_id": "another-lease"}, "lease"),
    ],
)
async def test_a_handle_of_another_epoch_or_lease_is_refused_and_moves_nothing(
    prefill, decode, change, match
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    with pytest.raises(HandleError, match=match):
        await t.pull(handle.model_copy(update=change), [5])
    assert not pool.any() and FABRIC.copies == 0
    assert len(prefill.parked) == 1, "a refused handle frees nothing"
    await t.pull(handle, [5])  # the real handle still works


async def test_an_expired_lease_is_refused_by_the_prefill_side_and_its_blocks_freed(
    prefill, decode
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    prefill.skew[0] = 120.0  # the prefill side's clock is past the lease; the handle is not
    with pytest.raises(HandleError, match="expired"):
        await t.pull(handle, [5])
    assert not pool.any()
    assert len(prefill.parked) == 0 and prefill.parked.expired_total == 1
    assert prefill.kv.get_num_free_blocks() == 16


async def test_a_block_that_changed_hands_since_the_park_is_never_sent(prefill, decode) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    prefill.kv.free(handle.request_id)  # an ownership bug: the parked block goes to another
    assert handle.block_ids[0] in prefill.kv.allocate("thief", 16 * 4)  # the whole pool
    with pytest.raises(HandleError):
        await t.pull(handle, [5])
    assert not pool.any() and FABRIC.copies == 0


# --- corruption ------------------------------------------------------------------------------


async def test_a_byte_flipped_on_the_way_fails_the_pull_naming_the_block(prefill, decode) -> None:
    t, pool = decode

    def flip(dst: np.ndarray, plan: TransferPlan) -> None:
        dst[int(plan.dst_offsets[0]) + 3] ^= 0x10
        FABRIC.on_copy = None  # once

    FABRIC.on_copy = flip
    handle = prefill.park(num_tokens=4)
    with pytest.raises(IntegrityError, match=f"{handle.request_id}.*decode block 5"):
        await t.pull(handle, [5])
    assert len(prefill.parked) == 1, "no Release after a failed check: the lease decides"
    again = prefill.park(num_tokens=4)
    await t.pull(again, [6])  # the next pull on the same transceiver is intact
    assert torch.equal(pool[:, 6], prefill.kv.pool[:, again.block_ids[0]])


# --- a stalled peer --------------------------------------------------------------------------


async def test_a_stalled_copy_times_out_and_nothing_lands_afterwards(prefill) -> None:
    t, pool = await _decode(timeout_s=0.3)
    try:
        FABRIC.paused = True
        handle = prefill.park(num_tokens=4)
        with pytest.raises(TransferError, match="timed out"):
            await t.pull(handle, [5])
        assert t.late_writes is False
        FABRIC.paused = False
        # The sender notices the closed connection and gives up (its transceiver says so).
        await _until(lambda: prefill.transceiver.recent_errors)
        assert not pool.any(), "the decode side's blocks are free to reuse at once"
        assert len(prefill.parked) == 1, "the park waits for its lease"
    finally:
        await t.close()


async def _until(cond, timeout: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    await wait_until(cond, timeout, interval_s=0.01)
