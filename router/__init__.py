"""The router: routes each request to workers and relays its tokens.

- ``router``: :class:`~pdserve.router.router.Router`, picks the path (disaggregated, local
  prefill, colocated) and starts the transaction
- ``transaction``: :class:`~pdserve.router.transaction.Transaction`, one request's legs under
  one deadline (prefill -> KV hand-off -> decode), its cleanup
- ``policy``: pairing and the KV-aware cost; ``kv_index``: block hashes per worker, from KV
  events; ``view``: the live workers; ``client``: the worker request plane; ``metrics``: the
  router's Prometheus collectors

Imports no worker, server or transfer module (``tests/unit/test_import_graph.py``).
"""
