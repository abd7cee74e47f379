"""``pdserve bench transfer --profile``: where the fixed cost of one hand-off goes.

Per transfer backend, a fresh child process (``python -m pdserve.bench.transfer.bench_transfer_profile
BACKEND PULLS INTEGRITY``; NIXL and ucxx bundle UCX builds that conflict, so one backend per
process) runs a prefill-side and a decode-side transceiver in one event loop, as the benchmark's
serve and pull roles do across two processes (:mod:`pdserve.bench.transfer.bench_transfer_peers`):
pool of SmolLM2's layout, one handle pulled again and again (its blocks stay parked), UCX with
its default transports (the ``-shm`` cases' setting). After a warm-up it times ``pulls`` one-block
pulls (wall and process CPU time, every thread of the process included), then runs as many again
under :mod:`cProfile` (its default clock: the main thread's wall time, almost all of it CPU
time here, as no pull waits for another process) and prints one result line: the CPU time per pull and
the functions with the most own time per pull. With both sides in one process, a pull's CPU
time is the work of both ends of a hand-off (the two-process benchmark runs part of it in
parallel), the copy of the block's bytes included (e.g. ``sendmsg`` on tcp).

The parent (:func:`run_profiles`) starts the children in turn and prints one table per backend.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import os
import pstats
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.transfer.bench_transfer import SMOLLM2_LAYOUT, Case, resolve_cases, unavailable
from pdserve.bench.transfer.bench_transfer_peers import (
    BENCH_EPOCH,
    RESULT_PREFIX,
    AllParked,
    block_bytes,
    emit,
    empty_pool,
    transfer_settings,
)
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey, generate_secret
from pdserve.transfer.transceiver import create_transceiver

DEFAULT_PULLS = 2000
WARMUP_PULLS = 100
TOP_FUNCTIONS = 15
UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES")
"""Cleared in the children: UCX picks its default transports (the same-host setting)."""
_RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Row:
    """One function of the profile: its own CPU time per pull and share of the profiled total."""

    function: str
    where: str
    us_per_pull: float
    share: float


@dataclass(frozen=True)
class Profile:
    """One backend's profile: wall and CPU (all threads) microseconds per pull without the
    profiler, the main thread's CPU per pull under it, and the top functions."""

    backend: str
    integrity: bool | None
    pulls: int
    wall_us: float
    cpu_us: float
    profiled_us: float
    rows: list[Row]


def profile_backends(names: Sequence[str]) -> list[str]:
    """Case names (``--backends``; aliases included) -> their backend names, in order, without
    repeats. Raises ValueError for an unknown name."""
    out: list[str] = []
    for case in resolve_cases(names):
        if case.backend not in out:
            out.append(case.backend)
    return out


def _where(path: str, line: int) -> str:
    """``path:line`` shortened to the package (``pdserve/...``, ``site-packages`` dropped)."""
    if path == "~":  # a builtin: pstats puts its name in the function column
        return "builtin"
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + 1 :]
            break
    else:
        here = Path(__file__).resolve().parents[2]  # the checkout (pdserve/, transfer/, ...)
        if Path(path).is_relative_to(here):
            parts = Path(path).relative_to(here).parts
        else:  # the standard library: from below lib/pythonX.Y
            tops = [i for i, part in enumerate(parts) if part.startswith("python")]
            parts = parts[tops[-1] + 1 :] if tops else parts[-1:]
    return f"{'/'.join(parts)}:{line}"


def _builtin_name(text: str) -> str:
    """pstats' ``<method 'sendmsg' of '_socket.socket' objects>`` -> ``_socket.socket.sendmsg``,
    ``<built-in method posix.sched_yield>`` -> ``posix.sched_yield``; anything else as is."""
    if m := re.fullmatch(r"<method '(.+)' of '(.+)' objects>", text):
        return f"{m[2]}.{m[1]}"
    if m := re.fullmatch(r"<built-in method (.+)>", text):
        return m[1]
    return text


def top_functions(stats: pstats.Stats, pulls: int, top: int = TOP_FUNCTIONS) -> list[Row]:
    """The ``top`` functions of ``stats`` by own time, per pull and as a share of the total
    own time (which is all of the profiled time)."""
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # untyped in typeshed
    total = sum(value[2] for value in entries.values()) or 1.0
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        Row(_builtin_name(func), _where(path, line), tt / pulls * 1e6, tt / total)
        for (path, line, func), (_cc, _nc, tt, _ct, _callers) in ranked
    ]


async def profile_pulls(
    backend: str, pulls: int, integrity: bool | None, layout: KVLayout = SMOLLM2_LAYOUT
) -> Profile:
    """Both transceivers of ``backend`` in this process; ``pulls`` one-block pulls timed, then
    as many under cProfile (see the module docstring). Raises RuntimeError when the bytes did
    not arrive."""
    key = ClusterKey(generate_secret().encode())
    prefill = create_transceiver(
        transfer_settings(backend),
        pool=empty_pool(layout, 1).fill_(1.0),
        layout=layout,
        worker_id="bench-prefill",
        epoch=BENCH_EPOCH,
        parked=AllParked(),
        key=key,
    )
    await prefill.start()
    pool = empty_pool(layout, 1)
    decode = create_transceiver(
        transfer_settings(backend, integrity=integrity),
        pool=pool,
        layout=layout,
        worker_id="bench-decode",
        epoch=BENCH_EPOCH,
        parked=None,
        key=key,
    )
    try:
        await decode.start()
        handle = TransferHandle(
            worker_id="bench-prefill",
            epoch=BENCH_EPOCH,
            request_id="bench-1-0",
            lease_id="bench",
            block_ids=(0,),
            num_tokens=layout.tokens_per_block,
            lease_deadline=time.time() + 3600,
            layout=layout,
            backend=decode.backend,
            transfer_endpoint=prefill.endpoint,
        )
        for _ in range(WARMUP_PULLS):
            await decode.pull(handle, [0])
        if not bool(pool.eq(1.0).all()):
            raise RuntimeError(f"{backend}: the pulls did not deliver the bytes")
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(pulls):
            await decode.pull(handle, [0])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(pulls):
            await decode.pull(handle, [0])
        profiler.disable()
    finally:
        await decode.close()
        await prefill.close()
    stats = pstats.Stats(profiler)
    profiled: float = stats.total_tt  # type: ignore[attr-defined]  # untyped in typeshed
    return Profile(
        backend=decode.backend,
        integrity=integrity,
        pulls=pulls,
        wall_us=wall / pulls * 1e6,
        cpu_us=cpu / pulls * 1e6,
        profiled_us=profiled / pulls * 1e6,
        rows=top_functions(stats, pulls),
    )


def format_profile(p: Profile) -> str:
    """The profile's header lines and its table ``function (file:line) | us per pull | share``."""
    digests = {None: "", False: ", digests off", True: ", digests on"}[p.integrity]
    lines = [
        f"{p.backend}: {p.pulls} one-block pulls{digests}, both transceivers in one process",
        f"  CPU time per pull: {p.cpu_us:.0f} us (all threads; wall {p.wall_us:.0f} us), "
        f"without the profiler",
        f"  under cProfile: {p.profiled_us:.0f} us per pull (the main thread; the profiler's "
        "overhead included, spread over the calls)",
        "",
        "| function (file:line) | us per pull | share |",
        "|---|---:|---:|",
    ]
    for r in p.rows:
        lines.append(f"| {r.function} ({r.where}) | {r.us_per_pull:.1f} | {r.share:.1%} |")
    return "\n".join(lines)


def _from_json(data: dict[str, Any]) -> Profile:
    return Profile(**{**data, "rows": [Row(**row) for row in data["rows"]]})


def run_profiles(
    backends: Sequence[str], pulls: int = DEFAULT_PULLS, integrity: bool | None = False
) -> int:
    """Profile each backend (:func:`profile_backends` names) in a child process of its own and
    print its table; a backend that is not available is reported as skipped. Returns 0, or 1
    when a child failed (its stderr is printed)."""
    layout, failed = SMOLLM2_LAYOUT, False
    print(
        f"Profile of one-block pulls ({block_bytes(layout)} bytes) of the {layout.model} layout, "
        f"after {WARMUP_PULLS} warm-up pulls; UCX with its default transports\n"
    )
    for backend in backends:
        if (why := unavailable(Case(backend, backend, "tcp"))) is not None:
            print(f"skipped {backend}: {why}\n")
            continue
        env = {k: v for k, v in os.environ.items() if k not in UCX_ENV}
        command = [sys.executable, "-m", __name__, backend, str(pulls), json.dumps(integrity)]
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S, check=False
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            print(f"profile of {backend} failed:\n{proc.stderr[-4000:]}\n")
            failed = True
            continue
        print(format_profile(_from_json(json.loads(lines[-1][len(RESULT_PREFIX) :]))), end="\n\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    """``python -m pdserve.bench.transfer.bench_transfer_profile BACKEND PULLS INTEGRITY_JSON``."""
    backend, pulls, integrity = (argv if argv is not None else sys.argv[1:])[:3]
    result = asyncio.run(profile_pulls(backend, int(pulls), json.loads(integrity)))
    data = {**result.__dict__, "rows": [row.__dict__ for row in result.rows]}
    emit(data)


if __name__ == "__main__":
    main()
