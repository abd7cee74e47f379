"""NATS discovery without a server: URL forms, key escaping, event messages and versions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.discovery import InvalidDiscoveryURLError, open_registration, parse_discovery_url
from pdserve.discovery.load_events import (
    EVENTS_VERSION,
    KVBlockEvent,
    LoadEvent,
    event_publisher,
    subject_token,
    worker_id_of,
)
from pdserve.protocol import WorkerLoad
from tests.support.fakes import CLUSTER_KEY


def test_nats_urls_default_to_port_4222_and_take_no_path() -> None:
    parsed = parse_discovery_url("nats://10.0.0.5")
    assert (parsed.scheme, parsed.host, parsed.port) == ("nats", "10.0.0.5", 4222)
    assert parse_discovery_url("NATS://h:4333/").port == 4333
    with pytest.raises(InvalidDiscoveryURLError, match="nats URLs take no path"):
        parse_discovery_url("nats://h:4222/bucket")
    with pytest.raises(InvalidDiscoveryURLError, match="nats://HOST:PORT"):
        parse_discovery_url("jetstream://h:4222")


@pytest.mark.parametrize("worker_id", ["decode-0", "p@host-1:8100", "a.b.c", "x_y-z"])
def test_worker_ids_become_one_subject_token_and_back(worker_id: str) -> None:
    token = subject_token(worker_id)
    assert not any(c in token for c in ".:@*> ")
    assert worker_id_of(token) == worker_id


def test_events_of_another_version_are_rejected_and_extra_fields_ignored() -> None:
    event = LoadEvent(worker_id="w", epoch=3, seq=0, sent_at=1.0, load=WorkerLoad(running=2))
    assert event.version == EVENTS_VERSION == 2
    wire = event.model_dump_json()
    assert LoadEvent.model_validate_json(wire) == event
    with pytest.raises(ValidationError):
        LoadEvent.model_validate_json(wire.replace('"version":2', '"version":1'))
    newer = wire[:-1] + ',"future_field":7}'
    assert LoadEvent.model_validate_json(newer) == event
    with pytest.raises(ValidationError):  # counters are never negative
        KVBlockEvent(
            worker_id="w", epoch=3, seq=0, sent_at=1.0, parked_requests=-1, parked_blocks=0,
            released_total=0, expired_total=0, free_blocks=0, total_blocks=0,
        )  # fmt: skip


def test_only_nats_registrations_have_an_event_publisher() -> None:
    assert (
        event_publisher(open_registration("http://127.0.0.1:1", ttl_s=1.0, key=CLUSTER_KEY)) is None
    )
    assert event_publisher(None) is None
    nats_reg = open_registration("nats://127.0.0.1:1", ttl_s=1.0, key=CLUSTER_KEY)
    assert event_publisher(nats_reg) is None  # created by start()
