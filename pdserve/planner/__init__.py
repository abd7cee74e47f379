"""Capacity planning and SLO-driven autoscaling for disaggregated serving.

Planning (``pdserve plan``), in reading order:

- ``profile``: a performance profile of the model on the hardware at hand (as ``pdserve bench
  profile`` writes it)
- ``simulate``: a discrete-event simulation of a deployment (router, schedulers, KV
  hand-offs), timed by a profile
- ``plan``: the search that recommends a prefill:decode split for a workload and its SLOs

Autoscaling (``pdserve up --autoscale``, ``pdserve planner``):

- ``observe``: what the planner sees of a live deployment (the router's metrics, sampled)
- ``autoscale``: the planner: every interval, observe, decide the worker counts, export them
- ``local``: the planner loop acting on the stack ``pdserve up`` supervises
- ``standalone``: the planner loop on its own, beside a router it does not own (Kubernetes)

Pure Python; nothing here imports torch or the serving processes.
"""
