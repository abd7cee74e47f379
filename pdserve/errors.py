"""One exception hierarchy for pdserve.

Every error that user or peer input can cause is a :class:`PdserveError` subclass carrying the
HTTP status and OpenAI error ``type``/``code`` it maps to; the HTTP layers turn it into an
``{"error": {...}}`` JSON body. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

from typing import Any

from pdserve.protocol import ErrorBody, ErrorEnvelope


class PdserveError(Exception):
    """Base class. ``status`` is the HTTP status the error maps to."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(
            error=ErrorBody(message=self.message, type=self.type, code=self.code, param=self.param)
        )

    def to_json(self) -> dict[str, Any]:
        return self.envelope().model_dump()


class InvalidRequestError(PdserveError):
    """The client's request is malformed or out of range (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFoundError(PdserveError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class CapacityError(PdserveError):
    """No worker (or not enough KV blocks) to take the request now (HTTP 503)."""

    status = 503
    type = "server_error"
    code = "no_capacity"


class NoWorkerError(CapacityError):
    code = "no_worker"


class QueueFullError(PdserveError):
    """A worker's waiting queue is at its bound (``scheduler.max_queued_requests``), or a
    decode worker found no free KV blocks for a transferred prompt before its lease ran out:
    the request is refused now and may be retried (HTTP 429 with ``Retry-After``)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after_s = 1


class DeadlineExceededError(PdserveError):
    status = 504
    type = "server_error"
    code = "deadline_exceeded"


class WorkerError(PdserveError):
    """A worker leg failed (peer died, returned an error, or broke its stream) (HTTP 502)."""

    status = 502
    type = "server_error"
    code = "worker_error"


class TransferError(PdserveError):
    """The KV transfer failed: peer unreachable, layout mismatch, unknown/expired handle,
    wrong epoch, short or corrupt data."""

    status = 502
    type = "server_error"
    code = "kv_transfer_failed"


class LayoutMismatchError(TransferError):
    code = "kv_layout_mismatch"


class HandleError(TransferError):
    """The handle names an unknown request, an old epoch, another lease, an expired lease, or
    blocks that are not (or no longer) the ones parked."""

    code = "kv_handle_invalid"


class IntegrityError(TransferError):
    """KV bytes arrived that differ from what the sender digested (corrupted on the way, or the
    source changed under the transfer); the message names the request and the blocks."""

    code = "kv_integrity_failed"


class DiscoveryError(PdserveError):
    status = 503
    type = "server_error"
    code = "discovery_unavailable"


class ConfigError(PdserveError):
    status = 400
    type = "config_error"
    code = "invalid_config"
