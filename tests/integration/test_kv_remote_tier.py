"""The KV cache connector's remote tier on a real redis-server (started per test, no
persistence): blocks written by one engine are loaded by another with an empty pool (another
host, or the same one after a restart) and the greedy output equals a cold run; a corrupt or
foreign entry is a miss and is deleted; a salted prompt never reads another salt's blocks; a
store that is stopped costs misses, not a stall, and is used again once it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from pdserve.protocol import ResumedChoice, SamplingParams
from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.requests import EngineRequest
from pdserve.workers.kv.cache_events import KVEventRecorder
from pdserve.workers.kv.remote import KEY_PREFIX, RemoteTier
from pdserve.workers.kv.tiers import decode_block
from tests.support.engine import complete, joined, make_engine, run
from tests.support.servers import RedisServer, wait_until_sync

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TEXT = "Every host of the fleet reads the blocks one worker stored in the shared store. " * 2


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, compile=False, prefix_caching=False)
    yield engine
    engine.shutdown()


def remote_engine(model_dir: Path, url: str, **settings: object) -> Engine:
    return make_engine(model_dir, compile=False, remote_cache=url, **settings)


def finished(engine: Engine) -> RemoteTier:
    """The engine's remote tier once its queued writes are in the store."""
    assert engine.connector is not None and engine.connector.remote is not None
    remote = engine.connector.remote
    assert remote.flush(30.0)
    return remote


def tokens_of(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def test_blocks_one_engine_stored_are_loaded_by_another_with_an_empty_pool(
    tiny_model_dir: Path, cold: Engine, redis_server: RedisServer
) -> None:
    tokens = tokens_of(cold, TEXT)
    want = complete(cold, "cold", tokens, GREEDY).token_ids
    first = remote_engine(tiny_model_dir, redis_server.url)
    recorder = KVEventRecorder()  # what the worker's KV cache events would report
    try:
        assert first.connector is not None
        first.connector.add_tier_listener(recorder)
        assert complete(first, "w-1", tokens, GREEDY).token_ids == want
        written = finished(first).stats()
        known = set(finished(first).hashes())
    finally:
        first.shutdown()
    fed = len(tokens) + GREEDY.max_tokens - 1  # every full block the first engine computed
    assert written.stored == fed // 4 and written.dropped == 0 and written.errors == 0
    changes, _ = recorder.drain()
    assert {h for (medium, h), held in changes.items() if medium == "remote" and held} == known
    assert len(known) == fed // 4
    store = redis.Redis.from_url(redis_server.url)
    assert len(store.keys(f"{KEY_PREFIX}*")) == fed // 4

    second = remote_engine(tiny_model_dir, redis_server.url)  # another host: nothing local
    try:
        outs = run(second, [EngineRequest("w-2", tokens, GREEDY)])["w-2"]
        assert joined(outs).token_ids == want
        stats = second.kv_connector_stats()
        assert stats is not None and stats.remote is not None
        assert stats.hit_tokens("remote") == (len(tokens) - 1) // 4 * 4
        assert outs[0].cached_tokens == stats.hit_tokens("remote"), "usage counts tier loads"
        # what it computed past the loaded prefix was already stored: one EXISTS, no bytes
        assert finished(second).stats().stored == 0
        # a salted prompt of the same tokens finds nothing of the unsalted one's
        salted = GREEDY.model_copy(update={"cache_salt": "tenant-b"})
        before = stats.hit_tokens("remote")
        assert complete(second, "w-salt", tokens, salted).token_ids == want
        after = second.kv_connector_stats()
        assert after is not None and after.hit_tokens("remote") == before
        assert second.kv_cache.prefix_stats().hit_tokens == 0, "nor in the pool"
    finally:
        second.shutdown()


def test_a_corrupt_or_foreign_entry_is_a_miss_and_is_deleted(
    tiny_model_dir: Path, cold: Engine, redis_server: RedisServer
) -> None:
    tokens = tokens_of(cold, TEXT)
    want = complete(cold, "cold-c", tokens, GREEDY).token_ids
    first = remote_engine(tiny_model_dir, redis_server.url)
    try:
        complete(first, "c-1", tokens, GREEDY)
        remote = finished(first)
        hashes = first.kv_cache.hasher.hash_tokens(tokens)
        store = redis.Redis.from_url(redis_server.url)
        flipped = bytearray(store.get(remote.key(hashes[2])))
        flipped[-50] ^= 0x10  # a K/V byte: the digest catches it
        store.set(remote.key(hashes[2]), bytes(flipped))
        # block 4's key holds block 5's entry: another block's, whole and digest-correct
        store.set(remote.key(hashes[4]), store.get(remote.key(hashes[5])))
        assert len(remote.load_prefix(hashes)) == 2, "the prefix ends at the flipped block"
        assert store.get(remote.key(hashes[2])) is None, "deleted"
        assert len(remote.load_prefix(hashes[3:6])) == 1, "and at the foreign entry"
        assert store.get(remote.key(hashes[4])) is None
        assert remote.stats().corrupt == 2
    finally:
        first.shutdown()
    second = remote_engine(tiny_model_dir, redis_server.url)
    try:
        assert complete(second, "c-2", tokens, GREEDY).token_ids == want
        stats = second.kv_connector_stats()
        assert stats is not None and stats.hit_tokens("remote") == 2 * 4
    finally:
        second.shutdown()


def test_a_stopped_store_costs_misses_not_a_stall_and_is_used_again_once_back(
    tiny_model_dir: Path, cold: Engine, redis_server: RedisServer
) -> None:
    tokens = tokens_of(cold, TEXT)
    want = complete(cold, "cold-s", tokens, GREEDY).token_ids
    engine = remote_engine(tiny_model_dir, redis_server.url, remote_cache_timeout_ms=200)
    try:
        remote = finished(engine)
        hashes = engine.kv_cache.hasher.hash_tokens(tokens)
        redis_server.stop(kill=True)
        started = time.monotonic()
        assert remote.load_prefix(hashes) == []
        assert time.monotonic() - started < 2.0
        assert not remote.available(), "the breaker is open"
        started = time.monotonic()
        assert remote.load_prefix(hashes) == [], "a miss at once while it is open"
        assert time.monotonic() - started < 0.05
        # requests go on: computed, their saves dropped (counted), the output exact
        assert complete(engine, "s-down", tokens, GREEDY).token_ids == want
        down = remote.stats()
        assert down.errors >= 1 and down.stored == 0
        redis_server.start()
        wait_until_sync(remote.available, 10.0, what="the breaker closes")
        other = tokens_of(cold, "A prompt of its own, sent once the store is back again. " * 2)
        complete(engine, "s-back", other, GREEDY)
        wait_until_sync(
            lambda: remote.flush(0.1) and remote.stats().stored > 0, 10.0, what="stored"
        )
        assert remote.load_prefix(engine.kv_cache.hasher.hash_tokens(other))
    finally:
        engine.shutdown()


def test_the_write_queue_is_bounded_and_a_known_block_is_not_sent_twice(
    tiny_model_dir: Path, redis_server: RedisServer
) -> None:
    engine = make_engine(tiny_model_dir, compile=False)  # only for a real layout
    try:
        layout = engine.layout
    finally:
        engine.shutdown()
    block = torch.zeros(layout.num_layers, 2, layout.tokens_per_block, layout.num_kv_heads,
                        layout.head_dim, dtype=engine.kv_cache.pool.dtype)  # fmt: skip
    size = block.numel() * block.element_size()
    small = RemoteTier(redis_server.url, layout, max_pending_bytes=size - 1)
    try:
        assert not small.save(1, block) and small.stats().dropped == 1, "past the bound"
    finally:
        small.close()
    tier = RemoteTier(redis_server.url, layout)
    try:
        assert tier.save(2, block) and tier.flush(5.0)
        assert tier.stats().stored == 1
        assert not tier.wants(2) and not tier.save(2, block.clone()), "known: not queued"
        store = redis.Redis.from_url(redis_server.url)
        problem, stored = decode_block(tier.layout_key, tier.shape, tier.dtype, 2,
                                       store.get(tier.key(2)))  # fmt: skip
        assert problem is None and stored is not None and torch.equal(stored, block)
        fresh = RemoteTier(redis_server.url, layout)
        try:
            assert fresh.save(2, block) and fresh.flush(5.0)
            assert fresh.stats().stored == 0, "already in the store: EXISTS, no bytes sent"
            loaded = fresh.load_prefix([2, 3])
            assert len(loaded) == 1 and torch.equal(loaded[0], block)
        finally:
            fresh.close()
    finally:
        tier.close()


def test_a_migrated_stream_loads_its_blocks_from_the_store_and_continues_exactly(
    tiny_model_dir: Path, cold: Engine, redis_server: RedisServer
) -> None:
    """Mid-stream migration with the remote tier: the first worker stored the prompt's and the
    sent tokens' full blocks as it computed them; the worker the stream moves to (nothing in
    its pool) loads them instead of recomputing prompt + sent tokens, and its greedy tokens
    continue the first worker's exactly."""
    tokens = tokens_of(cold, TEXT)
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = complete(cold, "cold-m", tokens, sampling)
    first = remote_engine(tiny_model_dir, redis_server.url)
    try:
        outs = run(first, [EngineRequest("m-1", tokens, sampling)])["m-1"]
        assert joined(outs).token_ids == want.token_ids
        finished(first)
    finally:
        first.shutdown()  # the first decode worker is gone: its pool with it
    sent, chars = [], 0
    for out in outs:  # the client got the first outputs' tokens and text, then the leg broke
        if len(sent) + len(out.token_ids) > 9:
            break
        sent += out.token_ids
        chars += len(out.text)
    resume = (ResumedChoice(index=0, token_ids=tuple(sent), text_chars=chars),)
    second = remote_engine(tiny_model_dir, redis_server.url)
    try:
        moved = run(second, [EngineRequest("m-1~m1", tokens, sampling, resume=resume)])["m-1~m1"]
        assert sent + joined(moved).token_ids == want.token_ids
        assert want.text == want.text[:chars] + joined(moved).text, "text resumes exactly"
        stats = second.kv_connector_stats()
        assert stats is not None
        recomputed = len(tokens) + len(sent) - stats.hit_tokens("remote")
        assert recomputed <= 4, f"only the last partial block is computed, not {recomputed}"
    finally:
        second.shutdown()
