"""The KV cache of one worker.

- ``manager``: :class:`~pdserve.workers.kv.manager.KVCacheManager`, the KV cache manager:
  fixed-size blocks carved out of one pool tensor (TensorRT-LLM's interface), with the prefix
  cache's reuse
- ``prefix_cache``: hit counters and stats (the hash itself: :mod:`pdserve.block_hash`)
- ``offload``: the KV cache connector (scheduler and worker sides, after TensorRT-LLM's): blocks
  found in a tier are loaded instead of recomputed
- ``tiers``: the connector's storage tiers below the pool: host memory and disk
- ``remote``: the connector's remote tier, a Redis or Valkey store every host reaches
- ``write_queue``: the bounded write-behind queue and thread of the disk and remote tiers
- ``sizing``: the pool's size from the machine's free memory
- ``cache_events``: KV cache events (stored / evicted block hashes) out to the router
- ``zmq_events``: the pool's events in vLLM's KV event format on ZMQ, for other indexers

Imports nothing of the engine or the roles.
"""
