"""KV transfer benchmark: every backend beside a raw-socket and a memcpy reference, in one run.

The KV transfer benchmark. Each *case* moves KV blocks of a real layout (default SmolLM2-135M: 30
layers, 3 KV heads, head dim 64, 16 tokens per block, float32 = 720 KiB per block) from a
prefill-side transceiver to a decode-side transceiver, in two fresh processes started with the
case's environment (:mod:`pdserve.bench.transfer.bench_transfer_peers`), exactly as workers do:
authenticate and handshake once per connection (outside the timing), then per request
SendBlocks -> bytes -> Release. Cases::

    tcp        the TCP backend (bytes on the control connection)
    nixl-tcp   NIXL WRITE with UCX_TLS=tcp on loopback      (the cross-host path, on one host)
    nixl-shm   NIXL WRITE with UCX's default transports     (same host: CMA / shared memory)
    ucx-tcp    the ucxx backend, UCX_TLS=tcp on loopback     (only when "ucx" is registered)
    ucx-shm    the ucxx backend, default transports

References measured in the same run (figures on a shared machine compare only within a run):
``raw-socket``, a blocking Python socket stream between two processes moving the same byte
counts (request 8 bytes, ``recv_into`` a preallocated buffer; same socket options as the TCP
backend), and ``memcpy``, ``numpy.copyto`` of the same byte counts in one process (the
benchmark's own, while no peer runs).

Every case is measured with integrity digests off and on when ``TransferSettings`` has the
``integrity`` field. With ``tp_pairs`` (``--tp-pairs 1:3 3:1``), every case also moves the same
requests from a prefill pool split over M tensor parallel ranks into a decode pool split over
N (series ``<case> tpM>N``): the Formatter maps the KV heads (staging on the prefill side;
M = N stays zero-copy, shard by shard), and each such series is compared with the case's
unmapped series of the same bytes. Per case a fit ``t = c + bytes / B`` (least squares on the p50 times,
weighted by 1/t^2 so every size counts by its relative error) gives the fixed cost per
transfer ``c`` in microseconds and the bandwidth ``B``. GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.bench.transfer.bench_transfer_peers import (
    RESULT_PREFIX,
    SECRET_ENV,
    PeerSpec,
    block_bytes,
    memcpy_times,
)
from pdserve.config.settings import TransferSettings
from pdserve.protocol import KVLayout
from pdserve.security import generate_secret
from pdserve.transfer import backend as backend_registry

SMOLLM2_LAYOUT = KVLayout(
    model="SmolLM2-135M-Instruct",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    tokens_per_block=16,
    dtype="float32",
)


def nearest_blocks(layout: KVLayout, size_bytes: float) -> int:
    """The whole number of ``layout``'s blocks (at least 1) whose bytes are closest to
    ``size_bytes`` (the smaller count on a tie)."""
    per_block = block_bytes(layout)
    low = max(1, math.floor(size_bytes / per_block))
    return min((low, low + 1), key=lambda n: (abs(n * per_block - size_bytes), n))


DEFAULT_BLOCKS = sorted({1, 2, 4, 8, 16, 32, 64, 91, nearest_blocks(SMOLLM2_LAYOUT, 16 * 2**20)})
"""One block (0.7 MiB) to 91 blocks (64.0 MiB) of the SmolLM2 layout, and the block count
closest to 16 MiB, where the same-host and digest targets are checked: 23 blocks = 16.2 MiB
(22 would be 15.5 MiB)."""

_UCX_ENV = ("UCX_TLS", "UCX_NET_DEVICES")  # cleared in every case: the case decides
_START_TIMEOUT_S = 120.0
_RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Case:
    """One backend configuration. ``path`` is what it stands for: ``"tcp"`` (a network path,
    compared with the raw socket) or ``"same-host"`` (compared with memcpy); ``env`` is set
    in both processes' environment."""

    name: str
    backend: str
    path: Literal["tcp", "same-host"]
    env: dict[str, str] = field(default_factory=dict)
    ucx_devices: str | None = None


_LOOPBACK_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("tcp", "tcp", "tcp"),
        Case("nixl-tcp", "nixl", "tcp", _LOOPBACK_TCP, ucx_devices="lo"),
        Case("nixl-shm", "nixl", "same-host"),
        Case("ucx-tcp", "ucx", "tcp", _LOOPBACK_TCP, ucx_devices="lo"),
        Case("ucx-shm", "ucx", "same-host"),
    )
}
ALIASES = {"nixl": ["nixl-tcp", "nixl-shm"], "ucx": ["ucx-tcp", "ucx-shm"]}


@dataclass(frozen=True)
class Fit:
    """``t = fixed_us * 1e-6 + bytes / (gbps * 1e9)``; ``gbps`` is ``inf`` when the time did
    not grow with the size."""

    fixed_us: float
    gbps: float


@dataclass
class Series:
    """One column of the result: seconds per repetition for every request size (blocks)."""

    name: str
    path: Literal["tcp", "same-host", "reference"]
    times: dict[int, list[float]]
    integrity: bool | None = None
    baseline: str | None = None
    """A mapped series (tensor parallel layouts): the unmapped series it is compared with."""

    def p50(self, blocks: int) -> float:
        return statistics.median(self.times[blocks])

    def gbps(self, blocks: int, layout: KVLayout) -> float:
        return blocks * block_bytes(layout) / self.p50(blocks) / 1e9

    def fit(self, layout: KVLayout) -> Fit:
        sizes = sorted(self.times)
        return fit_cost([n * block_bytes(layout) for n in sizes], [self.p50(n) for n in sizes])


@dataclass
class Result:
    """Everything one run measured; ``skipped`` holds ``case name -> why``."""

    layout: KVLayout
    blocks: list[int]
    series: list[Series]
    skipped: dict[str, str]

    def get(self, name: str) -> Series | None:
        return next((s for s in self.series if s.name == name), None)


def fit_cost(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> Fit:
    """Least squares of ``t = c + bytes / B`` weighted by ``1 / t**2`` (relative residuals, so
    the microseconds of small requests are not drowned by the milliseconds of large ones).

    Raises ValueError for fewer than two distinct sizes, unequal lengths or a time <= 0."""
    if len(sizes_bytes) != len(seconds):
        raise ValueError("one time per size is needed")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("a fit needs at least two distinct sizes")
    if min(seconds) <= 0:
        raise ValueError("times must be positive")
    w = [1.0 / t**2 for t in seconds]
    sw = sum(w)
    sb = sum(wi * b for wi, b in zip(w, sizes_bytes, strict=True))
    st = sum(wi * t for wi, t in zip(w, seconds, strict=True))
    sbb = sum(wi * b * b for wi, b in zip(w, sizes_bytes, strict=True))
    sbt = sum(wi * b * t for wi, b, t in zip(w, sizes_bytes, seconds, strict=True))
    slope = (sw * sbt - sb * st) / (sw * sbb - sb * sb)  # seconds per byte
    fixed = (st - slope * sb) / sw
    return Fit(fixed_us=fixed * 1e6, gbps=1e-9 / slope if slope > 0 else math.inf)


def resolve_cases(names: Sequence[str]) -> list[Case]:
    """Case names (or the aliases ``nixl``, ``ucx``) -> cases, in order, without repeats.
    Raises ValueError for an unknown name."""
    out: list[Case] = []
    for name in names:
        for n in ALIASES.get(name, [name]):
            if n not in CASES:
                known = ", ".join([*CASES, *ALIASES])
                raise ValueError(f"unknown transfer benchmark case {n!r} (known: {known})")
            if CASES[n] not in out:
                out.append(CASES[n])
    return out


def unavailable(case: Case) -> str | None:
    """Why ``case`` cannot run in this installation (None: it can)."""
    if case.backend not in backend_registry.registered_backends():
        return f"no {case.backend!r} transfer backend is registered in this build"
    try:
        TransferSettings.model_validate({"backend": case.backend})
    except ValueError:
        return f"TransferSettings does not accept backend {case.backend!r} yet"
    return None


def integrity_settings(mode: Literal["off", "on", "both"]) -> list[bool]:
    """The integrity values to measure ([] when TransferSettings has no ``integrity`` field)."""
    if "integrity" not in TransferSettings.model_fields:
        return []
    return {"off": [False], "on": [True], "both": [False, True]}[mode]


def run_transfer_benchmark(
    layout: KVLayout,
    blocks: Sequence[int],
    cases: Sequence[Case],
    *,
    integrity: Literal["off", "on", "both"] = "both",
    min_seconds: float = 0.3,
    rounds: int = 1,
    tp_pairs: Sequence[tuple[int, int]] = (),
) -> Result:
    """Measure the references and every case (see the module docstring) ``rounds`` times, in
    turn, pooling the repetitions of all rounds (on a shared machine the load drifts; rounds
    spread every series over the same stretch of time). Call it outside an event loop. A case
    whose backend is missing is skipped (``Result.skipped``); a case that fails raises
    RuntimeError with its processes' stderr. ``tp_pairs``: (prefill, decode) tensor parallel
    sizes to measure beside the unmapped case; each must split ``layout``'s KV heads (else
    pydantic's ValidationError)."""
    blocks = sorted(set(blocks))
    spec = PeerSpec(layout=layout, blocks=blocks, min_seconds=min_seconds)
    result = Result(layout, blocks, [], {})
    runnable = []
    for case in cases:
        if (why := unavailable(case)) is not None:
            result.skipped[case.name] = why
        else:
            runnable.append(case)
    pairs: list[tuple[KVLayout, KVLayout | None, str]] = [(layout, None, "")]
    for m, n in tp_pairs:
        src = KVLayout(**{**layout.model_dump(), "tp_size": m})
        dst = KVLayout(**{**layout.model_dump(), "tp_size": n})
        pairs.append((src, dst, f" tp{m}>{n}"))
    for _ in range(rounds):
        _round(result, spec, runnable, integrity_settings(integrity), pairs)
    return result


def _round(
    result: Result,
    spec: PeerSpec,
    cases: Sequence[Case],
    integrity: list[bool],
    pairs: Sequence[tuple[KVLayout, KVLayout | None, str]],
) -> None:
    """One measurement of every series, added to ``result`` (new series or more repetitions)."""
    env = _env({})
    _add(result, Series("memcpy", "reference", asyncio.run(memcpy_times(spec))))
    with _Server("source", spec, env) as server:
        times = _run_one("sink", spec.model_copy(update={"endpoint": server.endpoint}), env)
    _add(result, Series("raw-socket", "reference", times[0]["times"]))
    for case, (src, dst, label) in ((c, p) for c in cases for p in pairs):
        case_spec = spec.model_copy(
            update={
                "backend": case.backend,
                "ucx_devices": case.ucx_devices,
                "integrity": integrity,
                "layout": src,
                "dst_layout": dst,
            }
        )
        case_env = _env(case.env)
        with _Server("serve", case_spec, case_env) as server:
            pulled = _run_one(
                "pull", case_spec.model_copy(update={"endpoint": server.endpoint}), case_env
            )
        for r in pulled:
            digests = "+xxh3" if r["integrity"] else ""
            base = case.name + digests
            name = case.name + label + digests
            series = Series(name, case.path, r["times"], r["integrity"], base if label else None)
            _add(result, series)


def _add(result: Result, series: Series) -> None:
    series.times = {int(k): v for k, v in series.times.items()}  # JSON object keys are strings
    if (known := result.get(series.name)) is None:
        result.series.append(series)
    else:
        for n, times in series.times.items():
            known.times[n] = known.times[n] + times


def _env(extra: dict[str, str]) -> dict[str, str]:
    """The children's environment: ours without the UCX variables the case decides, plus
    ``extra`` and a fresh cluster secret (the serve and pull roles of a case share it)."""
    env = {k: v for k, v in os.environ.items() if k not in _UCX_ENV}
    return {**env, **extra, SECRET_ENV: generate_secret()}


def _command(role: str, spec: PeerSpec) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdserve.bench.transfer.bench_transfer_peers",
        role,
        spec.model_dump_json(),
    ]


def _results(stdout: str) -> list[dict[str, Any]]:
    import json

    return [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]


def _run_one(role: str, spec: PeerSpec, env: dict[str, str]) -> list[dict[str, Any]]:
    """Run a measuring role to its end; its result lines. Raises RuntimeError on failure."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(
            _command(role, spec),
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=_RUN_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0 or not (results := _results(proc.stdout)):
            err.seek(0)
            raise RuntimeError(f"benchmark role {role} failed:\n{err.read()[-4000:]}")
    return results


class _Server:
    """A serving role (``serve`` or ``source``) for the length of a ``with`` block. Its stdout
    goes to a file (a pipe nobody drains could fill up with library logs and block it)."""

    def __init__(self, role: str, spec: PeerSpec, env: dict[str, str]):
        self._out = tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-")  # noqa: SIM115
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            _command(role, spec),
            env=env,
            stdin=subprocess.PIPE,
            stdout=self._out,
            stderr=self._err,
        )
        self.role = role
        self.endpoint = ""

    def __enter__(self) -> _Server:
        try:
            self.endpoint = self._first_result()["endpoint"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # "serve" ends at EOF; "source" when the sink disconnected
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.close()
        self._err.close()

    def _first_result(self) -> dict[str, Any]:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and self._proc.poll() is None:
            with open(self._out.name) as out:
                if results := _results(out.read().rpartition("\n")[0]):
                    return results[0]
            time.sleep(0.05)
        self._err.seek(0)
        raise RuntimeError(f"benchmark role {self.role} did not start:\n{self._err.read()[-4000:]}")
