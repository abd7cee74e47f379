"""KV transfer: transceiver, sender/receiver, formatter, connections and transfer agents.

Public API (docs/architecture/transfer.md)::

    create_transceiver(cfg, *, pool, layout, worker_id, epoch, parked, key) -> Transceiver
    Transceiver: backend, endpoint, start(), communicator(), pull(handle, dst_block_ids), close()
    ParkedLookup: lookup(request_id, epoch, lease_id) -> block ids; release(request_id, lease_id)

Map, in reading order, along the TensorRT-LLM "KV cache transmission" seed's components:

- ``transceiver``: the seed's *Transceiver*, one per worker: serves its parked KV blocks and
  pulls other workers' blocks (``create_transceiver``)
- ``sender`` / ``receiver``: the seed's *Sender* / *Receiver*: the control plane of one
  transfer, prefill side / decode side
- ``wire``: the typed control messages between two transceivers and their framing
- ``formatter``: the seed's *Formatter*: which bytes of the prefill pool go to which bytes of
  the decode pool (layout mapping, block runs), the conversion kernel and staging buffers for
  mixed layouts, the copies a transfer costs
- ``connection``: the seed's *Connection*: the control connection (framed messages and raw
  byte streams over TCP), the mutual challenge-response on the cluster secret (first on every
  connection), the handshake (version, backend, layout), the admission of connections
- ``backend``: the data-plane interface every transfer backend implements, and the lazy
  backend registry
- ``agents``: the backends, the seed's *TransferAgent*: TCP (KV bytes on the control
  connection), UCX (a Connection over ucxx), NIXL (a TransferAgent over NIXL), in-process
  (tests)
- ``integrity``: block digests of the moved bytes (xxh3, or ``mix64`` where the bytes live)
- ``bandwidth_probe``: the bandwidth probe served in place of a Hello, for ``pdserve doctor``

The benchmarks and the doctor live in :mod:`pdserve.bench`; nothing here imports them.

Importing this package imports neither NIXL nor ucxx: each backend loads on first use.
"""

from pdserve.transfer.sender import ParkedLookup
from pdserve.transfer.transceiver import Transceiver, create_transceiver

__all__ = ["ParkedLookup", "Transceiver", "create_transceiver"]
