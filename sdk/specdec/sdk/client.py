"""Sync and asyncio clients for the specdec gateway.

Both clients share one request builder (:func:`build_generate_request`) and one response
conversion (:func:`~specdec.sdk.types.generation_from_proto` and
:class:`~specdec.sdk.types.StreamAssembler`); they differ only in transport. gRPC failures
are raised as :class:`~specdec.sdk.errors.SpecdecError` subclasses, bad arguments as
``ValueError`` before anything is sent.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import grpc.aio

from specdec.sdk.errors import from_rpc_error
from specdec.sdk.request import K_POLICIES, METHODS, Request, takes_request_options
from specdec.sdk.tracing import trace_metadata
from specdec.sdk.types import (
    Generation,
    ServerInfo,
    StreamAssembler,
    StreamChunk,
    generation_from_proto,
    server_info_from_proto,
)
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

__all__ = [
    "DEFAULT_TIMEOUT",
    "K_POLICIES",
    "MAX_MESSAGE_BYTES",
    "METHODS",
    "AsyncClient",
    "Client",
    "build_generate_request",
    "channel_options",
    "read_token",
    "tls_credentials",
]

#: Default per-call deadline in seconds.
DEFAULT_TIMEOUT = 300.0
#: Send / receive message size limit of the client channel.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class _Default(enum.Enum):
    TIMEOUT = "client default"


#: ``timeout=`` default of a call: the client's own timeout.
_CLIENT_DEFAULT = _Default.TIMEOUT


def channel_options(extra: Sequence[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """The channel options used by the clients: 64 MiB messages, then ``extra`` (which wins)."""
    options: dict[str, Any] = {
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    }
    for key, value in extra or ():
        options[key] = value
    return list(options.items())


@takes_request_options
def build_generate_request(
    prompt: str | None = None, **options: Any
) -> gateway_pb2.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (``ValueError`` / ``TypeError`` if invalid).

    Exactly one of ``prompt`` / ``token_ids``. The other arguments are the fields of the
    request's parts, flat (:mod:`specdec.sdk.request`): :class:`~specdec.sdk.request.Output`
    (``max_new_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
    ``n``, ``structured_output``, ``prediction``, ``record``),
    :class:`~specdec.sdk.request.Sampling` (``temperature``, ``top_p``, ``top_k``, ``seed``,
    the penalties, ``logit_bias``), :class:`~specdec.sdk.request.Session` (``session_id``,
    ``reset_session``, ``session_ttl_seconds``), :class:`~specdec.sdk.request.Speculation`
    (``k``, ``ssd``, ``k_policy``, ``method``, ``tree_width``) and
    :class:`~specdec.sdk.request.Scoring` (``logprobs``, ``top_logprobs``,
    ``prompt_logprobs``). Left as None, a sampling field takes the model's
    generation_config and a speculation field the server's default; no ``session_id``
    means a one-off request. The gateway checks the ranges.
    """
    return Request.build(prompt, **options).to_proto()


def _stream_request(prompt: str | None, options: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    """build_generate_request for stream(): one completion per stream here (the gateway
    streams n > 1 with a choice index per message; this client assembles one)."""
    if options.get("n", 1) != 1:
        raise ValueError("stream() streams one completion: use generate() for n > 1")
    return build_generate_request(prompt, **options)


def tls_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: the CA to trust (None: the system's roots)
    and, for a gateway that asks for client certificates, this client's cert and key."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("cert_file and key_file go together")

    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file),
        private_key=read(key_file),
        certificate_chain=read(cert_file),
    )


def read_token(path: str) -> str:
    """A bearer token from a file (its first non-empty line): tokens never go in a command
    line, where `ps` shows them."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise ValueError(f"{path} holds no token")


class _ClientBase:
    def __init__(
        self, timeout: float | None, token: str | None = None, tenant: str | None = None
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be > 0 seconds, or None for no deadline")
        self.timeout = timeout
        # Sent with every call when the gateway checks bearer tokens; the tenant keys the
        # gateway's suffix cache under --suffix-cache-scope tenant.
        metadata = [("authorization", f"Bearer {token}")] if token else []
        if tenant:
            metadata.append(("specdec-tenant", tenant))
        self._metadata = tuple(metadata) or None

    def _deadline(self, timeout: float | _Default | None) -> float | None:
        return self.timeout if timeout is _CLIENT_DEFAULT else timeout

    def _call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """A call's metadata: the bearer token, if any, and the caller's trace context."""
        metadata = (*(self._metadata or ()), *(trace_metadata() or ()))
        return metadata or None


class Client(_ClientBase):
    """Blocking client for the gateway. Thread-safe; use as a context manager or ``close()``.

    ``timeout`` is the default deadline of every call in seconds (None: no deadline);
    each call can override it with its own ``timeout=``.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = DEFAULT_TIMEOUT,
        channel_options: Sequence[tuple[str, Any]] | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        tenant: str | None = None,
    ) -> None:
        super().__init__(timeout, token, tenant)
        self.address = address
        options = _channel_options(channel_options)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    @takes_request_options
    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
        **options: Any,
    ) -> Generation:
        """Generate a completion and return it whole.

        ``options``: the request's fields, as :func:`build_generate_request` takes them.
        """
        request = build_generate_request(prompt, **options)
        try:
            response = self._stub.Generate(
                request, timeout=self._deadline(timeout), metadata=self._call_metadata()
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return generation_from_proto(response)

    @takes_request_options
    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
        **options: Any,
    ) -> Iterator[StreamChunk]:
        """Generate a completion chunk by chunk; the last chunk has ``final`` set.

        ``options``: the request's fields, as :func:`build_generate_request` takes them.

        Arguments are checked now; the call starts on the first ``next()``. Leaving the
        loop early (or closing the iterator) cancels the call.
        """
        request = _stream_request(prompt, options)
        return self._stream(request, self._deadline(timeout))

    def _stream(
        self, request: gateway_pb2.GenerateRequest, timeout: float | None
    ) -> Iterator[StreamChunk]:
        assembler = StreamAssembler()
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=self._call_metadata())
        try:
            for message in call:
                yield assembler.feed(message)
            assembler.finish()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the call has finished

    def server_info(self, timeout: float | _Default | None = _CLIENT_DEFAULT) -> ServerInfo:
        """The model behind the gateway and the limits a request must respect."""
        try:
            response = self._stub.GetServerInfo(
                gateway_pb2.GetServerInfoRequest(),
                timeout=self._deadline(timeout),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return server_info_from_proto(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, timeout={self.timeout!r})"


class AsyncClient(_ClientBase):
    """asyncio client (``grpc.aio``) with the same API as :class:`Client`.

    ``await client.generate(...)``; ``async for chunk in client.stream(...)``;
    ``async with AsyncClient(...)`` or ``await client.close()``.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = DEFAULT_TIMEOUT,
        channel_options: Sequence[tuple[str, Any]] | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        tenant: str | None = None,
    ) -> None:
        super().__init__(timeout, token, tenant)
        self.address = address
        options = _channel_options(channel_options)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    @takes_request_options
    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
        **options: Any,
    ) -> Generation:
        """Generate a completion and return it whole.

        ``options``: the request's fields, as :func:`build_generate_request` takes them.
        """
        request = build_generate_request(prompt, **options)
        try:
            response = await self._stub.Generate(
                request, timeout=self._deadline(timeout), metadata=self._call_metadata()
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return generation_from_proto(response)

    @takes_request_options
    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
        **options: Any,
    ) -> AsyncIterator[StreamChunk]:
        """Generate chunk by chunk (``async for``); the last chunk has ``final`` set.

        ``options``: the request's fields, as :func:`build_generate_request` takes them.

        Arguments are checked now (not awaited); the call starts on the first iteration.
        Leaving the loop early cancels the call.
        """
        request = _stream_request(prompt, options)
        return self._stream(request, self._deadline(timeout))

    async def _stream(
        self, request: gateway_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[StreamChunk]:
        assembler = StreamAssembler()
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=self._call_metadata())
        try:
            async for message in call:
                yield assembler.feed(message)
            assembler.finish()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once the call has finished

    async def server_info(self, timeout: float | _Default | None = _CLIENT_DEFAULT) -> ServerInfo:
        """The model behind the gateway and the limits a request must respect."""
        try:
            response = await self._stub.GetServerInfo(
                gateway_pb2.GetServerInfoRequest(),
                timeout=self._deadline(timeout),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return server_info_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}, timeout={self.timeout!r})"


# The constructors' ``channel_options`` parameter shadows the function inside them.
_channel_options = channel_options
