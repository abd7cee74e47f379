"""The event loop a server process runs on: uvloop (libuv; the router's default) or asyncio's
own.

uvloop runs the same asyncio programs with its transports, timers and DNS in C: for the
router, which mostly moves small HTTP messages between sockets, it cuts the CPU each request
costs (docs/benchmarks.md, "The router's own cost"). asyncio's loop stays available
(``--loop asyncio``) for debugging with ``PYTHONASYNCIODEBUG``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from pdserve.errors import ConfigError

LoopImpl = Literal["uvloop", "asyncio"]
"""The event loop implementations a server can run on (``--loop``)."""

T = TypeVar("T")


def loop_factory(impl: LoopImpl) -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of a new ``impl`` event loop. Raises :class:`ConfigError` when uvloop is
    asked for and cannot be imported (it is a dependency on Linux and macOS, not on Windows)."""
    if impl == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError.from_problems(
            [f"--loop uvloop: uvloop cannot be imported here ({exc}); use --loop asyncio"]
        ) from exc
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], impl: LoopImpl) -> T:
    """Run ``main`` to its end on a new ``impl`` event loop (as :func:`asyncio.run` does: the
    loop is closed after, its async generators and executor shut down); its result. Raises what
    ``main`` raises, and :class:`ConfigError` as :func:`loop_factory`."""
    with asyncio.Runner(loop_factory=loop_factory(impl)) as runner:
        return runner.run(main)
