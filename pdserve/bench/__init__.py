"""Operator tools that sit beside the serving stack, never inside it.

``bench_commands`` (every ``pdserve bench`` subcommand: its options and what runs it), ``bench``
(``serve`` and ``transfer``, and the benchmarks' stacks, :class:`pdserve.launch.stack.Stack`),
``bench_serve`` (the serving benchmark's client and metrics), ``bench_plot`` (``bench serve
--plot``: the PNG of TTFT/ITL distributions and output tokens/s against concurrency; matplotlib
imported lazily), ``bench_transfer`` /
``bench_transfer_peers`` / ``bench_transfer_report`` (KV transfer GB/s per backend between two
processes, references, fit, targets; the peers, the GPU one included), ``bench_formatter`` (what
layout conversion costs), ``bench_multiturn`` (multi-turn chat: prefix cache, KV-aware routing),
``bench_kv_restart`` (the KV disk tier across a restart), ``bench_compile`` (eager vs compiled
forward), ``bench_gpu`` + ``bench_models`` (engine and transfer on a GPU, random-weight models),
``scrape`` (the benchmarks' one reading of ``/metrics``), ``doctor`` / ``doctor_facts``
(``pdserve doctor``: the KV transfer environment and a probe of a worker).

Dependency direction: tools import the router, the workers and the data plane
(:mod:`pdserve.transfer`); nothing in the serving stack imports :mod:`pdserve.bench`.
"""
