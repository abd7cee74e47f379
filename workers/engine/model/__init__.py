"""The model side of a step: load a transformers causal LM and run its forward over the paged
KV cache.

- ``model_runner``: loads the model with paged attention and runs one step (a
  ``ScheduledBatch`` in, logits out)
- ``attention``: paged attention over the KV block pool, plugged into transformers' attention
  interface
- ``paged_kernel``: a CPU paged-attention kernel that reads the KV blocks where they are
- ``paged_kernel_source``: that kernel's C++ source (and the decode step's K/V store + attend)
- ``kernel_build``: building our C++ kernels on the machine that runs them (name per CPU, a
  build lock that survives a killed build)
- ``compile``: the compiled CPU forward (oneDNN-prepacked linears, ``torch.compile``)
- ``light_op``: opaque ops for the compiled forward at the dispatcher's cost
- ``cuda_graphs``: CUDA graphs of decode-only steps
- ``parallel``: tensor parallel ranks of one worker (sharding, rank processes, step fan-out)
- ``load_check``: the load-time probe: served only if the paged path computes what
  transformers does
- ``served_model``: what the engine serves of the loaded model: context window, EOS ids, KV
  layout, the KV pool sized for it
"""
