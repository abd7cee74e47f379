"""Configuration: every setting declared once, and how a process gets its values.

- ``settings``: every pdserve setting, one field of a section model each (its type, default,
  range, help, file key, environment variable and flag); ``PdserveConfig``, the whole file
- ``engine_settings``: the engine's sections (model, KV cache, scheduler) and what every
  section shares, re-exported by ``settings``
- ``planner_settings``: the planner section (SLO-driven autoscaling)
- ``router_settings``: the router section (listeners, limits, migration, KV-aware routing),
  re-exported by ``settings``
- ``flags``: how a setting declares its command-line flag and a second environment variable
- ``loading``: flags > environment > YAML file > defaults, resolved into the frozen runtime
  configs each process gets (``RouterConfig``, ``WorkerConfig``)
- ``reference``: the configuration reference (docs/configuration.md), generated from the
  declarations
- ``hosts``: host names and addresses as pdserve binds and advertises them
"""
