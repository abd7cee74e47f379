"""What the router answers with: router events rendered as OpenAI objects and stream chunks.

- ``chunks``: ``ChatRenderer`` / ``CompletionRenderer``, one per request: router token events
  into whole responses or stream chunks
- ``replies``: the OpenAI response models (completions, chunks, ``/v1/models``) and the bodies
  of ``/health`` and ``/ready``
- ``logprobs``: ``TokenRenderer``, token ids into the strings and bytes OpenAI logprobs report
- ``sse``: server-sent events in the OpenAI dialect (``data: [DONE]``, errors mid-stream)

Response rendering is named *Renderer* here; *Formatter* is the seed's KV layout mapping only
(:mod:`pdserve.transfer.formatter`).
"""
