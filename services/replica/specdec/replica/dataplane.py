"""The replica's data plane: the round's calls (Draft, Speculate, Verify) over one TCP
connection per gateway, read and answered on the model thread (the protocol:
protos/specdec/v1/dataplane.proto; the gateway's end: specdec.gateway.fleet.dataplane).

Why. A unary gRPC call costs about half a millisecond of round trip on the development
machine, and handing a call from the servicers' event loop to the model thread and back
costs wake-ups on both sides. Here the model thread's own loop (specdec.replica.batching
`Scheduler`) sleeps in a selector that holds the listening socket and the connections:
it reads a frame, validates the request and queues its job right there, batches it with
every other job as usual, and writes the reply when the job ends. No event loop and no
other thread is on this path.

The same as gRPC. A request is validated and its response built by the servicer's own
functions (`ReplicaServicer.model_calls`), errors become the status code and message
that `serving.rpc_errors` gives (`serving.status_of`), the job is bounded by --max-queue
(`ModelRuntime.submit`) and ordered per session, and the call is counted and traced like a
gRPC call (`metrics.CallRecord`: requests in flight, requests{method,code}, the SERVER
span under the frame's traceparent).

Life cycle. The port is bound at start-up (Info and the "listening" log line report it).
While the model loads, the model thread is busy loading, so a stand-in thread polls the
same selector and answers every call UNAVAILABLE "model is still loading"
(`while_loading`). On SIGTERM (`stop`), new calls are answered UNAVAILABLE "the service
is stopping", calls in flight finish within the grace period, then every connection
closes.

Liveness and bounds. A gateway's keepalive Ping is echoed as a pong when it is read,
between two forwards or during one: a forward that runs past STAND_IN_AFTER seconds hands
the selector to a stand-in thread (`Poller.stand_in_during_forwards`) that echoes pings
and queues every other call for the model thread, which dispatches them in order, as if
read after the forward. So a long prefill does not make a busy replica look dead, and a
stopped one still goes silent. A connection whose unsent replies pass MAX_UNSENT_BYTES (its
gateway stopped reading) is closed rather than grow. Error frames carry the error's Reason
(`serving.reason_of`).

TLS: the replica's own certificates (--tls-cert/--tls-key, client certificates required
with --tls-client-ca) through ssl.MemoryBIO, so the selector loop only ever moves bytes; a
replica configured for TLS never reads a plaintext frame.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import logging
import selectors
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from specdec.common.errors import NotReady, Reason
from specdec.common.frames import (
    MAX_FRAME_BYTES,
    PREFACE,
    FrameReader,
    ProtocolError,
    encode,
    with_message,
)
from specdec.common.serving import reason_of, status_of
from specdec.replica.metrics import CallRecord, ReplicaMetrics
from specdec.v1 import dataplane_pb2

if TYPE_CHECKING:
    from specdec.common.tls import ServerTls
    from specdec.replica.engine import Engine

log = logging.getLogger(__name__)

# DataCall's oneof fields (and DataReply's) -> the RPC they stand for.
METHODS = {"draft": "Draft", "speculate": "Speculate", "verify": "Verify"}
# DataReply's field number of each (the response travels there, serialized once).
REPLY_NUMBERS = {k: dataplane_pb2.DataReply.DESCRIPTOR.fields_by_name[k].number for k in METHODS}
STOPPING = "the service is stopping"
CANCELLED = "cancelled by the caller"
READ_BYTES = 256 * 1024
# A forward that runs this long (seconds) hands the sockets to a stand-in that echoes
# pings: a pong then waits at most about twice this, far below a gateway's keepalive
# timeout (--data-keepalive-timeout, 10 s by default); shorter forwards pay no hand-off.
STAND_IN_AFTER = 0.25
# Bytes a connection may hold unsent (the gateway does not read them): past it the
# connection closes rather than grow. One frame of the largest size always fits.
MAX_UNSENT_BYTES = MAX_FRAME_BYTES + 16 * 1024 * 1024

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening TCP socket on host:port (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise OSError(f"--data-port {port}: cannot listen on {host or '*'}: {e}") from None
    sock.setblocking(False)
    return sock


class Plan(Protocol):
    """A call validated for the model: the job it runs, its session, and how its result
    becomes the response (specdec.replica.replica.ModelCall)."""

    @property
    def job(self) -> Callable[[], Any]: ...

    @property
    def session(self) -> str: ...

    @property
    def respond(self) -> Callable[[Any], Any]: ...


class Served(Protocol):
    """What the data plane serves: a replica's servicer (specdec.replica.replica
    .ReplicaServicer), its engine and its model calls (RPC name -> request -> Plan)."""

    @property
    def runtime(self) -> Engine[Any]: ...

    def model_calls(self) -> Mapping[str, Callable[[Any], Plan]]: ...


class DataPlaneServer:
    """The data plane of one replica (see the module docstring).

    servicer: the replica's servicer (specdec.replica.replica.ReplicaServicer): its runtime,
    whose scheduler's selector (`Scheduler.io`) this serves on, and its model_calls().
    """

    def __init__(
        self,
        servicer: Served,
        service_name: str,
        host: str,
        port: int,
        tls: ServerTls | None = None,
    ):
        self.runtime = servicer.runtime
        self.role = self.runtime.config.role
        self.service_name = service_name
        self.io = self.runtime.scheduler.io
        self.calls = servicer.model_calls()  # RPC name -> request -> ModelCall
        self.metrics = ReplicaMetrics.for_role(self.role)
        self.tls_context: ssl.SSLContext | None = tls.ssl_context() if tls else None
        self.listener = listen(host, port)
        self.port = self.listener.getsockname()[1]
        self.connections: set[_Connection] = set()
        self.loading = True  # until while_loading's load returns: calls are UNAVAILABLE
        self.stopping = False  # after stop(): new calls are UNAVAILABLE
        self.in_flight = 0  # calls queued or running on the model
        self._standby = False
        self.unsent: set[_Connection] = set()  # connections with frames queued (send)
        # Calls the stand-in read during a forward, for the model thread (in order).
        self.deferred: collections.deque[tuple[_Connection, dataplane_pb2.DataCall]] = (
            collections.deque()
        )
        self.io.before_select.append(self._resume_deferred)
        self.io.before_select.append(self._flush_unsent)
        self.io.stand_in_during_forwards(STAND_IN_AFTER)
        self.io.call_soon(lambda: self.io.register(self.listener, _READ, self._accept))

    def _resume_deferred(self) -> None:
        """Dispatch the calls the stand-in read during the last forward, in the order they
        came, before anything read after it (the model thread, before it polls)."""
        if self.io.standing_in():
            return
        while self.deferred:
            conn, call = self.deferred.popleft()
            if not conn.closed:
                conn.handle(call)

    def _flush_unsent(self) -> None:
        """Write what the last steps queued, one write per connection (the polling thread,
        before it polls)."""
        while self.unsent:
            self.unsent.pop().flush()

    # -- start-up and shutdown ------------------------------------------------------------

    def while_loading(self, load: Callable[[], Any]) -> Any:
        """Run load() (a job on the model thread) while a stand-in thread polls the
        selector and answers calls UNAVAILABLE "model is still loading"."""
        self._standby = True
        standby = threading.Thread(
            target=self._stand_in, name=f"{self.role}-data-plane-loading", daemon=True
        )
        standby.start()
        try:
            return load()
        finally:
            self._standby = False
            self.io.wake()
            standby.join()
            self.io.thread = threading.current_thread()
            self.loading = False

    def _stand_in(self) -> None:
        while self._standby:
            self.io.poll(None)

    async def stop(self, grace: float) -> None:
        """Graceful stop (the event loop): refuse new calls, let the calls in flight
        finish for up to `grace` seconds, then close every connection."""
        self.stopping = True  # read by the model thread as each call arrives
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        self.io.call_soon(self._close_listener)
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        closed: concurrent.futures.Future[None] = concurrent.futures.Future()

        def close_all() -> None:
            for conn in list(self.connections):
                conn.close(STOPPING)
            closed.set_result(None)

        self.io.call_soon(close_all)
        try:  # the model thread gets to it after the forward it is running
            await asyncio.wait_for(asyncio.wrap_future(closed), max(1.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            log.warning("data plane connections not closed: the model thread is busy")

    def _close_listener(self) -> None:
        if self.listener.fileno() >= 0:
            self.io.unregister(self.listener)
            self.listener.close()

    # -- the model thread -----------------------------------------------------------------

    def _accept(self, _events: int) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the next readiness retries
                log.warning("data plane accept failed", extra={"why": str(e)})
                return
            if self.stopping:
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, sock, peer)
            self.io.register(sock, _READ, conn.on_events)
            self.connections.add(conn)
            self.metrics.data_connections.inc()
            log.info(
                "data plane connection", extra={"peer": conn.peer, "tls": conn.tls is not None}
            )
            conn.start()

    def dispatch(self, conn: _Connection, call: dataplane_pb2.DataCall) -> None:
        """One DataCall frame (model thread)."""
        kind = call.WhichOneof("call")
        if kind == "ping":  # the gateway's keepalive: echo it at once
            conn.send(
                encode(dataplane_pb2.DataReply(id=call.id, pong=call.ping).SerializeToString())
            )
            return
        if self.io.standing_in():  # a forward runs: the rest is the model thread's
            self.deferred.append((conn, call))
            return
        if kind == "cancel":
            future = conn.calls.get(call.id)
            if future is not None:
                future.cancel()  # only a job not started yet; its reply says CANCELLED
            return
        if call.id in conn.calls:
            raise ProtocolError(f"call {call.id} is already in flight on this connection")
        rpc = METHODS.get(kind or "")
        prepare = self.calls.get(rpc or "")
        if prepare is None:
            what = rpc or "an empty call"
            conn.reply_error(
                call.id, grpc.StatusCode.UNIMPLEMENTED, f"the {self.role} does not serve {what}"
            )
            return
        if self.stopping:
            conn.reply_error(call.id, grpc.StatusCode.UNAVAILABLE, STOPPING, Reason.STOPPING)
            return
        assert rpc is not None  # self.calls holds only the replica's methods
        self.metrics.child(self.metrics.data_calls, rpc).inc()
        context = contextvars.Context()
        context.run(
            self._start,
            context,
            conn,
            call.id,
            kind,
            rpc,
            prepare,
            getattr(call, kind),
            call.traceparent,
        )

    def _start(
        self,
        context: contextvars.Context,
        conn: _Connection,
        call_id: int,
        kind: str,
        rpc: str,
        prepare: Callable[[Any], Plan],
        request: Any,  # the call's request message
        traceparent: str,
    ) -> None:
        """Validate and queue one call, in its own context (its operation and span)."""
        record = CallRecord(
            self.runtime,
            self.service_name,
            rpc,
            request,
            {"traceparent": traceparent} if traceparent else {},
        )
        try:
            if self.loading:
                raise NotReady("model is still loading")
            plan = prepare(request)
            future = self.runtime.submit(plan.job, session=plan.session)
        except Exception as e:
            code, message = status_of(e, rpc)
            record.finish(code, message)
            conn.reply_error(call_id, code, message, reason_of(e))
            return
        conn.calls[call_id] = future
        self.in_flight += 1
        future.add_done_callback(
            functools.partial(self._done, context, record, conn, call_id, kind, plan.respond)
        )

    def _done(
        self,
        context: contextvars.Context,
        record: CallRecord,
        conn: _Connection,
        call_id: int,
        kind: str,
        respond: Callable[[Any], Any],
        future: concurrent.futures.Future[Any],
    ) -> None:
        """A call's job ended (or was cancelled before it started): answer it."""
        if not self.io.on_thread():  # a scheduler shut down from another thread
            self.io.call_soon(
                functools.partial(self._done, context, record, conn, call_id, kind, respond, future)
            )
            return
        conn.calls.pop(call_id, None)
        self.in_flight -= 1
        response = None
        reason = Reason.UNSPECIFIED
        if future.cancelled():
            code, message = grpc.StatusCode.CANCELLED, CANCELLED
        else:
            error = future.exception()
            if error is None:
                try:
                    response = respond(future.result())
                except Exception as e:
                    error = e
            if error is None:
                code, message = grpc.StatusCode.OK, ""
            else:
                code, message = status_of(error, record.method)
                reason = reason_of(error)
        context.run(record.finish, code, message)
        if response is None:
            conn.reply_error(call_id, code, message, reason)
        else:
            conn.reply(call_id, kind, response)


class _Connection:
    """One gateway's connection (model thread only)."""

    def __init__(self, server: DataPlaneServer, sock: socket.socket, peer: object):
        self.server = server
        self.io = server.io
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.reader = FrameReader()
        self.out = bytearray()  # bytes for the socket not sent yet
        self.events = _READ
        self.calls: dict[int, concurrent.futures.Future[Any]] = {}  # in flight, by call id
        self.closed = False
        self.tls: ssl.SSLObject | None = None
        self.handshaking = False
        if server.tls_context is not None:
            self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.tls = server.tls_context.wrap_bio(self.incoming, self.outgoing, server_side=True)
            self.handshaking = True

    def start(self) -> None:
        if self.tls is None:
            self.send(PREFACE)  # with TLS: once the handshake is done

    def on_events(self, events: int) -> None:
        if events & _WRITE:
            self.flush()
        if events & _READ and not self.closed:
            self.receive()

    def receive(self) -> None:
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(f"read failed: {e}")
            return
        if not data:
            self.close("the peer closed the connection")
            return
        if self.tls is not None:
            data = self._decrypt(data)
            if not data:
                return
        try:
            for payload in self.reader.feed(data):
                try:
                    call = dataplane_pb2.DataCall.FromString(payload)
                except DecodeError as e:
                    raise ProtocolError(f"a frame does not parse as a DataCall: {e}") from None
                if not self.handle(call):
                    return
        except ProtocolError as e:
            self._protocol_error(e)

    def handle(self, call: dataplane_pb2.DataCall) -> bool:
        """Dispatch one call; False once the connection is closed."""
        try:
            self.server.dispatch(self, call)
        except ProtocolError as e:
            self._protocol_error(e)
        return not self.closed

    def _protocol_error(self, e: ProtocolError) -> None:
        log.warning("data plane protocol error", extra={"peer": self.peer, "why": str(e)})
        self.close(str(e))

    def _decrypt(self, data: bytes) -> bytes:
        """TLS records in, plaintext out (b"" while there is none)."""
        assert self.tls is not None
        self.incoming.write(data)
        try:
            if self.handshaking:
                try:
                    self.tls.do_handshake()
                except ssl.SSLWantReadError:
                    return b""
                self.handshaking = False
                self.send(PREFACE)
            chunks = []
            while True:
                try:
                    chunk = self.tls.read(READ_BYTES)
                except ssl.SSLWantReadError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        except ssl.SSLZeroReturnError:
            self.close("the peer closed the TLS session")
        except ssl.SSLError as e:
            log.warning("data plane TLS error", extra={"peer": self.peer, "why": str(e)})
            self.close(f"TLS: {e}")
        finally:
            self._flush_tls()  # handshake flights, alerts, tickets
        return b""

    def _flush_tls(self) -> None:
        if self.tls is not None and not self.closed and self.outgoing.pending:
            self.out += self.outgoing.read()
            self.flush()

    def reply(self, call_id: int, kind: str, response: Message) -> None:
        head = dataplane_pb2.DataReply(id=call_id).SerializeToString()
        self.send(encode(with_message(head, REPLY_NUMBERS[kind], response.SerializeToString())))

    def reply_error(
        self,
        call_id: int,
        code: grpc.StatusCode,
        message: str,
        reason: Reason = Reason.UNSPECIFIED,
    ) -> None:
        error = dataplane_pb2.CallError(
            code=code.value[0], message=message, reason=dataplane_pb2.Reason.Value(reason.value)
        )
        reply = dataplane_pb2.DataReply(id=call_id, error=error)
        self.send(encode(reply.SerializeToString()))

    def send(self, data: bytes) -> None:
        """Queue a frame; it leaves at the model thread's next poll, with every other frame
        queued since (the replies of one batched forward in one write)."""
        if self.closed:
            return
        if self.tls is not None:
            self.tls.write(data)
            data = self.outgoing.read()
        self.out += data
        self.server.unsent.add(self)
        if len(self.out) > MAX_UNSENT_BYTES:  # the gateway stopped reading: bound it
            self.flush()
            if len(self.out) > MAX_UNSENT_BYTES:
                unsent = len(self.out)
                self.out.clear()
                self.close(f"{unsent} bytes unsent, over the bound of {MAX_UNSENT_BYTES}")

    def flush(self) -> None:
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.out.clear()  # nothing more can leave on it
                self.close(f"write failed: {e}")
                return
            del self.out[:sent]
        events = _READ | _WRITE if self.out else _READ
        if events != self.events:
            self.io.modify(self.sock, events, self.on_events)
            self.events = events

    def close(self, why: str) -> None:
        """Close the connection; its calls not started are cancelled, the replies of those
        running are dropped."""
        if self.closed:
            return
        if self.out:
            self.flush()  # replies queued before the close still leave, when they can
            if self.closed:
                return
        self.closed = True
        self.server.unsent.discard(self)
        self.io.unregister(self.sock)
        self.sock.close()
        self.server.connections.discard(self)
        self.server.metrics.data_connections.dec()
        log.info("data plane connection closed", extra={"peer": self.peer, "why": why})
        for future in list(self.calls.values()):
            future.cancel()
