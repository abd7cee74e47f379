"""The worker process: an engine, its KV cache, and the role it serves. Three rooms, arrows one
way (``roles`` -> ``engine`` -> ``kv``; nothing imports upward,
``tests/unit/test_import_graph.py`` enforces it)::

    roles/   the process: worker_app (HTTP app, run loop), service (what every role shares),
             one module per role (prefill, decode, colocated: lifecycle, routes, request
             handler), kv_transfer (the transceiver of the transferring roles), parking
             (leases of parked blocks), prefill_directory, bridge, timing, worker_metrics
       │ uses the engine through engine/api.py's WorkerEngine (a protocol; tests use a fake)
       v
    engine/  the step loop: engine (Engine), scheduler (the capacity scheduler), sequence,
             requests (its request types), resume (mid-stream migration), api (the protocol
             roles see), omp; model/ (model_runner, paged attention, compile, CUDA graphs,
             tensor parallel, the load check); sampling/ (sampler, grammar_masks, speculative)
       │
       v
    kv/      the KV cache: manager (the KV cache manager: blocks of one pool), prefix_cache,
             offload (the KV cache connector) + tiers (host and disk tiers), sizing (pool
             size from the machine), cache_events (KV events out to the router)
"""
