"""``pdserve doctor`` run as a subprocess against a worker found through a real (embedded, HTTP)
registry: it finds the worker's transceiver through discovery and measures it."""

from __future__ import annotations

import asyncio
import sys

from pdserve.discovery import EmbeddedRegistry, open_registration
from pdserve.protocol import Role, WorkerRecord
from tests.fakes import registry_app
from tests.fixtures.servers import free_port, serve_app
from tests.unit.test_doctor import LAYOUT, transceiver


async def test_doctor_command_finds_worker_through_discovery_and_measures_it() -> None:
    async with (
        transceiver() as t,
        serve_app(registry_app(EmbeddedRegistry(ttl_s=30)), free_port()) as router,
    ):
        reg = open_registration(router.base_url, ttl_s=30)
        await reg.start(
            WorkerRecord(
                role=Role.PREFILL,
                worker_id="prefill-doc",
                epoch=42,
                model="tiny",
                http_url="http://127.0.0.1:9",
                communicator=t.communicator(),
                layout=LAYOUT,
            )
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pdserve.cli", "--log-level", "warning", "doctor",
                "--discovery", router.base_url, "--worker", "prefill-doc", "--probe-mib", "4",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
        finally:
            await reg.close()
    text = out.decode()
    assert proc.returncode == 0, text
    assert f"peer: {t.endpoint}: worker prefill-doc (epoch 42)" in text
    assert "peer bandwidth:" in text and "GB/s p50" in text
