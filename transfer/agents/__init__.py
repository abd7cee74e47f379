"""The transfer backends: how the KV bytes move, the seed's *TransferAgent* (one-sided reads
of registered memory) and *Connection* (a bidirectional byte stream). Each implements
:class:`~pdserve.transfer.backend.Backend` and loads on first use (the registry of
:mod:`pdserve.transfer.backend`).

- ``tcp``: the dependency-free fallback: the KV bytes streamed on the control connection
- ``nixl_agent``: TransferAgent over NIXL (its UCX backend), the NIXL backend
- ``ucx``: Connection over UCX (ucxx tagged send/receive), the UCX backend
- ``inproc``: peers in one process copy between their pools (unit tests, no socket)
"""
