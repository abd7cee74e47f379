"""Run the router process: the public app on ``router.port`` and, with an embedded registry,
the registry's app on an internal listener (``router.registry_host``:``router.registry_port``,
default the router's host and port + 1), in one process and one event loop.

Two uvicorn servers share the loop. The public one runs as ``uvicorn.run`` would (it binds,
owns SIGINT / SIGTERM, runs the lifespan that starts the registry and the watcher); the internal
one binds its socket first (a taken port fails the start at once, naming the listener), starts
serving once the public server has started, and stops after the public server has drained and
closed (so workers deregistering during the router's shutdown still reach the registry). Both
speak ``router.http``'s protocol (:func:`~pdserve.http.uvicorn_protocol.server_protocol`:
httptools by default, h11 on request, both with the header deadline) on ``router.event_loop``'s
loop (:mod:`pdserve.http.event_loop`: uvloop by default).

The public port never serves ``/registry/*`` (404 there); the internal listener serves nothing
else, and every one of its routes needs the cluster token.

With ``router.reuse_port`` both listeners are bound here with SO_REUSEPORT, so that the router
replicas of one host (``pdserve up --routers N``) share them; the kernel hands each new
connection to one replica's listener, and a replica that dies stops receiving new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator

import uvicorn

from pdserve.config.hosts import listening_socket
from pdserve.config.loading import RouterConfig
from pdserve.http.event_loop import run
from pdserve.http.uvicorn_protocol import server_protocol
from pdserve.observability.logs import uvicorn_log_config
from pdserve.server.app import RouterApps, create_apps

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""Seconds open requests get to finish once the router is told to stop."""


class _InternalServer(uvicorn.Server):
    """A uvicorn server that leaves the signals alone: the public server owns them and stops
    this one when it is done (:func:`serve`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_listener(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: the OS picks) and listening
    (:func:`~pdserve.config.hosts.listening_socket`; uvicorn serves it), shared with the
    other replicas when ``reuse_port`` (then bound but not yet listening: uvicorn listens once
    the app has started, so a starting replica takes no connection). Raises OSError
    (``socket.gaierror`` for a host that does not resolve)."""
    return listening_socket(host, port, reuse_port=reuse_port, listen=not reuse_port)


async def serve(
    apps: RouterApps,
    cfg: RouterConfig,
    log_level: str,
    registry_sock: socket.socket | None,
    public_sock: socket.socket | None = None,
) -> None:
    """Serve ``apps`` until SIGINT / SIGTERM (module docstring); ``registry_sock``: the internal
    listener's socket (:func:`bind_listener`), needed when ``apps.registry`` is set;
    ``public_sock``: the public listener's, when bound by the caller (SO_REUSEPORT), else
    uvicorn binds ``router.host``:``router.port`` itself."""

    def config(app: object, **kw: object) -> uvicorn.Config:
        return uvicorn.Config(
            app,  # type: ignore[arg-type]
            http=server_protocol(cfg.router.http),  # request headers within 10 s
            log_level=log_level,
            log_config=uvicorn_log_config(),
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **kw,  # type: ignore[arg-type]
        )

    public = uvicorn.Server(config(apps.public, host=cfg.router.host, port=cfg.router.port))
    public_socks = None if public_sock is None else [public_sock]
    if apps.registry is None:
        await public.serve(public_socks)
        return
    assert registry_sock is not None
    internal = _InternalServer(config(apps.registry, lifespan="off"))
    public_task = asyncio.create_task(public.serve(public_socks), name="router-public")
    internal_task: asyncio.Task[None] | None = None

    def internal_ended(task: asyncio.Task[None]) -> None:
        if not public.should_exit:  # the registry stopped on its own: stop the router too
            log.error("the embedded registry's listener stopped; stopping the router")
            public.should_exit = True

    try:
        while not public.started and not public_task.done():
            await asyncio.sleep(0.05)
        if public.started:
            host, port = registry_sock.getsockname()[:2]
            log.info(
                "embedded registry on the internal listener %s:%d (cluster token; the public "
                "port %d does not serve it)",
                host,
                port,
                cfg.router.port,
            )
            internal_task = asyncio.create_task(
                internal.serve([registry_sock]), name="router-registry"
            )
            internal_task.add_done_callback(internal_ended)
        # Shielded: a cancelled serve() still stops the public server gracefully (below).
        await asyncio.shield(public_task)
    finally:
        if not public_task.done():
            public.should_exit = True
            await public_task
        internal.should_exit = True
        if internal_task is not None:
            await internal_task
        registry_sock.close()


def run_router(cfg: RouterConfig, log_level: str) -> int:
    """``pdserve router``: build the apps (:func:`~pdserve.server.app.create_apps`; raises
    :class:`~pdserve.errors.ConfigError` without a cluster secret), bind the registry's
    internal listener (1 when it cannot be bound, saying so) and serve (:func:`serve`); 0
    after a clean stop."""
    apps = create_apps(cfg)
    sock = public = None
    r = cfg.router
    if r.reuse_port and apps.registry is not None and not r.registry_store:
        log.warning(
            "--reuse-port with the embedded registry but no --registry-store: a worker is seen "
            "only by the replica it registered with; give every replica the same "
            "--registry-store FILE (pdserve up --routers N does)"
        )
    if r.reuse_port:  # uvicorn sets no SO_REUSEPORT itself: bind the public port here
        try:
            public = bind_listener(r.host, r.port, reuse_port=True)
        except OSError as exc:
            print(
                f"pdserve: cannot serve on {r.host}:{r.port} with SO_REUSEPORT: "
                f"{exc.strerror or exc} (held by a process that does not share it?)",
                file=sys.stderr,
            )
            return 1
    if apps.registry is not None:
        try:
            sock = bind_listener(
                r.registry_bind_host, r.registry_bind_port, reuse_port=r.reuse_port
            )
        except OSError as exc:
            print(
                f"pdserve: cannot serve the embedded registry on "
                f"{r.registry_bind_host}:{r.registry_bind_port}: {exc.strerror or exc} (another "
                "router on it? pick another with --registry-port)",
                file=sys.stderr,
            )
            return 1
    run(serve(apps, cfg, log_level, sock, public), cfg.router.event_loop)
    return 0
