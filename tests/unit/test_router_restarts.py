"""A worker's restart as the router sees it: a known worker id re-registering with a higher
epoch counts in ``pdserve_worker_restarts_total{role}``; every process exports its supervisor
restart count (``pdserve_process_restarts``); a decode worker that refuses the connection is
replaced by another one before the client notices."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.discovery import EmbeddedRegistry
from pdserve.protocol import SamplingParams, WorkerLoad, WorkerRecord
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.view import WorkerView
from pdserve.workers.roles.worker_metrics import WorkerMetrics
from tests.support.fakes import CLUSTER_KEY, MODEL, PROMPT, build_tokenizer_dir, make_router, record
from tests.support.fakes import decode_worker as decode
from tests.support.fakes import prefill_worker as prefill


class Source:
    """A discovery watcher's two calls the view uses: ``workers()`` and ``subscribe()``."""

    def __init__(self) -> None:
        self.records: dict[str, WorkerRecord] = {}
        self.subscribers: list[Callable[[str, WorkerRecord | None], None]] = []

    def workers(self) -> dict[str, WorkerRecord]:
        return dict(self.records)

    def subscribe(self, callback: Callable[[str, WorkerRecord | None], None]) -> None:
        self.subscribers.append(callback)

    def put(self, rec: WorkerRecord) -> None:
        self.records[rec.worker_id] = rec
        for callback in self.subscribers:
            callback(rec.worker_id, rec)

    def remove(self, worker_id: str) -> None:
        del self.records[worker_id]
        for callback in self.subscribers:
            callback(worker_id, None)


def test_view_counts_a_higher_epoch_of_a_known_worker_as_a_restart() -> None:
    registry = Source()
    registry.put(record("p0", "prefill", epoch=1))
    seen: list[tuple[str, int]] = []
    view = WorkerView(
        registry, served_model_name=MODEL, on_restart=lambda r: seen.append((r.worker_id, r.epoch))
    )
    view.follow(registry)
    registry.put(record("p0", "prefill", epoch=1))  # a refresh
    registry.put(record("d0", "decode", epoch=5))  # a new worker
    registry.remove("p0")  # its record expired after a crash ...
    registry.put(record("p0", "prefill", epoch=2))  # ... before its successor registered
    registry.put(record("d0", "decode", epoch=6))
    assert seen == [("p0", 2), ("d0", 6)] and view.restarts == 2


def test_router_metrics_export_worker_restarts_by_role_and_the_process_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_RESTARTS", "3")
    metrics = RouterMetrics()
    metrics.worker_restarts.labels("decode").inc()
    text = metrics.render().decode()
    assert 'pdserve_worker_restarts_total{role="decode"} 1.0' in text
    assert 'pdserve_worker_restarts_total{role="prefill"} 0.0' in text
    assert "pdserve_process_restarts 3.0" in text
    monkeypatch.delenv("PDSERVE_RESTARTS")
    worker = WorkerMetrics("prefill", lambda: None, lambda: 0).render().decode()
    assert "pdserve_process_restarts 0.0" in worker


async def test_router_app_counts_restarts_it_watches(tmp_path) -> None:
    import httpx

    from pdserve.server.app import create_app

    cfg = RouterConfig(model_path=build_tokenizer_dir(tmp_path / "tok"), served_model_name=MODEL)
    key = CLUSTER_KEY
    registry = EmbeddedRegistry(ttl_s=30, key=key)
    app = create_app(cfg, registry=registry, cluster_key=key)
    async with app.router.lifespan_context(app):
        registry.put(key.sign_record(record("p0", "prefill", epoch=1)))
        registry.put(key.sign_record(record("p0", "prefill", epoch=2)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            text = (await client.get("/metrics")).text
    assert 'pdserve_worker_restarts_total{role="prefill"} 1.0' in text


async def test_unreachable_decode_worker_is_replaced_by_another_after_the_first_token() -> None:
    dead = record("d-dead", "decode", "http://127.0.0.1:1")  # nothing listens on port 1
    ok = decode("d-ok", load=WorkerLoad(running=5, free_blocks=1))  # more loaded: tried second
    p = prefill()
    async with make_router(p, ok, extra_records=[dead]) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        assert txn.pair.decode.worker_id == "d-dead"
        events = [e async for e in txn.events()]
        assert txn.pair.decode.worker_id == "d-ok"
        assert "".join(e.text for e in events) == "Hi!\n"
        assert [w.worker_id for w in router.view.candidates().decode] == ["d-ok"]
        assert router.view.in_flight("d-ok") == router.view.in_flight("d-dead") == 0
    assert p.releases == [] and len(ok.generations) == 1


async def test_unreachable_decode_worker_alone_fails_and_releases_prefill_blocks() -> None:
    from pdserve.errors import WorkerUnreachableError

    dead = record("d-dead", "decode", "http://127.0.0.1:1")
    p = prefill()
    async with make_router(p, extra_records=[dead]) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        with pytest.raises(WorkerUnreachableError):
            async for _ in txn.events():
                pass
    assert [r.request_id for r in p.releases] == ["r1"]
