"""Sync and asyncio clients for the specdec gateway.

Both clients share one request builder (:func:`build_generate_request`) and one response
conversion (:func:`~specdec.sdk.types.generation_from_proto` and
:class:`~specdec.sdk.types.StreamAssembler`); they differ only in transport. gRPC failures
are raised as :class:`~specdec.sdk.errors.SpecdecError` subclasses, bad arguments as
``ValueError`` before anything is sent.
"""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from specdec.sdk.errors import from_rpc_error
from specdec.sdk.tracing import trace_metadata
from specdec.sdk.types import (
    Generation,
    ServerInfo,
    StreamAssembler,
    StreamChunk,
    generation_from_proto,
    server_info_from_proto,
)
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_MESSAGE_BYTES",
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
#: ``k_policy`` values: how the gateway picks each round's draft length.
K_POLICIES = {"fixed": gateway_pb2.K_POLICY_FIXED, "adaptive": gateway_pb2.K_POLICY_ADAPTIVE}
#: ``method`` values: where drafts come from.
METHODS = {
    "model": gateway_pb2.SPECULATION_METHOD_MODEL,
    "ngram": gateway_pb2.SPECULATION_METHOD_NGRAM,
    "suffix": gateway_pb2.SPECULATION_METHOD_SUFFIX,
    "hybrid": gateway_pb2.SPECULATION_METHOD_HYBRID,
}


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


def build_generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    session_id: str | None = None,
    reset_session: bool = False,
    session_ttl_seconds: int = 0,
    k: int | None = None,
    ssd: bool | None = None,
    k_policy: str | None = None,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prompt_logprobs: bool = False,
    n: int = 1,
    structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None,
    method: str | None = None,
    tree_width: int | None = None,
    prediction: str | Sequence[int] | None = None,
    record: bool | None = None,
) -> gateway_pb2.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (``ValueError`` / ``TypeError`` if invalid).

    Exactly one of ``prompt`` / ``token_ids``. ``seed``, ``k``, ``ssd`` and ``k_policy``
    left as None stay unset in the message (server defaults); no ``session_id`` means a
    one-off request. ``k_policy``: ``"fixed"`` (every round drafts ``k``) or ``"adaptive"``
    (``k`` is an upper bound; the gateway picks each round's k from acceptance and load).
    ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, the penalties and ``logit_bias``
    (token id -> bias) are the fields of the same names in ``GenerateRequest`` /
    ``SamplingParams``; the gateway checks their ranges.
    ``logprobs``: the target's log-probability of each generated token (with
    ``top_logprobs`` alternatives, 0..20; ``prompt_logprobs``: the prompt's too, no
    session). ``n``: independent completions (``Generation.choices``; not in a stream).
    ``structured_output``: the grammar the output follows, a ``StructuredOutput`` or a dict
    of one key: ``{"json_schema": <schema dict or JSON text>}``, ``{"regex": "..."}``,
    ``{"choice": ["a", "b"]}`` or ``{"json_object": True}``.
    ``method``: where drafts come from, ``"model"`` (the draft model), ``"ngram"`` (prompt
    lookup), ``"suffix"`` (suffix decoding over the request and recent outputs) or
    ``"hybrid"``; None: the server default. ``tree_width``: candidate continuations a
    lookup round may verify together as one token tree (1..8; None: the server default).
    ``prediction``: text (or token ids) the
    completion is expected to repeat (OpenAI's Predicted Outputs), a source of drafts;
    ``usage`` reports how much of it was accepted.
    ``record=False`` refuses the gateway's recording of this request (``--record``).
    """
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if k_policy is not None and k_policy not in K_POLICIES:
        raise ValueError(f"k_policy must be one of {', '.join(K_POLICIES)}, got {k_policy!r}")
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt or token_ids")
    if isinstance(stop, str):  # a lone string is one stop sequence, not its characters
        stop = (stop,)
    if not session_id and (reset_session or session_ttl_seconds):
        raise ValueError("reset_session and session_ttl_seconds need a session_id")

    request = gateway_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,  # None leaves the optional field unset
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=dict(logit_bias or {}),
        ),
        stop=list(stop),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
    )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
        request.prompt = prompt
    else:
        if isinstance(token_ids, (str, bytes)):
            raise TypeError("token_ids must be a sequence of ints")
        request.prompt_token_ids.ids.extend(token_ids)
    if session_id:
        request.session.CopyFrom(
            gateway_pb2.SessionOptions(
                id=session_id,
                mode=(
                    gateway_pb2.SESSION_MODE_RESET
                    if reset_session
                    else gateway_pb2.SESSION_MODE_CONTINUE
                ),
                ttl_seconds=session_ttl_seconds,
            )
        )
    if k is not None or ssd is not None:
        request.speculation.CopyFrom(gateway_pb2.SpeculationParams(num_draft_tokens=k, ssd=ssd))
    if k_policy is not None:
        request.speculation.k_policy = K_POLICIES[k_policy]
    request.logprobs, request.top_logprobs = logprobs, top_logprobs
    request.prompt_logprobs, request.n = prompt_logprobs, n
    if structured_output is not None:
        request.structured_output.CopyFrom(_structured_output(structured_output))
    if method is not None:
        request.speculation.method = METHODS[method]
    if tree_width is not None:
        request.speculation.tree_width = tree_width
    if isinstance(prediction, str):
        if prediction:
            request.prediction.text = prediction
    elif prediction is not None:
        if isinstance(prediction, bytes):
            raise TypeError("prediction must be a str or a sequence of ints")
        request.prediction.token_ids.ids.extend(prediction)
    if record is not None:
        request.record = record
    return request


def _structured_output(
    spec: dict[str, Any] | gateway_pb2.StructuredOutput,
) -> gateway_pb2.StructuredOutput:
    if isinstance(spec, gateway_pb2.StructuredOutput):
        return spec
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(
            "structured_output must be a StructuredOutput or a dict of one key: json_schema, "
            "regex, choice or json_object"
        )
    ((kind, value),) = spec.items()
    if kind == "json_schema":
        text = value if isinstance(value, str) else json.dumps(value)
        return gateway_pb2.StructuredOutput(json_schema=text)
    if kind == "regex":
        return gateway_pb2.StructuredOutput(regex=value)
    if kind == "choice":
        return gateway_pb2.StructuredOutput(
            choice=gateway_pb2.StructuredChoice(choices=list(value))
        )
    if kind == "json_object" and value:
        return gateway_pb2.StructuredOutput(json_object=gateway_pb2.StructuredJsonObject())
    raise ValueError(f"structured_output: unknown kind {kind!r}")


def _request(arguments: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    """build_generate_request from a generate()/stream() call's own arguments.

    The four public methods keep their full signatures for readers and IDEs; this keeps
    one copy of the forwarding.
    """
    params = {k: v for k, v in arguments.items() if k not in ("self", "timeout")}
    return build_generate_request(**params)


def _stream_request(arguments: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    """_request for stream(): one completion per stream here (the gateway streams n > 1
    with a choice index per message; this client assembles one)."""
    if arguments.get("n", 1) != 1:
        raise ValueError("stream() streams one completion: use generate() for n > 1")
    return _request(arguments)


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

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        session_id: str | None = None,
        reset_session: bool = False,
        session_ttl_seconds: int = 0,
        k: int | None = None,
        ssd: bool | None = None,
        k_policy: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        n: int = 1,
        structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None,
        method: str | None = None,
        tree_width: int | None = None,
        prediction: str | Sequence[int] | None = None,
        record: bool | None = None,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
    ) -> Generation:
        """Generate a completion and return it whole."""
        request = _request(locals())
        try:
            response = self._stub.Generate(
                request, timeout=self._deadline(timeout), metadata=self._call_metadata()
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return generation_from_proto(response)

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        session_id: str | None = None,
        reset_session: bool = False,
        session_ttl_seconds: int = 0,
        k: int | None = None,
        ssd: bool | None = None,
        k_policy: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        n: int = 1,
        structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None,
        method: str | None = None,
        tree_width: int | None = None,
        prediction: str | Sequence[int] | None = None,
        record: bool | None = None,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
    ) -> Iterator[StreamChunk]:
        """Generate a completion chunk by chunk; the last chunk has ``final`` set.

        Arguments are checked now; the call starts on the first ``next()``. Leaving the
        loop early (or closing the iterator) cancels the call.
        """
        request = _stream_request(locals())
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

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        session_id: str | None = None,
        reset_session: bool = False,
        session_ttl_seconds: int = 0,
        k: int | None = None,
        ssd: bool | None = None,
        k_policy: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        n: int = 1,
        structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None,
        method: str | None = None,
        tree_width: int | None = None,
        prediction: str | Sequence[int] | None = None,
        record: bool | None = None,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
    ) -> Generation:
        """Generate a completion and return it whole."""
        request = _request(locals())
        try:
            response = await self._stub.Generate(
                request, timeout=self._deadline(timeout), metadata=self._call_metadata()
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return generation_from_proto(response)

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        session_id: str | None = None,
        reset_session: bool = False,
        session_ttl_seconds: int = 0,
        k: int | None = None,
        ssd: bool | None = None,
        k_policy: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        n: int = 1,
        structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None,
        method: str | None = None,
        tree_width: int | None = None,
        prediction: str | Sequence[int] | None = None,
        record: bool | None = None,
        timeout: float | _Default | None = _CLIENT_DEFAULT,
    ) -> AsyncIterator[StreamChunk]:
        """Generate chunk by chunk (``async for``); the last chunk has ``final`` set.

        Arguments are checked now (not awaited); the call starts on the first iteration.
        Leaving the loop early cancels the call.
        """
        request = _stream_request(locals())
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
