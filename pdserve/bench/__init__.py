"""The benchmarks and ``pdserve doctor``: operator tools beside the serving stack, never inside
it. Each ``pdserve bench`` subcommand names its module below ``pdserve.bench``.

- ``bench_commands``: every ``pdserve bench`` subcommand: its options and what runs it (the
  CLI's one entry here; light to import)
- ``bench_options``: the options and descriptions of ``bench serve`` and ``bench transfer``
- ``bench_descriptions``: the ``--help`` text of the subcommands whose module is heavy
- ``bench``: ``bench serve`` and ``bench transfer``, and the benchmarks' stacks
  (:class:`pdserve.launch.stack.Stack`)
- ``bench_plot``: ``bench serve --plot``: TTFT/ITL distributions and output tokens/s against
  concurrency as one PNG (matplotlib imported lazily)
- ``scrape``: the benchmarks' one reading of ``/metrics``
- ``serving``: the serving benchmarks: the client and metrics of ``bench serve``, multi-turn
  chat (prefix cache, KV-aware routing), the router's overhead, speculative decoding,
  structured outputs and tool calls
- ``transfer``: KV transfer: GB/s per backend between two processes (its peers, report and
  fixed-cost profile), layout conversion (the Formatter's cost), the streamed hand-off
- ``engine``: the engine in one process: eager vs compiled forward, KV dtypes, the paged
  kernel, the KV cache connector's disk tier across a restart, random-weight models
- ``planning``: the planner's inputs and claims: the profile it reads, its predictions
  against real runs, autoscaling against a fixed deployment
- ``gpu``: engine and transfer on a GPU, and the one-call proof a lent GPU machine runs
- ``doctor``: ``pdserve doctor``: the KV transfer environment of this host and a probe of a
  worker

Dependency direction: the benchmarks import the router, the workers and the data plane
(:mod:`pdserve.transfer`); only :mod:`pdserve.cli` imports :mod:`pdserve.bench`.
"""
