"""A performance profile of one model on one kind of hardware, as ``pdserve bench profile``
writes it and the planner's simulator reads it (:mod:`pdserve.planner.simulate`).

The profile holds measured times, seconds, in a JSON file (format :data:`FORMAT`)::

    {"format": "pdserve-profile-v1", "model": ..., "cpu": ..., "device": "cpu", "dtype": ...,
     "tokens_per_block": 16, "kv_bytes_per_token": 184320, "transfer_backend": "nixl",
     "router_s": 0.0015, "leg_s": 0.004,
     "engines": [{"threads": 1,
                  "prefill": [[tokens, s], ...],          # one step, a whole fresh prompt
                  "decode": [[batch, context, s], ...],   # one decode step
                  "mixed": [[prompt, batch, context, s], ...]},  # both in one step
                 ...],
     "handoff": [[bytes, s], ...]}                         # one KV pull, D's view

From these :class:`EngineProfile` predicts the time of any engine step as the scheduler builds
it (continuous batching, chunked prefill: :class:`pdserve.workers.engine.scheduler.Scheduler`),
and :class:`Profile` a hand-off of any size:

- a prefill chunk of ``n`` tokens after ``c`` already computed: ``P(c + n) - P(c) + P0`` with
  ``P`` the measured whole-prompt time (linear between points, extended along the last segment)
  and ``P0`` its intercept, the fixed cost of a forward. A continued chunk costs what growing the
  prompt costs (its attention reads the earlier tokens) plus that fixed cost;
- a decode step of ``b`` sequences at mean context ``c``: bilinear in the measured grid
  (extended linearly in ``b``, held at the grid's edge in ``c``);
- several chunks in one step: one fixed cost ``P0`` for all;
- a mixed step: decode + chunks - ``overlap``, the cost a decode batch and a prompt chunk share
  in one forward (the weights are read once); ``overlap`` is the mean over the ``mixed`` points
  of what the sum overestimates, clamped at 0;
- a hand-off of ``B`` bytes: linear in the measured ``handoff`` points (``transfer_backend``).

``router_s`` (the router's own time per request: tokenize, route) and ``leg_s`` (one HTTP leg
router -> worker -> router, without the worker's compute) are the small fixed costs on the path.

DistServe (OSDI'24) and Dynamo's profiler fit the same kind of model (prefill time against
prompt length, decode step time against batch and context) to plan a P:D split.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "pdserve-profile-v1"
"""The ``format`` field of a profile file; :meth:`Profile.load` refuses any other."""


class ProfileError(ValueError):
    """A profile file that cannot be read or is not a usable pdserve profile."""


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points ``(xs[i], ys[i])`` (``xs`` increasing,
    at least one point), extended along the first and last segments outside them."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _clamp_interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    return interp(xs, ys, min(max(x, xs[0]), xs[-1]))


@dataclass
class EngineProfile:
    """The measured step times of one engine at ``threads`` torch threads (seconds).
    ``prefill``: ``(tokens, s)``; ``decode``: ``(batch, context, s)``; ``mixed``:
    ``(prompt, batch, context, s)``. Raises ProfileError when a table is empty."""

    threads: int
    prefill: list[tuple[int, float]]
    decode: list[tuple[int, int, float]]
    mixed: list[tuple[int, int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ProfileError(f"engine at {self.threads} threads: empty prefill or decode table")
        self.prefill = sorted(self.prefill)
        self._p_x = [float(n) for n, _ in self.prefill]
        self._p_y = [s for _, s in self.prefill]
        batches = sorted({b for b, _, _ in self.decode})
        self._d_rows: list[tuple[float, list[float], list[float]]] = []
        for b in batches:
            pts = sorted((c, s) for bb, c, s in self.decode if bb == b)
            self._d_rows.append((float(b), [float(c) for c, _ in pts], [s for _, s in pts]))
        self.fixed_s = max(0.0, interp(self._p_x, self._p_y, 0.0))
        errs = [self.decode_s(b, c) + self.chunk_s(p, 0) - s for p, b, c, s in self.mixed]
        self.overlap_s = max(0.0, sum(errs) / len(errs)) if errs else 0.0

    def prompt_s(self, tokens: float) -> float:
        """Seconds to prefill a fresh prompt of ``tokens`` in one step."""
        return max(self.fixed_s, interp(self._p_x, self._p_y, tokens))

    def chunk_s(self, tokens: int, context: int) -> float:
        """Seconds of a prefill chunk of ``tokens`` after ``context`` computed tokens."""
        if context <= 0:
            return self.prompt_s(tokens)
        return max(0.0, self.prompt_s(context + tokens) - self.prompt_s(context)) + self.fixed_s

    def decode_s(self, batch: int, context: float) -> float:
        """Seconds of a decode step of ``batch`` sequences at mean ``context`` tokens."""
        if batch <= 0:
            return 0.0
        ys = [_clamp_interp(cs, ss, context) for _, cs, ss in self._d_rows]
        return max(0.0, interp([b for b, _, _ in self._d_rows], ys, batch))

    def step_s(self, chunks: Sequence[tuple[int, int]], batch: int, context: float) -> float:
        """Seconds of one step: ``chunks`` as ``(tokens, context)`` prefill chunks beside a
        decode batch of ``batch`` sequences at mean ``context``. The chunks of one step share
        one forward, hence one fixed cost."""
        prefill = (
            self.fixed_s + sum(self.chunk_s(n, c) - self.fixed_s for n, c in chunks)
            if chunks
            else 0.0
        )
        decode = self.decode_s(batch, context)
        if prefill and decode:
            return max(prefill, decode, prefill + decode - self.overlap_s)
        return prefill + decode

    def to_json(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "prefill": [list(p) for p in self.prefill],
            "decode": [list(d) for d in self.decode],
            "mixed": [list(m) for m in self.mixed],
        }


@dataclass
class Profile:
    """A model's profile on one kind of hardware (see the module docstring). ``engines`` by
    thread count; ``handoff`` as ``(bytes, s)``; ``kv_bytes_per_token`` what one prompt token's
    K/V moves in a hand-off (all layers, K and V)."""

    model: str
    engines: list[EngineProfile]
    handoff: list[tuple[int, float]]
    kv_bytes_per_token: int
    tokens_per_block: int = 16
    router_s: float = 0.0015
    leg_s: float = 0.004
    transfer_backend: str = "nixl"
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it was measured (cpu, device, dtype, date, settings); not read by the model."""

    def __post_init__(self) -> None:
        if not self.engines:
            raise ProfileError("a profile needs at least one engine")
        if not self.handoff:
            raise ProfileError("a profile needs hand-off points")
        self.engines = sorted(self.engines, key=lambda e: e.threads)
        self.handoff = sorted(self.handoff)

    def engine(self, threads: int) -> EngineProfile:
        """The engine measured at the most threads not above ``threads`` (else the fewest)."""
        fit = [e for e in self.engines if e.threads <= threads]
        return fit[-1] if fit else self.engines[0]

    def handoff_s(self, prompt_tokens: int) -> float:
        """Seconds of the KV pull of a ``prompt_tokens`` prompt (whole blocks move)."""
        blocks = -(-prompt_tokens // self.tokens_per_block)
        size = blocks * self.tokens_per_block * self.kv_bytes_per_token
        xs = [float(b) for b, _ in self.handoff]
        return max(0.0, interp(xs, [s for _, s in self.handoff], size))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            **self.meta,
            "tokens_per_block": self.tokens_per_block,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "transfer_backend": self.transfer_backend,
            "router_s": self.router_s,
            "leg_s": self.leg_s,
            "engines": [e.to_json() for e in self.engines],
            "handoff": [list(h) for h in self.handoff],
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: Any) -> Profile:
        """Raises ProfileError for anything but a ``pdserve-profile-v1`` object."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ProfileError(f"not a pdserve profile (format {got!r}, expected {FORMAT!r})")
        known = {"format", "model", "tokens_per_block", "kv_bytes_per_token", "transfer_backend",
                 "router_s", "leg_s", "engines", "handoff"}  # fmt: skip
        try:
            engines = [
                EngineProfile(
                    int(e["threads"]),
                    [(int(n), float(s)) for n, s in e["prefill"]],
                    [(int(b), int(c), float(s)) for b, c, s in e["decode"]],
                    [(int(p), int(b), int(c), float(s)) for p, b, c, s in e.get("mixed", [])],
                )
                for e in data["engines"]
            ]
            return cls(
                model=str(data["model"]),
                engines=engines,
                handoff=[(int(b), float(s)) for b, s in data["handoff"]],
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                tokens_per_block=int(data.get("tokens_per_block", 16)),
                router_s=float(data.get("router_s", 0.0015)),
                leg_s=float(data.get("leg_s", 0.004)),
                transfer_backend=str(data.get("transfer_backend", "nixl")),
                meta={k: v for k, v in data.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise ProfileError(f"malformed profile: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Read ``path``; raises ProfileError when it is missing, not JSON or not a profile."""
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise ProfileError(f"{path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not JSON ({exc})") from exc
