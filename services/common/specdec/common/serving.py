"""One server bootstrap for every service.

grpc.aio server, standard grpc.health.v1 health (NOT_SERVING until `ready` finished),
server reflection, graceful stop on SIGTERM/SIGINT, and the single place where domain
errors become gRPC status codes (`rpc_errors`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from specdec.common.errors import REASON_KEY, RETRY_AFTER_KEY, Reason, SpecdecError

log = logging.getLogger(__name__)

ServicerT = TypeVar("ServicerT")
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")

# Large enough for a dense fp16 draft distribution per position over a 152k vocabulary
# (k * 300 KB) and for a compressed tokenizer in Info.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A server's port is its own: gRPC's default SO_REUSEPORT let a second service (another
# `specdec up` on the same --port) share it silently, each taking some of the connections.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class StartFailed(RuntimeError):
    """A service could not start for a reason outside its code (its replicas never served,
    or disagree); `specdec serve` prints the message as one line and exits 1."""


class _Malformed:
    """What a request deserializer returns for bytes that do not parse (see RefuseMalformed)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except Exception as e:  # DecodeError, or anything a parser raises on garbage
            return _Malformed(e)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: _Malformed) -> None:
    log.info("malformed request", extra={"method": method, "why": str(bad.error)})
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request bytes do not parse as the request message of {method}: {bad.error}",
    )


class RefuseMalformed(grpc.aio.ServerInterceptor):
    """Malformed request bytes get INVALID_ARGUMENT, with one log line and no traceback.

    grpc.aio answers a request deserializer that raises with UNKNOWN and logs a traceback
    per request. This wraps each unary-request handler's deserializer so that it never
    raises (it returns a _Malformed marker instead) and its behavior so that the marker is
    refused before any servicer code runs. Streaming-request methods (only reflection's)
    are left as they are.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            behavior = handler.unary_stream
            unary_stream: Callable[..., object]
            if inspect.isasyncgenfunction(behavior):

                async def streamed(
                    request: object, context: grpc.aio.ServicerContext
                ) -> AsyncIterator[object]:
                    if isinstance(request, _Malformed):
                        await _refuse(context, method, request)
                    async for item in behavior(request, context):
                        yield item

                unary_stream = streamed
            else:

                async def awaited(request: object, context: grpc.aio.ServicerContext) -> object:
                    if isinstance(request, _Malformed):
                        await _refuse(context, method, request)
                    return await behavior(request, context)

                unary_stream = awaited
            return handler._replace(
                request_deserializer=_tolerant(handler.request_deserializer),
                unary_stream=unary_stream,
            )
        behavior = handler.unary_unary

        async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            return await behavior(request, context)

        return handler._replace(
            request_deserializer=_tolerant(handler.request_deserializer),
            unary_unary=unary_unary,
        )


def status_of(e: BaseException, method_name: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers: a SpecdecError's own, anything
    else INTERNAL (logged with its traceback). The gRPC servicers (`rpc_errors`) and the
    data plane (specdec.replica.dataplane) both answer through it."""
    if isinstance(e, SpecdecError):
        return e.code, e.details
    log.exception("unexpected error in %s", method_name, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def reason_of(e: BaseException) -> Reason:
    """Why a call failed, beyond its status code (the Reason enum of dataplane.proto):
    UNSPECIFIED for anything but a SpecdecError that names one."""
    return e.reason if isinstance(e, SpecdecError) else Reason.UNSPECIFIED


async def _abort(context: grpc.aio.ServicerContext, method_name: str, e: Exception) -> None:
    code, message = status_of(e, method_name)
    reason = reason_of(e)
    trailing: list[tuple[str, str]] = []
    if reason is not Reason.UNSPECIFIED:
        trailing.append((REASON_KEY, reason.value))
    retry_after = e.retry_after if isinstance(e, SpecdecError) else None
    if retry_after is not None:  # when the same call may succeed (a busy session)
        trailing.append((RETRY_AFTER_KEY, str(max(1, round(retry_after * 1000)))))
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    await context.abort(code, message)


def rpc_errors(
    method: Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], Awaitable[ResponseT]],
) -> Callable[
    [ServicerT, RequestT, grpc.aio.ServicerContext], Coroutine[Any, Any, ResponseT | None]
]:
    """Map domain errors to gRPC status codes; anything unexpected is INTERNAL and logged.

    A failing request never takes the server down. Wraps unary methods. (The wrapper's
    None is never answered: context.abort raises.)
    """

    @functools.wraps(method)
    async def wrapper(
        self: ServicerT, request: RequestT, context: grpc.aio.ServicerContext
    ) -> ResponseT | None:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # the one place errors become statuses
            await _abort(context, method.__name__, e)
            return None  # not reached: context.abort raises

    return wrapper


def stream_rpc_errors(
    method: Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], AsyncIterator[ResponseT]],
) -> Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], AsyncIterator[ResponseT]]:
    """rpc_errors for server-streaming methods (async generators)."""

    @functools.wraps(method)
    async def wrapper(
        self: ServicerT, request: RequestT, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ResponseT]:
        try:
            async for item in method(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # the one place errors become statuses
            await _abort(context, method.__name__, e)

    return wrapper


class DataPlane(Protocol):
    """What `serve` needs of a replica's data plane (specdec.replica.dataplane)."""

    port: int

    async def stop(self, grace: float) -> None: ...


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection, v1alpha and v1.

    grpcio-reflection serves only grpc.reflection.v1alpha. v1's messages are the same as
    v1alpha's field for field (only the proto package differs), so the v1 service is the
    same servicer registered under the v1 method name with v1alpha's (de)serializers.
    """
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    alpha = reflection_pb2.ServerReflectionRequest
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )


def _listen(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None,
    what: str = "",
) -> int:
    """Bind `server` to `address` (TLS with `credentials`): the port bound. Raises OSError
    naming the address where it cannot (grpc says 0, or raises RuntimeError, by version)."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}{what} (in use, or not an address of this host)")
    return int(bound)


async def serve(
    *,
    service_name: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    reflect: Sequence[str],
    host: str,
    port: int,
    ready: Callable[[], Awaitable[None]],
    grace_seconds: float,
    on_stop: Callable[[], None] | None = None,
    on_port: Callable[[int], None] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_port: int = 0,
    data_plane: DataPlane | None = None,
) -> None:
    """Run a service until SIGTERM/SIGINT.

    The port opens first, with health NOT_SERVING, so an orchestrator sees a live process
    while the model loads; `ready()` then loads it and health turns SERVING.
    health_port: also serve the same health status, and nothing else, in plaintext on
    this port (probes that cannot speak the main port's TLS).
    data_plane: a replica's data plane (specdec.replica.dataplane), already listening: its
    port is logged with the gRPC port's, and it stops gracefully beside the gRPC server.
    """
    server = grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=[*interceptors, RefuseMalformed()]
    )
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection([*reflect, health.SERVICE_NAME], server)
    bound = _listen(server, f"{host}:{port}", credentials)
    servers = [server]
    if health_port:
        probe_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe_server)
        _listen(probe_server, f"{host}:{health_port}", None, " (--health-port)")
        servers.append(probe_server)
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    for s in servers:
        await s.start()
    log.info(
        "listening",
        extra={
            "port": bound,
            "grpc_service": service_name,
            "tls": bool(credentials),
            "health_port": health_port or None,
            "data_port": data_plane.port if data_plane else None,
        },
    )
    if on_port:
        on_port(bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    load = asyncio.ensure_future(ready())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([load, stopper], return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            load.result()  # a failed load stops the process with its error
            for name in ("", service_name):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("serving", extra={"grpc_service": service_name})
            await stopper
        else:
            load.cancel()
        log.info("stopping", extra={"grace_seconds": grace_seconds})
    finally:
        await health_servicer.enter_graceful_shutdown()
        stops = [s.stop(grace_seconds) for s in servers]
        if data_plane is not None:
            stops.append(data_plane.stop(grace_seconds))
        await asyncio.gather(*stops)
        if on_stop:
            on_stop()
        log.info("stopped")
