"""Errors of the HTTP API: gRPC status codes to HTTP answers, in OpenAI's error shape.

The gateway's errors are `SpecdecError`s (specdec.sdk.errors, the one tree) carrying a
gRPC status code and a typed Reason (answered as such over gRPC by
specdec.common.serving); this module is the one place they become HTTP answers, by code
and reason, never by the message's wording. The body
is OpenAI's, ``{"error": {"message", "type", "param", "code"}}``, and where OpenAI's clients
act on an answer it is OpenAI's answer:

- a request that cannot fit, the model's context or a replica's KV cache bound (gRPC's
  RESOURCE_EXHAUSTED from the replica), is 400 ``context_length_exceeded`` with ``param``
  the prompt's field: no retry can help, and the `openai` client retries every 429;
- backpressure (every replica of a role has a full queue) is 429 with ``Retry-After``;
- a session whose turn lock is held is 409 with ``Retry-After`` (the error's
  ``retry_after``: when the lease of a gateway that stopped answering lapses, else 1 s);
- ``param`` names the body field an error is about: a FieldError's own, or the body's
  name of the Request field an InvalidRequest names (its ``field``);
- a 500 tells nothing of its cause: a generic message naming the request's id (its trace
  id when traced), and the exception logged under that id.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.common.errors import InvalidRequest, SpecdecError
from specdec.gateway.fleet.caller import UpstreamError
from specdec.gateway.job import ContextLengthExceeded
from specdec.sdk.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,  # a session's turn is already in flight
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,  # backpressure only: see `http_status`
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # as OpenAI: an unknown model or path
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Seconds a client should wait after a 429 (backpressure: a replica's queue drains in
# about a forward's time); the `openai` client honours Retry-After up to a minute.
RETRY_AFTER_SECONDS = 1


class ModelNotFound(NotFound):
    error_code = "model_not_found"
    param = "model"


class FieldError(InvalidRequest):
    """A bad value of one field of the request body; `param` is its name there."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED
    error_code = "invalid_api_key"


class BodyTooLarge(InvalidArgument):
    """A request body beyond the gateway's message limit (gRPC's own answer would be
    RESOURCE_EXHAUSTED, which means backpressure here, hence the explicit status)."""

    http_status = 413


def is_backpressure(e: BaseException) -> bool:
    """Every replica of a role answered busy (full queues, --max-queue): a retry later may
    succeed. Its reason says so (Reason.BUSY), from a replica or through the caller."""
    return isinstance(e, SpecdecError) and e.busy


def is_context_length(e: BaseException) -> bool:
    """The request cannot fit: the model's context, or a replica's KV cache bound (the one
    RESOURCE_EXHAUSTED that is not backpressure: the same request never fits there)."""
    if isinstance(e, ContextLengthExceeded):
        return True
    return (
        isinstance(e, SpecdecError)
        and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and getattr(e, "http_status", None) is None
        and not is_backpressure(e)
    )


def http_status(e: BaseException) -> int:
    """The HTTP status of an error (500 for anything that is not a SpecdecError)."""
    if not isinstance(e, SpecdecError):
        return 500
    if is_context_length(e):
        return 400
    return getattr(e, "http_status", None) or HTTP_STATUS.get(e.code, 500)


@dataclass(frozen=True)
class ErrorContext:
    """What the HTTP layer knows of the request an error answers.

    prompt: the body field a request that cannot fit is about ("prompt" or "messages").
    fields: the Request's field names (an InvalidRequest's `field`) -> the body field each
    comes from in this request, where they differ ("max_new_tokens" -> "max_tokens",
    "reset_session" -> "session_reset", ...). request_id: names a 500 (the request's trace
    id when traced).
    """

    prompt: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""


@dataclass(frozen=True)
class ErrorAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def _upstream_details(e: SpecdecError) -> str:
    """A replica's own message (without the replica's name the caller puts before it)."""
    return e.replica_details if isinstance(e, UpstreamError) else e.details


def _param(e: BaseException, context: ErrorContext) -> str | None:
    if is_context_length(e):
        return context.prompt
    given: str | None = getattr(e, "param", None)
    if given:
        return given
    field = e.field if isinstance(e, InvalidRequest) else None
    return context.fields.get(field, field) if field else None


def answer(e: BaseException, context: ErrorContext | None = None) -> ErrorAnswer:
    """The HTTP answer to an exception: status, OpenAI's error body, headers. A 500 is
    logged here, with its exception, under the id its message names."""
    context = context or ErrorContext()
    status = http_status(e)
    headers: dict[str, str] = {}
    if status == 500 or not isinstance(e, SpecdecError):  # (the latter is always a 500)
        request_id = context.request_id or uuid.uuid4().hex
        log.error(
            "internal error answering an HTTP request",
            exc_info=e,
            extra={"request_id": request_id},
        )
        message = (
            "The server had an error while processing the request "
            f"(request id {request_id}); it is logged under that id"
        )
        code = "internal"
    elif is_context_length(e):
        message = e.details
        if not isinstance(e, ContextLengthExceeded):
            message = f"the request does not fit a replica's KV cache: {_upstream_details(e)}"
        code = CONTEXT_LENGTH_EXCEEDED
    else:
        message = _upstream_details(e) if is_backpressure(e) else e.details
        code = getattr(e, "error_code", None) or e.code.name.lower()
        if status == 429:
            headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        elif e.retry_after is not None:  # a busy session: when its lock may be free
            headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": _param(e, context) if status != 500 else None,
            "code": code,
        }
    }
    return ErrorAnswer(status, body, headers)


def error_body(e: BaseException, context: ErrorContext | None = None) -> dict[str, Any]:
    """OpenAI's error object for an exception."""
    return answer(e, context).body
