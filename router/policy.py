"""Routing policy: which path and which workers serve a request.

The policy is a pure function of a :class:`~pdserve.router.view.Candidates` snapshot; it decides
and never talks to a worker. A request takes one of three paths (:class:`RoutePath`):

- ``disaggregated``: a prefill worker runs the prompt and hands its KV blocks to a decode
  worker (two legs, :mod:`pdserve.router.transaction`);
- ``local_prefill``: a decode worker prefills the prompt itself and decodes (one leg, the same
  ``/internal/generate`` call without a handle that a colocated worker serves); TensorRT-LLM's
  and Dynamo's *conditional disaggregation*;
- ``colocated``: a colocated worker runs the whole request (one leg; aggregated mode).

:func:`choose_route` decides, in this order:

1. **Local prefill for short prompts** (:func:`prefill_locally`): when the tokens left to
   compute after the cached prefix are at most ``local_prefill_max_tokens`` (0 turns this
   off), the least loaded decode worker serves the request alone: the prefill costs its running
   batch about one step, less than the prefill leg's extra hop and KV pull.
2. Otherwise the least loaded compatible (prefill, decode) pair (:func:`choose_pair`).
3. **No usable pair** (no prefill worker registered, every one failed to connect, or none has a
   KV layout a decode worker maps): the least loaded decode worker prefills locally.
4. **Colocated workers** compete with the choice of 1-3: the least loaded colocated worker
   wins when its :func:`load_key` (without the id) is smaller than that of the worker the other
   path streams from (the decode worker: it holds the request until its last token, as a
   colocated worker does); a tie goes to the prefill/decode path. With colocated workers only,
   they serve everything.

Pairing (rule 2):

1. Only pairs whose KV layouts the transfer formatter maps qualify
   (:meth:`KVLayout.can_map_to`: the same model, layers, KV heads and head size; tokens per
   block and KV dtype may differ, the prefill side then converts while sending).
2. Among prefill workers, the least loaded one that has at least one compatible decode worker
   wins; among its compatible decode workers, the least loaded one wins (an equal layout is
   not preferred: the conversion costs far less than an unbalanced decode worker).
3. "Least loaded" compares :func:`load_key`: this router's in-flight count first (fresh), then
   the worker's reported ``running + waiting`` (up to a second old), then the most free KV
   blocks, then the worker id (a stable tie-break, so tests and logs are deterministic).

KV-aware routing (Dynamo's KV router; :class:`RouteWeights`, on when ``kv_overlap_weight > 0``):
the router knows, per worker, how many leading prompt tokens it is expected to hold cached
(``cached``, from the workers' KV events: :mod:`pdserve.router.kv_index`). Every choice above
("the least loaded prefill / decode / colocated worker") then takes the cheapest worker by
:func:`route_cost`, ties broken by :func:`load_key`::

    cost(w) = kv_overlap_weight * (prompt_tokens - cached(w)) + load_weight * load(w)
    load(w) = max(this router's in-flight requests on w, w's reported running + waiting)

in prompt tokens to compute: a prefix the worker holds saves computing it (a prefill worker,
or a decode worker prefilling locally) or pulling it (a decode worker on the disaggregated
path: delta transfer); each request already on the worker counts as ``load_weight`` tokens.
Rule 1 then uses the chosen decode worker's ``cached`` as the expected cached prefix. With
``kv_overlap_weight == 0`` the policy is exactly the least-loaded one above.

Retries (:func:`choose_retry`) use the same order: the decode worker a refused decode leg
moves to (among those the prefill worker's KV layout maps to) and the decode or colocated
worker a migrated stream continues on.

:class:`~pdserve.errors.NoWorkerError` (HTTP 503) says what is missing: from
:func:`choose_pair` when no pair qualifies, from :func:`choose_route` when no decode or
colocated worker is usable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from pdserve.errors import NoWorkerError
from pdserve.protocol import KVLayout, WorkerRecord
from pdserve.router.view import Candidates, WorkerState


@dataclass(frozen=True)
class Pair:
    """The workers chosen for one request."""

    prefill: WorkerRecord
    decode: WorkerRecord


def load_key(worker: WorkerState) -> tuple[int, int, int, str]:
    """Sort key, smaller = less loaded: (in-flight, running + waiting, -free blocks, id)."""
    load = worker.record.load
    return (worker.in_flight, load.running + load.waiting, -load.free_blocks, worker.worker_id)


@dataclass(frozen=True)
class RouteWeights:
    """The KV-aware cost's weights (``router.kv_overlap_weight``, ``router.load_weight``; see
    the module docstring). ``kv_overlap_weight == 0``: least-loaded routing."""

    kv_overlap_weight: float = 0.0
    load_weight: float = 256.0

    @property
    def kv_aware(self) -> bool:
        return self.kv_overlap_weight > 0


LEAST_LOADED = RouteWeights()


def worker_load(worker: WorkerState) -> int:
    """Requests on ``worker``: this router's in-flight count or the worker's reported running
    + waiting, whichever is larger (the report may lag, or count other routers' requests)."""
    load = worker.record.load
    return max(worker.in_flight, load.running + load.waiting)


def route_cost(
    worker: WorkerState, prompt_tokens: int, cached_tokens: int, weights: RouteWeights
) -> float:
    """``kv_overlap_weight * (prompt_tokens - cached_tokens) + load_weight * load``, in prompt
    tokens to compute (smaller is better)."""
    uncached = max(prompt_tokens - cached_tokens, 0)
    return weights.kv_overlap_weight * uncached + weights.load_weight * worker_load(worker)


@dataclass(frozen=True)
class Score:
    """One candidate as KV-aware routing saw it (for the decision's debug log)."""

    worker_id: str
    cached_tokens: int
    load: int
    cost: float

    def __str__(self) -> str:
        return f"{self.worker_id}(cached={self.cached_tokens} load={self.load} cost={self.cost:g})"


_Key = Callable[[WorkerState], tuple[float, int, int, int, str]]


def _sort_key(prompt_tokens: int, cached: Mapping[str, int], weights: RouteWeights) -> _Key:
    """Smaller = better: (cost, *load_key) when KV-aware, else (0, *load_key)."""

    def key(w: WorkerState) -> tuple[float, int, int, int, str]:
        cost = 0.0
        if weights.kv_aware:
            cost = route_cost(w, prompt_tokens, cached.get(w.worker_id, 0), weights)
        return (cost, *load_key(w))

    return key


def choose_pair(cands: Candidates, *, exclude_prefill: Collection[str] = ()) -> Pair:
    """Pick the least loaded compatible (prefill, decode) pair.

    ``exclude_prefill`` lists prefill worker ids not to use (a retry after a connection error).
    Raises :class:`NoWorkerError` naming what is missing: no prefill worker, no decode worker,
    or no pair with mappable KV layouts (with the layout hashes on each side and what differs).
    """
    model = repr(cands.model)
    prefill = [w for w in cands.prefill if w.worker_id not in exclude_prefill]
    if not prefill:
        others = " other than " + ", ".join(sorted(exclude_prefill)) if exclude_prefill else ""
        raise NoWorkerError(
            f"no live prefill worker{others} serves model {model}{_why(cands)}",
            public=f"no live prefill worker serves model {model}",
        )
    if not cands.decode:
        raise NoWorkerError(
            f"no live decode worker serves model {model}{_why(cands)}",
            public=f"no live decode worker serves model {model}",
        )

    pair = _best_pair(prefill, list(cands.decode))
    if pair is not None:
        return Pair(prefill=pair[0].record, decode=pair[1].record)

    p_hashes = sorted({w.compat_hash for w in prefill})
    d_hashes = sorted({w.compat_hash for w in cands.decode})
    example = prefill[0].record.layout.describe_unmappable(cands.decode[0].record.layout)
    raise NoWorkerError(
        f"no prefill/decode pair with mappable KV layouts for model {model}: prefill layouts "
        f"{p_hashes}, decode layouts {d_hashes} (e.g. {prefill[0].worker_id} -> "
        f"{cands.decode[0].worker_id}: {example}; workers must run the same model with the same "
        "layers, KV heads and head size)",
        public=f"no prefill/decode pair of workers with mappable KV layouts serves model {model}",
    )


class RoutePath(StrEnum):
    """How a request is served (the ``path`` label of ``pdserve_router_decisions_total``)."""

    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local_prefill"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Route:
    """The routing decision for one request. ``worker`` streams the tokens (a decode worker on
    the disaggregated and local-prefill paths, a colocated worker on the colocated path);
    ``prefill`` is set on the disaggregated path only. ``reason`` says why, for the log."""

    path: RoutePath
    worker: WorkerRecord
    prefill: WorkerRecord | None = None
    reason: str = ""
    cached_tokens: int = 0
    """Prompt tokens ``worker`` is expected to hold cached (KV-aware routing; else 0)."""
    prefill_cached_tokens: int = 0
    """Prompt tokens ``prefill`` is expected to hold cached (disaggregated path)."""
    scores: tuple[Score, ...] = ()
    """Every candidate's cached tokens, load and cost (KV-aware routing only)."""

    @property
    def pair(self) -> Pair | None:
        """The (prefill, decode) pair of a disaggregated route, else None."""
        return Pair(self.prefill, self.worker) if self.prefill is not None else None


def prefill_locally(prompt_tokens: int, cached_tokens: int, max_tokens: int) -> bool:
    """Conditional disaggregation: whether a decode worker should prefill this prompt itself
    instead of taking the hand-off from a prefill worker.

    True when ``max_tokens > 0`` and the tokens left to compute, ``prompt_tokens`` minus the
    ``cached_tokens`` the decode worker is expected to hold already (0 until the router knows
    the workers' cached prefixes: KV-aware routing), are at most ``max_tokens``
    (``router.local_prefill_max_tokens``; 0 turns local prefill of short prompts off).
    """
    left = max(prompt_tokens - max(cached_tokens, 0), 0)
    return max_tokens > 0 and left <= max_tokens


def choose_route(
    cands: Candidates,
    prompt_tokens: int,
    *,
    local_prefill_max_tokens: int,
    cached: Mapping[str, int] | None = None,
    weights: RouteWeights = LEAST_LOADED,
    exclude: Collection[str] = (),
) -> Route:
    """Pick the path and the workers for a request of ``prompt_tokens`` tokens (the rules of
    the module docstring). ``cached``: per worker id, the prompt tokens it is expected to hold
    (KV-aware routing; used only when ``weights.kv_aware``). ``exclude`` lists worker ids not
    to use (a retry after a connection error). Raises :class:`NoWorkerError` when no decode or
    colocated worker is usable."""
    prefill = [w for w in cands.prefill if w.worker_id not in exclude]
    decode = [w for w in cands.decode if w.worker_id not in exclude]
    colocated = [w for w in cands.colocated if w.worker_id not in exclude]
    cached = cached if cached is not None and weights.kv_aware else {}
    key = _sort_key(prompt_tokens, cached, weights)
    limit = local_prefill_max_tokens
    route: Route | None = None
    streams: WorkerState | None = None  # the worker that streams the tokens on ``route``
    best_decode = min(decode, key=key) if decode else None
    d_cached = cached.get(best_decode.worker_id, 0) if best_decode is not None else 0
    left = max(prompt_tokens - d_cached, 0)
    if best_decode is not None and prefill_locally(prompt_tokens, d_cached, limit):
        streams = best_decode
        why = f"{left} tokens to compute <= local_prefill_max_tokens {limit}"
        route = Route(RoutePath.LOCAL_PREFILL, streams.record, reason=why, cached_tokens=d_cached)
    elif best_decode is not None:
        pair = _best_pair(prefill, decode, key)
        if pair is not None:
            streams = pair[1]
            why = "local prefill of short prompts is off"
            if limit > 0:
                why = f"{left} tokens to compute > local_prefill_max_tokens {limit}"
            route = Route(
                RoutePath.DISAGGREGATED,
                streams.record,
                pair[0].record,
                why,
                cached_tokens=cached.get(streams.worker_id, 0),
                prefill_cached_tokens=cached.get(pair[0].worker_id, 0),
            )
        else:
            streams = best_decode
            why = "no usable prefill worker"
            if prefill:
                why = "no prefill/decode pair with mappable KV layouts"
            route = Route(
                RoutePath.LOCAL_PREFILL, streams.record, reason=why, cached_tokens=d_cached
            )
    if colocated:
        c = min(colocated, key=key)
        if streams is None or load_key(c)[:3] < load_key(streams)[:3]:
            why = "no usable decode worker"
            if streams is not None:
                why = f"less loaded than decode worker {streams.worker_id}"
            c_cached = cached.get(c.worker_id, 0)
            route = Route(RoutePath.COLOCATED, c.record, reason=why, cached_tokens=c_cached)
    if route is None:
        others = " other than " + ", ".join(sorted(exclude)) if exclude else ""
        what = f"no live decode or colocated worker serves model {cands.model!r}"
        raise NoWorkerError(what.replace(" serves", f"{others} serves") + _why(cands), public=what)
    if weights.kv_aware:
        route = replace(route, scores=_scores(key, cached, *prefill, *decode, *colocated))
    return route


def choose_retry(
    cands: Candidates,
    prompt_tokens: int,
    *,
    skip: Callable[[WorkerState], bool],
    maps_from: KVLayout | None = None,
    colocated: bool = False,
    cached: Mapping[str, int] | None = None,
    weights: RouteWeights = LEAST_LOADED,
) -> WorkerRecord | None:
    """The worker that takes a request whose leg failed, by the same order as
    :func:`choose_route` (the KV-aware cost when ``weights.kv_aware``, then :func:`load_key`):
    a decode worker (and a colocated one when ``colocated``: a migration, which needs no
    prefill worker) that ``skip`` does not rule out (the workers or incarnations already
    tried) and, with ``maps_from`` (the prefill worker's KV layout on a decode-leg retry, whose
    blocks are still parked there), whose layout that one maps to. None: no such worker now."""
    cached = cached if cached is not None and weights.kv_aware else {}
    key = _sort_key(prompt_tokens, cached, weights)
    usable = [
        w
        for w in (*cands.decode, *(cands.colocated if colocated else ()))
        if not skip(w) and (maps_from is None or maps_from.can_map_to(w.record.layout))
    ]
    return min(usable, key=key).record if usable else None


def _scores(key: _Key, cached: Mapping[str, int], *workers: WorkerState) -> tuple[Score, ...]:
    return tuple(
        Score(w.worker_id, cached.get(w.worker_id, 0), worker_load(w), key(w)[0]) for w in workers
    )


def _best_pair(
    prefill: list[WorkerState], decode: list[WorkerState], key: _Key = lambda w: (0.0, *load_key(w))
) -> tuple[WorkerState, WorkerState] | None:
    """The first prefill worker by ``key`` that has a decode worker its layout maps to, with
    the best such decode worker by ``key``."""
    for p in sorted(prefill, key=key):
        compatible = [d for d in decode if p.record.layout.can_map_to(d.record.layout)]
        if compatible:
            return p, min(compatible, key=key)
    return None


def _why(cands: Candidates) -> str:
    return f" (skipped: {'; '.join(cands.skipped)})" if cands.skipped else ""


def route_attributes(route: Route) -> dict[str, object]:
    """The routing decision as span attributes (path, workers, KV overlap, reason)."""
    return {
        "pdserve_route_path": str(route.path),
        "pdserve_route_reason": route.reason,
        "pdserve_worker_id": route.worker.worker_id,
        "pdserve_prefill_worker_id": route.prefill.worker_id if route.prefill else None,
        "pdserve_kv_overlap_tokens": route.cached_tokens,
        "pdserve_prefill_kv_overlap_tokens": route.prefill_cached_tokens if route.prefill else None,
    }
