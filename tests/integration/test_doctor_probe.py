"""``pdserve doctor`` run as a subprocess against a worker found through a real (embedded, HTTP)
registry: it finds the worker's transceiver through discovery and measures it, authenticated
with the cluster secret file it is given; with another deployment's secret it is refused."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from pdserve.discovery import EmbeddedRegistry, open_registration
from pdserve.protocol import Role, WorkerRecord
from pdserve.security import write_secret_file
from tests.support.fakes import TEST_SECRET, registry_app
from tests.support.servers import free_port, serve_app, wait_until
from tests.support.transfer import TEST_KEY
from tests.support.transfer_inproc import LAYOUT_SMALL as LAYOUT
from tests.support.transfer_inproc import serving_transceiver as transceiver


async def _doctor(*args: str) -> tuple[int | None, str]:
    """Run ``pdserve doctor ARGS`` (no PDSERVE_* variables of ours leak in): exit code, output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "--log-level", "warning", "doctor", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode()


async def test_doctor_command_finds_worker_through_discovery_and_measures_it(
    tmp_path: Path,
) -> None:
    secret = write_secret_file(tmp_path / "secret", TEST_SECRET)
    async with (
        transceiver() as t,
        serve_app(registry_app(EmbeddedRegistry(ttl_s=30, key=TEST_KEY)), free_port()) as router,
    ):
        reg = open_registration(router.base_url, ttl_s=30, key=TEST_KEY)
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
            code, text = await _doctor(
                "--discovery", router.base_url, "--worker", "prefill-doc", "--probe-mib", "4",
                "--cluster-secret-file", str(secret),
            )  # fmt: skip
        finally:
            await reg.close()
    assert code == 0, text
    assert f"peer: {t.endpoint}: worker prefill-doc (epoch 42)" in text
    assert "peer bandwidth:" in text and "GB/s p50" in text
    assert t.auth_failures.total == 0


async def test_doctor_command_with_another_deployments_secret_is_refused(tmp_path: Path) -> None:
    other = write_secret_file(tmp_path / "other", "another-deployment-secret-0123456789abcdef")
    async with transceiver() as t:
        code, text = await _doctor("--peer", t.endpoint, "--cluster-secret-file", str(other))
        await wait_until(lambda: t.auth_failures.total == 1, 5.0, what="the refusal counted")
    assert code == 1, text
    assert "FAIL  peer: cannot probe" in text and "could not prove" in text, text
    assert "peer bandwidth" not in text
