"""From a step's logits to its tokens.

- ``sampler``: logits processing (penalties, bias, min_tokens), greedy, temperature, min-p,
  top-k/p, per-request seeds, logprobs
- ``grammar_masks``: structured outputs: one llguidance matcher per sequence, the step's
  token masks (the grammar text: :mod:`pdserve.grammar`)
- ``speculative``: n-gram (prompt lookup) speculative decoding, verified in one forward
"""
