"""A bidirectional gRPC stream as the round's transport, measured against the data plane
(`python -m specdec.tools.bench.callgap --transports dataplane,grpcstream,grpc`).

The candidate: one long-lived grpc.aio stream per gateway <-> replica connection, the
data plane's own messages on it (a DataCall up, a DataReply down, multiplexed by id),
each call answered as the unary gRPC method answers it (validated and queued from the
servicers' event loop, run on the model thread, its response handed back to the loop).
It is a measurement, not a transport the gateway uses: the data plane won (see the data
plane's page, docs/concepts/dataplane.md, "What it costs").

    python -m specdec.tools.bench.grpcstream [specdec serve verifier's flags]

runs a verifier that also serves the stream (service specdec.bench.DataStream, method
Calls); `StreamTransport` is its gateway end (a specdec.gateway.fleet.transport Transport).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import Any

import grpc

from specdec.gateway.fleet.dataplane import FIELDS
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.v1 import dataplane_pb2

PATH = "/specdec.bench.DataStream/Calls"
METHODS = {"draft": "Draft", "speculate": "Speculate", "verify": "Verify"}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def add_stream(servicer, server: grpc.aio.Server) -> None:
    """Serve the stream on the replica's gRPC server, answering each call through the
    servicer's model calls (as its unary methods do)."""
    from specdec.common.serving import reason_of, status_of

    calls = servicer.model_calls()

    async def answer(one: dataplane_pb2.DataCall, replies: asyncio.Queue) -> None:
        kind = one.WhichOneof("call") or ""
        rpc = METHODS.get(kind, "")
        try:
            prepare = calls.get(rpc)
            if prepare is None:
                raise ValueError(f"the replica does not serve {kind or 'an empty call'}")
            response = await servicer.answer(prepare(getattr(one, kind)))
            reply = dataplane_pb2.DataReply(id=one.id)
            getattr(reply, kind).CopyFrom(response)
        except Exception as e:
            code, message = status_of(e, rpc)
            error = dataplane_pb2.CallError(
                code=code.value[0],
                message=message,
                reason=dataplane_pb2.Reason.Value(reason_of(e).value),
            )
            reply = dataplane_pb2.DataReply(id=one.id, error=error)
        replies.put_nowait(reply)

    async def stream(requests, context):
        replies: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def read() -> None:
            async for one in requests:
                task = asyncio.ensure_future(answer(one, replies))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
            replies.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            reader.cancel()

    handler = grpc.stream_stream_rpc_method_handler(
        stream,
        request_deserializer=dataplane_pb2.DataCall.FromString,
        response_serializer=dataplane_pb2.DataReply.SerializeToString,
    )
    service, method = PATH.strip("/").split("/")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )


class StreamTransport:
    """The round's calls over one bidirectional stream on `channel`."""

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self._stream: Any = None  # grpc's StreamStreamCall, once opened (grpc has no types)
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, tuple[asyncio.Future, Method]] = {}
        self._ids = itertools.count(1)

    async def call(
        self, method: Method, request: Any, timeout: float, traceparent: str | None = None
    ) -> Any:
        if self._stream is None:
            self._stream = self.channel.stream_stream(
                PATH,
                request_serializer=dataplane_pb2.DataCall.SerializeToString,
                response_deserializer=dataplane_pb2.DataReply.FromString,
            )()
            self._reader = asyncio.ensure_future(self._read())
        call_id = next(self._ids)
        one = dataplane_pb2.DataCall(id=call_id, traceparent=traceparent or "")
        getattr(one, FIELDS[method]).CopyFrom(request)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (future, method)
        await self._stream.write(one)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._pending.pop(call_id, None)

    async def _read(self) -> None:
        try:
            async for reply in self._stream:
                waiting = self._pending.get(reply.id)
                if waiting is None or waiting[0].done():
                    continue
                future, method = waiting
                if reply.WhichOneof("reply") == "error":
                    code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
                    reason = dataplane_pb2.Reason.Name(reply.error.reason)
                    future.set_exception(CallFailed(code, reply.error.message, reason))
                else:
                    future.set_result(getattr(reply, FIELDS[method]))
        except grpc.aio.AioRpcError as err:
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(CallFailed(err.code(), err.details() or ""))

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.done_writing()
        if self._reader is not None:
            await self._reader


def main(argv: list[str] | None = None) -> int:
    from specdec.common.settings import SettingsParser
    from specdec.replica.replica import run_replica
    from specdec.v1 import verifier_pb2_grpc
    from specdec.verifier.config import VerifierConfig
    from specdec.verifier.server import SERVICE_NAME, VerifierServicer

    parser = SettingsParser(prog="python -m specdec.tools.bench.grpcstream")
    VerifierConfig.add_arguments(parser, default_port=0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def add(servicer, server) -> None:
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
        add_stream(servicer, server)

    run_replica(VerifierConfig, args, SERVICE_NAME, VerifierServicer, add)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
