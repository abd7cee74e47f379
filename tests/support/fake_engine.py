"""A deterministic engine without a model, implementing
:class:`pdserve.workers.engine.api.WorkerEngine` over a real CPU
:class:`~pdserve.workers.kv.manager.KVCacheManager` pool, so the worker roles, the transceiver and
the fencing around them run unchanged in unit tests.

What it does per mode (outputs are delivered synchronously from :meth:`FakeEngine.add_request`;
the worker's :class:`~pdserve.workers.roles.bridge.OutputStream` queues them on the event loop):

- ``prefill``: allocates the prompt's blocks, fills them with :func:`kv_pattern` (the K/V a
  real prefill would write: a function of the prompt), answers one output carrying token
  :func:`token_at` (prompt, 0) and ``parked_block_ids`` (the caller owns them until
  :meth:`FakeEngine.free_parked`), unless ``max_tokens == 1`` with ``n == 1`` (finished,
  blocks freed at once).
- ``resume``: needs a reservation (:meth:`FakeEngine.reserve`) holding exactly the prompt's
  K/V pattern (else the request fails with ``finish_reason=ERROR``: a transfer that did not
  land is caught), then streams tokens 1..max_tokens-1 and frees the blocks.
- ``full``: streams tokens 0..max_tokens-1.

Tokens are ``token_at(prompt, i)``, so the prefill and decode legs of a request agree with a
colocated run. Use :attr:`FakeEngine.hold` to keep requests "running" (their outputs are not
sent) until :meth:`FakeEngine.finish_held` is called.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.protocol import FinishReason, KVLayout, SamplingParams, WorkerLoad
from pdserve.workers.engine.requests import EngineOutput, EngineRequest, Reservation, Sink
from pdserve.workers.kv.manager import KVCacheManager

VOCAB = 256


def token_at(prompt: list[int] | tuple[int, ...], index: int) -> int:
    """The deterministic token at output position ``index`` of ``prompt``."""
    return (sum(prompt) * 31 + index * 7 + len(prompt)) % VOCAB


def kv_pattern(layout: KVLayout, prompt: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The K/V a prefill of ``prompt`` writes: ``[num_layers, blocks, 2, tpb, kvh, hd]`` in
    ``layout.dtype``, distinct per prompt, layer, block and element (positions past the prompt's
    last token are zero, as in a real pool)."""
    tpb = layout.tokens_per_block
    blocks = -(-len(prompt) // tpb)
    shape = (layout.num_layers, blocks, 2, tpb, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator().manual_seed(sum(prompt) * 1_000_003 + len(prompt))
    data = torch.randn(shape, generator=gen)
    unused = blocks * tpb - len(prompt)  # token slots past the prompt in its last block
    if unused:
        data[:, -1, :, tpb - unused :] = 0
    return data.to(getattr(torch, layout.dtype))


@dataclass
class FakeEngine:
    """A :class:`~pdserve.workers.engine.api.WorkerEngine` over a ``num_blocks``-block CPU pool.

    Records every request (``requests``), abort (``aborted``), reservation lifecycle
    (``unreserved``) and parked release (``freed_parked``) for assertions.
    """

    layout: KVLayout
    num_blocks: int = 32
    hold: bool = False
    kv_cache: KVCacheManager = field(init=False)
    requests: list[EngineRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    unreserved: list[str] = field(default_factory=list)
    freed_parked: list[str] = field(default_factory=list)
    started: bool = False
    stopped: bool = False

    def __post_init__(self) -> None:
        self.kv_cache = KVCacheManager(self.layout, self.num_blocks, "cpu")
        self._lock = threading.Lock()
        self._parked: dict[str, list[int]] = {}
        self._reserved: dict[str, list[int]] = {}
        self._running: dict[str, tuple[EngineRequest, Sink]] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.started = True

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stopped = True

    def kv_connector_stats(self) -> None:
        return None  # no KV cache tiers

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, sink: Sink) -> None:
        if not req.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if (req.mode == "resume") != (req.first_token is not None):
            raise InvalidRequestError("first_token is required in resume mode and only there")
        self.requests.append(req)
        if req.mode == "prefill":
            self._prefill(req, sink)
        elif self.hold:
            self._running[req.request_id] = (req, sink)
        else:
            self._decode(req, sink)

    def finish_held(self) -> None:
        """Run every held request to its end."""
        held, self._running = self._running, {}
        for req, sink in held.values():
            self._decode(req, sink)

    def _prefill(self, req: EngineRequest, sink: Sink) -> None:
        prompt = req.prompt_token_ids
        blocks = self.kv_cache.allocate(req.request_id, len(prompt))
        self.kv_cache.write_blocks(blocks, kv_pattern(self.layout, prompt))
        first = token_at(prompt, 0)
        n, max_tokens = req.sampling.n, req.sampling.max_tokens
        if max_tokens == 1 and n == 1:
            self.kv_cache.free(req.request_id)
            sink(EngineOutput(req.request_id, [first], "", [], FinishReason.LENGTH))
            return
        with self._lock:
            self._parked[req.request_id] = blocks
        finish = FinishReason.LENGTH if max_tokens == 1 else None
        sink(EngineOutput(req.request_id, [first], "", [], finish, parked_block_ids=blocks))

    def _decode(self, req: EngineRequest, sink: Sink) -> None:
        rid, prompt, max_tokens = req.request_id, req.prompt_token_ids, req.sampling.max_tokens
        start = 0
        if req.mode == "resume":
            with self._lock:
                blocks = self._reserved.pop(rid, None)
            if blocks is None:
                sink(EngineOutput(rid, [], "", [], FinishReason.ERROR, "no reservation"))
                return
            landed = self.kv_cache.read_blocks(blocks)
            self.kv_cache.free(rid)
            if not torch.equal(landed, kv_pattern(self.layout, prompt)):
                sink(EngineOutput(rid, [], "", [], FinishReason.ERROR, "K/V did not land"))
                return
            start = 1  # the prefill leg sampled token 0
        for index in range(req.sampling.n):
            for i in range(start, max_tokens):
                finish = FinishReason.LENGTH if i == max_tokens - 1 else None
                sink(EngineOutput(rid, [token_at(prompt, i)], "", [], finish, index=index))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.free_parked(request_id)
        self.unreserve(request_id)
        self._running.pop(request_id, None)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        reuse_prefix: bool = False,
    ) -> Reservation:
        with self._lock:
            if request_id in self._reserved or request_id in self._parked:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
        blocks = self.kv_cache.allocate(request_id, len(prompt_token_ids))  # CapacityError
        with self._lock:
            self._reserved[request_id] = blocks
        return Reservation(blocks)  # no prefix cache: every block is pulled

    def unreserve(self, request_id: str) -> None:
        with self._lock:
            blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.unreserved.append(request_id)
            self.kv_cache.free(request_id)

    def free_parked(self, request_id: str) -> None:
        with self._lock:
            blocks = self._parked.pop(request_id, None)
        if blocks is not None:
            self.freed_parked.append(request_id)
            self.kv_cache.free(request_id)

    # -- peer prefix pull (PrefixLending: the fake is its own scheduler) -------------------------

    @property
    def scheduler(self) -> FakeEngine:
        return self

    def lend(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        tokens = len(block_hashes) * self.layout.tokens_per_block + 1
        self.kv_cache.acquire_prefix(lend_id, block_hashes, tokens)
        return self.kv_cache.block_table(lend_id)

    def end_lend(self, lend_id: str) -> None:
        self.kv_cache.free(lend_id)

    def adopt(self, request_id: str) -> int:
        with self._lock:
            blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.kv_cache.free(request_id)
        return 0  # no block hashes here: nothing is indexed

    def load(self) -> WorkerLoad:
        with self._lock:
            parked = len(self._parked)
        return WorkerLoad(
            running=len(self._running),
            waiting=0,
            parked=parked,
            free_blocks=self.kv_cache.get_num_free_blocks(),
            total_blocks=self.kv_cache.get_max_resource_count(),
        )

    # -- test helpers ----------------------------------------------------------------------------

    @property
    def parked_ids(self) -> set[str]:
        with self._lock:
            return set(self._parked)

    @property
    def reserved_ids(self) -> set[str]:
        with self._lock:
            return set(self._reserved)

    def fill(self, count: int) -> None:
        """Take ``count`` free blocks away (a full pool) under the id ``"filler"``."""
        try:
            self.kv_cache.allocate("filler", count * self.layout.tokens_per_block)
        except CapacityError:
            raise AssertionError(f"the pool has fewer than {count} free blocks") from None

    def unfill(self) -> None:
        self.kv_cache.free("filler")
