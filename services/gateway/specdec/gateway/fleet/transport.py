"""How the gateway reaches a replica for the calls of a speculation round.

A round's calls (`Draft`, `Speculate`, `Verify`) go through a replica's `Transport`:

- `GrpcTransport`: the replica's gRPC service, one unary call each (the public API of
  the replicas, which tools such as grpcurl also use);
- the data plane (specdec.gateway.fleet.dataplane): length-prefixed `DataCall` / `DataReply`
  frames (protos/specdec/v1/dataplane.proto) over one persistent TCP connection per
  replica, multiplexed by call id, answered on the replica's model thread. It exists
  because a unary gRPC call costs about 0.5 ms of round trip on the development machine,
  more than the whole per-round budget of a GPU deployment.

Both answer the same request messages with the same response messages, and fail the same
way: `CallFailed` with the status code, message and Reason the replica answered (the
replicas' status codes, protos/specdec/v1/common.proto; the Reason enum,
protos/specdec/v1/dataplane.proto, from the error frame or from gRPC's trailing metadata
"specdec-reason"), or UNAVAILABLE when the replica cannot be reached. The caller tells a
cache miss or a busy replica by its Reason, never by the message's wording. Nothing above
this module knows which transport a replica uses.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import grpc

from specdec.common.errors import Reason, SpecdecError
from specdec.gateway.names import Role
from specdec.sdk.errors import reason_in
from specdec.v1 import drafter_pb2, verifier_pb2


class Method(enum.Enum):
    """A call of the round: the role that serves it, its RPC name and its response type."""

    DRAFT = (Role.DRAFTER, "Draft", drafter_pb2.DraftResponse)
    SPECULATE = (Role.DRAFTER, "Speculate", drafter_pb2.SpeculateResponse)
    VERIFY = (Role.VERIFIER, "Verify", verifier_pb2.VerifyResponse)

    def __init__(self, role: Role, rpc: str, response: type):
        self.role = role
        self.rpc = rpc  # the RPC's name in the role's gRPC service
        self.response = response


class CallFailed(SpecdecError):
    """A replica answered a call with an error status, or could not be reached
    (UNAVAILABLE); the replica's status code, message and Reason are kept."""

    def __init__(
        self, code: grpc.StatusCode, details: str, reason: Reason = Reason.UNSPECIFIED
    ) -> None:
        super().__init__(details, code, reason)

    @property
    def cache_miss(self) -> bool:
        """The replica does not hold the named prefix: resend the full context."""
        return self.reason is Reason.CACHE_MISS


class Transport(Protocol):
    """The calls of a round to one replica."""

    async def call(
        self, method: Method, request: Any, timeout: float, traceparent: str | None = None
    ) -> Any:
        """Send `request` (the method's request message) and return its response message.

        timeout: seconds; past it the call is cancelled (a job the replica has not started
        never runs) and CallFailed(DEADLINE_EXCEEDED) is raised. traceparent: the W3C trace
        context of the caller's span whenever tracing is on (sampled or not: a replica's
        parent-based sampler follows it). Cancelling the awaiting task cancels the call the
        same way. Raises CallFailed."""
        ...

    async def close(self) -> None:
        """Fail every call in flight with UNAVAILABLE and release the connection."""
        ...


class GrpcTransport:
    """One unary gRPC call per round call, on the replica's channel."""

    def __init__(self, stub: Any):
        self.stub = stub

    async def call(
        self, method: Method, request: Any, timeout: float, traceparent: str | None = None
    ) -> Any:
        metadata = (("traceparent", traceparent),) if traceparent else None
        try:
            return await getattr(self.stub, method.rpc)(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            raise CallFailed(err.code(), err.details() or "", reason_in(err)) from None

    async def close(self) -> None:  # the channel belongs to the replica (health, Info)
        pass
