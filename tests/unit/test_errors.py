"""One error tree: the SDK's classes are the services' bases, the Reason is the proto's
enum, it travels in gRPC's trailing metadata to the SDK's exception, and the HTTP answer
is chosen by (code, reason)."""

from __future__ import annotations

import pickle

import grpc
import pytest

from specdec.common.errors import (
    CacheMiss,
    CapacityExceeded,
    InvalidRequest,
    NotReady,
    Reason,
    ReplicaBusy,
)
from specdec.common.serving import rpc_errors
from specdec.gateway.fleet.caller import UpstreamError
from specdec.gateway.fleet.transport import CallFailed
from specdec.gateway.front.http.errors import FieldError, answer
from specdec.sdk import errors as sdk
from specdec.v1 import dataplane_pb2


def test_reason_is_the_protos_enum():
    assert [r.value for r in Reason] == list(dataplane_pb2.Reason.keys())
    assert Reason.named(b"REASON_BUSY") is Reason.BUSY
    assert Reason.named("REASON_FROM_A_NEWER_SERVER") is Reason.UNSPECIFIED


def test_service_errors_are_the_sdks_classes():
    assert isinstance(InvalidRequest("x"), sdk.InvalidArgument)
    assert isinstance(InvalidRequest("x"), ValueError)
    assert isinstance(NotReady("x"), sdk.Unavailable) and NotReady("x").reason is Reason.LOADING
    assert isinstance(ReplicaBusy("x"), sdk.ResourceExhausted) and ReplicaBusy("x").busy
    assert isinstance(CapacityExceeded("x"), sdk.ResourceExhausted)
    assert not CapacityExceeded("x").busy
    assert CacheMiss("x").code == grpc.StatusCode.FAILED_PRECONDITION
    assert CacheMiss("x").reason is Reason.CACHE_MISS
    assert sdk.InvalidArgument.default_code == grpc.StatusCode.INVALID_ARGUMENT  # earlier name
    e = InvalidRequest("k too large")
    assert e.details == "k too large" and str(e) == "INVALID_ARGUMENT: k too large"


class _Replica:
    def __repr__(self) -> str:
        return "drafter@127.0.0.1:1"


def test_every_error_pickles_whatever_its_constructor():
    failed = CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica busy: 3", Reason.BUSY)
    for e in (
        failed,
        FieldError("top_k", "top_k must be an integer"),
        ReplicaBusy("replica busy: 3"),
        sdk.InvalidArgument("bad k"),
    ):
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and again.__dict__ == e.__dict__
        assert (again.code, again.reason, again.details) == (e.code, e.reason, e.details)
    upstream = UpstreamError(_Replica(), failed)
    assert upstream.details == "drafter@127.0.0.1:1: replica busy: 3"
    assert upstream.replica_details == "replica busy: 3" and upstream.busy


@pytest.mark.parametrize(
    "error, status, code",
    [
        (sdk.ResourceExhausted("full", reason=Reason.BUSY), 429, "resource_exhausted"),
        (sdk.ResourceExhausted("kv", reason=Reason.CAPACITY), 400, "context_length_exceeded"),
        (NotReady("loading"), 503, "unavailable"),
        (sdk.DeadlineExceeded("late"), 504, "deadline_exceeded"),
    ],
)
def test_the_http_answer_follows_code_and_reason(error, status, code):
    a = answer(error)
    assert (a.status, a.body["error"]["code"]) == (status, code)


async def test_the_reason_travels_to_the_sdk_in_trailing_metadata():
    """A real gRPC server on loopback answers through rpc_errors; the SDK's exception has
    the class, the message and the reason the server raised (never its wording)."""

    class Servicer:
        @rpc_errors
        async def Busy(self, request, context):
            raise ReplicaBusy("replica busy: 2 queued")

        @rpc_errors
        async def Bad(self, request, context):
            raise InvalidRequest("k must be in [0, 8], got 9")

    servicer = Servicer()

    def handler(method):
        async def behavior(request, context):
            return await method(request, context)

        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=bytes, response_serializer=bytes
        )

    handlers = {name: handler(getattr(servicer, name)) for name in ("Busy", "Bad")}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            got = []
            for name in ("Busy", "Bad"):
                call = channel.unary_unary(f"/t.T/{name}")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"", timeout=10)
                got.append(sdk.from_rpc_error(e.value))
    finally:
        await server.stop(None)
    busy, bad = got
    assert type(busy) is sdk.ResourceExhausted and busy.reason is Reason.BUSY and busy.busy
    assert busy.details == "replica busy: 2 queued"
    assert type(bad) is sdk.InvalidArgument and bad.reason is Reason.UNSPECIFIED
    assert bad.details == "k must be in [0, 8], got 9"
