"""pdserve: disaggregated prefill/decode LLM serving.

A request enters the router's OpenAI-compatible HTTP API, is routed to a prefill worker (the
context phase), whose KV cache a decode worker pulls over the KV transfer path before it
generates the tokens. The map, in reading order: the rooms first, then the core they share.

The rooms (``tests/unit/test_import_graph.py`` keeps their arrows one way):

- ``server`` (``pdserve.server``, folder server/): the router process's HTTP API: the app and
  the OpenAI surfaces (chat/, responses/, rendering/)
- ``router`` (``pdserve.router``, router/): routing: the worker view, the router's policy
  (``router/policy.py``: which path and which workers, the KV-aware cost), the two-leg
  transaction
- ``workers`` (``pdserve.workers``, workers/): the worker process: roles/ (prefill, decode,
  colocated); engine/ (the step loop; the scheduler is ``workers/engine/scheduler.py``); kv/
  (the KV cache manager; the KV cache connector is ``workers/kv/offload.py``, with its host
  and disk tiers)
- ``transfer`` (``pdserve.transfer``, transfer/): KV cache transmission, along the seed's
  components: the Transceiver (``transfer/transceiver.py``), Sender/Receiver
  (transfer/sender.py, transfer/receiver.py), the Formatter (``transfer/formatter/``), the
  Connection (transfer/connection/) and the TransferAgent (``transfer/agents/``: TCP, UCX,
  NIXL)
- ``discovery`` (pdserve/discovery/): how workers announce themselves and the router finds
  them (embedded registry, etcd, NATS)
- ``bench`` (``pdserve/bench/``): the benchmarks (serving/, transfer/, engine/, planning/,
  gpu/) and ``pdserve doctor``; only the CLI imports them

The core, which every room may import and which imports no room (but for the entry points,
``cli`` and ``launch``'s launcher, which compose the rooms):

- ``cli``: the command line (``pdserve up | router | prefill | decode | colocated | config |
  model | bench | plan | planner | doctor``), where configuration is resolved once
- ``config``: every setting, declared once; loading (file, environment, flags); the generated
  reference (docs/configuration.md)
- ``launch``: ``pdserve up`` and the one way to start a stack of processes (its supervisor)
- ``planner``: capacity planning (``pdserve plan``) and SLO-driven autoscaling (``pdserve up
  --autoscale``, ``pdserve planner``)
- ``protocol``: the typed, versioned wire messages between router, workers and transfer path
- ``kv_lend``: peer prefix pull's messages (a worker leases a prompt's cached prefix blocks)
- ``errors``: the one exception hierarchy and the HTTP status each error maps to
- ``block_hash``: the KV block hash the workers' prefix caches and the router's KV index share
- ``security``: client API keys and the cluster secret
- ``http``: the HTTP plumbing the router and the workers share (error bodies, the h11 protocol)
- ``observability``: Prometheus metrics, per-request timelines and tracing, process logs
- ``grammar``: a request's structured output as a grammar (llguidance)
- ``models``: model preparation (the default model's conversion) and resolution
- ``hardware``: what the machine computes natively; the dtype ``--dtype auto`` picks

Importing ``pdserve`` imports neither torch, NIXL nor UCX.
"""

__version__ = "0.1.0"
