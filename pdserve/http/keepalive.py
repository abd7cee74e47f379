"""The request plane's keep-alive timeouts, in seconds: how long an idle HTTP connection between
the router and a worker stays open on each side.

The worker's server (uvicorn's ``timeout_keep_alive``, :mod:`pdserve.workers.roles.worker_app`)
keeps one open :data:`WORKER_KEEPALIVE_S`; the router's client (:mod:`.plane_client`'s pool, or
httpx's ``keepalive_expiry`` with ``router.worker_client: httpx``) drops it after
:data:`ROUTER_KEEPALIVE_S`, well before. The order is
the contract: the router never sends a request on a connection the worker is closing, which
fails as a ReadError (with equal timeouts, a release sent ~5 s after the connection's last use
lost that race). Constants only: nothing is imported, nothing raises.
"""

WORKER_KEEPALIVE_S = 30.0
"""How long a worker keeps an idle request-plane HTTP connection open (uvicorn's
``timeout_keep_alive``). The router's client drops idle connections well before
(:data:`ROUTER_KEEPALIVE_S`), so it never sends a request on a connection the worker is closing
(which fails as a ReadError: with equal timeouts, a release sent ~5 s after the connection's
last use lost that race)."""
ROUTER_KEEPALIVE_S = WORKER_KEEPALIVE_S / 2
"""How long the router's client keeps an idle connection to a worker (the plane client's pool,
httpx's ``keepalive_expiry``): half the workers' :data:`WORKER_KEEPALIVE_S`."""
