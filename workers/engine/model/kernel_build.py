"""Building our C++ kernels on the machine that runs them (``torch.utils.cpp_extension``):
the build's name per CPU, and a build lock that survives a killed build.

Used by :mod:`pdserve.workers.engine.model.paged_kernel`.
"""

from __future__ import annotations

import fcntl
import logging
import platform
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def cpu_build_name(prefix: str) -> str:
    """``prefix`` with a hash of this CPU's flags: a build made with ``-march=native`` is valid
    on this CPU only, so a build cache shared between machines keeps one build per CPU."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line for line in cpu.splitlines() if line.startswith("flags")), platform.machine())
    return f"{prefix}_{zlib.crc32(cpu.encode()):08x}"


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<build dir>.flock`` for the build or load of ``name``.

    torch's own lock is a ``lock`` file in the build directory that ``load_inline`` creates and
    deletes; a process killed while holding it (a test run interrupted during the first build)
    leaves it behind, and every later process waits on it forever. Every pdserve process takes
    this ``flock`` first, and the kernel releases a ``flock`` when its holder dies, so a
    ``lock`` file found while holding it is such a leftover: it is removed, with a warning."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir.with_name(build_dir.name + ".flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield
