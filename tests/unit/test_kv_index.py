"""The router's KV index (router/kv_index.py): applying KV cache events in order, gaps,
epochs, snapshots, eviction, and the expected cached prefix of a prompt per worker."""

from __future__ import annotations

import pytest

from pdserve.block_hash import BlockHasher
from pdserve.discovery.kvcache import KVCacheEvent, Medium, encode_hash
from pdserve.router.kv_index import (
    MEDIUM_LOAD_COST,
    KVIndex,
    PromptHashes,
    expected_cached_tokens,
)
from pdserve.workers.kv.manager import KVCacheManager
from tests.support.fakes import CLUSTER_KEY, layout, record

TPB = 16
LAYOUT = layout(tokens_per_block=TPB)
HASHER = BlockHasher(LAYOUT.model, LAYOUT.dtype, TPB)
PROMPT = list(range(100, 100 + 5 * TPB + 3))  # 5 full blocks + 3 tokens
HASHES = HASHER.hash_tokens(PROMPT)


def event(
    seq: int,
    *,
    stored: list[int] = (),  # type: ignore[assignment]
    removed: list[int] = (),  # type: ignore[assignment]
    reset: bool = False,
    epoch: int = 7,
    worker_id: str = "p0",
    medium: Medium = "device",
) -> KVCacheEvent:
    """A KV cache event signed with the cluster key, as a worker's publisher signs it."""
    unsigned = KVCacheEvent(
        worker_id=worker_id,
        epoch=epoch,
        seq=seq,
        sent_at=0.0,
        reset=reset,
        medium=medium,
        stored=tuple(encode_hash(h) for h in stored),
        removed=tuple(encode_hash(h) for h in removed),
    )
    return CLUSTER_KEY.sign_event(unsigned)


def synced_index(*hashes: int) -> KVIndex:
    index = KVIndex(key=CLUSTER_KEY)
    assert index.apply(event(0, reset=True, stored=list(hashes))) is False
    return index


def test_a_snapshot_then_changes_give_the_leading_overlap() -> None:
    index = synced_index(*HASHES[:3])
    assert index.overlap("p0", 7, HASHES) == 3
    index.apply(event(1, stored=[HASHES[3]]))
    assert index.overlap("p0", 7, HASHES) == 4
    index.apply(event(2, removed=[HASHES[1]]))  # evicted: the chain breaks at block 1
    assert index.overlap("p0", 7, HASHES) == 1
    assert index.stats().outcomes["applied"] == 3


def test_the_overlap_stops_at_the_first_missing_block() -> None:
    index = synced_index(HASHES[0], HASHES[2], HASHES[3])
    assert index.overlap("p0", 7, HASHES) == 1


def test_events_before_the_first_snapshot_are_not_counted_and_ask_for_one() -> None:
    index = KVIndex(key=CLUSTER_KEY)
    assert index.apply(event(4, stored=HASHES)) is True  # joined late: unsynced
    assert index.overlap("p0", 7, HASHES) == 0
    assert index.apply(event(5, reset=True, stored=HASHES[:2])) is False
    assert index.overlap("p0", 7, HASHES) == 2
    assert index.stats().outcomes["unsynced"] == 1


def test_a_sequence_gap_clears_the_worker_until_its_next_snapshot() -> None:
    index = synced_index(*HASHES[:2])
    assert index.apply(event(2, stored=[HASHES[2]])) is True  # seq 1 was lost
    assert index.overlap("p0", 7, HASHES) == 0
    assert not index.synced("p0", 7)
    assert index.apply(event(3, stored=[HASHES[3]])) is True  # still unsynced
    assert index.overlap("p0", 7, HASHES) == 0
    index.apply(event(4, reset=True, stored=HASHES[:4]))
    assert index.overlap("p0", 7, HASHES) == 4
    assert index.stats().outcomes["gap"] == 1


def test_duplicate_and_reordered_events_are_dropped() -> None:
    index = synced_index(*HASHES[:2])
    index.apply(event(1, removed=[HASHES[0]]))
    index.apply(event(1, stored=[HASHES[0]]))  # duplicate seq
    index.apply(event(0, reset=True, stored=HASHES))  # an old snapshot, late
    assert index.overlap("p0", 7, HASHES) == 0
    assert index.stats().outcomes["stale"] == 2


def test_a_new_epoch_replaces_the_old_incarnation_and_an_old_epoch_is_ignored() -> None:
    index = synced_index(*HASHES)
    assert index.apply(event(0, epoch=8, stored=HASHES)) is True  # restarted: unsynced
    assert index.overlap("p0", 7, HASHES) == 0
    assert index.overlap("p0", 8, HASHES) == 0
    index.apply(event(1, epoch=8, reset=True, stored=HASHES[:1]))
    assert index.overlap("p0", 8, HASHES) == 1
    index.apply(event(9, epoch=7, reset=True, stored=HASHES))  # the dead incarnation
    assert index.overlap("p0", 8, HASHES) == 1
    assert index.overlap("p0", 7, HASHES) == 0


def test_a_forgotten_worker_holds_nothing() -> None:
    index = synced_index(*HASHES)
    index.forget("p0")
    assert index.overlap("p0", 7, HASHES) == 0
    assert index.stats().workers == 0


def test_workers_are_tracked_separately() -> None:
    index = synced_index(*HASHES[:2])
    index.apply(event(0, worker_id="p1", reset=True, stored=HASHES))
    assert index.overlap("p0", 7, HASHES) == 2
    assert index.overlap("p1", 7, HASHES) == 5
    stats = index.stats()
    assert (stats.workers, stats.synced, stats.blocks) == (2, 2, 7)


def test_a_malformed_event_is_rejected_at_validation() -> None:
    with pytest.raises(ValueError, match="32 hex digits"):
        KVCacheEvent(worker_id="p0", epoch=1, seq=0, sent_at=0.0, stored=("abc",))


def test_prompt_hashes_match_what_the_workers_kv_cache_indexes() -> None:
    """The router hashes a prompt exactly as a worker's KV cache manager does: a prefix the
    manager matches is the prefix the index reports."""
    cache = KVCacheManager(LAYOUT, num_blocks=16)
    cache.allocate("r", len(PROMPT))
    cache.register("r", HASHES, len(PROMPT))
    index = synced_index(*cache.cached_hashes())
    prompt = PromptHashes(PROMPT)
    worker_matched = cache.match_prefix(HASHES, len(PROMPT))[1]
    got = expected_cached_tokens(index, [record("p0", "prefill", kv_layout=LAYOUT)], prompt)
    assert got == {"p0": worker_matched} and worker_matched == 5 * TPB


def test_expected_cached_tokens_leave_the_last_token_to_compute() -> None:
    """A prompt of exactly 5 blocks can reuse 4 of them: one token is always computed."""
    exact = PROMPT[: 5 * TPB]
    index = synced_index(*HASHES)
    got = expected_cached_tokens(index, [record("p0", "prefill")], PromptHashes(exact))
    assert got == {"p0": 4 * TPB}


def test_expected_cached_tokens_per_layout_and_epoch() -> None:
    """Another block size hashes differently (no match); another epoch counts nothing."""
    index = synced_index(*HASHES)
    index.apply(event(0, worker_id="p1", reset=True, stored=HASHES))
    index.apply(event(0, worker_id="p2", reset=True, stored=HASHES))
    workers = [
        record("p0", "prefill"),
        record("p1", "prefill", kv_layout=layout(tokens_per_block=8)),
        record("p2", "prefill", epoch=8),
        record("p3", "prefill"),
    ]
    got = expected_cached_tokens(index, workers, PromptHashes(PROMPT))
    assert got == {"p0": 5 * TPB, "p1": 0, "p2": 0, "p3": 0}


def test_a_salted_prompt_is_credited_only_with_blocks_of_its_salt() -> None:
    """The router hashes a salted prompt as the workers do (pdserve.block_hash): a worker that
    holds the prompt's blocks under another salt (or none) is credited with nothing."""
    salted = HASHER.hash_tokens(PROMPT, "tenant\x00a\x00")
    index = synced_index(*HASHES, *salted)  # the worker holds both chains
    workers = [record("p0", "prefill", kv_layout=LAYOUT)]
    for salt, want in [(None, 5 * TPB), ("tenant\x00a\x00", 5 * TPB), ("tenant\x00b\x00", 0)]:
        assert expected_cached_tokens(index, workers, PromptHashes(PROMPT, salt)) == {"p0": want}
    index = synced_index(*salted)  # only tenant a's
    assert expected_cached_tokens(index, workers, PromptHashes(PROMPT)) == {"p0": 0}


def test_tier_blocks_are_credited_by_their_load_cost_and_a_snapshot_clears_every_medium() -> None:
    """A worker that holds a prefix in its pool beats one that holds it on disk, which beats
    one that holds nothing; a block in two media counts at the cheaper one."""
    index = synced_index(*HASHES[:2])  # p0: blocks 0-1 in the pool ...
    index.apply(event(1, medium="host", stored=HASHES[1:3]))  # ... 1-2 in host memory
    index.apply(event(2, medium="disk", stored=HASHES[3:5]))  # ... and 3-4 on disk
    assert index.overlap_media("p0", 7, HASHES) == ["device", "device", "host", "disk", "disk"]
    index.apply(event(0, worker_id="p1", reset=True, medium="disk", stored=HASHES))
    index.apply(event(0, worker_id="p2", reset=True, medium="remote", stored=HASHES[:3]))
    workers = [record(w, "prefill") for w in ("p0", "p1", "p2", "p3")]
    got = expected_cached_tokens(index, workers, PromptHashes(PROMPT))
    disk, host, remote = (1 - MEDIUM_LOAD_COST[m] for m in ("disk", "host", "remote"))
    assert got == {
        "p0": int((2 + host + 2 * disk) * TPB),
        "p1": int(5 * disk * TPB),
        "p2": int(3 * remote * TPB),
        "p3": 0,
    }
    assert got["p0"] > got["p1"] > got["p2"] > got["p3"] == 0
    index.apply(event(3, medium="disk", removed=HASHES[3:4]))  # a file removed for room
    assert index.overlap_media("p0", 7, HASHES) == ["device", "device", "host"]
    index.apply(event(4, reset=True, stored=HASHES[:1]))  # a snapshot: the tiers start over
    assert index.overlap_media("p0", 7, HASHES) == ["device"]
    assert index.stats().blocks == 1 + 5 + 3
