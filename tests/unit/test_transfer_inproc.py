"""The transfer logic on the in-process backend: two real transceivers in this process (the
control messages on loopback connections, the KV bytes copied between the pools), a real
KV cache manager and lease table on the prefill side. The subprocess suites
(tests/integration/test_transfer_fencing.py, test_transfer_corruption.py) run the same checks
on the real backends; these cover the logic in milliseconds.

Fencing (epoch, lease id, expiry, block generations), corruption (digest mismatch), a stalled
peer, and release (a pulled park is freed; a refused one is kept; an expired one is freed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import pytest
import torch

from pdserve.errors import HandleError, IntegrityError, TransferError
from pdserve.transfer import receiver
from pdserve.transfer.agents.inproc import FABRIC, InprocBackend
from pdserve.transfer.backend import _REGISTRY
from pdserve.transfer.formatter.mapping import TransferPlan
from pdserve.transfer.integrity import mix64
from tests.support.servers import wait_until
from tests.support.transfer import EPOCH, NUM_BLOCKS, assert_landed, backend_cfg
from tests.support.transfer_inproc import DecodeSide, LocalPrefill, decode_side

pytestmark = pytest.mark.timeout(20)

INPROC = backend_cfg("inproc", timeout_s=2.0)


@pytest.fixture(autouse=True)
def _clean_fabric() -> Iterator[None]:
    FABRIC.reset()
    yield
    FABRIC.reset()


@pytest.fixture
async def prefill() -> AsyncIterator[LocalPrefill]:
    async with LocalPrefill(INPROC) as side:
        yield side


@pytest.fixture
async def decode() -> AsyncIterator[DecodeSide]:
    async with decode_side(INPROC) as side:
        yield side


def test_inproc_is_a_registered_backend_that_never_writes_late() -> None:
    assert _REGISTRY["inproc"] == "pdserve.transfer.agents.inproc:InprocBackend"
    assert InprocBackend.inline_bytes is False


async def test_a_pull_copies_the_parked_blocks_and_releases_the_park(
    prefill: LocalPrefill, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=7)
    await t.pull(handle, [9, 3])
    src = list(handle.block_ids)
    assert torch.equal(pool[:, [9, 3]], prefill.kv.pool[:, src])
    assert_landed(pool, src, [9, 3])
    assert FABRIC.copies >= 1
    await _until(lambda: len(prefill.parked) == 0)
    assert prefill.parked.released_total == 1
    assert prefill.kv.get_num_free_blocks() == NUM_BLOCKS, "the released park went back"


# --- fencing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": EPOCH - 1}, "epoch"),
        ({"lease_id": "another-lease"}, "lease"),
    ],
)
async def test_a_handle_of_another_epoch_or_lease_is_refused_and_moves_nothing(
    prefill: LocalPrefill, decode: DecodeSide, change: dict[str, object], match: str
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    with pytest.raises(HandleError, match=match):
        await t.pull(handle.model_copy(update=change), [5])
    assert not pool.any() and FABRIC.copies == 0
    assert len(prefill.parked) == 1, "a refused handle frees nothing"
    await t.pull(handle, [5])  # the real handle still works


async def test_an_expired_lease_is_refused_by_the_prefill_side_and_its_blocks_freed(
    prefill: LocalPrefill, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    prefill.skew = 120.0  # the prefill side's clock is past the lease; the handle is not
    with pytest.raises(HandleError, match="expired"):
        await t.pull(handle, [5])
    assert not pool.any()
    assert len(prefill.parked) == 0 and prefill.parked.expired_total == 1
    assert prefill.kv.get_num_free_blocks() == NUM_BLOCKS


async def test_a_block_that_changed_hands_since_the_park_is_never_sent(
    prefill: LocalPrefill, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    stolen = prefill.steal(handle.request_id)  # an ownership bug: it goes to another request
    assert handle.block_ids[0] in stolen and len(stolen) == NUM_BLOCKS  # the whole pool
    with pytest.raises(HandleError):
        await t.pull(handle, [5])
    assert not pool.any() and FABRIC.copies == 0


# --- corruption ------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["xxh3_64", "mix64"])
async def test_a_byte_flipped_on_the_way_fails_the_pull_naming_the_block(
    prefill: LocalPrefill, decode: DecodeSide, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either digest: xxh3 (CPU pools), mix64 (what two GPU pools agree on; forced here, as if
    both pools were on a GPU): the sender computes the one asked for, the receiver checks it."""
    monkeypatch.setattr(receiver, "choose_algorithm", lambda *_: algorithm)
    hashed: list[int] = []
    real = mix64.digests

    def counted(memory: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        hashed.append(len(offsets))
        return real(memory, offsets, lengths)

    monkeypatch.setattr(mix64, "digests", counted)
    t, pool = decode

    def flip(dst: np.ndarray, plan: TransferPlan) -> None:
        dst[int(plan.dst_offsets[0]) + 3] ^= 0x10
        FABRIC.on_copy = None  # once

    FABRIC.on_copy = flip
    handle = prefill.park(num_tokens=4)
    with pytest.raises(IntegrityError, match=f"{handle.request_id}.*decode block 5.*{algorithm}"):
        await t.pull(handle, [5])
    assert len(prefill.parked) == 1, "no Release after a failed check: the lease decides"
    again = prefill.park(num_tokens=4)
    await t.pull(again, [6])  # the next pull on the same transceiver is intact
    assert torch.equal(pool[:, 6], prefill.kv.pool[:, again.block_ids[0]])
    # both sides of both pulls hashed with mix64 when it was asked for, and only then
    assert len(hashed) == (4 if algorithm == "mix64" else 0)


# --- a stalled peer --------------------------------------------------------------------------


async def test_a_stalled_copy_times_out_and_nothing_lands_afterwards(
    prefill: LocalPrefill,
) -> None:
    async with decode_side(backend_cfg("inproc", timeout_s=0.3)) as (t, pool):
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


async def _until(cond: Callable[[], object], timeout: float = 2.0) -> None:
    await wait_until(cond, timeout, interval_s=0.01)
