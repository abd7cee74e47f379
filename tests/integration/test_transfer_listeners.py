"""The NIXL and UCX backends open their UCX listeners only where pdserve binds: a transceiver
on a loopback address (as ``pdserve up`` runs) leaves no listening socket on another
interface's address. Each backend is opened in a process of its own (NIXL and ucxx bundle
different UCX builds), and the listening sockets it adds are read from the kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, psutil, torch
from pdserve.config.settings import TransferSettings
from pdserve.transfer.backend import open_backend
from pdserve.transfer.formatter.mapping import PoolGeometry
from tests.support.fakes import layout

def listening():
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}

before = listening()
lay = layout()
pool = torch.zeros(lay.num_layers, 4, 2, lay.tokens_per_block, lay.num_kv_heads, lay.head_dim)
cfg = TransferSettings(backend=sys.argv[1], host=sys.argv[2])
backend = open_backend(cfg, pool=pool, geometry=PoolGeometry.from_pool(pool, lay), agent_name="l")
print(json.dumps(sorted(listening() - before)))
"""


def other_addresses() -> set[str]:
    """This machine's IPv4 addresses off loopback."""
    return {
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family.name == "AF_INET" and not a.address.startswith("127.")
    }


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_a_loopback_transceiver_opens_no_ucx_listener_on_another_interface(backend: str) -> None:
    if not other_addresses():
        pytest.skip("this machine has no interface besides loopback to leak onto")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, backend, "127.0.0.1"],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT,
    )  # fmt: skip
    opened = [tuple(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]
    assert opened, f"{backend} opened no listener at all: {out.stderr[-2000:]}"
    assert all(ip.startswith("127.") for ip, _ in opened), f"{backend} listens on {opened}"
