"""Exceptions raised by the SDK: one class per gRPC status the gateway uses.

Every exception carries the gRPC status ``code`` (a :class:`grpc.StatusCode`) and the
server's ``details`` message. Statuses without a dedicated class become a plain
:class:`SpecdecError` with the code preserved.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = [
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "SpecdecError",
    "Unavailable",
    "Unimplemented",
    "from_rpc_error",
]


class SpecdecError(Exception):
    """A failed gateway call. ``code`` is the gRPC status, ``details`` the server's message."""

    #: Status used when none is given explicitly (subclasses fix their own).
    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None) -> None:
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.details: str = details
        super().__init__(f"{self.code.name}: {details}" if details else self.code.name)

    def __reduce__(
        self,
    ) -> tuple[Any, ...]:  # keep exceptions picklable (multiprocessing, loadtest workers)
        return (type(self), (self.details, self.code))


class InvalidArgument(SpecdecError):
    """The request was rejected as invalid (bad parameters, prompt too long, ...)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class Unavailable(SpecdecError):
    """The gateway (or every replica behind it) could not be reached."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    """The call did not finish before its deadline (``timeout=``)."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(SpecdecError):
    """The gateway is overloaded or a message exceeded a size limit."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(SpecdecError):
    """A named resource (e.g. a session) does not exist."""

    default_code = grpc.StatusCode.NOT_FOUND


class Unimplemented(SpecdecError):
    """The server does not implement this method (wrong address or version?)."""

    default_code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(SpecdecError):
    """A server-side bug or a protocol violation detected by the client."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SpecdecError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        Unavailable,
        DeadlineExceeded,
        ResourceExhausted,
        NotFound,
        Unimplemented,
        InternalError,
    )
}


def from_rpc_error(err: grpc.RpcError) -> SpecdecError:
    """The SDK exception for a failed call (sync or ``grpc.aio``); unknown codes -> SpecdecError."""
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    if details is None:
        details = str(err)
    return _BY_CODE.get(code, SpecdecError)(details, code)
