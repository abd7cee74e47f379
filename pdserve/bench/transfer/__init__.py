"""KV transfer benchmarks (``pdserve bench transfer``, ``bench formatter``, ``bench handoff``).

- ``bench_transfer``: every backend beside a raw-socket and a memcpy reference, in one run
- ``bench_transfer_peers``: the benchmark's processes, one role each (the GPU one included)
- ``bench_transfer_report``: its tables, fits, target checks and command line
- ``bench_transfer_profile``: ``--profile``: where the fixed cost of one hand-off goes
- ``bench_formatter``: what layout conversion (the Formatter) costs: the staging kernel alone,
  and a whole pull between processes
- ``bench_handoff``: the streamed hand-off against the whole-request hand-off
"""
