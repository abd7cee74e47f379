"""The stateless OpenAI Responses API (``POST /v1/responses``), served by the chat machinery.

- ``routes``: the route: a Responses request run as a chat completion, rendered back as a
  response object or its stream of events
- ``chat_mapping``: a Responses request mapped onto the chat completion request that serves it,
  and errors mapped back
- ``schemas``: the request and response models (the conventions of
  :mod:`pdserve.server.chat.schemas`)
"""
