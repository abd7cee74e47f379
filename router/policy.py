"""Pairing policy: which prefill worker and which decode worker serve a request.

The policy is a pure function of a :class:`~pdserve.router.view.Candidates` snapshot; it decides
and never talks to a worker. Rules, in order:

1. Only pairs whose KV layouts the transfer formatter maps qualify
   (:meth:`KVLayout.can_map_to`: the same model, layers, KV heads and head size; tokens per
   block and KV dtype may differ, the prefill side then converts while sending).
2. Among prefill workers, the least loaded one that has at least one compatible decode worker
   wins; among its compatible decode workers, the least loaded one wins (an equal layout is
   not preferred: the conversion costs far less than an unbalanced decode worker).
3. "Least loaded" compares :func:`load_key`: this router's in-flight count first (fresh), then
   the worker's reported ``running + waiting`` (up to a second old), then the most free KV
   blocks, then the worker id (a stable tie-break, so tests and logs are deterministic).

When no pair qualifies, :class:`~pdserve.errors.NoWorkerError` (HTTP 503) says why.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pdserve.errors import NoWorkerError
from pdserve.protocol import WorkerRecord
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
        raise NoWorkerError(f"no live prefill worker{others} serves model {model}{_why(cands)}")
    if not cands.decode:
        raise NoWorkerError(f"no live decode worker serves model {model}{_why(cands)}")

    for p in sorted(prefill, key=load_key):
        compatible = [d for d in cands.decode if p.record.layout.can_map_to(d.record.layout)]
        if compatible:
            d = min(compatible, key=load_key)
            return Pair(prefill=p.record, decode=d.record)

    p_hashes = sorted({w.compat_hash for w in prefill})
    d_hashes = sorted({w.compat_hash for w in cands.decode})
    example = prefill[0].record.layout.describe_unmappable(cands.decode[0].record.layout)
    raise NoWorkerError(
        f"no prefill/decode pair with mappable KV layouts for model {model}: prefill layouts "
        f"{p_hashes}, decode layouts {d_hashes} (e.g. {prefill[0].worker_id} -> "
        f"{cands.decode[0].worker_id}: {example}; workers must run the same model with the same "
        "layers, KV heads and head size)"
    )


def _why(cands: Candidates) -> str:
    return f" (skipped: {'; '.join(cands.skipped)})" if cands.skipped else ""
