"""The worker process and its roles.

- ``worker_app``: the HTTP app and the run loop
  (:func:`~pdserve.workers.roles.worker_app.run_worker`), ``WORKER_CLASSES``
- ``service``: :class:`~pdserve.workers.roles.service.WorkerService`, what every role shares
  (settings, identity, registration, common routes, drain)
- ``prefill``, ``decode``, ``colocated``: one module per role, each with its request lifecycle,
  its worker class (parts, routes) and its request handler
- ``kv_transfer``: what the roles with a transceiver share (the transceiver over the engine's
  KV pool, parked blocks, the lend route, the deadline cap)
- ``lending``: peer prefix pull: lending cached prefix blocks to a peer, and pulling a lent
  prefix before a prefill
- ``parking``: parked KV blocks under leases (prefill results, lent prefixes);
  ``prefill_directory``: the workers a worker may pull from (those discovery lists)
- ``bridge``: engine thread -> event loop streams
- ``timing``: the worker's side of a request's timeline
- ``worker_metrics``: the worker's Prometheus collectors (``GET /metrics``)

Imports the engine (through ``engine.api``) and the KV cache.
"""
