"""What ``pdserve doctor`` looks at, gathered once: the one place the doctor reads the
environment, ``/proc`` and ``/sys``, imports the optional transfer libraries and runs
``ucx_info``. Every step degrades to "unknown" instead of failing: a missing library or tool
is itself a finding of the checks (:mod:`pdserve.bench.doctor.doctor`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

_ENV_PREFIXES = ("UCX_", "UCXPY_", "NIXL_")
_UCX_INFO_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class BackendFacts:
    """Whether a transfer backend can be used here: ``version`` of its library; ``detail`` the
    failure, or a note."""

    name: str
    available: bool
    version: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class Facts:
    """Everything the checks look at.

    ``cpu_count``: CPUs this process may run on. ``env``: the ``UCX_*``, ``UCXPY_*`` and
    ``NIXL_*`` variables at start. ``ucx_transports``: transport -> devices as UCX reports them
    (None: could not be listed; ``ucx_source`` says how they were asked for). ``nics``: network
    interfaces that are up, loopback excluded. ``ptrace_scope``: ``kernel.yama.ptrace_scope``
    (None: no Yama on this kernel).
    """

    cpu_count: int
    env: Mapping[str, str] = field(default_factory=dict)
    backends: tuple[BackendFacts, ...] = ()
    ucx_transports: Mapping[str, tuple[str, ...]] | None = None
    ucx_source: str = ""
    nics: tuple[str, ...] = ()
    ptrace_scope: int | None = None


def gather_facts() -> Facts:
    """Look at this host (a few seconds: it initialises NIXL once and runs ``ucx_info``).

    The environment is read first: importing ucxx adds ``UCX_*`` variables of its own."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    transports, source = ucx_transports()
    return Facts(
        cpu_count=len(os.sched_getaffinity(0)),
        env=env,
        backends=(
            BackendFacts("tcp", True, None, "(built in)"),
            _nixl_facts(),
            _ucx_facts(),
        ),
        ucx_transports=transports,
        ucx_source=source,
        nics=_nics(Path("/sys/class/net")),
        ptrace_scope=_read_int(Path("/proc/sys/kernel/yama/ptrace_scope")),
    )


def _nixl_facts() -> BackendFacts:
    """NIXL imports and an agent with the UCX backend initialises (what the backend needs)."""
    quiet = logging.getLogger("nixl")  # NIXL logs INFO lines to stdout, into the report
    level = quiet.level
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # configures that logger

        quiet.setLevel(logging.WARNING)
        agent = nixl_agent(
            f"pdserve-doctor-{os.getpid()}",
            nixl_agent_config(enable_prog_thread=False, backends=[]),
        )
        agent.create_backend("UCX", {})
    except Exception as exc:  # any import or init failure is the finding
        return BackendFacts("nixl", False, _version("nixl"), f"{type(exc).__name__}: {exc}")
    finally:
        quiet.setLevel(level)
    return BackendFacts("nixl", True, _version("nixl"), "(its UCX backend initialises)")


def _ucx_facts() -> BackendFacts:
    """ucxx imports (its UCX version) and pdserve has the backend registered."""
    from pdserve.transfer.backend import registered_backends

    try:
        ucxx = importlib.import_module("ucxx")
        ucx_version = ".".join(str(v) for v in ucxx.get_ucx_version())
    except Exception as exc:
        return BackendFacts("ucx", False, None, f"ucxx: {type(exc).__name__}: {exc}")
    version = str(getattr(ucxx, "__version__", "")) or None
    if "ucx" not in registered_backends():
        return BackendFacts("ucx", False, version, "this pdserve build has no ucx backend")
    return BackendFacts("ucx", True, version, f"(ucxx, UCX {ucx_version})")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def ucx_transports() -> tuple[dict[str, tuple[str, ...]] | None, str]:
    """Transport -> devices from the ``ucx_info -d`` the libucx wheel ships (its own UCX;
    NIXL bundles another build of the same transports), with a note of where they came from.
    ``(None, why)`` when it cannot be run."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None, "libucx wheel (ucx_info) not installed"
    root = Path(spec.submodule_search_locations[0])
    binary = root / "bin" / "ucx_info"
    if not binary.exists():
        return None, f"no ucx_info in {root}"
    env = dict(os.environ)  # the child's environment only: its bundled libraries
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(root / "lib"), env.get("LD_LIBRARY_PATH", "")) if p
    )
    try:
        out = subprocess.run(
            [str(binary), "-d"],
            env=env,
            capture_output=True,
            text=True,
            timeout=_UCX_INFO_TIMEOUT_S,
            check=True,
        ).stdout
        version = subprocess.run(
            [str(binary), "-v"],
            env=env,
            capture_output=True,
            text=True,
            timeout=_UCX_INFO_TIMEOUT_S,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"ucx_info failed: {exc}"
    match = re.search(r"Library version:\s*(\S+)", version)
    return parse_ucx_info(out), f"ucx_info -d, UCX {match.group(1) if match else '?'}"


def parse_ucx_info(text: str) -> dict[str, tuple[str, ...]]:
    """``ucx_info -d`` output -> transport -> its devices, in order of appearance::

    #      Transport: tcp        ->  {"tcp": ("eth0", "lo"), "cma": ("memory",)}
    #         Device: eth0
    """
    found: dict[str, list[str]] = {}
    transport: str | None = None
    for line in text.splitlines():
        if m := re.match(r"#\s*Transport:\s*(\S+)", line):
            transport = m.group(1)
            found.setdefault(transport, [])
        elif (m := re.match(r"#\s*Device:\s*(\S+)", line)) and transport is not None:
            if m.group(1) not in found[transport]:
                found[transport].append(m.group(1))
    return {t: tuple(d) for t, d in found.items()}


def _nics(root: Path) -> tuple[str, ...]:
    """Interfaces whose ``operstate`` is ``up``, loopback excluded, sorted."""
    if not root.is_dir():
        return ()
    up = []
    for dev in root.iterdir():
        state = dev / "operstate"
        if dev.name != "lo" and state.exists() and state.read_text().strip() == "up":
            up.append(dev.name)
    return tuple(sorted(up))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
