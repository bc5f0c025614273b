"""The gateway's end of the data plane: `DataPlaneTransport`, a specdec.gateway.transport
`Transport` over one persistent TCP connection to a replica's data port (the protocol:
protos/specdec/v1/dataplane.proto; the replica's end: specdec.common.dataplane).

One asyncio Protocol per replica: each call gets an id and a future, its DataCall frame
is written at once (TCP_NODELAY), and `data_received` parses the replies as they come and
resolves the futures by id, so any number of calls share the connection. A call past its
timeout, or whose awaiting task is cancelled, sends a cancel frame (the replica drops the
job if it has not started) and fails with DEADLINE_EXCEEDED, or passes the cancellation
on. When the connection is lost, every call in flight fails with UNAVAILABLE; the next
call connects again, once, and fails with UNAVAILABLE if that fails too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specdec.common.frames import PREFACE, FrameReader, ProtocolError, encode, with_message
from specdec.gateway.transport import CallFailed, Method
from specdec.v1 import dataplane_pb2

log = logging.getLogger(__name__)

# Method -> the DataCall / DataReply oneof field that carries it.
FIELDS = {Method.DRAFT: "draft", Method.SPECULATE: "speculate", Method.VERIFY: "verify"}
# ... and its field number in DataCall (the request travels there, serialized once).
NUMBERS = {m: dataplane_pb2.DataCall.DESCRIPTOR.fields_by_name[f].number for m, f in FIELDS.items()}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class DataPlaneSettings:
    """How the gateway reaches replicas' data ports: TLS as for their gRPC ports (None:
    plaintext) and the name checked in their certificates ("" : the address's host)."""

    tls: ssl.SSLContext | None = None
    server_name: str = ""
    connect_timeout: float = 5.0


class _Protocol(asyncio.Protocol):
    """One connection: frames in, futures resolved by call id."""

    def __init__(self, target: str):
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.pending: dict[int, tuple[asyncio.Future, Method]] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lost: str | None = None  # why the connection is gone; None while it is up
        self.unsent: list[bytes] = []  # frames queued in this pass of the event loop

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(PREFACE)

    def data_received(self, data: bytes) -> None:
        try:
            payloads = self.reader.feed(data)
        except ProtocolError as e:
            self._abort(str(e))
            return
        if not self.ready.done() and self.reader.preface_seen:
            self.ready.set_result(None)
        for payload in payloads:
            try:
                reply = dataplane_pb2.DataReply.FromString(payload)
            except DecodeError as e:
                self._abort(f"a frame does not parse as a DataReply: {e}")
                return
            waiting = self.pending.pop(reply.id, None)
            if waiting is None:
                continue  # timed out or cancelled here: the reply is moot
            future, method = waiting
            if future.done():
                continue
            kind = reply.WhichOneof("reply")
            if kind == "error":
                code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
                future.set_exception(CallFailed(code, reply.error.message))
            elif kind == FIELDS[method]:
                future.set_result(getattr(reply, kind))
            else:
                future.set_exception(
                    CallFailed(
                        grpc.StatusCode.INTERNAL,
                        f"the replica answered a {method.rpc} call with {kind or 'nothing'}",
                    )
                )

    def _abort(self, why: str) -> None:
        log.warning("data plane protocol error", extra={"replica": self.target, "why": why})
        self.lost = why
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        why = self.lost or (str(exc) if exc else "the replica closed the connection")
        self.lost = why
        error = CallFailed(
            grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.target} lost: {why}"
        )
        if not self.ready.done():
            self.ready.set_exception(error)
        pending, self.pending = self.pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(error)

    def send(self, call: bytes) -> None:
        """Queue a frame; the frames of one pass of the event loop leave in one write at
        its end (sessions resumed by one batch of replies send their next calls
        together, and the replica reads them together)."""
        assert self.transport is not None
        if not self.unsent:
            asyncio.get_running_loop().call_soon(self._flush)
        self.unsent.append(encode(call))

    def _flush(self) -> None:
        frames, self.unsent = self.unsent, []
        if self.transport is not None and self.lost is None:
            self.transport.write(b"".join(frames))


class DataPlaneTransport:
    """The round's calls to one replica over its data port (see the module docstring)."""

    def __init__(self, host: str, port: int, settings: DataPlaneSettings | None = None):
        self.host = host
        self.port = port
        self.settings = settings or DataPlaneSettings()
        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._ids = itertools.count(1)
        self._closed = False

    def __repr__(self) -> str:
        return f"DataPlaneTransport({self.target})"

    @property
    def connected(self) -> bool:
        return self._protocol is not None and self._protocol.lost is None

    async def connect(self) -> None:
        """Connect now (done at most once at a time; every caller waits for the same
        attempt). Raises CallFailed(UNAVAILABLE) when the replica cannot be reached or does
        not answer the data plane's preface."""
        if self.connected:
            return
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        attempt = self._connecting
        try:
            await asyncio.shield(attempt)
        finally:
            if attempt.done() and self._connecting is attempt:
                self._connecting = None

    async def _connect(self) -> None:
        if self._closed:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"data plane to {self.target} closed")
        loop = asyncio.get_running_loop()
        settings = self.settings
        tls = {}
        if settings.tls is not None:
            tls = {"ssl": settings.tls, "server_hostname": settings.server_name or self.host}
        protocol = _Protocol(self.target)

        async def handshake() -> None:
            await loop.create_connection(lambda: protocol, self.host, self.port, **tls)
            await protocol.ready  # the replica's preface

        try:
            await asyncio.wait_for(handshake(), settings.connect_timeout)
        except CallFailed:
            raise
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            if protocol.transport is not None:
                protocol.transport.abort()
            why = str(e) or type(e).__name__
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE, f"data plane of {self.target} unreachable: {why}"
            ) from None
        self._protocol = protocol

    async def call(
        self, method: Method, request: Any, timeout: float, traceparent: str | None = None
    ) -> Any:
        if not self.connected:
            await self.connect()  # once: a failure is this call's UNAVAILABLE
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:  # lost while connecting
            why = protocol.lost if protocol is not None else "closed"
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.target}: {why}"
            )
        call_id = next(self._ids)
        head = dataplane_pb2.DataCall(id=call_id, traceparent=traceparent or "")
        frame = with_message(head.SerializeToString(), NUMBERS[method], request.SerializeToString())
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        protocol.pending[call_id] = (future, method)
        protocol.send(frame)
        timer = loop.call_later(timeout, self._expire, protocol, call_id, future)
        try:
            return await future
        except asyncio.CancelledError:
            if protocol.pending.pop(call_id, None) is not None:
                self._cancel(protocol, call_id)
            raise
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, call_id: int, future: asyncio.Future) -> None:
        if protocol.pending.pop(call_id, None) is None or future.done():
            return
        self._cancel(protocol, call_id)
        future.set_exception(CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    @staticmethod
    def _cancel(protocol: _Protocol, call_id: int) -> None:
        if protocol.lost is None and protocol.transport is not None:
            protocol.send(
                dataplane_pb2.DataCall(
                    id=call_id, cancel=dataplane_pb2.CancelCall()
                ).SerializeToString()
            )

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.lost = protocol.lost or "the gateway closed it"
            protocol.transport.close()
            # connection_lost (called soon) fails what is still pending with UNAVAILABLE
            pending, protocol.pending = protocol.pending, {}
            error = CallFailed(
                grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.target} closed"
            )
            for future, _ in pending.values():
                if not future.done():
                    future.set_exception(error)
