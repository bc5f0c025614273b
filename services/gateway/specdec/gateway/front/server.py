"""GatewayService: the thin gRPC servicer over specdec.gateway.front.turn, and the bootstrap.

A call's GenerateRequest becomes the SDK's typed Request once, here (`Request.from_proto`),
and goes to `Gateway.run` as the HTTP API's does."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator

import grpc
import uvloop

from specdec.common.errors import SpecdecError
from specdec.common.logs import setup_logging
from specdec.common.serving import rpc_errors, serve, stream_rpc_errors
from specdec.common.telemetry import setup_tracing
from specdec.common.tls import BearerTokens
from specdec.gateway.config import GatewayConfig
from specdec.gateway.front.info import server_info
from specdec.gateway.front.response import stream_message
from specdec.gateway.front.turn import Gateway
from specdec.gateway.observe import metrics, tracing
from specdec.sdk.request import Request
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def client_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as time.monotonic(), or None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


TENANT_METADATA = "specdec-tenant"


def client_tenant(context: grpc.aio.ServicerContext) -> str:
    """The call's tenant (metadata specdec-tenant), "" when it names none."""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def typed_request(message: gateway_pb2.GenerateRequest) -> Request:
    """The call's request as the SDK's Request (InvalidRequest, counted as a failed
    request, for what no Request can hold)."""
    try:
        return Request.from_proto(message)
    except SpecdecError as e:
        metrics.REQUEST_ERRORS.labels(code=e.code.name).inc()
        raise


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    @rpc_errors
    async def Generate(
        self, message: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        request = typed_request(message)
        # Drain the generator (never return from inside the loop): its cleanup (the
        # session's turn lock, metrics, cache release) must run before the answer leaves.
        with tracing.request_span(
            "Generate", context, request, tracing.served_model(self.gateway.fleet)
        ) as span:
            final = None
            async for event in self.gateway.run(
                request, deadline=client_deadline(context), tenant=client_tenant(context)
            ):
                final = event.final or final
            if final is None:
                raise AssertionError("generation ended without a final response")
            tracing.finish(span, final, context)
        return final

    @rpc_errors
    async def GetServerInfo(
        self, request: gateway_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetServerInfoResponse:
        return server_info(self.gateway)

    @stream_rpc_errors
    async def GenerateStream(
        self, message: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        request = typed_request(message)
        with tracing.request_span(
            "GenerateStream", context, request, tracing.served_model(self.gateway.fleet)
        ) as span:
            async for event in self.gateway.run(
                request, deadline=client_deadline(context), tenant=client_tenant(context)
            ):
                if event.final is not None:
                    tracing.finish(span, event.final, context)
                message = stream_message(
                    event.text,
                    event.tokens,
                    event.final,
                    event.time_to_first_token_ms,
                    logprobs=event.logprobs,
                    prompt_logprobs=event.prompt_logprobs,
                    index=event.index,
                    choice=event.choice,
                )
                if event.final is not None:
                    message.trace_id = event.final.trace_id
                yield message


def main(args: argparse.Namespace) -> None:
    """`specdec serve gateway`: config, logging, metrics, serve until SIGTERM."""
    config = GatewayConfig.from_args(args)
    setup_logging("gateway")
    telemetry = setup_tracing("gateway")

    async def run() -> None:
        gateway = Gateway(config)  # grpc.aio channels bind to the running loop

        async def ready() -> None:
            if config.metrics_port:
                from prometheus_client import start_http_server

                start_http_server(config.metrics_port)
            await gateway.start()

        http = None
        try:
            if config.http_port:
                from specdec.gateway.front.http.app import start_http

                http = await start_http(gateway, config)  # answers 503 until ready
            await serve(
                service_name=SERVICE_NAME,
                add_servicers=lambda server: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
                    GatewayServicer(gateway), server
                ),
                reflect=[SERVICE_NAME],
                host=config.host,
                port=config.port,
                ready=ready,
                grace_seconds=config.grace_seconds,
                credentials=config.tls.credentials() if config.tls else None,
                health_port=config.tls.health_port if config.tls else 0,
                interceptors=[BearerTokens(config.auth_tokens)] if config.auth_tokens else [],
            )
        finally:
            if http is not None:
                await http.stop()
            await gateway.close()

    try:
        uvloop.run(run())  # libuv's loop: grpc.aio runs on it, and the data plane is cheaper
    finally:
        if telemetry:
            telemetry.shutdown()  # flush the spans of the graceful stop
