"""Typed errors that cross the bus as ErrorReply and reach HTTP clients with the right status."""
from __future__ import annotations

from .messages import ErrorReply


class RadixflowError(Exception):
    code = 500
    kind = "internal_error"

    def __init__(self, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after    # seconds a client should wait before trying again (HTTP Retry-After)

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, kind=self.kind, message=self.message, param=self.param,
                          retry_after=self.retry_after)


class BadRequest(RadixflowError):
    code = 400
    kind = "invalid_request_error"


class Forbidden(RadixflowError):
    code = 403
    kind = "permission_error"


class NotFound(RadixflowError):
    code = 404
    kind = "not_found_error"


class PayloadTooLarge(RadixflowError):
    """A message larger than the NATS server's max_payload: refused before sending."""
    code = 413
    kind = "payload_too_large"


class Overloaded(RadixflowError):
    """Too much in flight (the service's, or one tenant's limits); `retry_after` says when to come back."""
    code = 429
    kind = "overloaded"


class ServiceUnavailable(RadixflowError):
    """Nobody answers on a subject (no responders), or the service is known dead."""
    code = 503
    kind = "service_unavailable"


class RequestLost(ServiceUnavailable):
    """The NATS connection dropped while a request waited: it or its answer may be lost."""


class RequestTimeout(RadixflowError):
    code = 504
    kind = "timeout"


class StreamGap(RadixflowError):
    """A streamed reply skipped a sequence number: part of the output was lost."""
    code = 502
    kind = "stream_gap"


class Unauthorized(RadixflowError):
    code = 401
    kind = "authentication_error"


_BY_CODE = {c.code: c for c in (BadRequest, Forbidden, NotFound, PayloadTooLarge, Overloaded, ServiceUnavailable,
                                RequestTimeout, StreamGap, Unauthorized)}


def from_reply(reply: ErrorReply) -> RadixflowError:
    cls = _BY_CODE.get(reply.code, RadixflowError)
    err = cls(reply.message, reply.param, reply.retry_after)
    err.code, err.kind = reply.code, reply.kind
    return err


def from_exception(exc: BaseException) -> ErrorReply:
    if isinstance(exc, RadixflowError):
        return exc.to_reply()
    return ErrorReply(code=500, kind="internal_error", message=f"{type(exc).__name__}: {exc}")
