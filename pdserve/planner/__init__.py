"""Capacity planning for disaggregated serving: a profile of the model on the hardware at hand
(:mod:`.profile`), a discrete-event simulation of a deployment (:mod:`.simulate`) and the
search that recommends a prefill:decode split for a workload and its SLOs (:mod:`.plan`).
Pure Python; nothing here imports torch or the serving processes."""
