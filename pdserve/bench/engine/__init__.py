"""Engine benchmarks, mostly in one process.

- ``bench_compile``: eager vs compiled forward of the model runner
- ``bench_kv_dtype``: what a KV storage dtype (and int8 weights) cost and keep
- ``bench_paged_kernel``: the paged-attention kernel against gather + SDPA
- ``bench_decode_floor``: the decode step against its memory-bandwidth floor, and its profile
- ``bench_kv_restart``: the KV cache connector's disk or remote tier across a restart of the stack
- ``bench_kv_migrate``: a stream whose decode worker is killed, with the remote tier and without
- ``bench_kv_peer``: a follow-up on the worker without its prefix, with the peer prefix pull and
  without
- ``bench_models``: stand-in models with random weights (for ``pdserve bench gpu``)
"""
