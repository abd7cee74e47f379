"""The worker apps of the three roles, in this process on fakes: the deterministic engine
(tests/support/fake_engine.py), the in-process transfer backend and a registration that keeps the
record in memory. Each role serves its own routes and 404s the others'; a prefill -> decode
request moves the blocks and frees the park; admission answers 429 when the decode pool stays
full; parked blocks are freed on release, on lease expiry and when the decode side fails; a
failed pull's blocks are quarantined only while a write may still land."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from pdserve.config.loading import EngineConfig, WorkerConfig
from pdserve.config.settings import (
    KVCacheSettings,
    SchedulerSettings,
    TransferSettings,
    WorkerSettings,
)
from pdserve.discovery import RegistrationState
from pdserve.errors import TransferError
from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    GenerationRequest,
    Role,
    SamplingParams,
    TransferHandle,
    WorkerRecord,
)
from pdserve.security import ClusterKey
from pdserve.transfer.agents.inproc import FABRIC
from pdserve.workers.roles.decode import DecodeHandler
from pdserve.workers.roles.worker_app import create_worker_app
from tests.support.fake_engine import FakeEngine, token_at
from tests.support.fakes import CLUSTER_KEY, INTERNAL_AUTH, layout
from tests.support.servers import wait_until
from tests.support.transfer import backend_cfg

pytestmark = pytest.mark.timeout(30)

LAYOUT = layout(tokens_per_block=4)
PROMPT = (1, 2, 3, 4, 5, 6)


LISTED: dict[str, WorkerRecord] = {}
"""What the in-memory "discovery" lists: the newest record of every worker registered."""


class MemoryWatcher:
    """A decode worker's view of :data:`LISTED` (the Watcher interface it uses)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def workers(self) -> dict[str, WorkerRecord]:
        return dict(LISTED)


@dataclass
class MemoryRegistration:
    """A registration that keeps the record in memory (``state`` as the real ones report)."""

    records: list[WorkerRecord] = field(default_factory=list)
    state: RegistrationState = RegistrationState.IDLE

    async def start(self, record: WorkerRecord) -> None:
        self.records.append(record)
        LISTED[record.worker_id] = record
        self.state = RegistrationState.REGISTERED

    async def update(self, record: WorkerRecord) -> None:
        self.records.append(record)
        LISTED[record.worker_id] = record

    async def close(self) -> None:
        self.state = RegistrationState.CLOSED


def worker_cfg(role: Role, *, lease_s: float = 30.0, timeout_s: float = 2.0) -> WorkerConfig:
    """A worker config for the fake engine (which reads none of the engine section)."""
    return WorkerConfig(
        role=role,
        engine=EngineConfig(
            model_path=Path("/nonexistent"),
            served_model_name="tiny-test",
            kv_cache=KVCacheSettings(lease_s=lease_s),
            scheduler=SchedulerSettings(max_queued_requests=4),
        ),
        transfer=backend_cfg("inproc", timeout_s=timeout_s),
        worker=WorkerSettings(worker_id=f"{role.value}-0"),
        control_plane="memory://",
    )


@dataclass
class Running:
    app: FastAPI
    client: httpx.AsyncClient
    engine: FakeEngine
    registration: MemoryRegistration

    @property
    def worker(self) -> Any:
        return self.app.state.worker


@asynccontextmanager
async def running(role: Role, num_blocks: int = 32, **kw: Any) -> AsyncIterator[Running]:
    engine = FakeEngine(LAYOUT, num_blocks=num_blocks)
    registration = MemoryRegistration()
    app = create_worker_app(
        worker_cfg(role, **kw),
        http_url=f"http://{role.value}.test",
        cluster_key=CLUSTER_KEY,
        engine_factory=lambda _cfg: engine,
        registration_factory=lambda _cfg, _id: registration,  # type: ignore[arg-type,return-value]
        watcher_factory=lambda _cfg, _id: MemoryWatcher(),  # type: ignore[arg-type,return-value]
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://w", headers=INTERNAL_AUTH
        ) as client:
            yield Running(app, client, engine, registration)
    assert engine.stopped and registration.state is RegistrationState.CLOSED


def context_body(rid: str = "r1", max_tokens: int = 4) -> dict[str, Any]:
    return ContextRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens),
        deadline=time.time() + 20,
    ).model_dump(mode="json")


def generation_body(ctx: ContextResponse, max_tokens: int = 4) -> dict[str, Any]:
    return GenerationRequest(
        request_id=ctx.request_id,
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens),
        first_token=ctx.first_token,
        handle=ctx.handle,
        deadline=time.time() + 20,
    ).model_dump(mode="json")


async def _context(prefill: Running, rid: str = "r1") -> ContextResponse:
    r = await prefill.client.post("/internal/context", json=context_body(rid))
    assert r.status_code == 200, r.text
    return ContextResponse.model_validate(r.json())


# --- routes per role -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "missing"),
    [
        (Role.PREFILL, ["/internal/generate"]),
        (Role.DECODE, ["/internal/context", "/internal/release"]),
        (Role.COLOCATED, ["/internal/context", "/internal/release"]),
    ],
)
async def test_each_role_serves_only_its_own_routes(role: Role, missing: list[str]) -> None:
    async with running(role) as w:
        for path in missing:
            r = await w.client.post(path, json={})
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
        health = (await w.client.get("/health")).json()
        assert health["role"] == role.value and health["worker_id"] == f"{role.value}-0"
        assert (await w.client.get("/ready")).status_code == 200
        assert (await w.client.get("/load")).json()["total_blocks"] == 32
        assert b"pdserve" in (await w.client.get("/metrics")).content
        record = w.registration.records[0]
        assert record.role is role and record.layout == LAYOUT
        assert "endpoint" in record.communicator  # every role lends prefix blocks
        lend = await w.client.post("/internal/kv/lend", json={})
        assert lend.status_code == 400, lend.text  # the route exists and checks its body


async def test_a_malformed_worker_request_is_a_400_naming_the_field() -> None:
    async with running(Role.PREFILL) as w:
        r = await w.client.post("/internal/context", json={"request_id": "r1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids"


async def test_internal_routes_need_the_cluster_token_and_the_probes_do_not() -> None:
    other = ClusterKey(b"another-deployment-secret-0123456789abcdef")
    async with running(Role.PREFILL) as p, running(Role.DECODE) as d:
        ctx = await _context(p)  # with the token: r1 runs and parks
        assert ctx.handle is not None and p.worker.parked_count() == 1
        release = {"request_id": "r1", "epoch": ctx.handle.epoch, "lease_id": ctx.handle.lease_id}
        calls = [
            (p, "/internal/context", context_body("r2")),
            (p, "/internal/release", release),
            (d, "/internal/generate", generation_body(ctx)),
        ]
        for w, path, body in calls:
            transport = httpx.ASGITransport(app=w.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as bare:
                for headers in (
                    {},  # no Authorization at all
                    other.http_headers(),  # another deployment's token
                    {"Authorization": f"Basic {CLUSTER_KEY.http_token}"},  # not a bearer
                    {"Authorization": "Bearer "},
                ):
                    r = await bare.post(path, json=body, headers=headers)
                    assert r.status_code == 401, (path, headers, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"
                    error = r.json()["error"]
                    assert error["code"] == "unauthorized" and path in error["message"]
                    assert error["request_id"] == r.headers["x-request-id"]
                    assert CLUSTER_KEY.http_token not in r.text
                for probe in ("/health", "/ready", "/load", "/metrics"):
                    assert (await bare.get(probe)).status_code == 200, probe
        # Nothing reached an engine: r1 still parked, r2 never ran, d pulled nothing.
        assert [req.request_id for req in p.engine.requests] == ["r1"]
        assert p.worker.parked_count() == 1 and p.engine.freed_parked == []
        assert d.engine.requests == []


# --- the two legs ----------------------------------------------------------------------------


async def _chunks(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines() if line]


async def test_prefill_then_decode_moves_the_blocks_and_frees_the_park() -> None:
    async with running(Role.PREFILL) as p, running(Role.DECODE) as d:
        ctx = await _context(p)
        assert ctx.handle is not None and ctx.first_token == token_at(PROMPT, 0)
        assert p.worker.parked_count() == 1
        r = await d.client.post("/internal/generate", json=generation_body(ctx))
        assert r.status_code == 200, r.text
        chunks = await _chunks(r)
        assert [c["token_ids"][0] for c in chunks] == [token_at(PROMPT, i) for i in (1, 2, 3)]
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["error"] is None
        await _until(lambda: p.worker.parked_count() == 0)
        assert p.engine.freed_parked == ["r1"]
        assert d.engine.kv_cache.get_num_free_blocks() == 32


async def test_colocated_runs_the_whole_request_and_refuses_a_handle() -> None:
    async with running(Role.PREFILL) as p, running(Role.COLOCATED) as c:
        plain = GenerationRequest(
            request_id="c1",
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(max_tokens=3),
            deadline=time.time() + 20,
        )
        r = await c.client.post("/internal/generate", json=plain.model_dump(mode="json"))
        assert [ch["token_ids"][0] for ch in await _chunks(r)] == [
            token_at(PROMPT, i) for i in range(3)
        ]
        ctx = await _context(p)
        r = await c.client.post("/internal/generate", json=generation_body(ctx))
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_handle_invalid"


# --- admission -------------------------------------------------------------------------------


async def test_a_decode_pool_that_stays_full_answers_429_before_the_lease_runs_out() -> None:
    async with running(Role.PREFILL, lease_s=1.3) as p, running(Role.DECODE, num_blocks=4) as d:
        ctx = await _context(p)
        d.engine.fill(4)
        t0 = time.monotonic()
        r = await d.client.post("/internal/generate", json=generation_body(ctx))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert time.monotonic() - t0 < 1.3
        assert d.worker.handler.waiting_for_blocks == 0 and d.engine.reserved_ids == set()


# --- release ---------------------------------------------------------------------------------


async def test_release_frees_the_parked_blocks_once_and_only_for_this_epoch() -> None:
    async with running(Role.PREFILL) as p:
        ctx = await _context(p)
        assert ctx.handle is not None
        body = {"request_id": "r1", "epoch": ctx.handle.epoch, "lease_id": ctx.handle.lease_id}
        stale = {**body, "epoch": ctx.handle.epoch - 1}
        assert (await p.client.post("/internal/release", json=stale)).json() == {"released": False}
        forged = {**body, "lease_id": "0" * 32}
        assert (await p.client.post("/internal/release", json=forged)).json() == {"released": False}
        lease_less = {"request_id": "r1", "epoch": ctx.handle.epoch}
        refused = await p.client.post("/internal/release", json=lease_less)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lease_id"
        assert p.worker.parked_count() == 1
        assert (await p.client.post("/internal/release", json=body)).json() == {"released": True}
        assert (await p.client.post("/internal/release", json=body)).json() == {"released": False}
        assert p.engine.freed_parked == ["r1"] and p.worker.parked_count() == 0


async def test_a_router_that_left_before_the_handle_came_gets_the_blocks_freed() -> None:
    """The router gave up on the prefill leg (deadline, client gone) and will never learn the
    lease id that a release needs: the worker sees the closed connection and frees the park."""
    async with running(Role.PREFILL) as p:
        inbox = [{"type": "http.request", "body": json.dumps(context_body()).encode()}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return inbox.pop(0) if inbox else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in INTERNAL_AUTH.items()]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/internal/context", "raw_path": b"/internal/context",
            "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("w", 80),
        }  # fmt: skip
        await p.app(scope, receive, send)
        assert sent and sent[0]["status"] == 200, sent
        assert p.worker.parked_count() == 0 and p.engine.freed_parked == ["r1"]


async def test_an_expired_lease_frees_the_parked_blocks() -> None:
    async with running(Role.PREFILL, lease_s=0.2, timeout_s=0.1) as p:
        await _context(p)
        p.worker.parked.start(interval_s=0.05)  # the reaper, sooner than its default
        await _until(lambda: p.worker.parked_count() == 0, timeout=5)
        assert p.engine.freed_parked == ["r1"] and p.worker.leases_expired() == 1


async def test_a_decode_side_that_fails_mid_pull_frees_its_blocks_and_the_lease_frees_the_park():
    async with (
        running(Role.PREFILL, lease_s=1.5, timeout_s=0.3) as p,
        running(Role.DECODE, timeout_s=0.3) as d,
    ):
        ctx = await _context(p)
        p.worker.parked.start(interval_s=0.05)
        p.worker.parked.send_grace_s = 0.2  # transfer timeout + 5 s in production
        FABRIC.paused = True  # the copy never happens: the pull times out
        try:
            r = await d.client.post("/internal/generate", json=generation_body(ctx))
        finally:
            FABRIC.paused = False
        assert r.status_code == 502 and "timed out" in r.json()["error"]["message"]
        assert d.engine.unreserved == ["r1"], "inproc writes nothing late: freed at once"
        assert d.worker.handler.quarantined == 0
        await _until(lambda: p.worker.parked_count() == 0, timeout=5)
        assert p.engine.freed_parked == ["r1"]


# --- quarantine ------------------------------------------------------------------------------


@dataclass
class LateWritingTransceiver:
    """A backend whose failed pull may still land (NIXL, UCX): its blocks must wait."""

    late_writes: bool = True

    async def pull(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> None:
        raise TransferError("transfer peer p:1 lost while receiving")


async def test_a_failed_pull_that_may_still_land_is_quarantined_then_freed() -> None:
    engine = FakeEngine(LAYOUT)
    role = DecodeHandler(
        engine=engine,
        transceiver=LateWritingTransceiver(),  # type: ignore[arg-type]
        transfer=TransferSettings(timeout_s=0.2),  # the quarantine
    )
    async with running(Role.PREFILL) as p:
        ctx = await _context(p)
        with pytest.raises(TransferError, match="lost while receiving"):
            await role.admit(GenerationRequest.model_validate(generation_body(ctx)))
    assert role.quarantined == 1 and engine.reserved_ids == {"r1"}, "held while a write may land"
    await _until(lambda: role.quarantined == 0)
    assert engine.unreserved == ["r1"] and engine.kv_cache.get_num_free_blocks() == 32


async def _until(cond, timeout: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    await wait_until(cond, timeout, interval_s=0.01)


async def test_a_callers_deadline_is_capped_by_the_workers_own_maximum() -> None:
    from pdserve.workers.roles.kv_transfer import capped

    far = ContextRequest.model_validate({**context_body(), "deadline": time.time() + 10**9})
    cut = capped(far, 60.0)
    assert cut.deadline <= time.time() + 60.0 and cut.request_id == far.request_id
    near = ContextRequest.model_validate(context_body())  # 20 s: within the cap, kept as sent
    assert capped(near, 60.0) is near


async def test_a_forged_handle_pointing_elsewhere_is_refused_without_a_connection() -> None:
    """The handle's endpoint is an address from a request: the decode worker dials only the
    endpoint discovery lists for that prefill worker, so a handle redirected to another address
    is refused, and that address never sees a connection."""
    import socket

    lure = socket.create_server(("127.0.0.1", 0))
    lure.setblocking(False)
    try:
        async with running(Role.PREFILL) as p, running(Role.DECODE) as d:
            ctx = await _context(p)
            assert ctx.handle is not None
            port = lure.getsockname()[1]
            forged = ctx.model_copy(
                update={
                    "handle": ctx.handle.model_copy(
                        update={"transfer_endpoint": f"127.0.0.1:{port}"}
                    )
                }
            )
            r = await d.client.post("/internal/generate", json=generation_body(forged))
            assert r.status_code == 502 and r.json()["error"]["code"] == "kv_handle_invalid"
            assert "not the one discovery lists" in r.json()["error"]["message"]
            with pytest.raises(BlockingIOError):
                lure.accept()  # nobody connected
            assert d.engine.reserved_ids == set() and p.worker.parked_count() == 1
    finally:
        lure.close()
