"""The errors of specdec, client and server alike: one tree, one class per gRPC status.

Every exception carries the gRPC status ``code`` (a :class:`grpc.StatusCode`), the
``details`` message and a typed ``reason`` (:class:`Reason`): why, beyond the status
code, as a value a program acts on instead of the message's wording. A server sends the
reason in the gRPC trailing metadata ``specdec-reason`` (:data:`REASON_KEY`) of a failed
call and in the data plane's error frames; :func:`from_rpc_error` reads it back.
Statuses without a dedicated class become a plain :class:`SpecdecError` with the code
preserved.

The services raise subclasses of these classes (``specdec.common.errors``); the status
code of a class is its gRPC answer, and the HTTP API maps the same (code, reason) pairs to
its answers in one table.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import grpc

__all__ = [
    "REASON_KEY",
    "RETRY_AFTER_KEY",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "InvalidRequest",
    "NotFound",
    "Reason",
    "ResourceExhausted",
    "SpecdecError",
    "Unavailable",
    "Unimplemented",
    "error_for",
    "from_rpc_error",
]

#: The gRPC trailing metadata key that carries a failed call's :class:`Reason` by name.
REASON_KEY = "specdec-reason"
#: The gRPC trailing metadata key that says, in milliseconds, when a refused call may be
#: retried (a session whose turn lock is held: ABORTED); read into ``retry_after``.
RETRY_AFTER_KEY = "specdec-retry-after-ms"


class Reason(str, enum.Enum):
    """Why a call failed, beyond its status code: the ``Reason`` enum of
    protos/specdec/v1/dataplane.proto, value for value (each value is the proto name)."""

    #: Nothing more than the status code says.
    UNSPECIFIED = "REASON_UNSPECIFIED"
    #: FAILED_PRECONDITION: the replica does not hold the prefix a call names.
    CACHE_MISS = "REASON_CACHE_MISS"
    #: RESOURCE_EXHAUSTED: a queue is full (backpressure); another replica, or later.
    BUSY = "REASON_BUSY"
    #: RESOURCE_EXHAUSTED: the request does not fit a replica's KV cache bound.
    CAPACITY = "REASON_CAPACITY"
    #: UNAVAILABLE: the model is still loading (or the gateway still connecting).
    LOADING = "REASON_LOADING"
    #: UNAVAILABLE: the replica is stopping.
    STOPPING = "REASON_STOPPING"
    #: UNAVAILABLE: the replica stopped answering keepalive pings.
    KEEPALIVE_TIMEOUT = "REASON_KEEPALIVE_TIMEOUT"
    #: UNAVAILABLE: the connection closed or could not be made.
    DISCONNECTED = "REASON_DISCONNECTED"
    #: UNAVAILABLE: the replica speaks another version of the data plane.
    VERSION_MISMATCH = "REASON_VERSION_MISMATCH"
    #: UNAVAILABLE: the replica broke the data plane's protocol.
    PROTOCOL_ERROR = "REASON_PROTOCOL_ERROR"

    @classmethod
    def named(cls, name: str | bytes | None) -> Reason:
        """The reason of a name on the wire; UNSPECIFIED for none or one this version does
        not know (a newer server's)."""
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        try:
            return cls(name)
        except ValueError:
            return cls.UNSPECIFIED

    def __str__(self) -> str:
        return self.value


class SpecdecError(Exception):
    """A failed call. ``code`` is the gRPC status, ``details`` the message, ``reason``
    why beyond the code (:class:`Reason`). A subclass fixes its status (and reason) as
    class attributes; ``code``/``reason`` given here override them."""

    #: The gRPC status of this class (an instance may carry another one).
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    #: Why, beyond the code.
    reason: Reason = Reason.UNSPECIFIED
    #: Seconds after which the same call may succeed, when the server said (None: it did
    #: not): a session's turn lock held by another turn (ABORTED).
    retry_after: float | None = None
    #: The class's ``code`` (its earlier name, kept for callers).
    default_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.default_code = cls.code

    def __init__(
        self,
        details: str = "",
        code: grpc.StatusCode | None = None,
        reason: Reason | str | None = None,
    ) -> None:
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = Reason.named(reason) if not isinstance(reason, Reason) else reason
        self.details: str = details
        super().__init__(details)

    @property
    def busy(self) -> bool:
        """Backpressure: a queue was full (``Reason.BUSY``); the same call may succeed on
        another replica or later."""
        return self.reason is Reason.BUSY

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable whatever a subclass's __init__ takes (multiprocessing, loadtest workers).
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[SpecdecError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class InvalidArgument(SpecdecError):
    """The request was rejected as invalid (bad parameters, prompt too long, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidRequest(InvalidArgument, ValueError):
    """A request refused before it runs: malformed input, a value out of range (bad token
    ids, an empty prompt, k too large, bad sampling values). ``field`` names the request
    field it is about, as the request's parts spell it (``"temperature"``, ``"k"``,
    ``"max_new_tokens"``, ``"prompt"``; :mod:`specdec.sdk.request`), None when it is about
    none; the gRPC answer is its message alone, the HTTP API's names the body's field."""

    def __init__(
        self,
        details: str = "",
        code: grpc.StatusCode | None = None,
        reason: Reason | str | None = None,
        *,
        field: str | None = None,
    ) -> None:
        super().__init__(details, code, reason)
        self.field = field

    def about(self, field: str) -> InvalidRequest:
        """This error, naming ``field`` unless it names one already (re-raise it)."""
        if self.field is None:
            self.field = field
        return self


class Unavailable(SpecdecError):
    """The gateway (or every replica behind it) could not be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    """The call did not finish before its deadline (``timeout=``)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(SpecdecError):
    """The gateway is overloaded or a message exceeded a size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(SpecdecError):
    """A named resource (e.g. a session) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class Unimplemented(SpecdecError):
    """The server does not do this: a method it does not serve (wrong address or
    version?), or a feature it does not implement yet (the message says which)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(SpecdecError):
    """A server-side bug or a protocol violation detected by the client."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SpecdecError]] = {
    cls.code: cls
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


def error_for(
    code: grpc.StatusCode, details: str, reason: Reason | str | None = None
) -> SpecdecError:
    """The exception of a status received from a server (its class by code)."""
    return _BY_CODE.get(code, SpecdecError)(details, code, reason)


def from_rpc_error(err: grpc.RpcError) -> SpecdecError:
    """The SDK exception for a failed call (sync or ``grpc.aio``), with the reason its
    trailing metadata names; unknown codes -> SpecdecError."""
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    if details is None:
        details = str(err)
    error = error_for(code, details, reason_in(err))
    error.retry_after = retry_after_in(err)
    return error


def retry_after_in(err: grpc.RpcError) -> float | None:
    """Seconds after which a failed call may be retried, when its trailing metadata says."""
    metadata_fn = getattr(err, "trailing_metadata", None)
    metadata = metadata_fn() if callable(metadata_fn) else None
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return int(value) / 1000
            except (TypeError, ValueError):
                return None
    return None


def reason_in(err: grpc.RpcError) -> Reason:
    """The Reason a failed call's trailing metadata names (UNSPECIFIED when none)."""
    metadata_fn = getattr(err, "trailing_metadata", None)
    metadata = metadata_fn() if callable(metadata_fn) else None
    for key, value in metadata or ():
        if key == REASON_KEY:
            return Reason.named(value)
    return Reason.UNSPECIFIED
