"""The worker process: an engine, its KV cache, and the role it serves. Three rooms, arrows one
way (``roles -> engine -> kv``; nothing imports upward, ``tests/unit/test_import_graph.py``
enforces it)::

    roles/   the process: app (HTTP app, run loop), service (what every role shares), one
             module per role (prefill, decode, colocated: lifecycle, routes, request
             handler), parking (leases of parked blocks), prefill_directory, bridge
       │ uses the engine through engine.api.WorkerEngine (a protocol; tests use a fake)
       v
    engine/  the step loop: engine (Engine), scheduler, sequence, sampler, model_runner,
             attention (paged attention), compile, cuda_graphs, requests (its request types),
             api (the protocol roles see)
       │
       v
    kv/      the KV cache: manager (blocks of one pool), prefix_cache, connector + tiers (host
             and disk tiers), sizing (pool size from the machine), events (KV events out)
"""
