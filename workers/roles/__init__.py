"""The worker process and its roles.

- ``worker_app``: the HTTP app and the run loop
  (:func:`~pdserve.workers.roles.worker_app.run_worker`), ``WORKER_CLASSES``
- ``service``: :class:`~pdserve.workers.roles.service.WorkerService`, what every role shares
  (settings, identity, registration, common routes, drain)
- ``prefill``, ``decode``, ``colocated``: one module per role, each with its request lifecycle,
  its worker class (parts, routes) and its request handler
- ``kv_transfer``: what the two transferring roles share (the transceiver over the engine's KV
  pool, the deadline cap)
- ``parking``: parked KV blocks under leases (prefill); ``prefill_directory``: the prefill
  workers a decode worker may pull from
- ``bridge``: engine thread -> event loop streams
- ``timing``: the worker's side of a request's timeline
- ``worker_metrics``: the worker's Prometheus collectors (``GET /metrics``)

Imports the engine (through ``engine.api``) and the KV cache.
"""
