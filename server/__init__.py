"""The router process's HTTP API: OpenAI-compatible routes in front of the router.

Read in this order:

- ``app``: the FastAPI app factory and its lifespan (discovery watcher, worker view, router,
  tokenizer pool, grammar checker), the ``/v1`` routes, ``/health`` and ``/ready``
- ``serve``: runs the router process (the public app and, with an embedded registry, the
  registry's internal listener) in one event loop
- ``chat``: ``/v1/chat/completions`` and ``/v1/completions``: request schemas, preprocessing
  (chat template, tokenization, sampling fields), tool calling, structured-output checks
- ``responses``: the stateless Responses API, ``POST /v1/responses``, on the chat machinery
- ``rendering``: router events into OpenAI responses and stream chunks (the *Renderer*s), SSE,
  logprobs, the reply models
- ``guard``: the public plane's door: client API keys and the request body limit (middleware)
- ``openapi``: what the OpenAPI document declares (status codes, bearer security)
- ``timelines``: the router's side of a request's timeline (span, GenAI attributes, phase line)

Error bodies and the HTTP/1.1 protocol are shared with the workers (:mod:`pdserve.http`); the
routing itself is :mod:`pdserve.router`. Imports no worker module
(``tests/unit/test_import_graph.py``).
"""
