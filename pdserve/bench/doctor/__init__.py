"""``pdserve doctor``: what the KV transfer path can use on this host, what hurts it, and how
fast this host reaches a worker.

- ``doctor``: the checks and the report (and ``--peer``: a probe of a worker's transceiver)
- ``doctor_facts``: what the doctor looks at, gathered once (environment, ``/proc``, ``/sys``,
  the optional transfer libraries, ``ucx_info``)
"""
