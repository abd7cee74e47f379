"""The KV cache of one worker.

- ``manager``: :class:`~pdserve.workers.kv.manager.KVCacheManager`, fixed-size blocks carved
  out of one pool tensor (TensorRT-LLM's interface), with the prefix cache's reuse
- ``prefix_cache``: block hash chains, stats (the hash itself: :mod:`pdserve.block_hash`)
- ``connector`` + ``tiers``: the KV cache connector (scheduler and worker sides) with host
  memory and disk tiers
- ``sizing``: the pool's size from the machine's free memory
- ``events``: KV events (stored / evicted block hashes) out to the router

Imports nothing of the engine or the roles.
"""
