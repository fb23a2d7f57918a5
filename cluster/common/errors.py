"""Typed errors that cross pool boundaries, with the status each API edge maps them to."""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # overload: worth retrying later (Retry-After)
    # A request over a size limit: HTTP 413, which clients do not retry (gRPC has no such code:
    # RESOURCE_EXHAUSTED with a message naming the limit).
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"  # nothing streamed yet: safe to retry
    ABORTED = "ABORTED"  # failed after the first token reached the client
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"

    @property
    def http_status(self) -> int:
        return _HTTP[self]

    @property
    def openai_type(self) -> str:
        return _OPENAI_TYPE.get(self, "server_error")


_HTTP = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.ABORTED: 502,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}

_OPENAI_TYPE = {
    ErrorCode.INVALID_ARGUMENT: "invalid_request_error",
    ErrorCode.NOT_FOUND: "invalid_request_error",
    ErrorCode.ALREADY_EXISTS: "invalid_request_error",
    ErrorCode.UNAUTHENTICATED: "authentication_error",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorCode.PAYLOAD_TOO_LARGE: "invalid_request_error",
}


class PDServeError(Exception):
    """An error with a status code for the API edge; ``message`` is safe to show a client.

    ``retry_after_s``: when an overloaded cluster expects to have room again (HTTP
    ``Retry-After``, gRPC ``retry-after-ms`` trailing metadata); None: no advice."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[ErrorCode, str, str, float | None]]:
        # Survives Ray's serialization between replicas with its fields intact.
        return (type(self), (self.code, self.message, self.request_id, self.retry_after_s))

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def invalid(message: str) -> PDServeError:
    return PDServeError(ErrorCode.INVALID_ARGUMENT, message)


def internal_error(request_id: str) -> PDServeError:
    """A bug as a client sees it: code, fixed message, request id (details stay in the log)."""
    return PDServeError(ErrorCode.INTERNAL, "internal error", request_id)
