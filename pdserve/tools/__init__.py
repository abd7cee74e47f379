"""Operator tools that sit beside the serving stack, never inside it.

``bench`` (the ``pdserve bench`` command: ``serve`` and ``transfer``), ``bench_serve`` (the
serving benchmark's client and metrics), ``bench_transfer`` / ``bench_transfer_peers`` /
``bench_transfer_report`` (KV transfer GB/s per backend between two processes, references, fit,
targets), ``bench_formatter`` (what layout conversion costs), ``doctor`` / ``doctor_facts``
(``pdserve doctor``: the KV transfer environment and a probe of a worker).

Dependency direction: tools import the router, the workers and the data plane
(:mod:`pdserve.transfer`); nothing in the serving stack imports :mod:`pdserve.tools`.
"""
