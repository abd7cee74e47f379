"""Parked KV blocks on the prefill worker: leases, epochs, lease ids, block generations."""

from __future__ import annotations

import pytest

from pdserve.errors import HandleError
from pdserve.protocol import KVLayout
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.roles.parking import ParkedBlocks

LAYOUT = KVLayout(
    model="m", num_layers=2, num_kv_heads=1, head_dim=4, tokens_per_block=4, dtype="float32"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup() -> tuple[ParkedBlocks, Clock, list[str]]:
    clock, freed = Clock(), []
    parked = ParkedBlocks(
        epoch=7, lease_s=30.0, free_blocks=freed.append, send_grace_s=10.0, clock=clock
    )
    return parked, clock, freed


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(LAYOUT, num_blocks=4)


def test_lookup_returns_parked_blocks_until_released(setup) -> None:
    parked, _, freed = setup
    lease = parked.park("r1", [4, 5, 6], num_tokens=40)
    assert lease.deadline == 1030.0
    assert parked.lookup("r1", 7, lease.lease_id) == [4, 5, 6]
    assert parked.num_blocks == 3
    assert parked.release("r1", lease.lease_id) is True
    assert freed == ["r1"]
    assert parked.release("r1", lease.lease_id) is False, "release is idempotent"
    assert freed == ["r1"], "blocks are freed exactly once"


def test_every_park_issues_a_new_lease_id(setup) -> None:
    parked, _, _ = setup
    ids = {parked.park(f"r{i}", [i], num_tokens=1).lease_id for i in range(50)}
    assert len(ids) == 50


def test_lookup_refuses_another_epoch(setup) -> None:
    parked, _, _ = setup
    lease = parked.park("r1", [1], num_tokens=3)
    with pytest.raises(HandleError, match="another epoch.*restarted") as refused:
        parked.lookup("r1", 6, lease.lease_id)
    assert "7" not in str(refused.value), "the refusal does not tell the current epoch"


def test_lookup_refuses_unknown_request(setup) -> None:
    parked, _, _ = setup
    lease = parked.park("r1", [1], num_tokens=3)
    with pytest.raises(HandleError, match="no KV blocks are parked under this handle") as ghost:
        parked.lookup("ghost", 7, "any")
    with pytest.raises(HandleError) as wrong_lease:
        parked.lookup("r1", 7, "any")
    assert str(ghost.value) == str(wrong_lease.value), "a peer cannot tell which ids exist"
    assert lease.lease_id not in str(wrong_lease.value)


def test_lookup_refuses_a_lease_id_that_is_not_the_current_park(setup) -> None:
    parked, _, freed = setup
    old = parked.park("r1", [1], num_tokens=1)
    parked.release("r1", old.lease_id)
    new = parked.park("r1", [2], num_tokens=1)  # same request id, another allocation
    for stale in (old.lease_id, "bogus"):
        with pytest.raises(HandleError, match="another park") as refused:
            parked.lookup("r1", 7, stale)
        assert new.lease_id not in str(refused.value), "the current lease id never leaks"
    assert parked.lookup("r1", 7, new.lease_id) == [2]
    assert freed == ["r1"], "a refused lookup frees nothing"


def test_release_naming_another_lease_is_ignored(setup) -> None:
    parked, _, freed = setup
    lease = parked.park("r1", [1], num_tokens=1)
    assert parked.release("r1", "stale-lease") is False
    assert freed == [] and len(parked) == 1
    assert parked.release("r1", lease.lease_id) is True
    assert freed == ["r1"]


def test_expired_lease_frees_blocks_and_refuses_lookup(setup) -> None:
    parked, clock, freed = setup
    lease = parked.park("r1", [1, 2], num_tokens=20)
    clock.now += 31
    with pytest.raises(HandleError, match="expired"):
        parked.lookup("r1", 7, lease.lease_id)
    assert freed == ["r1"]
    assert len(parked) == 0


def test_expired_lease_keeps_blocks_a_send_may_still_read_until_the_send_window_closes(
    setup,
) -> None:
    parked, clock, freed = setup
    lease = parked.park("r1", [1, 2], num_tokens=8)
    clock.now += 29.5
    parked.lookup("r1", 7, lease.lease_id)  # a send starts just before the deadline
    clock.now += 1.0  # lease over, send window (10 s) still open
    assert parked.reap() == 0
    with pytest.raises(HandleError, match="expired"):
        parked.lookup("r1", 7, lease.lease_id)  # no new send may start
    assert freed == []
    clock.now += 9.0
    assert parked.reap() == 1
    assert freed == ["r1"]


def test_reaper_frees_only_expired_requests(setup) -> None:
    parked, clock, freed = setup
    parked.park("old", [1], num_tokens=1)
    clock.now += 20
    new = parked.park("new", [2], num_tokens=1)
    clock.now += 11
    assert parked.reap() == 1
    assert freed == ["old"]
    assert parked.lookup("new", 7, new.lease_id) == [2]


def test_parking_twice_is_refused(setup) -> None:
    parked, _, _ = setup
    parked.park("r1", [1], num_tokens=1)
    with pytest.raises(HandleError, match="already parked"):
        parked.park("r1", [2], num_tokens=1)


def test_block_generation_moves_at_every_allocation_and_free(kv) -> None:
    (block,) = kv.allocate("a", 4)
    first = kv.generations([block])
    kv.free("a")
    freed = kv.generations([block])
    kv.allocate("b", 16)  # all four blocks, the freed one among them
    assert first < freed < kv.generations([block])
    with pytest.raises(IndexError):
        kv.generations([-1])


def test_block_freed_and_reallocated_since_the_park_is_never_handed_out(kv) -> None:
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=kv.free, generations=kv.generations)
    blocks = kv.allocate("a", 8)
    lease = parked.park("a", blocks, num_tokens=8)
    kv.free("a")  # an ownership bug elsewhere: the parked blocks go back to the pool...
    reused = kv.allocate("b", 16)  # ...and another request gets them
    assert set(blocks) <= set(reused)
    with pytest.raises(HandleError, match="a KV block of the handle .* freed or reallocated"):
        parked.lookup("a", 7, lease.lease_id)


def test_block_freed_since_the_park_is_refused_even_before_reuse(kv) -> None:
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=kv.free, generations=kv.generations)
    lease = parked.park("a", kv.allocate("a", 4), num_tokens=4)
    kv.free("a")
    with pytest.raises(HandleError, match="freed or reallocated"):
        parked.lookup("a", 7, lease.lease_id)


def test_untouched_parked_blocks_pass_the_generation_check(kv) -> None:
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=kv.free, generations=kv.generations)
    blocks = kv.allocate("a", 8)
    lease = parked.park("a", blocks, num_tokens=8)
    kv.allocate("other", 8)  # other allocations do not disturb the parked blocks
    assert parked.lookup("a", 7, lease.lease_id) == blocks
    assert parked.release("a", lease.lease_id)
    assert kv.get_num_free_blocks() == 2


async def test_close_frees_everything(setup) -> None:
    parked, _, freed = setup
    parked.start(interval_s=0.01)
    parked.park("a", [1], num_tokens=1)
    parked.park("b", [2], num_tokens=1)
    await parked.close()
    await parked.close()
    assert sorted(freed) == ["a", "b"]
