"""What the worker roles use of an engine: the :class:`WorkerEngine` protocol.

The roles (:mod:`pdserve.workers.roles`, :mod:`~pdserve.workers.roles.prefill`,
:mod:`~pdserve.workers.roles.decode`) depend on this protocol, never on the concrete
:class:`pdserve.workers.engine.engine.Engine`, so a deterministic fake without a model
(``tests/support/fake_engine.py``) can stand in for it. Everything listed here is used by a role; add
a member only when a role starts using it.

Threading: the engine runs its own step thread; every method here may be called from the
worker's event loop thread and must not block on a forward pass. Sinks are called on the
engine thread (see :class:`pdserve.workers.roles.bridge.OutputStream`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.config.loading import EngineConfig
    from pdserve.protocol import KVLayout, SamplingParams, WorkerLoad
    from pdserve.workers.engine.requests import EngineRequest, Reservation, Sink
    from pdserve.workers.kv.manager import KVCacheManager
    from pdserve.workers.kv.offload import KVConnectorStats


class PrefixLending(Protocol):
    """The scheduler's side of a peer prefix pull (:mod:`pdserve.workers.roles.lending`;
    :class:`~pdserve.workers.engine.scheduler.Scheduler` implements it, thread-safe)."""

    def lend(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        """Pin the longest cached leading run of ``block_hashes``; its block ids ([]: none)."""
        ...

    def end_lend(self, lend_id: str) -> None:
        """Unpin what :meth:`lend` pinned (the blocks stay cached); idempotent."""
        ...

    def adopt(self, request_id: str) -> int:
        """Index a filled reservation's full blocks in the prefix cache and free them; the
        blocks indexed now."""
        ...


class WorkerEngine(Protocol):
    """The engine as the worker roles see it.

    ``layout``: the KV layout of :attr:`kv_cache`'s pool (what goes into handles and the
    discovery record). ``kv_cache``: owns the pool tensor
    ``[num_layers, num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]`` and the block
    generations the prefill side's fencing checks. ``scheduler``: lends and adopts prefix
    blocks (peer prefix pull).
    """

    layout: KVLayout
    kv_cache: KVCacheManager

    @property
    def scheduler(self) -> PrefixLending:
        """Lends and adopts prefix blocks (peer prefix pull)."""
        ...

    def start(self) -> None:
        """Start the step thread; idempotent."""
        ...

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the step thread (waits at most ``timeout`` seconds); idempotent."""
        ...

    def prepare_grammar(self, sampling: SamplingParams) -> None:
        """Compile ``sampling.structured`` into the engine's grammar cache (a no-op without
        one); blocking, call it in a thread. Raises InvalidRequestError (does not compile)."""
        ...

    def add_request(self, req: EngineRequest, sink: Sink) -> None:
        """Queue ``req``; its outputs go to ``sink``. Raises InvalidRequestError,
        CapacityError (never fits), QueueFullError (queue at its bound)."""
        ...

    def abort(self, request_id: str) -> None:
        """End ``request_id`` wherever it is (parked and reserved blocks are freed now)."""
        ...

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        reuse_prefix: bool = False,
    ) -> Reservation:
        """Allocate the prompt's blocks for a pull (token order); with ``reuse_prefix`` the
        leading ones may be a prefix cache hit (``Reservation.cached_blocks``: not pulled).
        Raises CapacityError when they are not free now, InvalidRequestError as
        :meth:`add_request` does."""
        ...

    def unreserve(self, request_id: str) -> None:
        """Drop a reservation not yet submitted, freeing its blocks; idempotent."""
        ...

    def free_parked(self, request_id: str) -> None:
        """Free the blocks a prefill-mode request parked; idempotent."""
        ...

    def load(self) -> WorkerLoad:
        """Queue lengths and KV block counts now."""
        ...

    def kv_connector_stats(self) -> KVConnectorStats | None:
        """The KV cache connector's tier counters (None: no tier); the worker's metrics."""
        ...


EngineFactory = Callable[["EngineConfig"], WorkerEngine]
"""Builds a worker's engine from its config (blocking: loads the model); run in a thread."""


def default_engine_factory(cfg: EngineConfig) -> WorkerEngine:
    """The real engine (imports torch and transformers on first use)."""
    from pdserve.workers.engine.engine import Engine

    return Engine(cfg)
