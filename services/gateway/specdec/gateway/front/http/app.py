"""The gateway's OpenAI-compatible HTTP API: a Starlette app served by uvicorn in the
gateway's own event loop, next to grpc.aio, so every request calls `Gateway.run` directly.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}, GET /health, GET /metrics (the gateway's Prometheus registry, the
one --metrics-port serves). POST /v1/responses, OpenAI's Responses API, is known and not
built: 501 in OpenAI's error shape, naming what to call instead. Each generation is one
`Gateway.run` of the typed Request the body becomes (its resolution, the turn lock, the
loop and the session write are the gRPC path's own); this module only translates
(specdec.gateway.front.http.api), streams server-sent events, enforces the request's
`timeout` and cancels the generation when the client goes away: cancelling the turn's
generator runs its cleanup, so the session's turn lock is released at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from http import HTTPStatus
from pathlib import PurePosixPath
from ssl import CERT_REQUIRED
from typing import Any

import grpc
import uvicorn
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.common import telemetry
from specdec.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotReady,
    SpecdecError,
    Unimplemented,
)
from specdec.common.serving import MAX_MESSAGE_BYTES
from specdec.common.tls import ServerTls, pem_files
from specdec.gateway.config import GatewayConfig
from specdec.gateway.front.http import api
from specdec.gateway.front.http.chat import ChatTemplate, ChatTurn
from specdec.gateway.front.http.errors import (
    ERROR_TYPE,
    BodyTooLarge,
    ErrorContext,
    ModelNotFound,
    Unauthenticated,
    answer,
    http_status,
)
from specdec.gateway.front.http.logprobs import LogprobsRenderer
from specdec.gateway.front.info import supported_request_fields
from specdec.gateway.front.response import Event
from specdec.gateway.front.turn import Gateway
from specdec.gateway.job import Limits
from specdec.gateway.observe import tracing
from specdec.gateway.round import grammar
from specdec.gateway.text import TextCodec
from specdec.sdk import request as typed
from specdec.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
)
HTTP_RESPONSES = Counter(
    "specdec_gateway_http_responses",
    "HTTP API answers by path and status (499: the client went away first)",
    ["path", "status"],
)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_response(e: BaseException, context: ErrorContext | None = None) -> JSONResponse:
    a = answer(e, context)
    return JSONResponse(a.body, status_code=a.status, headers=a.headers)


def model_folder_name(model_id: str) -> str:
    """The served model's default name: the name of the verifier's model folder, the last
    component of its model path (a GGUF model's `#file` left out). Where that component
    names no model, the folder that does: `specdec models install` keeps a model in
    `<name>/model`, a Hugging Face cache in `models--<org>--<name>/snapshots/<revision>`."""
    path = PurePosixPath(model_id.split("#", 1)[0].rstrip("/") or "/")
    parent = path.parent
    if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
        return parent.parent.name.split("--", 2)[-1]
    if path.name == "model" and parent.name:
        return parent.name
    return path.name or model_id


def _sse(obj: Any) -> bytes:
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


class GenerationResponse:
    """An ASGI response that runs one generation: unary JSON or a stream of events.

    Three things race: the generation (`_pump`), the client going away (`_disconnect`)
    and the request's timeout. A client that disconnects cancels the generation; a
    timeout cancels it and answers 504 (an error event when the stream has started).
    Errors before the first event get their own HTTP status; later ones (streams only)
    arrive as an error event followed by `data: [DONE]`.
    """

    def __init__(
        self,
        events: AsyncGenerator[Event, None],
        renderer: api.Renderer,
        opts: api.Options,
        turn: ChatTurn | None,
        span: Span | None = None,
    ):
        self.events = events
        self.span = span  # the request's SERVER span (tracing on); ends with the answer
        self.renderer = renderer
        self.opts = opts
        self.turn = turn
        self.started = False  # response headers sent
        self.tokens = 0
        self.scope: Scope = {"type": "http"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.span is None:
            await self._answer(scope, receive, send)
            return
        with trace.use_span(self.span, end_on_exit=True):  # the turn's spans hang under it
            await self._answer(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {pump, gone}, timeout=self.opts.timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (pump, gone):
                task.cancel()
        if pump in done:
            pump.result()
            return
        with contextlib.suppress(asyncio.CancelledError):
            await pump  # the generation's cleanup (turn lock, metrics) has run
        if gone in done:
            if self.span is not None:
                self.span.set_attribute("http.response.status_code", 499)
                self.span.set_status(Status(StatusCode.ERROR, "client disconnected"))
            log.info(
                "http client disconnected; generation cancelled",
                extra={"session_id": self.opts.session_id, "tokens": self.tokens},
            )
            return
        with contextlib.suppress(OSError):
            await self._send_error(send, self._timed_out())

    def _timed_out(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the generation did not finish within timeout={self.opts.timeout}s "
            f"(tokens generated: {self.tokens})"
        )

    async def _pump(self, send: Send) -> None:
        r, opts = self.renderer, self.opts
        final = None
        try:
            async for event in self.events:
                self.tokens += len(event.tokens)
                if event.final is not None:
                    final = event.final
                    self._note_session(final)
                    self.renderer.trace_id = tracing.finish(self.span, final, _NoMetadata())
                if opts.stream:
                    if not self.started:
                        await send(
                            {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                        )
                        self.started = True
                    for chunk in r.chunks(event, opts.include_usage, opts.continuous_usage):
                        await send(
                            {"type": "http.response.body", "body": _sse(chunk), "more_body": True}
                        )
            if final is None:
                raise AssertionError("generation ended without a final response")
            if opts.stream:
                await send(
                    {"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False}
                )
            else:
                await JSONResponse(r.body(final))(self.scope, _no_receive, send)
        except Exception as e:  # a 500 is logged with its exception by errors.answer
            if (
                self.opts.timeout
                and isinstance(e, SpecdecError)
                and e.code == grpc.StatusCode.DEADLINE_EXCEEDED
            ):  # a replica call ran into the request's timeout (it bounds them) before the
                # wait above did: the same answer, whichever timer fired first
                e = self._timed_out()
            await self._send_error(send, e)
        finally:
            await self.events.aclose()

    def _note_session(self, final: gateway_pb2.GenerateResponse) -> None:
        if not self.opts.session_id:
            return
        session: dict[str, Any] = {
            "id": self.opts.session_id,
            "history_tokens": final.usage.history_tokens,
            "turns": final.usage.session_turns,
        }
        if self.turn is not None:
            session["continued"] = self.turn.continued
            session["restarted"] = self.turn.restarted
        self.renderer.session = session

    def _error_context(self) -> ErrorContext:
        return ErrorContext(
            prompt=self.opts.prompt_field,
            fields=self.opts.fields,
            request_id=telemetry.trace_id_hex(self.span) or self.renderer.id,
        )

    async def _send_error(self, send: Send, e: BaseException) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", http_status(e))
            self.span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"[:500]))
        a = answer(e, self._error_context())
        if not self.started:
            response = JSONResponse(a.body, status_code=a.status, headers=a.headers)
            await response(self.scope, _no_receive, send)
            self.started = True
            return
        await send({"type": "http.response.body", "body": _sse(a.body), "more_body": True})
        await send({"type": "http.response.body", "body": _sse("[DONE]"), "more_body": False})


def _deadline(opts: api.Options) -> float | None:
    """The request's `timeout` as Gateway.run's deadline (time.monotonic()): it bounds every
    replica call, as a gRPC client's deadline does."""
    return time.monotonic() + opts.timeout if opts.timeout else None


class _NoMetadata:
    """tracing.finish sets gRPC trailing metadata; an HTTP answer carries the trace id in
    its `specdec` extension instead."""

    def set_trailing_metadata(self, metadata: object) -> None:
        pass


def request_span(request: Request, route: str, asked: typed.Request, model: str) -> Span | None:
    """The SERVER span of one HTTP generation, under the caller's `traceparent` header
    (None when tracing is off). Started here, made current while the answer runs."""
    if not telemetry.enabled():
        return None
    span = telemetry.tracer.start_span(
        f"POST {route}",
        context=propagate.extract(dict(request.headers)),
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": "POST",
            "url.path": route,
            **tracing._request_attributes(asked, model),
        },
        record_exception=False,
        set_status_on_exception=False,
    )
    span.set_attribute("http.response.status_code", 200)  # replaced by an error's status
    return span


async def _no_receive() -> Message:
    raise AssertionError("a response does not read the request")


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """The routes, over one Gateway."""

    def __init__(
        self,
        gateway: Gateway,
        served_model_name: str = "",
        tokens: frozenset[str] = frozenset(),
        strict_fields: bool = False,
    ):
        self.gateway = gateway
        self.served_model_name = served_model_name
        self.strict_fields = strict_fields  # --strict-fields: unknown body fields are 400
        self.tokens = tuple(t.encode() for t in tokens)  # --auth-tokens-file, as gRPC
        self.created = int(time.time())
        self._chat_template: tuple[str, ChatTemplate] | None = None

    # -- state ---------------------------------------------------------------------------

    def _ready(self) -> tuple[Limits, TextCodec]:
        """The started gateway's limits and codec (NotReady while it starts)."""
        limits, codec = self.gateway.limits, self.gateway.codec
        if limits is None or codec is None:
            raise NotReady("the gateway is starting: its replicas have not all answered yet")
        return limits, codec

    def _verifier_info(self) -> common_pb2.ModelInfo:
        for replica in self.gateway.fleet.verifiers.replicas:
            if replica.info is not None:
                return replica.info
        raise NotReady("no verifier has answered Info yet")

    @property
    def model(self) -> str:
        """--served-model-name, else the verifier's model folder's name."""
        return self.served_model_name or model_folder_name(self._verifier_info().model_id)

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other names a request's `model` may give: without --served-model-name, the
        verifier's whole model id (the default name before it was the folder's)."""
        return () if self.served_model_name else (self._verifier_info().model_id,)

    def chat_template(self) -> ChatTemplate:
        info = self._verifier_info()
        if self._chat_template is None or self._chat_template[0] != info.chat_template:
            self._chat_template = (
                info.chat_template,
                ChatTemplate(info.chat_template, dict(info.special_tokens)),
            )
        return self._chat_template[1]

    def _authorize(self, request: Request) -> None:
        if not self.tokens:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # Every token compared, in constant time each (as the gRPC BearerTokens).
        matches = [hmac.compare_digest(given, t) for t in self.tokens]
        if scheme.lower() != "bearer" or not any(matches):
            raise Unauthenticated("missing or invalid bearer token (Authorization: Bearer <token>)")

    async def _body(self, request: Request) -> Any:
        """The JSON body, read up to the gRPC API's message limit (413 beyond it)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_MESSAGE_BYTES:
            raise BodyTooLarge(f"the request body is over {MAX_MESSAGE_BYTES} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_MESSAGE_BYTES:
                raise BodyTooLarge(f"the request body is over {MAX_MESSAGE_BYTES} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the request body is not valid JSON: {e}") from None

    # -- routes --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        self._ready()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """The gateway's Prometheus registry, as --metrics-port serves it (behind the
        bearer tokens when --auth-tokens-file is set, as the rest of the API)."""
        self._authorize(request)
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        limits, _ = self._ready()
        return JSONResponse({"object": "list", "data": [self._model_card(limits)]})

    async def model_card(self, request: Request) -> Response:
        self._authorize(request)
        limits, _ = self._ready()
        name = request.path_params["model"]
        if name != self.model and name not in self.aliases:
            raise ModelNotFound(
                f"the model {name!r} does not exist; this server serves {self.model!r}"
            )
        return JSONResponse(self._model_card(limits))

    def _model_card(self, limits: Limits) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "specdec",
            "max_model_len": limits.max_context,
            # The optional request fields served (as GetServerInfo's supported_request_fields).
            api.EXTENSION: {"supported_request_fields": supported_request_fields(self.gateway)},
            "structured_output": (
                {"engine": grammar.ENGINE, "kinds": list(grammar.KINDS)}
                if self.gateway.grammars
                else None
            ),
        }

    async def completions(self, request: Request) -> GenerationResponse:
        self._authorize(request)
        _, codec = self._ready()
        asked, opts = api.completion_request(
            await self._body(request), self.model, self.aliases, self.strict_fields
        )
        renderer = api.Renderer(chat=False, model=opts.model)
        self._scores(renderer, asked, opts, codec)
        span = request_span(request, "/v1/completions", asked, opts.model)
        events = self.gateway.run(asked, deadline=_deadline(opts), tenant=opts.user)
        return GenerationResponse(events, renderer, opts, None, span)

    async def chat_completions(self, request: Request) -> GenerationResponse:
        self._authorize(request)
        limits, codec = self._ready()
        asked, opts, messages = api.chat_request(
            await self._body(request), self.model, self.aliases, self.strict_fields
        )
        template = self.chat_template()
        tools = opts.tools.tools if opts.tools is not None else None
        rendered = await asyncio.to_thread(template.render, messages, True, tools)
        asked = dataclasses.replace(asked, prompt=rendered)
        turn = ChatTurn(
            codec,
            rendered,
            opts.session_id,
            fill_context=not opts.max_tokens_given,
            max_context=limits.max_context,
            max_new_tokens=limits.max_new_tokens,
        )
        renderer = api.Renderer(chat=True, model=opts.model, tools=opts.tools is not None)
        self._scores(renderer, asked, opts, codec)
        span = request_span(request, "/v1/chat/completions", asked, opts.model)
        events = self.gateway.run(asked, prompter=turn, deadline=_deadline(opts), tenant=opts.user)
        return GenerationResponse(events, renderer, opts, turn, span)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: known, not built (501, as an unbuilt gRPC method's
        UNIMPLEMENTED), so a client learns what to call instead of a bare 404."""
        self._authorize(request)
        raise Unimplemented(
            "POST /v1/responses (OpenAI's Responses API) is not served by this gateway yet: "
            "send the same conversation to POST /v1/chat/completions (input as messages, "
            "instructions as a system message, max_output_tokens as max_tokens)"
        )

    def _scores(
        self, renderer: api.Renderer, asked: typed.Request, opts: api.Options, codec: TextCodec
    ) -> None:
        """What the renderer needs for logprobs and echo."""
        if asked.scoring.logprobs:
            renderer.scores = LogprobsRenderer(codec)
        renderer.prompt_scores = asked.scoring.prompt_logprobs
        if opts.echo:
            renderer.echo = (
                asked.prompt
                if asked.prompt is not None
                else codec.decode(list(asked.token_ids or ()))
            )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", _answering(self.health), methods=["GET"]),
                Route("/metrics", _answering(self.metrics), methods=["GET"]),
                Route("/v1/models", _answering(self.models), methods=["GET"]),
                Route(
                    "/v1/models/{model:path}", _answering(self.model_card, "model"), methods=["GET"]
                ),
                Route("/v1/completions", _answering(self.completions, "prompt"), methods=["POST"]),
                Route(
                    "/v1/chat/completions",
                    _answering(self.chat_completions, "messages"),
                    methods=["POST"],
                ),
                Route("/v1/responses", _answering(self.responses), methods=["POST"]),
            ],
            exception_handlers={HTTPException: routing_error},
        )


def _answering(
    handler: Callable[[Request], Awaitable[ASGIApp]], prompt: str | None = None
) -> Callable[[Request], Awaitable[ASGIApp]]:
    """A route that answers every error of `handler` in OpenAI's shape (a generation's
    own errors are answered by GenerationResponse): its status, or a 500 that names a
    request id and tells nothing else. prompt: the field a request that cannot fit is
    about."""

    async def route(request: Request) -> ASGIApp:
        try:
            return await handler(request)
        except Exception as e:
            return error_response(e, ErrorContext(prompt=prompt))

    return route


async def routing_error(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or method (405, with its Allow header) in OpenAI's shape:
    `invalid_request_error` with the status's name as code ("not_found",
    "method_not_allowed")."""
    if not isinstance(exc, HTTPException):  # the handler of HTTPException only
        raise exc
    status = exc.status_code
    phrase = HTTPStatus(status).phrase
    body = {
        "error": {
            "message": f"{request.method} {request.url.path}: {phrase}",
            "type": ERROR_TYPE.get(status, "invalid_request_error"),
            "param": None,
            "code": phrase.lower().replace(" ", "_"),
        }
    }
    return JSONResponse(body, status_code=status, headers=dict(exc.headers or {}))


class CountResponses:
    """ASGI wrapper: counts every answer in HTTP_RESPONSES by path and status."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path not in ROUTES:  # bounded label values
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        status = {"code": 499}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            HTTP_RESPONSES.labels(path=path, status=str(status["code"])).inc()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway's bootstrap owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving the app in the running event loop; HTTPS with the gateway's TLS
    settings (--tls-cert/--tls-key, client certificates with --tls-client-ca)."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, grace_seconds: float, tls: ServerTls | None
    ):
        pems: dict[str, bytes] = {}
        if tls is not None:
            # uvicorn reads PEM files: the bytes read at start-up go to anonymous in-memory
            # files (specdec.common.tls.pem_files) that the TLS context below loads.
            pems = {"cert": tls.cert, "key": tls.key}
            if tls.client_ca:
                pems["client_ca"] = tls.client_ca
        with pem_files(**pems) as paths:
            ssl: dict[str, Any] = {}
            if tls is not None:
                ssl = {"ssl_certfile": paths["cert"], "ssl_keyfile": paths["key"]}
            if "client_ca" in paths:
                ssl.update(ssl_ca_certs=paths["client_ca"], ssl_cert_reqs=CERT_REQUIRED)
            config = uvicorn.Config(
                app,
                host=host,
                port=port,
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=max(1, int(grace_seconds)),
                **ssl,
            )
            config.load()  # builds the TLS context now, from the PEM bytes
        self.scheme = "https" if tls else "http"
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self.task.done():
                with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot bind
                    self.task.result()
                raise OSError(f"cannot serve HTTP on port {self.port}")
            await asyncio.sleep(0.05)
        log.info("http serving", extra={"http_port": self.port, "scheme": self.scheme})

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self.task


async def start_http(gateway: Gateway, config: GatewayConfig) -> HttpServer:
    """Serve the OpenAI-compatible API on config.http_port (GatewayConfig)."""
    routes = OpenAIServer(
        gateway, config.served_model_name, config.auth_tokens, config.strict_fields
    )
    app = CountResponses(routes.app())
    server = HttpServer(app, config.host, config.http_port, config.grace_seconds, config.tls)
    await server.start()
    return server
