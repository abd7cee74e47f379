"""One exception hierarchy for pdserve (modelled on httpx's ``_exceptions.py``).

Every error that user or peer input can cause is a :class:`PdserveError` subclass carrying the
HTTP status and the OpenAI error ``type``/``code`` it maps to; the HTTP layer
(:func:`pdserve.http.error_responses.install_error_handlers`, shared by the router and the workers)
turns it into an ``{"error": {...}}`` JSON body. ``assert`` is reserved for internal
invariants; anything that is not a :class:`PdserveError` reaching the HTTP layer is a bug and
becomes a generic 500 (logged with its traceback, never shown to the client).

The tree (HTTP status in brackets)::

    PdserveError [500]                      base; also what an unexpected failure maps to
    ├── InvalidRequestError [400]           malformed or out-of-range request
    │   ├── UnsupportedFieldError [400]     a field pdserve does not implement (``unsupported``)
    │   └── RequestTooLargeError [413]      the request body exceeds ``router.max_request_bytes``
    ├── AuthenticationError [401]           no valid credentials: an internal route without the
    │   │                                   cluster token (``unauthorized``)
    │   └── InvalidAPIKeyError [401]        /v1 request without a valid client API key
    ├── ModelNotFoundError [404]            the request names a model nobody serves
    ├── ClientDisconnectedError [499]       the client left before its response was ready
    ├── QueueFullError [429]                a worker's queue (or the router's tokenizer) is full
    ├── CapacityError [503]                 no capacity now (or ever) for the request
    │   └── NoWorkerError [503]             no compatible prefill/decode worker is live
    ├── DeadlineExceededError [504]         the request's deadline passed
    ├── WorkerError [502]                   a worker leg failed
    │   └── WorkerUnreachableError [502]    the request never reached the worker (retryable)
    ├── TransferError [502]                 the KV transfer failed
    │   ├── LayoutMismatchError [502]       the two KV layouts cannot be mapped
    │   ├── HandleError [502]               unknown / fenced / expired transfer handle
    │   └── IntegrityError [502]            the moved KV bytes failed the digest check
    ├── DiscoveryError [503]                the discovery service is unusable
    │   (subclasses in :mod:`pdserve.discovery`: InvalidDiscoveryURLError, SupersededError)
    └── ConfigError [400]                   invalid configuration

The public plane (the router's ``/v1``) shows a client :attr:`PdserveError.public_message`,
never ``message`` where that names the deployment's inside: the classes that report a worker,
a transfer, the discovery service or a capacity shortfall carry a fixed public text
(``public_text``; the status, ``type`` and ``code`` stay exact), and the router logs the full
``message`` under the request id that the body names. The internal planes (worker to router)
carry ``message`` whole.

Catch the base to handle every pdserve failure; a subclass's ``code`` (e.g.
``kv_handle_invalid``) travels in the error body, and :mod:`pdserve.router.client` maps a
worker's answer back to the matching class.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ErrorBody(BaseModel):
    """OpenAI-style error body: ``{"error": {"message", "type", "code", "param",
    "request_id"}}``; ``request_id`` names the failed request (the client's ``X-Request-Id``
    or one the server generated) so a client report can be matched with the server's log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    message: str
    type: str
    code: str | None = None
    param: str | None = None
    request_id: str | None = None


class ErrorEnvelope(BaseModel):
    """The OpenAI error envelope every error response and SSE error event carries (the public
    API's and the workers' internal plane's alike)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: ErrorBody


class PdserveError(Exception):
    """Base class of every pdserve error. Raised as such for an unexpected server-side failure
    (HTTP 500, ``internal_error``).

    ``message`` is the full account (logs, internal planes); ``public`` (or else the class's
    ``public_text``, or else ``message``) is what a client of the public API reads
    (:attr:`public_message`). ``param`` names the offending request field (or None); ``code``
    overrides the class's machine-readable code for this instance.
    """

    status: int = 500
    type: str = "internal_error"
    code: str | None = None
    public_text: ClassVar[str | None] = "internal error (the server's log names this request)"
    """What a client outside the deployment reads instead of ``message`` (None: ``message``,
    which then must name nothing internal: worker ids, addresses, peers)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        public: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.public = public
        if code is not None:
            self.code = code

    @property
    def public_message(self) -> str:
        """The message for the public API: ``public``, the class's ``public_text``, or
        ``message`` (classes whose message is the client's own business)."""
        return self.public or self.public_text or self.message

    def envelope(self, request_id: str | None = None, *, public: bool = False) -> ErrorEnvelope:
        """The OpenAI error envelope; ``request_id`` names the request in the body;
        ``public``: with :attr:`public_message` (for the public API) instead of ``message``."""
        return ErrorEnvelope(
            error=ErrorBody(
                message=self.public_message if public else self.message,
                type=self.type,
                code=self.code,
                param=self.param,
                request_id=request_id,
            )
        )

    def to_json(self, request_id: str | None = None, *, public: bool = False) -> dict[str, Any]:
        """:meth:`envelope` as a JSON-ready dict."""
        return self.envelope(request_id, public=public).model_dump()


class InvalidRequestError(PdserveError):
    """The client's request is malformed or out of range: wrong types, missing fields, a prompt
    beyond the context window, an unsupported parameter (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    public_text = None


class UnsupportedFieldError(InvalidRequestError):
    """The request uses a field pdserve does not implement (tools, a JSON response format, a
    logit bias, penalties, ...) with a value that would change the output: refused rather than
    ignored (HTTP 400, ``unsupported``, ``param`` names the field)."""

    code = "unsupported"


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than ``router.max_request_bytes`` (HTTP 413)."""

    status = 413
    code = "request_too_large"


class AuthenticationError(PdserveError):
    """The request carries no valid credentials: an internal route (the registry's
    ``/registry/*``, a worker's ``/internal/*``) without ``Authorization: Bearer`` and the token
    derived from the cluster secret, or a worker record whose signature does not verify
    (HTTP 401 with ``WWW-Authenticate: Bearer``, ``unauthorized``)."""

    status = 401
    type = "authentication_error"
    code = "unauthorized"
    public_text = None


class InvalidAPIKeyError(AuthenticationError):
    """A ``/v1`` request without ``Authorization: Bearer KEY`` naming a configured client API
    key (HTTP 401 with ``WWW-Authenticate: Bearer``; OpenAI's type and code)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(PdserveError):
    """The request names a model other than the one this deployment serves (HTTP 404)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    public_text = None


class ClientDisconnectedError(PdserveError):
    """The client went away before its (non-streamed) response was ready; nobody reads the
    answer, which exists for the logs and metrics (HTTP 499, nginx's "client closed request")."""

    status = 499
    type = "client_closed_request"
    code = "client_disconnected"
    public_text = "the client closed the request"


class CapacityError(PdserveError):
    """No worker (or not enough KV blocks) to take the request now, or a request that could
    never fit this worker's KV pool (HTTP 503)."""

    status = 503
    type = "server_error"
    code = "no_capacity"
    public_text = (
        "no worker has the KV cache capacity for this request now (or ever, for a request "
        "larger than a worker's KV cache); retry later or send a shorter one"
    )


class NoWorkerError(CapacityError):
    """No live, compatible prefill/decode worker serves the requested model; the message says
    what is missing (HTTP 503)."""

    code = "no_worker"
    public_text = "no worker can serve this request now; retry later"


class QueueFullError(PdserveError):
    """A worker's waiting queue is at its bound (``scheduler.max_queued_requests``), or a
    decode worker found no free KV blocks for a transferred prompt before its lease ran out,
    or the router's tokenizer pool is at its backlog bound (code ``tokenizer_busy``,
    :mod:`pdserve.server.chat.tokenizer_pool`): the request is refused now and may be retried
    (HTTP 429 with ``Retry-After``)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after_s = 1
    public_text = (
        "the server is at capacity: its request queues are full "
        "(scheduler.max_queued_requests); retry after the Retry-After delay"
    )


class DeadlineExceededError(PdserveError):
    """The request's deadline (``router.request_timeout_s`` after it arrived) passed before it
    finished, on either leg or during the KV transfer (HTTP 504)."""

    status = 504
    type = "server_error"
    code = "deadline_exceeded"
    public_text = "the request did not finish before its deadline"


class WorkerError(PdserveError):
    """A worker leg failed: the peer died, returned an error, or broke its stream (HTTP 502)."""

    status = 502
    type = "server_error"
    code = "worker_error"
    public_text = "a worker failed while serving this request"


class WorkerUnreachableError(WorkerError):
    """The connection to the worker could not be opened: the request was never delivered, so
    the router may retry it on another worker (HTTP 502)."""

    code = "worker_unreachable"
    public_text = "no worker could be reached for this request"


class TransferError(PdserveError):
    """The KV transfer failed: peer unreachable, layout mismatch, unknown/expired handle,
    wrong epoch, short or corrupt data (HTTP 502; ``code`` starts with ``kv_``)."""

    status = 502
    type = "server_error"
    code = "kv_transfer_failed"
    public_text = "the KV cache transfer between the prefill and decode workers failed"


class LayoutMismatchError(TransferError):
    """The prefill and decode KV layouts differ in a field no formatter maps (layers, KV heads,
    head size, model); the message names the field (HTTP 502)."""

    code = "kv_layout_mismatch"


class HandleError(TransferError):
    """The handle names an unknown request, an old epoch, another lease, an expired lease, or
    blocks that are not (or no longer) the ones parked: the fencing refused it (HTTP 502)."""

    code = "kv_handle_invalid"


class IntegrityError(TransferError):
    """KV bytes arrived that differ from what the sender digested (corrupted on the way, or the
    source changed under the transfer); the message names the request and the blocks
    (HTTP 502)."""

    code = "kv_integrity_failed"
    public_text = (
        "KV cache blocks arrived corrupted between the prefill and decode workers; the "
        "integrity check stopped the request before anything was generated from them"
    )


class DiscoveryError(PdserveError):
    """The discovery service (embedded registry, etcd, NATS) cannot be reached or refused the
    operation (HTTP 503)."""

    status = 503
    type = "server_error"
    code = "discovery_unavailable"
    public_text = "the deployment's discovery service is unavailable; retry later"


class ConfigError(PdserveError):
    """Invalid configuration: a bad setting, an unusable model folder, an unavailable transfer
    backend (HTTP 400 where it reaches the HTTP layer; the CLI prints it and exits 2).

    ``problems`` lists ``"path: message  [source]"`` lines, every one found (not only the
    first; :meth:`from_problems`); an error raised with a plain message has that one line.
    """

    status = 400
    type = "config_error"
    code = "invalid_config"
    public_text = "invalid configuration (the server's log says which setting)"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        problems: list[str] | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.problems = problems if problems is not None else [message]

    @classmethod
    def from_problems(cls, problems: list[str], origin: str = "configuration") -> ConfigError:
        """One error listing every problem of ``origin`` (a file name or ``configuration``)."""
        text = f"invalid {origin}:\n" + "\n".join(f"  {p}" for p in problems)
        return cls(text, problems=problems)
