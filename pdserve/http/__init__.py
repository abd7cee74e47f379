"""The HTTP plumbing the router and the workers share; it imports no room
(``tests/unit/test_import_graph.py``).

- ``error_responses``: every failure as a JSON ``{"error": {...}}`` body (pdserve errors,
  validation errors, internal errors), installed on every app
- ``uvicorn_protocol``: uvicorn's h11 protocol with a deadline on a request's headers
- ``keepalive``: the request plane's idle-connection timeouts, the router's below the workers'
"""
