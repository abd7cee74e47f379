"""KV transfer: transceiver, sender/receiver, formatter, connections and transfer agents.

Public API (docs/architecture.md, "Transfer")::

    create_transceiver(cfg, *, pool, layout, worker_id, epoch, parked, key) -> Transceiver
    Transceiver: backend, endpoint, start(), communicator(), pull(handle, dst_block_ids), close()
    ParkedLookup: lookup(request_id, epoch, lease_id) -> block ids; release(request_id, lease_id)

Modules (the TensorRT-LLM "KV cache transmission" components):
``transceiver`` (Transceiver), ``sender`` / ``receiver`` (control plane, prefill / decode side),
``auth`` (mutual challenge-response on the cluster secret, first on every connection),
``handshake`` (version/backend/layout checks), ``formatter`` (layout mapping, block runs),
``convert`` (re-block/dtype kernel and staging buffers for mixed layouts),
``wire`` (typed control messages and framing), ``control`` (the control Connection: framed
messages and raw byte streams over TCP), ``integrity`` (xxh3 digests of the moved bytes),
``tcp`` (the TCP backend: KV bytes on the control connection),
``nixl_agent`` (TransferAgent over NIXL, the NIXL backend), ``ucx`` (Connection over ucxx, the
UCX backend), ``backend`` (data-plane interface and lazy registry), ``probe`` (bandwidth probe
served in place of a Hello, for ``pdserve doctor``). The benchmarks and the doctor live in
:mod:`pdserve.bench`; nothing here imports them.

Importing this package imports neither NIXL nor ucxx: each backend loads on first use.
"""

from pdserve.transfer.sender import ParkedLookup
from pdserve.transfer.transceiver import Transceiver, create_transceiver

__all__ = ["ParkedLookup", "Transceiver", "create_transceiver"]
