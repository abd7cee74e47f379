"""Engine (model runner, KV cache manager, scheduler, sampler) and the prefill/decode roles."""
