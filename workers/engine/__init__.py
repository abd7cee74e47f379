"""The engine: a continuous-batching step loop over one model and one KV pool.

- ``engine``: :class:`~pdserve.workers.engine.engine.Engine` (threads, step loop, reserve/
  resume for decode workers, park for prefill workers)
- ``scheduler``: admission by need, preemption, the batch of each step
- ``sequence``: a sequence's state, the incremental detokenizer
- ``sampler``: logits processing (penalties, bias, min_tokens), greedy, temperature,
  min-p, top-k/p, seeds, logprobs
- ``grammar``: structured outputs (per-sequence llguidance matchers, the step's token masks)
- ``model_runner``: the forward pass over the paged KV cache; ``attention`` (paged attention
  for transformers' attention interface), ``compile`` (torch.compile, oneDNN linears),
  ``cuda_graphs`` (decode-step graphs)
- ``requests``: the engine's request/response types; ``api``: the protocol the roles use

Imports ``pdserve.workers.kv``; never a role.
"""
