"""One error hierarchy for the service; each error carries its HTTP status.

The core raises these; the HTTP edge (:mod:`batcher.app`) maps them to ``{"error": message}`` responses in one
place. Status codes follow the KServe v2 protocol and Triton's HTTP front end.
"""

from __future__ import annotations


class BatcherError(Exception):
    """Base of every error the service answers with. ``status`` is the HTTP status code."""

    status: int = 500
    #: failure reason label for ``batcher_request_failure_total{reason}``.
    reason: str = "other"

    def __init__(self, message: str, *, retry_after_s: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        #: extra response headers (e.g. ``Accept-Encoding`` of a 415)
        self.headers = headers or {}


class InvalidInput(BatcherError):
    """Malformed request: bad JSON or header, unknown input, wrong datatype/shape/byte size, too many rows."""

    status = 400
    reason = "invalid"


class Unauthorized(BatcherError):
    """A repository request without the configured bearer token."""

    status = 401
    reason = "invalid"


class RequestTimeout(BatcherError):
    """The request body did not arrive within ``server.read_timeout_s``."""

    status = 408
    reason = "invalid"


class ModelNotFound(BatcherError):
    """Unknown model or version."""

    status = 404
    reason = "not_found"


class NotFound(BatcherError):
    """Something other than a model that is not there: a shared-memory region, or a disabled extension's endpoint."""

    status = 404
    reason = "not_found"


class PayloadTooLarge(BatcherError):
    """Request body over ``server.max_body_bytes``."""

    status = 413
    reason = "invalid"


class UnsupportedMediaType(BatcherError):
    """A request body in a ``Content-Encoding`` the server cannot undo; answered with ``Accept-Encoding``."""

    status = 415
    reason = "invalid"


class Unavailable(BatcherError):
    """Queue full, model not ready, or server shutting down; answered with ``Retry-After``."""

    status = 503
    reason = "rejected"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class DeadlineExceeded(BatcherError):
    """The request's deadline passed before it was executed; it never ran."""

    status = 504
    reason = "timeout"


class ExecutionFailed(BatcherError):
    """The engine failed on the batch holding this request; the message carries the engine's reason."""

    status = 500
    reason = "backend"


class RemoteError(BatcherError):
    """An error raised in another process of the server (multi-process mode), carried with its status, reason and
    ``Retry-After``: answered and counted exactly as the original."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.status = status
        self.reason = reason


class ConfigError(ValueError):
    """Invalid configuration; the message names the field path and the bad value. Not an HTTP error."""
