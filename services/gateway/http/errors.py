"""Errors of the HTTP API: gRPC status codes to HTTP statuses, in OpenAI's error shape.

The gateway's errors are `SpecdecError`s carrying a gRPC status code (mapped for gRPC in
specdec.common.serving); this table is the one place they become HTTP statuses. The body
is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import grpc

from specdec.common.errors import SpecdecError

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,  # a session's turn is already in flight
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "cancelled",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ModelNotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND
    error_code = "model_not_found"


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED
    error_code = "invalid_api_key"


class BodyTooLarge(SpecdecError):
    """A request body beyond the gateway's message limit (gRPC's own answer would be
    RESOURCE_EXHAUSTED, which means backpressure here, hence the explicit status)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 413


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotReady(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


def http_status(e: BaseException) -> int:
    """The HTTP status of an error (500 for anything that is not a SpecdecError)."""
    if isinstance(e, SpecdecError):
        return getattr(e, "http_status", None) or HTTP_STATUS.get(e.code, 500)
    return 500


def error_body(e: BaseException) -> dict:
    """OpenAI's error object for an exception."""
    status = http_status(e)
    if isinstance(e, SpecdecError):
        message = str(e)
        code = getattr(e, "error_code", None) or e.code.name.lower()
    else:
        message = f"internal error: {type(e).__name__}: {e}"
        code = "internal"
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": getattr(e, "param", None),
            "code": code,
        }
    }
