"""Trust: TLS on a service's port (optionally requiring client certificates), TLS from the
gateway to its replicas (mTLS when it presents a certificate), and bearer tokens on the
gateway (torch-free; read once at start-up).

Secrets are only ever read from files (a mounted Secret), never from flag values, which
show in `ps`: flags and SPECDEC_* variables name paths.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.common.settings import ConfigError, env_name, port_number, setting

log = logging.getLogger(__name__)

# Methods a caller may use without a token: orchestrators' health checks.
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/",)


def _read(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{setting} / {env_name(setting)}: cannot read {path!r}: {e}") from None


@contextlib.contextmanager
def pem_files(**pems: bytes) -> Iterator[dict[str, str]]:
    """PEM bytes as paths for APIs that only read files (ssl's load_cert_chain, uvicorn):
    anonymous in-memory files (memfd), which no signal or crash can leave behind on disk,
    closed when the block ends (load them inside it). {name: path}."""
    fds: list[int] = []
    try:
        paths = {}
        for name, data in pems.items():
            fd = os.memfd_create(f"specdec-{name}", os.MFD_CLOEXEC)
            fds.append(fd)
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
            paths[name] = f"/proc/self/fd/{fd}"
        yield paths
    finally:
        for fd in fds:
            os.close(fd)


@dataclass(frozen=True)
class ServerTls:
    """PEM bytes of a server's certificate chain and key, and of the CA its clients'
    certificates must chain to (None: clients need no certificate)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None
    # A second, plaintext port that serves grpc.health.v1 only (0: none): for orchestrators
    # whose probes cannot speak TLS, such as the kubelet's gRPC probe.
    health_port: int = 0

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same as `credentials` for a plain TLS socket (the data plane): this
        certificate, and client certificates required when client_ca is set."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        with pem_files(cert=self.cert, key=self.key) as paths:
            context.load_cert_chain(paths["cert"], paths["key"])
        if self.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.client_ca.decode())
        return context


@dataclass(frozen=True)
class ClientTls:
    """PEM bytes of the CA a client trusts, and of its own certificate and key (mTLS)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""  # checked in the server's certificate instead of the address's host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same as `credentials` for a plain TLS socket (the data plane): trust `ca`
        (the system's CAs without one), show `cert` when set. The name to check is the
        caller's: server_name, else the address's host."""
        context = ssl.create_default_context(cadata=self.ca.decode() if self.ca else None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None and self.key is not None:
            with pem_files(cert=self.cert, key=self.key) as paths:
                context.load_cert_chain(paths["cert"], paths["key"])
        return context


@dataclass(frozen=True)
class ServerTlsSettings:
    """The flags of a server's TLS (a `settings_group` of each service's config): TLS on
    its port with --tls-cert and --tls-key, client certificates required with --tls-client-ca."""

    tls_cert: str = setting("", "PEM certificate chain of this server (TLS on its port)")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_client_ca: str = setting(
        "", "PEM CA that clients' certificates must chain to: only they get in (mTLS)"
    )
    health_port: int = setting(
        0,
        "with TLS: a plaintext port that serves only grpc.health.v1, for probes that cannot "
        "speak TLS (the kubelet's gRPC probe); 0: none",
        check=port_number,
    )

    def build(self) -> ServerTls | None:
        """The server's TLS, None without --tls-cert (ConfigError when incomplete)."""
        cert, key, client_ca = self.tls_cert, self.tls_key, self.tls_client_ca
        if not cert and not key:
            if client_ca:
                raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
            if self.health_port:
                raise ConfigError(
                    "--health-port is a plaintext health port beside a TLS port; without "
                    "--tls-cert the service's own port answers health checks"
                )
            return None
        if not (cert and key):
            raise ConfigError("--tls-cert and --tls-key go together")
        return ServerTls(
            cert=_read("--tls-cert", cert),
            key=_read("--tls-key", key),
            client_ca=_read("--tls-client-ca", client_ca) if client_ca else None,
            health_port=self.health_port,
        )


@dataclass(frozen=True)
class ReplicaTlsSettings:
    """The flags of the gateway's TLS to its replicas (a `settings_group` of its config)."""

    replica_ca: str = setting("", "PEM CA that the replicas' certificates chain to")
    replica_cert: str = setting("", "PEM certificate the gateway shows replicas (mTLS)")
    replica_key: str = setting("", "PEM private key of --replica-cert")
    replica_server_name: str = setting(
        "",
        "name to check in the replicas' certificates instead of each address's host (one "
        "certificate per pool when discovery yields pod IPs); empty: the address's host",
    )

    def build(self) -> ClientTls | None:
        """How the gateway reaches its replicas: None (plaintext) without --replica-ca."""
        ca, cert, key = self.replica_ca, self.replica_cert, self.replica_key
        if not ca:
            if cert or key or self.replica_server_name:
                raise ConfigError(
                    "--replica-cert / --replica-key / --replica-server-name need --replica-ca"
                )
            return None
        if bool(cert) != bool(key):
            raise ConfigError("--replica-cert and --replica-key go together")
        return ClientTls(
            ca=_read("--replica-ca", ca),
            cert=_read("--replica-cert", cert) if cert else None,
            key=_read("--replica-key", key) if key else None,
            server_name=self.replica_server_name,
        )


def read_tokens(path: str) -> frozenset[str]:
    """Bearer tokens from a file, one per line (blank lines and '#' comments skipped)."""
    lines = _read("--auth-tokens-file", path).decode().splitlines()
    tokens = frozenset(t.strip() for t in lines if t.strip() and not t.lstrip().startswith("#"))
    if not tokens:
        raise ConfigError(
            f"--auth-tokens-file / {env_name('--auth-tokens-file')}: {path!r} holds no token"
        )
    return tokens


class BearerTokens(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call's `authorization` metadata is `Bearer <token>` with
    one of the configured tokens (compared in constant time). Health checks are exempt."""

    def __init__(self, tokens: Iterable[str]):
        self._tokens = tuple(t.encode() for t in tokens)

    def _allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key.lower() != "authorization":
                continue
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer":
                return False
            given = token.strip().encode()
            return any(hmac.compare_digest(given, t) for t in self._tokens)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_METHODS) or self._allowed(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return handler._replace(stream_stream=streaming)
    if handler.request_streaming:
        return handler._replace(stream_unary=unary)
    if handler.response_streaming:
        return handler._replace(unary_stream=streaming)
    return handler._replace(unary_unary=unary)
