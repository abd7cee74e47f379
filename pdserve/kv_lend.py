"""Peer prefix pull's messages (``POST /internal/kv/lend``, the router's half
:mod:`pdserve.router.peer_pull`, the workers' :mod:`pdserve.workers.roles.lending`): part of the
wire protocol, versioned by :data:`pdserve.protocol.PROTOCOL_VERSION` (17 added them)."""

from __future__ import annotations

from pydantic import Field

from pdserve.protocol import TransferHandle, _Msg

MAX_LEND_BLOCKS = 1 << 16
"""The most block hashes one :class:`LendRequest` may name (a 1M-token prompt at 16 tokens per
block): the lender's lookup is linear in them and bounded."""


class LendRequest(_Msg):
    """Router -> any worker with a transceiver, ``POST /internal/kv/lend``: lease the longest
    leading run of ``block_hashes`` (the prompt's chained block hashes under the lender's KV
    layout, :class:`pdserve.block_hash.BlockHasher`, 128-bit ints) that the worker's KV pool
    holds, for another worker to pull (peer prefix pull). ``request_id`` names the lease (unique
    per lend); the blocks stay the lender's, pinned, until the puller releases them or
    ``deadline`` (wall-clock UNIX seconds) passes."""

    request_id: str = Field(min_length=1, max_length=256)
    block_hashes: tuple[int, ...] = Field(min_length=1, max_length=MAX_LEND_BLOCKS)
    deadline: float = Field(
        description="wall-clock UNIX seconds; the lease ends then at the latest"
    )


class LendResponse(_Msg):
    """Lender -> router: the handle of the leased blocks (``handle.num_tokens`` tokens, the
    first ``len(handle.block_ids)`` of the request's hashes), or None when the pool holds
    none of them now (evicted since its KV events said so)."""

    handle: TransferHandle | None = None
