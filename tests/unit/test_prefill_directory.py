"""A decode worker dials only prefill workers that discovery lists (issue 13): the directory
answers the endpoint of the record that matches the handle's worker id and epoch, waits a
little for a worker registered a moment ago, and refuses anything else before any connection."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.errors import HandleError
from pdserve.protocol import Role, TransferHandle, WorkerRecord
from pdserve.workers.roles.prefill_directory import PrefillDirectory
from tests.support.fakes import layout
from tests.support.servers import wait_until


class ListWatcher:
    """A discovery view of ``records``; ``lookups`` counts the reads of it."""

    def __init__(self) -> None:
        self.records: dict[str, WorkerRecord] = {}
        self.lookups = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def workers(self) -> dict[str, WorkerRecord]:
        self.lookups += 1
        return dict(self.records)


def record(worker_id: str = "prefill-0", epoch: int = 3, role: Role = Role.PREFILL) -> WorkerRecord:
    return WorkerRecord(
        role=role, worker_id=worker_id, epoch=epoch, model="m", http_url="http://127.0.0.1:1",
        communicator={"backend": "tcp", "endpoint": "10.0.0.5:7000"}, layout=layout(),
    )  # fmt: skip


def handle(**update: object) -> TransferHandle:
    h = TransferHandle(
        worker_id="prefill-0", epoch=3, request_id="r1", lease_id="l" * 32, block_ids=(1,),
        num_tokens=4, lease_deadline=time.time() + 30, layout=layout(), backend="tcp",
        transfer_endpoint="10.0.0.5:7000",
    )  # fmt: skip
    return h.model_copy(update=update)


def directory(watcher: ListWatcher, wait_s: float = 0.2) -> PrefillDirectory:
    return PrefillDirectory(watcher, wait_s=wait_s, poll_s=0.01)  # type: ignore[arg-type]


async def test_a_listed_prefill_worker_gives_its_published_endpoint() -> None:
    watcher = ListWatcher()
    watcher.records["prefill-0"] = record()
    assert await directory(watcher).endpoint(handle()) == "10.0.0.5:7000"


@pytest.mark.parametrize(
    ("listed", "forged", "why"),
    [
        (None, {}, "is not a registered prefill worker"),
        (record(epoch=2), {}, "epoch 3 is not a registered"),  # the worker restarted since
        (record(role=Role.DECODE), {}, "is not a registered prefill worker"),
        (record(), {"transfer_endpoint": "10.9.9.9:22"}, "is not the one discovery lists"),
    ],
)
async def test_anything_else_is_refused_without_a_connection(
    listed: WorkerRecord | None, forged: dict[str, object], why: str
) -> None:
    watcher = ListWatcher()
    if listed is not None:
        watcher.records["prefill-0"] = listed
    d = directory(watcher)
    with pytest.raises(HandleError, match=why):
        await d.endpoint(handle(**forged))
    assert d.refused == 1


async def test_a_prefill_worker_registered_a_moment_ago_is_waited_for() -> None:
    watcher = ListWatcher()

    async def registers_soon() -> None:  # once the directory looked, found nothing, looks again
        await wait_until(lambda: watcher.lookups >= 2, 2.0, interval_s=0.005, what="a 2nd look")
        watcher.records["prefill-0"] = record()

    task = asyncio.create_task(registers_soon())
    assert await directory(watcher, wait_s=2.0).endpoint(handle()) == "10.0.0.5:7000"
    await task


async def test_the_wait_never_outlasts_the_lease() -> None:
    d = directory(ListWatcher(), wait_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(HandleError):
        await d.endpoint(handle(lease_deadline=time.time() + 0.1))
    assert time.monotonic() - t0 < 5.0
