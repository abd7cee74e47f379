"""Benchmarks of the planner's inputs and claims (:mod:`pdserve.planner`).

- ``bench_profile``: measure the model on this machine and write the profile the planner reads
- ``bench_plan_check``: the planner's predictions against real runs on this machine
- ``bench_autoscale``: ``pdserve up --autoscale`` against a fixed deployment sized for the peak
"""
