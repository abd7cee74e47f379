"""GPU benchmarks.

- ``bench_gpu``: engine step time (TPOT) and KV transfer GB/s on a GPU (the CPU side runs the
  same code with ``--device cpu``)
- ``bench_gpu_proof``: everything a session lent a GPU machine must run, in one call
- ``bench_gpu_report``: the proof's summary: markdown tables, targets met or missed, the verdict
  on CUDA graphs
"""
