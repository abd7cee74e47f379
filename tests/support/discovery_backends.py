"""One harness per discovery backend, so a single contract suite runs against all three.

Each :class:`Backend` owns a real server (the router's embedded registry on uvicorn, etcd or
nats-server from the venv), a started router-side watcher, and the operations the contract
needs: read the stored record with a separate client, remove a record behind the worker's back,
lose the server's state, (etcd / NATS) stop and start the server for an outage, and write a
record straight into the store the way a peer with write access but without the cluster secret
could (:meth:`Backend.write_forged`).

Timing constants are per backend: etcd and NATS TTLs are whole seconds (``ceil(ttl_s)``) and
their expiry is reported with a delay, so they get a longer TTL and slack than the embedded
registry.
"""

from __future__ import annotations

import abc

import httpx

from pdserve.discovery import (
    EmbeddedRegistry,
    Registration,
    Watcher,
    open_registration,
    open_watcher,
)
from pdserve.discovery.etcd import EtcdRegistration, EtcdWatcher, worker_key
from pdserve.discovery.http import HttpRegistration
from pdserve.discovery.nats import BUCKET, NatsRegistration
from pdserve.discovery.nats_watcher import NatsWatcher
from pdserve.protocol import Role, WorkerLoad, WorkerRecord
from tests.support.fakes import CLUSTER_KEY, INTERNAL_AUTH, record, registry_app
from tests.support.servers import EtcdServer, NatsServer, UvicornHandle, free_port

WORKER_ID = "decode@host-1:8100.a"
"""A worker id with every character NATS keys and URL paths must escape or accept."""


def make_record(
    worker_id: str = WORKER_ID,
    epoch: int = 1,
    running: int = 0,
    url: str = "http://127.0.0.1:9",
    role: Role = Role.DECODE,
) -> WorkerRecord:
    """A worker record of the tiny test layout (discovery never reads the layout)."""
    return record(worker_id, role, url, epoch=epoch, load=WorkerLoad(running=running))


class Backend(abc.ABC):
    """A discovery backend under test: a running server plus a started watcher."""

    name: str
    ttl_s: float  # registration TTL the tests use
    slack_s: float  # how late an expiry may be reported
    close_within_s: float  # how soon close() must be visible to the watcher
    registration_type: type[Registration]
    watcher: Watcher

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The registration URL workers use."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Open and start :attr:`watcher`."""

    async def aclose(self) -> None:
        await self.watcher.close()

    def following(self) -> bool:
        """Whether the watcher currently follows the server (the embedded one always does)."""
        return True

    def unreachable_url(self) -> str:
        """A URL of this backend's scheme on which nobody listens."""
        return f"{self.url.split('://')[0]}://127.0.0.1:{free_port()}"

    @abc.abstractmethod
    async def stored(self, worker_id: str) -> WorkerRecord | None:
        """The record the server holds, read with a separate client (None when absent)."""

    @abc.abstractmethod
    async def remove_behind_back(self, reg: Registration, worker_id: str) -> None:
        """Remove the record as if it had expired while the worker was cut off."""

    @abc.abstractmethod
    async def lose_state(self) -> None:
        """Restart the server without its state (every record gone)."""

    @abc.abstractmethod
    async def write_forged(self, rec: WorkerRecord) -> None:
        """Write ``rec`` as it is (no signing) with the most direct write access the backend
        offers a peer: etcd / NATS clients, the registry's route with the cluster token."""

    @abc.abstractmethod
    async def erase(self, worker_id: str) -> None:
        """Delete whatever the store holds under ``worker_id`` (cleanup after
        :meth:`write_forged`)."""


class EmbeddedBackend(Backend):
    """The router's embedded registry over real HTTP; the watcher is the router's own."""

    name = "embedded"
    ttl_s = 1.0
    slack_s = 0.6
    close_within_s = 0.0  # the DELETE is answered after the record is gone
    registration_type = HttpRegistration

    def __init__(self) -> None:
        self.registry = EmbeddedRegistry(ttl_s=self.ttl_s, key=CLUSTER_KEY)
        self.handle = UvicornHandle(registry_app(self.registry), free_port())

    @property
    def url(self) -> str:
        return self.handle.base_url

    async def open(self) -> None:
        await self.handle.start()
        self.watcher = open_watcher("embedded", registry=self.registry, key=CLUSTER_KEY)
        await self.watcher.start()

    async def aclose(self) -> None:
        await super().aclose()
        await self.handle.stop()

    async def stored(self, worker_id: str) -> WorkerRecord | None:
        async with httpx.AsyncClient(base_url=self.url, headers=INTERNAL_AUTH) as client:
            resp = await client.get(f"/registry/workers/{worker_id}")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return WorkerRecord.model_validate_json(resp.content)

    async def remove_behind_back(self, reg: Registration, worker_id: str) -> None:
        self.registry.remove(worker_id)

    async def write_forged(self, rec: WorkerRecord) -> None:
        """PUT with the cluster token (more than a peer without the secret has): the route
        refuses the record (401) before it reaches the registry."""
        body = {"record": rec.model_dump(mode="json")}
        async with httpx.AsyncClient(base_url=self.url, headers=INTERNAL_AUTH) as client:
            resp = await client.put(f"/registry/workers/{rec.worker_id}", json=body)
        assert resp.status_code == 401, resp.text

    async def erase(self, worker_id: str) -> None:
        self.registry.remove(worker_id)

    async def lose_state(self) -> None:
        """The router restarts with an empty registry (and a new watcher over it)."""
        await self.watcher.close()
        await self.handle.stop()
        self.registry = EmbeddedRegistry(ttl_s=self.ttl_s, key=CLUSTER_KEY)
        await self.handle.start(registry_app(self.registry))
        self.watcher = open_watcher("embedded", registry=self.registry, key=CLUSTER_KEY)
        await self.watcher.start()


class EtcdBackend(Backend):
    name = "etcd"
    ttl_s = 2.0
    slack_s = 2.0
    close_within_s = 1.0  # revoking the lease deletes the record at once
    registration_type = EtcdRegistration
    watcher: EtcdWatcher

    def __init__(self, server: EtcdServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    async def open(self) -> None:
        watcher = open_watcher(self.url, key=CLUSTER_KEY)
        assert isinstance(watcher, EtcdWatcher)
        self.watcher = watcher
        await watcher.start()

    def following(self) -> bool:
        return self.watcher.connected

    async def stored(self, worker_id: str) -> WorkerRecord | None:
        import aetcd

        async with aetcd.Client(port=self.server.client_port) as client:
            kv = await client.get(worker_key(worker_id))
        return None if kv is None else WorkerRecord.model_validate_json(kv.value)

    async def remove_behind_back(self, reg: Registration, worker_id: str) -> None:
        """Revoke the worker's lease, as if it had expired during a partition."""
        import aetcd

        assert isinstance(reg, EtcdRegistration) and reg.lease_id is not None
        async with aetcd.Client(port=self.server.client_port) as client:
            await client.revoke_lease(reg.lease_id)

    async def lose_state(self) -> None:
        self.server.restart(wipe=True)  # every key and lease is gone

    async def write_forged(self, rec: WorkerRecord) -> None:
        import aetcd

        async with aetcd.Client(port=self.server.client_port) as client:
            await client.put(worker_key(rec.worker_id), rec.model_dump_json().encode())

    async def erase(self, worker_id: str) -> None:
        import aetcd

        async with aetcd.Client(port=self.server.client_port) as client:
            await client.delete(worker_key(worker_id))


class NatsBackend(Backend):
    name = "nats"
    ttl_s = 2.0
    slack_s = 2.0
    close_within_s = 2.0  # the DEL marker reaches the watch at once
    registration_type = NatsRegistration
    watcher: NatsWatcher

    def __init__(self, server: NatsServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    async def open(self) -> None:
        watcher = open_watcher(self.url, key=CLUSTER_KEY)
        assert isinstance(watcher, NatsWatcher)
        self.watcher = watcher
        await watcher.start()
        assert watcher.connected

    def following(self) -> bool:
        return self.watcher.connected

    async def stored(self, worker_id: str) -> WorkerRecord | None:
        return await nats_stored_record(self.server, worker_id)

    async def remove_behind_back(self, reg: Registration, worker_id: str) -> None:
        import nats

        from pdserve.discovery.load_events import subject_token

        nc = await nats.connect(self.server.url)
        try:
            await (await nc.jetstream().key_value(BUCKET)).delete(subject_token(worker_id))
        finally:
            await nc.close()

    async def lose_state(self) -> None:
        self.server.restart(wipe=True)  # the bucket and every record are gone

    async def write_forged(self, rec: WorkerRecord) -> None:
        import nats

        from pdserve.discovery.load_events import subject_token

        nc = await nats.connect(self.server.url)
        try:
            kv = await nc.jetstream().key_value(BUCKET)
            await kv.put(subject_token(rec.worker_id), rec.model_dump_json().encode())
        finally:
            await nc.close()

    async def erase(self, worker_id: str) -> None:
        import nats

        from pdserve.discovery.load_events import subject_token

        nc = await nats.connect(self.server.url)
        try:
            await (await nc.jetstream().key_value(BUCKET)).delete(subject_token(worker_id))
        finally:
            await nc.close()


async def nats_stored_record(server: NatsServer, worker_id: str) -> WorkerRecord | None:
    """The record in the bucket, read with a separate client (None when absent or deleted)."""
    import nats
    import nats.js.errors

    from pdserve.discovery.load_events import subject_token

    nc = await nats.connect(server.url)
    try:
        kv = await nc.jetstream().key_value(BUCKET)
        try:
            entry = await kv.get(subject_token(worker_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:  # a server-placed expiry marker
            return None
        return WorkerRecord.model_validate_json(entry.value)
    finally:
        await nc.close()


def open_registration_for(backend: Backend, *, ttl_s: float | None = None) -> Registration:
    """A registration against ``backend`` (its TTL unless ``ttl_s``), of the expected type."""
    reg = open_registration(backend.url, ttl_s=ttl_s or backend.ttl_s, key=CLUSTER_KEY)
    assert isinstance(reg, backend.registration_type)
    return reg
