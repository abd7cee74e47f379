"""Starting pdserve's processes.

- ``launcher``: ``pdserve up``: a router and N prefill + M decode (+ K colocated) workers on
  one machine, with the settings resolved for this host, the port check and the signals
- ``stack``: the one way to start a stack (router and workers as child processes), which
  ``pdserve up``, the benchmarks and the tests' stack build on
- ``supervisor``: child processes started, waited for, watched, restarted and stopped in one
  way (``PDSERVE_RESTARTS`` in each child's environment)
"""
