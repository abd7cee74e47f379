"""The servers' event loop (:mod:`pdserve.http.event_loop`): uvloop by default for the router,
asyncio's on request, and a clear ConfigError where uvloop cannot be imported."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pdserve.config.settings import RouterSettings
from pdserve.errors import ConfigError
from pdserve.http.event_loop import run


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_the_router_runs_on_uvloop_by_default() -> None:
    assert RouterSettings().event_loop == "uvloop"
    assert run(loop_module(), "uvloop").startswith("uvloop")


def test_asyncio_s_own_loop_on_request() -> None:
    assert run(loop_module(), "asyncio").startswith("asyncio")


def test_a_missing_uvloop_is_a_config_error_naming_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    coro = loop_module()
    with pytest.raises(ConfigError, match="--loop asyncio"):
        run(coro, "uvloop")
    coro.close()
