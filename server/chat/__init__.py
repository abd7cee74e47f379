"""``/v1/chat/completions`` and ``/v1/completions``: from an OpenAI request to what the router
runs (prompt token ids + ``SamplingParams``).

- ``schemas``: the request and response models of both routes and ``/v1/models`` (types and
  ranges: a wrong value is a 400 naming the field)
- ``preprocess``: :class:`~pdserve.server.chat.preprocess.Preprocessor`, the steps in order:
  chat template, tokenization, limits, sampling fields
- ``sampling_fields``: a request's sampling fields, the unsupported ones refused, the rest
  (with its output constraint) mapped into ``SamplingParams``
- ``sampling_defaults``: the model's sampling defaults (``generation_config.json``) for the
  fields a request leaves out
- ``tokenizer_pool``: chat templating and tokenization off the event loop
- ``content_guard``: special-token text in chat content kept as plain text
- ``json_values``: client text and free-form JSON checked (no lone surrogate, bounded depth)
- ``tool_calls``: tool calling: tools into the template, the model's text parsed into
  ``tool_calls`` (whole or streamed)
- ``tool_grammar``: each ``tool_choice`` as a structured-output constraint
- ``grammar_checker``: a request's structured output compiled in a child process, under a
  deadline
- ``batch``: several prompts in one ``/v1/completions`` request, their events merged
"""
