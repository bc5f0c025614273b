"""One server bootstrap for every service.

grpc.aio server, standard grpc.health.v1 health (NOT_SERVING until `ready` finished),
server reflection, graceful stop on SIGTERM/SIGINT, and the single place where domain
errors become gRPC status codes (`rpc_errors`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.common.errors import SpecdecError

log = logging.getLogger(__name__)

# Large enough for a dense fp16 draft distribution per position over a 152k vocabulary
# (k * 300 KB) and for a compressed tokenizer in Info.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


async def _abort(context: grpc.aio.ServicerContext, method_name: str, e: Exception):
    if isinstance(e, SpecdecError):
        await context.abort(e.code, str(e))
    log.exception("unexpected error in %s", method_name, exc_info=e)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def rpc_errors(method):
    """Map domain errors to gRPC status codes; anything unexpected is INTERNAL and logged.

    A failing request never takes the server down. Wraps unary methods.
    """

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # the one place errors become statuses
            await _abort(context, method.__name__, e)

    return wrapper


def stream_rpc_errors(method):
    """rpc_errors for server-streaming methods (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in method(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # the one place errors become statuses
            await _abort(context, method.__name__, e)

    return wrapper


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
) -> None:
    """Run a service until SIGTERM/SIGINT.

    The port opens first, with health NOT_SERVING, so an orchestrator sees a live process
    while the model loads; `ready()` then loads it and health turns SERVING.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*reflect, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("listening", extra={"port": bound, "grpc_service": service_name})
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
        await server.stop(grace_seconds)
        if on_stop:
            on_stop()
        log.info("stopped")
