"""The router: routes each request to workers and relays its tokens.

- ``router``: :class:`~pdserve.router.router.Router`, picks the path (disaggregated, local
  prefill, colocated) and starts the transaction
- ``policy``: the routing policy: which path and which workers serve a request (pairing, the
  KV-aware cost), and which worker a retried or migrated leg moves to; a pure function of a
  ``view`` snapshot
- ``transaction``: :class:`~pdserve.router.transaction.Transaction`, one request's legs under
  one deadline (prefill -> KV hand-off -> decode), its cleanup
- ``request``: a routed request's spec (``RequestSpec``) and what it streams back, one
  ``TokenEvent`` per step of a choice
- ``view``: the live workers of one served model, read from the discovery watcher; its
  readiness
- ``kv_index``: block hashes per worker, from the workers' KV cache events (KV-aware routing)
- ``peer_pull``: peer prefix pull: which worker lends a prompt's cached prefix to the worker
  that prefills it, and the lend call
- ``sessions``: session affinity: a session's next turn prefers the worker of its last one
- ``admission``: the fair queue between tenants (deficit round robin, priority) while the
  workers are saturated
- ``retry``: the one retry policy of every leg (first leg, decode-leg refusal, migration): what
  is retryable, how often, how much deadline must be left
- ``migration``: mid-stream migration's parts: a lost leg, why a leg failed, the request that
  continues it on another worker
- ``client``: typed HTTP calls to a worker's request plane
- ``router_metrics``: the router's Prometheus collectors (``GET /metrics``)

Imports no worker, server or transfer module (``tests/unit/test_import_graph.py``).
"""
