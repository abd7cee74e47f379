"""pdserve: disaggregated prefill/decode LLM serving.

Packages: ``pdserve`` (core: cli, config, protocol, discovery, errors), ``pdserve.server``
(OpenAI-compatible HTTP API), ``pdserve.router`` (worker view, pairing, two-leg transaction),
``pdserve.workers`` (engine and the prefill/decode roles), ``pdserve.transfer`` (KV transfer).
Importing ``pdserve`` imports neither torch, NIXL nor UCX.
"""

__version__ = "0.1.0"
