"""The one test support kit: everything tests share lives here, and test modules import only
from here (never from one another).

- ``fakes``: fake discovery watcher, scripted fake workers, a tiny tokenizer, ``serve_app``,
  ``router_harness`` (a router app over fake workers), the test cluster secret
- ``fake_engine``: a deterministic engine without a model (the roles' unit tests)
- ``models``: the tiny random model (fixture ``tiny_model_dir``), SmolLM2 (``smollm2_dir``);
  ``gpu_models``: a SmolLM2-shaped random model for GPU tests
- ``servers``: etcd / NATS servers really started, ``wait_until``, ``free_port``, uvicorn
  helpers; ``pki``: certificates for TLS tests; ``netns``: network-namespace hosts
- ``stack``: a real stack (router + worker processes) on the product's supervisor
- ``engine``: engine construction and completion helpers; ``kv_connector_child``: a worker
  engine in a child process (KV tiers across restarts); ``discovery_backends``: the discovery
  contract's backends and records
- the transfer rig: ``transfer`` (what every transfer test shares: the backends under test,
  keys, layout, settings, pools, the checks of what landed, a peer spawned behind a pipe, and
  ``PrefillPeer``, a prefill side with fault levers in a process); ``transfer_inproc`` (both
  sides in the test's process: ``LocalPrefill`` with the real KV manager and lease table, the
  decode side, a bare side for wire-level tests, a serving transceiver); ``kv_peer``
  (``LocalPrefill`` in a process of its own, with levers and counters; fixture
  ``prefill_process``); ``cuda_peer``: the GPU tests' peer
- ``chaos``: the fault harness against ``pdserve up``; ``podman_stack``: compose stacks under
  podman; ``procfs``: what /proc tells of a process (children, argv, listening sockets)
"""
