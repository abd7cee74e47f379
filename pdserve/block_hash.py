"""The KV block hash: the contract between the workers' prefix caches and the router's KV index.

A worker names each full KV block of a prompt by a hash of the whole prefix up to it, computed
the same way on every process and host; the router (KV-aware routing,
:mod:`pdserve.router.kv_index`) hashes a new prompt the same way to find which worker holds how
much of it. Both import this module; neither imports the other.

Design origin: vLLM's automatic prefix caching (a chained hash per *full* block) and
TensorRT-LLM's KV cache block reuse. Hash of full block ``i`` of a token sequence (``tpb`` =
tokens per block)::

    h[-1] = blake2b-128(extra keys: model identity, KV dtype, tokens per block)
    h[i]  = blake2b-128(h[i-1] || tokens[i*tpb : (i+1)*tpb] as little-endian int64)

so ``h[i]`` names the whole prefix ``tokens[: (i+1)*tpb]`` and the pool that computed it: two
blocks with equal hashes hold the same K/V. The hash is a 128-bit ``int``, deterministic across
processes and hosts (never Python's ``hash()``). A partial last block has no hash.

Cache salt (vLLM's ``cache_salt``; the router adds the tenant's when API keys name tenants): a
salted sequence chains its first block to ``blake2b-128(h[-1] || "salt" || salt)`` instead of
``h[-1]``, so none of its blocks equals a block of another salt (or of none): the prefix cache,
the host and disk tiers, the KV events and the router's index all key blocks by these hashes,
so a salted prompt never hits another salt's K/V anywhere. No salt: the hashes are unchanged.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Protocol

_DIGEST_BYTES = 16


class TokenBlocks(Protocol):
    """A sequence whose full blocks are hashed: its known tokens, its hash list and its cache
    salt (None: unsalted)."""

    block_hashes: list[int]

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, count: int) -> list[int]: ...


class BlockHasher:
    """Chained block hashes of one KV pool (see the module docstring).

    ``model``: the model identity (``KVLayout.model``: served name + config digest); ``dtype``:
    the pool's KV dtype name; ``tokens_per_block``: block size in tokens. Any of them changing
    changes every hash, so blocks of another model, dtype or block size never match.
    """

    def __init__(self, model: str, dtype: str, tokens_per_block: int) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        seed = f"pdserve-kv-v1\x00{model}\x00{dtype}\x00{tokens_per_block}".encode()
        self.root = int.from_bytes(hashlib.blake2b(seed, digest_size=_DIGEST_BYTES).digest(), "big")

    def salted_root(self, salt: str | None) -> int:
        """The parent of a sequence's first block: :attr:`root`, or for a ``salt`` the root
        chained with it (module docstring)."""
        if salt is None:
            return self.root
        h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        h.update(self.root.to_bytes(_DIGEST_BYTES, "big"))
        h.update(b"\x00salt\x00" + salt.encode("utf-8", "surrogatepass"))
        return int.from_bytes(h.digest(), "big")

    def hash_block(self, parent: int | None, token_ids: list[int]) -> int:
        """Hash of one full block: ``parent`` is the previous block's hash (None: the first
        block, chained to :attr:`root`); ``token_ids`` exactly ``tokens_per_block`` ids.
        Raises ValueError for another length."""
        if len(token_ids) != self.tokens_per_block:
            raise ValueError(
                f"a full block has {self.tokens_per_block} tokens, got {len(token_ids)}"
            )
        h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        h.update((self.root if parent is None else parent).to_bytes(_DIGEST_BYTES, "big"))
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        return int.from_bytes(h.digest(), "big")

    def hash_tokens(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Hashes of every full block of ``token_ids`` (a trailing partial block is skipped),
        salted with ``salt`` (module docstring)."""
        tpb, out = self.tokens_per_block, []
        parent: int | None = None if salt is None else self.salted_root(salt)
        for start in range(0, len(token_ids) - tpb + 1, tpb):
            parent = self.hash_block(parent, token_ids[start : start + tpb])
            out.append(parent)
        return out

    def extend(self, seq: TokenBlocks, num_tokens: int | None = None) -> list[int]:
        """Extend ``seq.block_hashes`` (in place) to cover the full blocks of its first
        ``num_tokens`` tokens (default: all known tokens) and return it. Only the blocks not
        hashed yet are read and hashed, so calling this every step costs O(new blocks)."""
        tpb = self.tokens_per_block
        limit = seq.num_tokens if num_tokens is None else min(num_tokens, seq.num_tokens)
        hashes = seq.block_hashes
        done, full = len(hashes), limit // tpb
        if full > done:
            tokens = seq.token_slice(done * tpb, (full - done) * tpb)
            salt = seq.cache_salt
            parent = hashes[-1] if hashes else (None if salt is None else self.salted_root(salt))
            for i in range(full - done):
                parent = self.hash_block(parent, tokens[i * tpb : (i + 1) * tpb])
                hashes.append(parent)
        return hashes
