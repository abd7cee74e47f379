"""The GPU tests' prefill transfer peer: the product's
:class:`pdserve.bench.transfer.bench_transfer_peers.PatternPeer` (a spawned process whose pool, on a
chosen device, holds :func:`pattern`) keyed with the test cluster secret, so the test side's
``tests.support.kv_peer.TEST_KEY`` pulls from it; ``pdserve bench gpu`` runs the same peer with
a fresh secret. The calling process plays the decode worker.
"""

from __future__ import annotations

from typing import Any

from pdserve.bench.transfer import bench_transfer_peers as peers
from pdserve.bench.transfer.bench_transfer_peers import empty_pool, pattern
from pdserve.protocol import KVLayout
from tests.support.fakes import TEST_SECRET

__all__ = ["PatternPeer", "empty_pool", "pattern", "transfer_cfg"]


def transfer_cfg(backend: str, *, integrity: bool = True, timeout_s: float = 30.0) -> Any:
    """Loopback transfer settings (``ucx_devices="lo"``)."""
    return peers.transfer_settings(
        backend, ucx_devices="lo", integrity=integrity, timeout_s=timeout_s
    )


class PatternPeer(peers.PatternPeer):
    """:class:`pdserve.bench.transfer.bench_transfer_peers.PatternPeer` with the test cluster secret."""

    def __init__(self, backend: str, layout: KVLayout, num_blocks: int, device: str) -> None:
        super().__init__(backend, layout, num_blocks, device, secret=TEST_SECRET)
