"""Session affinity (issue 42, item 4; router/sessions.py): a session's next turn goes to the
worker of its last turn while that worker is the same incarnation and not overloaded past the
credited prefix; the entry ends when the worker leaves or restarts, lapses after its TTL and is
LRU-bounded; a session id comes from the header, or ``user`` when asked, and is bounded."""

from __future__ import annotations

import httpx
import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.errors import InvalidRequestError
from pdserve.protocol import Role, SamplingParams, WorkerLoad
from pdserve.router.client import WorkerClient
from pdserve.router.router import Router
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.sessions import MAX_SESSION_ID_CHARS, SessionTable, session_id_from
from pdserve.router.view import WorkerView
from tests.support.fakes import (
    CLUSTER_KEY,
    MODEL,
    FakeWatcher,
    FakeWorker,
    build_tokenizer_dir,
    record,
    router_harness,
)

REPLY = [(100 + i, f"t{i}") for i in range(4)]
PROMPT = list(range(1, 1001))


def test_an_entry_ends_with_its_worker_its_ttl_or_the_lru_bound() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10.0, max_sessions=2, clock=lambda: now[0])
    d0, d1 = record("d0", Role.DECODE, epoch=1), record("d1", Role.DECODE, epoch=1)
    live = {"d0": d0, "d1": d1}
    table.remember("a", d0, 300)
    cached: dict[str, int] = {"d0": 50}
    assert table.cached("a", 200, live.get, cached) == "d0"
    assert cached == {"d0": 200}  # the credit is capped at the new prompt's length
    cached = {"d0": 250}
    table.cached("a", 400, live.get, cached)
    assert cached == {"d0": 300}  # never less than what the KV index says
    live["d0"] = record("d0", Role.DECODE, epoch=2)  # restarted: its cache is gone
    assert table.lookup("a", live.get) is None and len(table) == 0
    table.remember("b", d1, 10)
    table.remember("c", d1, 10)
    table.remember("d", d1, 10)
    assert table.lookup("b", live.get) is None  # the least recently used went first
    now[0] = 10.5
    assert table.lookup("c", live.get) is None  # lapsed
    del live["d1"]
    assert table.lookup("d", live.get) is None  # its worker left discovery


def test_the_session_id_comes_from_the_header_or_user_and_is_bounded() -> None:
    assert session_id_from("s1", "u1", from_user=True) == "s1"
    assert session_id_from(None, "u1", from_user=True) == "u1"
    assert session_id_from(None, "u1", from_user=False) is None
    assert session_id_from("", None, from_user=False) is None
    with pytest.raises(InvalidRequestError, match="x-session-id: a session id has at most"):
        session_id_from("x" * (MAX_SESSION_ID_CHARS + 1), None, from_user=False)


async def _turn(router: Router, rid: str, session: str | None) -> None:
    txn = await router.start(rid, PROMPT, SamplingParams(max_tokens=4), session_id=session)
    [e async for e in txn.events()]
    await txn.aclose()


async def test_a_session_stays_on_its_worker_until_it_is_overloaded() -> None:
    workers = [FakeWorker(f"d{i}", Role.DECODE, REPLY) for i in range(2)]
    watcher = FakeWatcher([w.record() for w in workers])
    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in workers}
    metrics = RouterMetrics()
    settings = RouterSettings(request_timeout_s=10.0, local_prefill_max_tokens=4096)
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as http:
        router = Router(
            WorkerView(watcher, served_model_name=MODEL),
            WorkerClient(http, key=CLUSTER_KEY, connect_timeout_s=1.0),
            settings,
            metrics=metrics,
        )
        await _turn(router, "r1", "chat-1")  # d0: the first by id among equals
        assert [len(w.generations) for w in workers] == [1, 0]
        # d0 now runs a request: without a session the next turn goes to the idle d1 ...
        busy = WorkerLoad(running=1, free_blocks=100, total_blocks=100)
        watcher.put(record("d0", Role.DECODE, workers[0].http_url, load=busy))
        await _turn(router, "r2", None)
        assert [len(w.generations) for w in workers] == [1, 1]
        # ... with it, d0 keeps it: 1000 prompt tokens credited outweigh one request (256)
        await _turn(router, "r3", "chat-1")
        assert [len(w.generations) for w in workers] == [2, 1]
        # overloaded past the credit (4 requests = 1024 tokens > 1000): the session moves
        busy = WorkerLoad(running=4, free_blocks=100, total_blocks=100)
        watcher.put(record("d0", Role.DECODE, workers[0].http_url, load=busy))
        await _turn(router, "r4", "chat-1")
        assert [len(w.generations) for w in workers] == [2, 2]
        # and now it lives on d1: a restart of d0 does not matter to it
        assert router.sessions is not None
        assert router.sessions.lookup("chat-1", watcher.workers().get).worker_id == "d1"  # type: ignore[union-attr]
    text = metrics.render().decode()
    for outcome, n in (("new", 1), ("kept", 1), ("moved", 1)):
        assert f'pdserve_router_session_routes_total{{outcome="{outcome}"}} {float(n)}' in text


# -- through the HTTP app ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=128)


def _cfg(model_dir, **router):  # type: ignore[no-untyped-def]
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    settings = cfg.router.model_copy(update={"local_prefill_max_tokens": 100, **router})
    return cfg.model_copy(update={"router": settings})


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("via", ["header", "user"])
async def test_the_app_routes_a_session_to_its_worker(model_dir, via) -> None:  # type: ignore[no-untyped-def]
    workers = [FakeWorker(f"d{i}", Role.DECODE, REPLY) for i in range(2)]
    cfg = _cfg(model_dir, session_from_user=via == "user")

    def turn(client: httpx.AsyncClient):  # type: ignore[no-untyped-def]
        if via == "header":
            return client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s1"})
        return client.post("/v1/chat/completions", json={**CHAT, "user": "s1"})

    async with router_harness(cfg, workers) as h:
        busy = WorkerLoad(running=1, free_blocks=100, total_blocks=100)
        h.watcher.put(record("d0", Role.DECODE, workers[0].http_url, load=busy))
        assert (await turn(h.client)).status_code == 200  # d0 busy: the session starts on d1
        h.watcher.put(workers[0].record())  # d0 idle again: a tie, which d0 wins by its id ...
        r = await h.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and [len(w.generations) for w in workers] == [1, 1]
        assert (await turn(h.client)).status_code == 200  # ... but not against the session
        assert [len(w.generations) for w in workers] == [1, 2]


async def test_a_session_id_past_its_bound_is_refused(model_dir) -> None:  # type: ignore[no-untyped-def]
    workers = [FakeWorker("d0", Role.DECODE, REPLY)]
    async with router_harness(_cfg(model_dir), workers) as h:
        long = "x" * (MAX_SESSION_ID_CHARS + 1)
        r = await h.client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": long})
    assert r.status_code == 400
    assert "x-session-id: a session id has at most 256 characters" in r.json()["error"]["message"]
    assert workers[0].generations == []
