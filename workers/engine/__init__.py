"""The engine: a continuous-batching step loop over one model and one KV pool.

- ``engine``: :class:`~pdserve.workers.engine.engine.Engine` (threads, step loop, reserve/
  resume for decode workers, park for prefill workers)
- ``scheduler``: the capacity scheduler: admission by need, preemption, the batch of each step
- ``sequence``: a sequence's state, the incremental detokenizer
- ``requests``: the engine's request/response types and the checks a request passes
- ``api``: the ``WorkerEngine`` protocol the roles use (never the concrete engine)
- ``resume``: mid-stream migration: the sequences of a request another worker started
- ``model``: the forward pass: ``model_runner`` over the paged KV cache, paged attention and
  its CPU kernel, ``torch.compile``, CUDA graphs, tensor parallel ranks, the load-time check
- ``sampling``: from logits to tokens: the sampler, structured-output token masks, n-gram
  speculative decoding
- ``omp``: one OpenMP thread team per engine process

Imports ``pdserve.workers.kv``; never a role.
"""
