"""Serving benchmarks: a stack (or any OpenAI-compatible server) driven by a workload.

- ``bench_serve``: the serving benchmark's client and metrics (``pdserve bench serve``: TTFT,
  ITL, throughput against concurrency, fixed-seed synthetic chat)
- ``bench_multiturn``: multi-turn chat: the prefix cache on against off, KV-aware routing
- ``bench_router``: what the router adds to a request, and how many it can route
- ``bench_speculative``: n-gram speculative decoding against plain decoding
- ``bench_structured``: structured outputs and tool calls: validity, grammar cost in ITL,
  schema compile time
"""
