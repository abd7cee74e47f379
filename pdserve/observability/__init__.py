"""What a running pdserve tells its operator: metrics, timelines and logs.

- ``prometheus``: the shared parts of ``GET /metrics`` (one registry per app, the restarts
  gauge); the router's and the workers' own collectors live beside them
  (:mod:`pdserve.router.router_metrics`, :mod:`pdserve.workers.roles.worker_metrics`)
- ``tracing``: per-request timelines and distributed tracing (OpenTelemetry)
- ``logs``: process logging, text or JSON lines, with the request id on every line
- ``log_relay``: the JSON-log relay process: a serving process's output, every line a JSON
  object
"""
