"""The HTTP plumbing the router and the workers share; it imports no room
(``tests/unit/test_import_graph.py``).

- ``error_responses``: every failure as a JSON ``{"error": {...}}`` body (pdserve errors,
  validation errors, internal errors), installed on every app
- ``uvicorn_protocol``: uvicorn's httptools and h11 protocols with a deadline on a request's
  headers (and a bound on their size)
- ``event_loop``: the event loop a server runs on (uvloop or asyncio's)
- ``keepalive``: the request plane's idle-connection timeouts, the router's below the workers'
- ``plane_client``: the router's HTTP/1.1 client for the worker request plane (httptools,
  keep-alive pool), and an httpx adapter behind the same interface
"""
