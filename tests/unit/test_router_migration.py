"""Mid-stream migration, lost leases and waiting for a worker, against scripted workers
(in-process ASGI, no sockets). The engine side of a resumed request (exact continuation) is
tests/integration/test_engine_migration.py; real processes: tests/chaos/."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import NoWorkerError, QueueFullError, TransferError, WorkerError
from pdserve.protocol import SamplingParams, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.view import WorkerView
from tests.support.fakes import MODEL, PROMPT, FakeWatcher, make_router, record
from tests.support.fakes import decode_worker as decode
from tests.support.fakes import prefill_worker as prefill


def migrations(router: Router) -> dict[tuple[str, str], float]:
    """``pdserve_router_migrations_total`` by (leg, reason)."""
    assert router.metrics is not None
    out = {}
    for line in router.metrics.render().decode().splitlines():
        if line.startswith("pdserve_router_migrations_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(kv.split("=") for kv in key[key.index("{") + 1 : -1].split(","))
            out[(labels["leg"].strip('"'), labels["reason"].strip('"'))] = float(value)
    return out


async def collect(router: Router, **sampling):
    txn = await router.start("r1", PROMPT, SamplingParams(**sampling))
    return txn, [e async for e in txn.events()]


async def test_an_error_mid_stream_continues_on_another_decode_worker():
    p = prefill()
    bad = decode("d-bad", fail_after=2)
    good = decode("d-good", load=WorkerLoad(running=5))  # more loaded: not the first choice
    async with make_router(p, bad, good) as router:
        txn, events = await collect(router)
    assert "".join(e.text for e in events) == "Hi!\n"  # nothing repeated, nothing missing
    assert [t for e in events for t in e.token_ids] == [72, 105, 33, 10]
    (resumed,) = good.generations
    assert resumed.handle is None and resumed.first_token is None
    assert resumed.resume is not None
    choice = resumed.resume[0]
    assert (choice.index, choice.token_ids, choice.text_chars) == (0, (72, 105, 33), 3)
    assert txn.migrations == 1 and txn.route.worker.worker_id == "d-good"
    assert [r.request_id for r in p.releases] == ["r1"]  # D-bad may never have pulled
    assert router.view.in_flight("d-good") == 0
    assert migrations(router) == {("decode", "worker_error"): 1.0}


async def test_migrations_stop_at_the_limit():
    p = prefill()
    workers = [decode(f"d{i}", fail_after=0) for i in range(3)]
    async with make_router(p, *workers, migration_limit=1) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        with pytest.raises(WorkerError, match="failed the request"):
            async for _ in txn.events():
                pass
    assert sum(len(w.generations) for w in workers) == 2  # the leg and one migration
    assert txn.migrations == 1


async def test_a_decode_worker_that_leaves_discovery_mid_stream_is_given_up():
    """A stopped worker keeps its connection open; its lost registration is what tells."""
    watcher = FakeWatcher()
    p = prefill()
    stuck = decode("d-stuck", token_delay_s=30.0)  # streams nothing for 30 s
    good = decode("d-good", load=WorkerLoad(running=5))
    async with make_router(p, stuck, good, watcher=watcher) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        events = txn.events()
        first = await anext(events)
        rest = asyncio.ensure_future(_drain(events))
        await asyncio.sleep(0.2)  # the decode leg is open on d-stuck, waiting
        assert not rest.done() and stuck.generations
        watcher.remove("d-stuck")  # its registration lease expired
        texts = await asyncio.wait_for(rest, 5.0)
    assert first.text + "".join(texts) == "Hi!\n"
    assert txn.migrations == 1 and good.generations[0].resume is not None
    assert migrations(router) == {("decode", "lease_lost"): 1.0}
    assert stuck.aborted == ["r1"]  # the router closed the stuck stream


async def _drain(events) -> list[str]:
    return [e.text async for e in events]


async def test_a_request_waits_for_a_worker_to_register():
    watcher = FakeWatcher()
    d = decode("d0")
    async with make_router(d, watcher=watcher, worker_wait_s=5.0) as router:
        watcher.remove("d0")  # restarting: served in-process, but not registered
        start = asyncio.ensure_future(collect(router))
        await asyncio.sleep(0.2)
        assert not start.done()  # held, not refused
        assert b"pdserve_router_waiting_for_worker 1.0" in router.metrics.render()
        watcher.put(d.record())
        txn, events = await asyncio.wait_for(start, 5.0)
    assert "".join(e.text for e in events) == "Hi!\n"


async def test_waiting_is_bounded_in_time_and_in_requests():
    async with make_router(worker_wait_s=0.3) as router:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(NoWorkerError):
            await router.start("r1", PROMPT, SamplingParams())
        assert 0.25 < loop.time() - t0 < 2.0
    async with make_router(worker_wait_s=5.0) as router:
        router.settings = router.settings.model_copy(update={"worker_wait_max_requests": 1})
        held = asyncio.ensure_future(router.start("r1", PROMPT, SamplingParams()))
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFullError, match="wait for a worker"):
            await router.start("r2", PROMPT, SamplingParams())
        held.cancel()


async def test_a_prefill_worker_lost_mid_prefill_is_left_for_a_local_prefill():
    watcher = FakeWatcher()
    stuck = prefill(context_delay_s=30.0)
    d = decode()
    async with make_router(stuck, d, watcher=watcher, timeout_s=20.0) as router:
        start = asyncio.ensure_future(collect(router))
        await asyncio.sleep(0.2)
        assert stuck.contexts and not start.done()
        watcher.remove("p0")
        txn, events = await asyncio.wait_for(start, 5.0)
    assert "".join(e.text for e in events) == "Hi!\n"
    assert txn.route.path == "local_prefill" and d.generations[0].handle is None
    assert migrations(router) == {("prefill", "lease_lost"): 1.0}


async def test_a_failed_pull_is_recomputed_on_the_same_decode_worker():
    """The prefill worker died under the pull: the decode worker is not at fault, so the only
    one takes the request again, without a handle."""
    p = prefill()
    d = decode(handle_error=TransferError("prefill worker gone", code="kv_transfer_failed"))
    async with make_router(p, d) as router:
        txn, events = await collect(router)
    assert "".join(e.text for e in events) == "Hi!\n"
    assert [g.handle is not None for g in d.generations] == [True, False]
    # the second leg on the same worker runs under its own id: the worker may still hold the
    # first leg (it frees it only once it notices the closed stream)
    assert [g.request_id for g in d.generations] == ["r1", "r1~m1"]
    assert d.generations[1].resume is not None
    assert d.generations[1].resume[0].token_ids == (72,)
    assert migrations(router) == {("decode", "transfer"): 1.0}


async def test_watch_loss_fires_once_per_incarnation_on_delete_or_a_higher_epoch():
    watcher = FakeWatcher()
    view = WorkerView(watcher, served_model_name=MODEL)
    view.follow(watcher)
    d = record("d0", "decode")
    watcher.put(d)
    seen: list[str] = []
    view.watch_loss(d, seen.append)
    stop = view.watch_loss(d, lambda why: seen.append("stopped watch: " + why))
    stop()
    stop()  # idempotent
    watcher.put(d.model_copy(update={"load": WorkerLoad(running=1)}))  # same epoch: no loss
    assert seen == []
    watcher.put(d.model_copy(update={"epoch": d.epoch + 1}))  # restarted
    assert len(seen) == 1 and "d0 left discovery: it restarted" in seen[0]
    later = watcher.workers()["d0"]
    view.watch_loss(later, seen.append)
    watcher.remove("d0")
    assert len(seen) == 2 and "registration expired" in seen[1]
    watcher.remove("d0")
    assert len(seen) == 2
