"""KV events in vLLM's format (``kv_cache.zmq_events``, :mod:`pdserve.workers.kv.zmq_events`)
read by a real ZMQ SUB socket off the tiny model's engine and decoded with msgspec as vLLM's
``KVEventBatch`` is: the start clears, a prompt's full blocks arrive as ``BlockStored`` with
their tokens and a parent hash chaining them, and a pool too small for the next prompt evicts
them as ``BlockRemoved``; batch sequence numbers count from 0 without a gap."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pdserve.block_hash import BlockHasher
from pdserve.protocol import SamplingParams
from pdserve.workers.kv.zmq_events import TOPIC, ZmqKVEvents
from tests.support.engine import complete, make_engine

TPB = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def _receive(sub: zmq.Socket[bytes], want: int, timeout_s: float = 10.0) -> list[list[Any]]:
    """Decode batches until ``want`` events arrived; checks topic and sequence numbers."""
    events: list[list[Any]] = []
    seqs: list[int] = []
    give_up = time.monotonic() + timeout_s
    while len(events) < want:
        assert time.monotonic() < give_up, f"got {len(events)} of {want} events: {events}"
        if not sub.poll(100):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC
        seqs.append(int.from_bytes(seq, "big"))
        ts, batch = msgspec.msgpack.decode(payload)
        assert abs(ts - time.time()) < 60
        events.extend(batch)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    return events


def test_stored_and_removed_blocks_in_vllms_format(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=12)
    publisher = ZmqKVEvents("tcp://127.0.0.1:0", TPB)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(publisher.endpoint)
        publisher.attach(engine.kv_cache)
        time.sleep(0.3)  # a SUB socket gets nothing sent before it joined (ZMQ's slow joiner)
        assert publisher.sent == 0  # the clearing event waits until there is more to send
        prompt = [(7 * i) % 200 + 20 for i in range(6 * TPB + 1)]  # 6 full blocks
        complete(engine, "a", prompt, GREEDY)
        events = _receive(sub, 2)
        assert events[0] == ["AllBlocksCleared"]
        stored = [e for e in events if e[0] == "BlockStored"]
        hasher = BlockHasher(engine.layout.model, engine.layout.dtype, TPB)
        want = [h.to_bytes(16, "big") for h in hasher.hash_tokens(prompt[: 6 * TPB])]
        got_hashes = [h for e in stored for h in e[1]]
        assert got_hashes[:6] == want
        first = stored[0]
        assert first[2] is None  # the run starts the sequence
        assert first[3] == prompt[: len(first[1]) * TPB]
        assert first[4:] == [TPB, None, "GPU"]
        for prev, nxt in zip(stored, stored[1:], strict=False):  # runs chain by parent hash
            assert nxt[2] == prev[1][-1]
        # A second prompt that needs the whole pool evicts the first one's cached blocks.
        other = [(11 * i) % 200 + 30 for i in range(11 * TPB)]  # + 2 tokens: all 12 blocks
        complete(engine, "b", other, GREEDY)
        removed: list[bytes] = []
        give_up = time.monotonic() + 10
        while not set(want) <= set(removed):
            assert time.monotonic() < give_up, removed
            removed += [h for e in _receive(sub, 1) if e[0] == "BlockRemoved" for h in e[1]]
    finally:
        sub.close()
        publisher.close()
        engine.shutdown()


def test_a_taken_endpoint_is_a_config_error() -> None:
    from pdserve.errors import ConfigError

    first = ZmqKVEvents("tcp://127.0.0.1:0", TPB)
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            ZmqKVEvents(first.endpoint, TPB)
    finally:
        first.close()
