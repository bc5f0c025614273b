"""The gateway's end of the data plane: `DataPlaneTransport`, a specdec.gateway.fleet.transport
`Transport` over one persistent TCP connection to a replica's data port (the protocol:
protos/specdec/v1/dataplane.proto; the replica's end: specdec.replica.dataplane).

One asyncio Protocol per connection: each call gets an id and a future, its DataCall frame
is written at once (TCP_NODELAY), and `data_received` parses the replies as they come and
resolves the futures by id, so any number of calls share the connection. A call past its
timeout, or whose awaiting task is cancelled, sends a cancel frame (the replica drops the
job if it has not started) and fails with DEADLINE_EXCEEDED, or passes the cancellation
on. A replica's error frame becomes CallFailed with its code, message and Reason.

Liveness. Every `keepalive_interval` the connection sends a Ping, busy or idle; the
replica answers it between two forwards or during one. Hearing nothing at all from the replica for
`keepalive_timeout` (a process stopped, a host gone, a network cut that closed nothing)
closes the connection. When the connection is lost, every call in flight fails at once
with UNAVAILABLE (its Reason: KEEPALIVE_TIMEOUT, VERSION_MISMATCH, PROTOCOL_ERROR or
DISCONNECTED), which the caller treats as a failover.

Reconnect. After a loss the transport reconnects in the background with an exponential
back-off (`reconnect_initial`, doubling up to `reconnect_max`; reset by a connection that
completes its handshake). A call while no connection is up waits for an attempt in
progress, else fails at once with UNAVAILABLE (DISCONNECTED) naming when the next attempt
is due: a replica that is down costs its callers no connect timeout each.

Backpressure. The bytes written but not yet taken by the socket are bounded by
`max_buffered`: a call that finds the bound reached waits (within its timeout) until the
socket drains below half of it, so a replica that stops reading holds at most the bound
plus one frame of this gateway's memory; a call that waits past its timeout fails with
DEADLINE_EXCEEDED without having been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from specdec.common.errors import Reason
from specdec.common.frames import (
    PREFACE,
    FrameReader,
    ProtocolError,
    VersionMismatch,
    encode,
    with_message,
)
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.v1 import dataplane_pb2

log = logging.getLogger(__name__)

# Method -> the DataCall / DataReply oneof field that carries it.
FIELDS = {Method.DRAFT: "draft", Method.SPECULATE: "speculate", Method.VERIFY: "verify"}
# ... and its field number in DataCall (the request travels there, serialized once).
NUMBERS = {m: dataplane_pb2.DataCall.DESCRIPTOR.fields_by_name[f].number for m, f in FIELDS.items()}
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# Makes one connection: called with the protocol factory, returns once the transport is
# made (loop.create_connection's shape). The default dials TCP (with TLS per settings);
# tests pass one end of a socket pair (tests/unit/fakewire.py).
Connector = Callable[[Callable[[], asyncio.Protocol]], Awaitable[Any]]


@dataclass(frozen=True)
class DataPlaneSettings:
    """How the gateway reaches replicas' data ports: TLS as for their gRPC ports (None:
    plaintext), the name checked in their certificates ("": the address's host), and the
    connection's liveness, reconnect and buffer bounds (seconds, bytes; see the module
    docstring). A replica answers pings during a forward too (a pong waits at most about
    0.5 s: specdec.replica.dataplane)."""

    tls: ssl.SSLContext | None = None
    server_name: str = ""
    connect_timeout: float = 5.0
    keepalive_interval: float = 1.0
    keepalive_timeout: float = 10.0
    reconnect_initial: float = 0.1
    reconnect_max: float = 5.0
    max_buffered: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 < self.keepalive_interval < self.keepalive_timeout:
            raise ValueError(
                f"the keepalive interval ({self.keepalive_interval} s) must be positive and "
                f"shorter than the keepalive timeout ({self.keepalive_timeout} s)"
            )
        if not 0 < self.reconnect_initial <= self.reconnect_max:
            raise ValueError("reconnect back-off: 0 < reconnect_initial <= reconnect_max")
        if self.max_buffered <= 0:
            raise ValueError("max_buffered must be positive")


def _reason(number: int) -> Reason:
    """An error frame's Reason (UNSPECIFIED for a number this version does not know)."""
    known = number in dataplane_pb2.Reason.values()
    return Reason.named(dataplane_pb2.Reason.Name(number)) if known else Reason.UNSPECIFIED


def _unavailable(why: str, reason: Reason) -> CallFailed:
    return CallFailed(grpc.StatusCode.UNAVAILABLE, why, reason)


class _Protocol(asyncio.Protocol):
    """One connection: frames in, futures resolved by call id, pings out."""

    def __init__(self, target: str, settings: DataPlaneSettings):
        self.target = target
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.pending: dict[int, tuple[asyncio.Future[Any], Method]] = {}
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.lost: str | None = None  # why the connection is gone; None while it is up
        self.reason = Reason.DISCONNECTED  # the Reason of the loss
        self.unsent: list[bytes] = []  # frames queued in this pass of the event loop
        self.unsent_bytes = 0
        self.paused = False  # the transport's buffer is over its high-water mark
        self._drained: list[asyncio.Future[None]] = []  # calls waiting for room
        self.last_heard = self.loop.time()  # when the replica last sent anything
        self.pings = 0  # sent
        self.pongs = 0  # answered
        self._tick: asyncio.TimerHandle | None = None
        self.on_lost: Callable[[_Protocol], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (asyncio's or uvloop's, which share no base class).
        self.transport = transport = cast(asyncio.Transport, transport)
        high = self.settings.max_buffered
        transport.set_write_buffer_limits(high=high, low=high // 2)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.last_heard = self.loop.time()
        transport.write(PREFACE)
        self._tick = self.loop.call_later(self.settings.keepalive_interval, self._keepalive)

    def _keepalive(self) -> None:
        """Every keepalive interval: a replica silent for the timeout is dead, else ping."""
        if self.lost is not None:
            return
        silent = self.loop.time() - self.last_heard
        if silent > self.settings.keepalive_timeout:
            self._abort(
                f"no answer for {silent:.1f} s (keepalive timeout "
                f"{self.settings.keepalive_timeout:g} s)",
                Reason.KEEPALIVE_TIMEOUT,
            )
            return
        if self.reader.preface_seen:  # before it, the connect timeout watches
            self.pings += 1
            ping = dataplane_pb2.DataCall(id=0, ping=dataplane_pb2.Ping(nonce=self.pings))
            self.send(ping.SerializeToString())
        self._tick = self.loop.call_later(self.settings.keepalive_interval, self._keepalive)

    def data_received(self, data: bytes) -> None:
        self.last_heard = self.loop.time()
        try:
            payloads = self.reader.feed(data)
        except VersionMismatch as e:
            self._abort(str(e), Reason.VERSION_MISMATCH)
            return
        except ProtocolError as e:
            self._abort(str(e), Reason.PROTOCOL_ERROR)
            return
        if not self.ready.done() and self.reader.preface_seen:
            self.ready.set_result(None)
        for payload in payloads:
            try:
                reply = dataplane_pb2.DataReply.FromString(payload)
            except DecodeError as e:
                self._abort(f"a frame does not parse as a DataReply: {e}", Reason.PROTOCOL_ERROR)
                return
            kind = reply.WhichOneof("reply")
            if kind == "pong":
                self.pongs += 1
                continue
            waiting = self.pending.pop(reply.id, None)
            if waiting is None:
                continue  # timed out or cancelled here: the reply is moot
            future, method = waiting
            if future.done():
                continue
            if kind == "error":
                code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
                reason = _reason(reply.error.reason)
                future.set_exception(CallFailed(code, reply.error.message, reason))
            elif kind == FIELDS[method]:
                future.set_result(getattr(reply, kind))
            else:
                future.set_exception(
                    CallFailed(
                        grpc.StatusCode.INTERNAL,
                        f"the replica answered a {method.rpc} call with {kind or 'nothing'}",
                    )
                )

    def _abort(self, why: str, reason: Reason) -> None:
        log.warning(
            "data plane connection dropped",
            extra={"replica": self.target, "why": why, "reason": reason},
        )
        self.lost, self.reason = why, reason
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        why = self.lost or (str(exc) if exc else "the replica closed the connection")
        self.lost = why
        if self._tick is not None:
            self._tick.cancel()
        error = _unavailable(f"data plane connection to {self.target} lost: {why}", self.reason)
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: a failed handshake raises in connect
        self.fail_pending(error)
        self._wake(error)
        if self.on_lost is not None:
            self.on_lost(self)

    def fail_pending(self, error: CallFailed) -> None:
        pending, self.pending = self.pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(error)

    # -- writing, bounded ---------------------------------------------------------------

    def send(self, call: bytes) -> None:
        """Queue a frame; the frames of one pass of the event loop leave in one write at
        its end (sessions resumed by one batch of replies send their next calls
        together, and the replica reads them together)."""
        assert self.transport is not None
        if not self.unsent:
            self.loop.call_soon(self._flush)
        frame = encode(call)
        self.unsent.append(frame)
        self.unsent_bytes += len(frame)

    def _flush(self) -> None:
        frames, self.unsent, self.unsent_bytes = self.unsent, [], 0
        if self.transport is not None and self.lost is None:
            self.transport.write(b"".join(frames))  # may call pause_writing
        if not self.paused:
            self._wake(None)

    @property
    def buffered(self) -> int:
        """Bytes queued for the replica and not yet taken by the socket."""
        size = self.transport.get_write_buffer_size() if self.transport is not None else 0
        return size + self.unsent_bytes

    @property
    def full(self) -> bool:
        return self.paused or self.buffered > self.settings.max_buffered

    async def room(self) -> None:
        """Return once a frame may be queued (the buffer below its bound); raises the
        connection's CallFailed if it is lost meanwhile."""
        while self.full:
            if self.lost is not None:
                raise _unavailable(
                    f"data plane connection to {self.target}: {self.lost}", self.reason
                )
            waiter = self.loop.create_future()
            self._drained.append(waiter)
            await waiter

    def _wake(self, error: CallFailed | None) -> None:
        waiters, self._drained = self._drained, []
        for waiter in waiters:
            if not waiter.done():
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake(None)


class DataPlaneTransport:
    """The round's calls to one replica over its data port (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        settings: DataPlaneSettings | None = None,
        connector: Connector | None = None,
    ):
        self.host = host
        self.port = port
        self.settings = settings or DataPlaneSettings()
        self.target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._connector = connector or self._dial
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._ids = itertools.count(1)
        self._closed = False
        self.delay = 0.0  # the back-off after the last failure; 0 while connected
        self.retry_at = 0.0  # loop.time() of the next attempt after a failure
        self.delays: list[float] = []  # every back-off taken, in order (for inspection)
        self.last_failure = ""
        self._reconnecting: asyncio.Future[None] | None = None

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

    async def _dial(self, factory: Callable[[], asyncio.Protocol]) -> Any:
        tls: dict[str, Any] = {}
        if self.settings.tls is not None:
            server_name = self.settings.server_name or self.host
            tls = {"ssl": self.settings.tls, "server_hostname": server_name}
        loop = asyncio.get_running_loop()
        return await loop.create_connection(factory, self.host, self.port, **tls)

    async def _connect(self) -> None:
        if self._closed:
            raise _unavailable(f"data plane to {self.target} closed", Reason.DISCONNECTED)
        loop = asyncio.get_running_loop()
        protocol = _Protocol(self.target, self.settings)

        async def handshake() -> None:
            await self._connector(lambda: protocol)
            await protocol.ready  # the replica's preface

        try:
            await asyncio.wait_for(handshake(), self.settings.connect_timeout)
        except (CallFailed, OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            if protocol.transport is not None:
                protocol.lost = protocol.lost or "connect failed"
                protocol.transport.abort()
            if isinstance(e, CallFailed):
                failure = e
            else:
                why = str(e) or type(e).__name__
                failure = _unavailable(
                    f"data plane of {self.target} unreachable: {why}", Reason.DISCONNECTED
                )
            self._failed(loop, failure.details)
            raise failure from None
        self.delay = 0.0
        protocol.on_lost = self._lost
        self._protocol = protocol

    def _failed(self, loop: asyncio.AbstractEventLoop, why: str) -> None:
        """A connection failed or was lost: the next attempt waits the back-off."""
        initial, most = self.settings.reconnect_initial, self.settings.reconnect_max
        self.delay = min(most, self.delay * 2) if self.delay else initial
        self.delays.append(self.delay)
        self.retry_at = loop.time() + self.delay
        self.last_failure = why

    def _lost(self, protocol: _Protocol) -> None:
        if protocol is not self._protocol or self._closed:
            return
        self._failed(protocol.loop, protocol.lost or "lost")
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        """Reconnect in the background until a connection is up or the transport closes,
        each attempt after the back-off of the last failure."""
        loop = asyncio.get_running_loop()
        while not self._closed and not self.connected:
            await asyncio.sleep(max(0.0, self.retry_at - loop.time()))
            if self._closed or self.connected:
                return
            try:
                await self.connect()
            except CallFailed as e:
                log.info(
                    "data plane reconnect failed",
                    extra={"replica": self.target, "why": e.details, "retry_in": self.delay},
                )
            else:
                log.info("data plane reconnected", extra={"replica": self.target})

    async def call(
        self, method: Method, request: Any, timeout: float, traceparent: str | None = None
    ) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not self.connected:
            if self._connecting is None and loop.time() < self.retry_at:
                raise _unavailable(
                    f"data plane connection to {self.target} down ({self.last_failure}); "
                    f"next attempt in {self.retry_at - loop.time():.2f} s",
                    Reason.DISCONNECTED,
                )
            await self.connect()  # one attempt: its failure is this call's UNAVAILABLE
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:  # lost while connecting
            why = protocol.lost if protocol is not None else "closed"
            reason = protocol.reason if protocol is not None else Reason.DISCONNECTED
            raise _unavailable(f"data plane connection to {self.target}: {why}", reason)
        if protocol.full:  # backpressure: wait for room, within the call's timeout
            try:
                await asyncio.wait_for(protocol.room(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise CallFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"Deadline Exceeded (waiting for the data plane's write buffer to "
                    f"{self.target}, {protocol.buffered} bytes over its bound)",
                ) from None
        call_id = next(self._ids)
        head = dataplane_pb2.DataCall(id=call_id, traceparent=traceparent or "")
        frame = with_message(head.SerializeToString(), NUMBERS[method], request.SerializeToString())
        future = loop.create_future()
        protocol.pending[call_id] = (future, method)
        protocol.send(frame)
        timer = loop.call_at(deadline, self._expire, protocol, call_id, future)
        try:
            return await future
        except asyncio.CancelledError:
            if protocol.pending.pop(call_id, None) is not None:
                self._cancel(protocol, call_id)
            raise
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, call_id: int, future: asyncio.Future[Any]) -> None:
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
        for task in (self._connecting, self._reconnecting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.lost = protocol.lost or "the gateway closed it"
            protocol.transport.close()
            # connection_lost (called soon) fails what is still pending with UNAVAILABLE
            protocol.fail_pending(
                _unavailable(f"data plane connection to {self.target} closed", Reason.DISCONNECTED)
            )
