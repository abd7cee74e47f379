"""Serving benchmarks: a stack (or any OpenAI-compatible server) driven by a workload.

- ``bench_serve``: the serving benchmark's client and metrics (``pdserve bench serve``: TTFT,
  ITL, throughput against concurrency, fixed-seed synthetic chat)
- ``bench_multiturn``: multi-turn chat: the prefix cache on against off, KV-aware routing,
  turns with and without session ids (session affinity); ``bench_multiturn_workload``: its
  conversations (system prompt, seeded user messages, each turn's messages)
- ``bench_fairness``: one tenant floods, another sends one request at a time: the router's fair
  queue against none
- ``bench_router``: what the router adds to a request, and how many it can route (one or
  several router processes)
- ``bench_speculative``: n-gram speculative decoding against plain decoding
- ``bench_structured``: structured outputs and tool calls: validity, grammar cost in ITL,
  schema compile time
"""
