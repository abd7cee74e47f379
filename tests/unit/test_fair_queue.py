"""The router's fair queue (issue 42, item 3; router/admission.py): deficit round robin by
tenant weight while the workers are saturated, priorities within a tenant, per-tenant caps and
the longest wait (429 with Retry-After), a waiter whose client left is skipped; API key entries
name tenants; the guard hands the tenant to the app, and a flooding tenant's queue does not hold
back another tenant's request."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.config.settings import SchedulerSettings, SecuritySettings
from pdserve.errors import ConfigError
from pdserve.router.admission import (
    DEFAULT_REQUESTS_PER_WORKER,
    FairQueue,
    QueueTimeoutError,
    TenantQueueFullError,
    Ticket,
)
from pdserve.security import DEFAULT_TENANT, APIKeys, Tenant, load_api_keys, parse_key_entry

FAR = time.time() + 3600


class Slots:
    """A worker pool of ``n`` slots that the tickets fill (what ``room()`` would see)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.used = 0

    def room(self, needs_prefill: bool = False) -> int:
        return self.n - self.used


async def _take(q: FairQueue, slots: Slots, tenant: Tenant, priority: int = 0) -> Ticket:
    ticket = await q.admit(tenant, priority, FAR)
    ticket.routed()
    slots.used += 1
    return ticket


def _free(slots: Slots, ticket: Ticket) -> None:
    slots.used -= 1
    ticket.release()


async def test_saturated_workers_serve_tenants_by_weight_and_priority() -> None:
    slots = Slots(1)
    q = FairQueue(slots.room, max_queued=100, max_wait_s=30)
    a, b = Tenant("a", weight=2.0), Tenant("b", weight=1.0)
    first = await _take(q, slots, a)  # room: admitted at once
    order: list[str] = []

    async def wait(tenant: Tenant, label: str, priority: int = 0) -> None:
        ticket = await _take(q, slots, tenant, priority)
        order.append(label)
        await asyncio.sleep(0)
        _free(slots, ticket)

    # a floods with 6 requests before b's 3 arrive; b's third is urgent (lower priority value)
    tasks = [asyncio.create_task(wait(a, f"a{i}")) for i in range(6)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(wait(b, f"b{i}", priority=-5 if i == 2 else 0)) for i in range(3)]
    await asyncio.sleep(0)
    assert q.waiting("a") == 6 and q.waiting("b") == 3 and q.waiting() == 9
    _free(slots, first)
    await asyncio.gather(*tasks)
    # 2:1 while both wait, b's urgent one first among b's, then a alone
    assert order == ["a0", "a1", "b2", "a2", "a3", "b0", "a4", "a5", "b1"]


async def test_a_request_that_needs_no_prefill_worker_passes_a_blocked_flood() -> None:
    """Long prompts wait for a prefill worker with room; a short one, which a decode worker
    prefills itself, goes ahead while decode workers have room, whatever the tenant."""
    room = {True: 1, False: 3}
    q = FairQueue(lambda needs_prefill: room[needs_prefill], max_queued=10, max_wait_s=30)
    (await q.admit(Tenant("a"), 0, FAR, True)).routed()  # a's first long prompt, in prefill
    room = {True: 0, False: 3}  # the prefill workers are full, the decode workers are not
    long_a = [asyncio.create_task(q.admit(Tenant("a"), 0, FAR, True)) for _ in range(3)]
    await asyncio.sleep(0)
    assert q.waiting("a") == 3
    short_a = await asyncio.wait_for(q.admit(Tenant("a"), 5, FAR, False), 5)
    short_b = await asyncio.wait_for(q.admit(Tenant("b"), 0, FAR, False), 5)
    short_a.routed(), short_b.routed()
    room[False] = 1  # the two short ones now count in the decode workers' load
    assert q.waiting("a") == 3 and not any(t.done() for t in long_a)
    room[True] = 1  # a prefill worker has room: the oldest long prompt goes
    q.pump()
    await asyncio.wait_for(long_a[0], 5)
    assert not long_a[1].done() and not long_a[2].done()
    for t in long_a[1:]:
        t.cancel()


async def test_a_tenant_with_no_prefill_in_flight_passes_a_flood_s_full_prefill_workers() -> None:
    """a's flood fills the prefill workers; b, with none of its requests in prefill, sends one
    long prompt past the cap (the prefill worker's scheduler then gives its chunks the turn);
    b's second waits until the first leaves its prefill leg, a's waiters meanwhile stay."""
    room = {True: 2, False: 10}
    q = FairQueue(lambda needs_prefill: room[needs_prefill], max_queued=10, max_wait_s=30)
    for _ in range(2):
        (await q.admit(Tenant("a"), 0, FAR, True)).routed()
    room[True] = 0  # a's two prefills fill the prefill worker
    more_a = asyncio.create_task(q.admit(Tenant("a"), 0, FAR, True))
    await asyncio.sleep(0)
    first_b = await asyncio.wait_for(q.admit(Tenant("b"), 0, FAR, True), 5)
    first_b.routed()
    second_b = asyncio.create_task(q.admit(Tenant("b"), 0, FAR, True))
    await asyncio.sleep(0)
    assert not more_a.done() and not second_b.done()
    first_b.prefill_done()  # its first token is out: b has no prefill in flight again
    await asyncio.wait_for(second_b, 5)
    assert not more_a.done()
    more_a.cancel()


async def test_the_caps_and_the_longest_wait_answer_429() -> None:
    slots = Slots(0)  # saturated throughout
    q = FairQueue(slots.room, max_queued=1, max_wait_s=0.2)
    waiter = asyncio.create_task(q.admit(Tenant("a"), 0, FAR))
    await asyncio.sleep(0)
    with pytest.raises(TenantQueueFullError, match="tenant 'a' has 1 requests waiting") as full:
        await q.admit(Tenant("a"), 0, FAR)
    assert full.value.status == 429 and full.value.retry_after_s >= 1
    roomy = asyncio.create_task(q.admit(Tenant("b", max_queued=5), 0, FAR))  # another tenant
    with pytest.raises(QueueTimeoutError, match="router.max_queue_wait_s 0.2"):
        await waiter
    with pytest.raises(QueueTimeoutError):
        await roomy
    assert q.waiting() == 0


async def test_a_waiter_whose_client_left_is_skipped() -> None:
    slots = Slots(1)
    q = FairQueue(slots.room, max_queued=10, max_wait_s=30)
    held = await _take(q, slots, Tenant("a"))
    gone = asyncio.create_task(q.admit(Tenant("a"), 0, FAR))
    stays = asyncio.create_task(_take(q, slots, Tenant("a")))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    _free(slots, held)
    ticket = await asyncio.wait_for(stays, 5)
    assert gone.cancelled() and q.pending == 0 and q.waiting() == 0
    _free(slots, ticket)


async def test_nothing_waits_while_a_worker_has_room() -> None:
    slots = Slots(2)
    q = FairQueue(slots.room, max_queued=0, max_wait_s=30)  # a cap of 0: waiting is refused
    t1 = await q.admit(Tenant(), 0, FAR)
    t2 = await q.admit(Tenant(), 0, FAR)  # two grants pending: no worker shows them yet
    assert q.pending == 2
    with pytest.raises(TenantQueueFullError):  # the promised slots count against the room
        await q.admit(Tenant(), 0, FAR)
    t1.release()
    t1.release()  # idempotent
    t2.routed()
    assert q.pending == 0


def test_key_entries_name_tenants() -> None:
    assert parse_key_entry("sk-1") == ("sk-1", Tenant())
    key, tenant = parse_key_entry("sk-2 tenant=team-a weight=2.5 max_queued=7")
    assert key == "sk-2" and tenant == Tenant("team-a", 2.5, 7)
    for bad in ("sk tenant=a b", "sk weight=0", "sk weight=x", "sk max_queued=-1", "sk color=red",
                "sk tenant=a tenant=b", "sk tenant=" + "x" * 65):  # fmt: skip
        with pytest.raises(ConfigError, match="of a key entry"):
            parse_key_entry(bad)
    keys = APIKeys(["sk-a1 tenant=a weight=2", "sk-a2 tenant=a weight=2", "sk-b tenant=b", "sk-c"])
    assert keys.names_tenants and sorted(keys.tenants) == ["a", "b", DEFAULT_TENANT]
    assert keys.tenant_of("Bearer sk-a2") == Tenant("a", 2.0)
    assert keys.tenant_of("Bearer sk-c") == Tenant()
    assert keys.tenant_of("Bearer sk-a2 tenant=a") is None  # the fields are not the key
    assert keys.check("Bearer sk-b") and not keys.check("Bearer nope")
    assert not APIKeys(["sk-1", "sk-2"]).names_tenants
    assert APIKeys([]).tenant_of(None) == Tenant()
    with pytest.raises(ConfigError, match="tenant 'a' is named with different weights"):
        APIKeys(["k1 tenant=a weight=1", "k2 tenant=a weight=2"])


def test_the_key_file_holds_entries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "keys"
    file.write_text("sk-a tenant=a weight=3\n\nsk-b tenant=b max_queued=2\n")
    keys = APIKeys(load_api_keys(SecuritySettings(api_key_file=file)))
    assert keys.tenant_of("Bearer sk-b") == Tenant("b", 1.0, 2)


def test_the_default_per_worker_limit_is_the_engine_batch() -> None:
    assert SchedulerSettings().max_num_seqs == DEFAULT_REQUESTS_PER_WORKER


# -- through the router app ----------------------------------------------------------------------


async def test_a_flooding_tenant_does_not_hold_back_another(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.config.loading import RouterConfig
    from pdserve.protocol import Role
    from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

    model_dir = build_tokenizer_dir(tmp_path / "tok", max_position_embeddings=128)
    keys = ["sk-a tenant=a max_queued=4", "sk-b tenant=b"]
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL,
                       security=SecuritySettings(api_keys=keys))  # fmt: skip
    router = cfg.router.model_copy(update={"max_requests_per_worker": 1,
                                           "local_prefill_max_tokens": 100})  # fmt: skip
    cfg = cfg.model_copy(update={"router": router})
    reply = [(100 + i, f"t{i}") for i in range(4)]
    worker = FakeWorker("d0", Role.DECODE, reply, token_delay_s=0.05)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    done: list[str] = []
    async with router_harness(cfg, [worker]) as h:

        async def send(key: str, label: str) -> int:
            auth = {"Authorization": f"Bearer {key}"}
            r = await h.client.post("/v1/completions", json=body, headers=auth)
            done.append(label)
            return r.status_code

        flood = [asyncio.create_task(send("sk-a", f"a{i}")) for i in range(5)]

        async def queued(tenant: str) -> float:
            text = (await h.client.get("/metrics")).text
            line = f'pdserve_router_tenant_queued{{tenant="{tenant}"}} '
            return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0)

        for _ in range(500):  # until a's other four wait behind its first
            if await queued("a") == 4:
                break
            await asyncio.sleep(0.01)
        late = asyncio.create_task(send("sk-b", "b0"))
        over = await send("sk-a", "a-over")  # a's fifth waiter: past its max_queued of 4
        statuses = await asyncio.gather(*flood, late)
        metrics = (await h.client.get("/metrics")).text
    assert over == 429 and statuses == [200] * 6
    # b's one request went in right after a's next one, not behind all of a's
    served = [label for label in done if label != "a-over"]  # a's reach the queue in any order
    assert served.index("b0") == 2, done  # a's running one, a's next (DRR: a was first), b
    assert 'pdserve_router_tenant_rejected_total{tenant="a"} 1.0' in metrics
    assert 'pdserve_router_tenant_admitted_total{tenant="b"} 1.0' in metrics
    assert 'pdserve_router_tenant_time_to_first_token_seconds_count{tenant="a"} 5.0' in metrics
    # every leg carries its tenant's share, by which the worker's scheduler orders chunks
    shares = sorted({(g.sampling.share.tenant, g.sampling.share.weight)
                     for g in worker.generations if g.sampling.share is not None})  # fmt: skip
    assert shares == [("a", 1.0), ("b", 1.0)] and len(worker.generations) == 6
    assert all(g.sampling.share is not None for g in worker.generations)


async def test_a_queued_request_whose_client_leaves_leaves_the_queue(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from pdserve.config.loading import RouterConfig
    from pdserve.protocol import Role
    from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

    model_dir = build_tokenizer_dir(tmp_path / "tok", max_position_embeddings=128)
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    router = cfg.router.model_copy(update={"max_requests_per_worker": 1,
                                           "local_prefill_max_tokens": 100})  # fmt: skip
    cfg = cfg.model_copy(update={"router": router})
    # the first request holds the only slot for 4 s: the leaving one's disconnect is seen
    # (every 0.5 s) long before that slot frees
    worker = FakeWorker("d0", Role.DECODE, [(100 + i, f"t{i}") for i in range(8)],
                        token_delay_s=0.5)  # fmt: skip
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    async with router_harness(cfg, [worker], real_sockets=True) as h:

        async def queued() -> float:
            text = (await h.client.get("/metrics")).text
            line = 'pdserve_router_tenant_queued{tenant="default"} '
            return next((float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)), 0)

        first = asyncio.create_task(h.client.post("/v1/completions", json=body))
        # the first holds the slot before the other is sent (else either may be the one queued)
        for _ in range(500):
            if worker.generations:
                break
            await asyncio.sleep(0.01)
        assert len(worker.generations) == 1
        async with httpx.AsyncClient(base_url=h.url, trust_env=False) as other:
            leaving = asyncio.create_task(other.post("/v1/completions", json=body))
            for _ in range(500):
                if await queued() == 1:
                    break
                await asyncio.sleep(0.01)
            assert await queued() == 1
            leaving.cancel()  # the client gives up: its connection closes
        for _ in range(500):
            if await queued() == 0:
                break
            await asyncio.sleep(0.01)
        assert await queued() == 0
        assert not first.done()  # so the queue emptied because the client left, not by a grant
        served = await first
        assert served.status_code == 200
        # the one that left never reached the worker: every leg there is the first's (a leg of
        # it may be migrated, "<id>~m1", on a loaded machine)
        legs = {g.request_id.split("~")[0] for g in worker.generations}
        assert legs == {served.headers["x-request-id"]}, worker.generations


async def test_a_requests_resource_is_the_policys_path() -> None:
    from tests.support.fakes import decode_worker, make_router, prefill_worker

    async with make_router(prefill_worker(), decode_worker()) as router:  # local prefill off
        assert router.needs_prefill([1, 2, 3], None)
    async with make_router(decode_worker()) as router:  # no prefill worker: local prefill
        assert not router.needs_prefill([1, 2, 3], None)
    async with make_router() as router:  # no worker at all: the wait for one answers
        assert not router.needs_prefill([1, 2, 3], None)
