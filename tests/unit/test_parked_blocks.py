"""Parked KV blocks on the prefill worker: leases, epochs, release."""

from __future__ import annotations

import pytest

from pdserve.errors import HandleError
from pdserve.workers.parking import ParkedBlocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup() -> tuple[ParkedBlocks, Clock, list[str]]:
    clock, freed = Clock(), []
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=freed.append, clock=clock)
    return parked, clock, freed


def test_lookup_returns_parked_blocks_until_released(setup) -> None:
    parked, _, freed = setup
    deadline = parked.park("r1", [4, 5, 6], num_tokens=40)
    assert deadline == 1030.0
    assert parked.lookup("r1", 7) == [4, 5, 6]
    assert parked.num_blocks == 3
    assert parked.release("r1") is True
    assert freed == ["r1"]
    assert parked.release("r1") is False, "release is idempotent"
    assert freed == ["r1"], "blocks are freed exactly once"


def test_lookup_refuses_another_epoch(setup) -> None:
    parked, _, _ = setup
    parked.park("r1", [1], num_tokens=3)
    with pytest.raises(HandleError, match="epoch 6"):
        parked.lookup("r1", 6)


def test_lookup_refuses_unknown_request(setup) -> None:
    parked, _, _ = setup
    with pytest.raises(HandleError, match="no parked KV blocks"):
        parked.lookup("ghost", 7)


def test_expired_lease_frees_blocks_and_refuses_lookup(setup) -> None:
    parked, clock, freed = setup
    parked.park("r1", [1, 2], num_tokens=20)
    clock.now += 31
    with pytest.raises(HandleError, match="expired"):
        parked.lookup("r1", 7)
    assert freed == ["r1"]
    assert len(parked) == 0


def test_reaper_frees_only_expired_requests(setup) -> None:
    parked, clock, freed = setup
    parked.park("old", [1], num_tokens=1)
    clock.now += 20
    parked.park("new", [2], num_tokens=1)
    clock.now += 11
    assert parked.reap() == 1
    assert freed == ["old"]
    assert parked.lookup("new", 7) == [2]


def test_parking_twice_is_refused(setup) -> None:
    parked, _, _ = setup
    parked.park("r1", [1], num_tokens=1)
    with pytest.raises(HandleError, match="already parked"):
        parked.park("r1", [2], num_tokens=1)


async def test_close_frees_everything(setup) -> None:
    parked, _, freed = setup
    parked.start(interval_s=0.01)
    parked.park("a", [1], num_tokens=1)
    parked.park("b", [2], num_tokens=1)
    await parked.close()
    await parked.close()
    assert sorted(freed) == ["a", "b"]
