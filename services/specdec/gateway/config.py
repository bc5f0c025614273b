"""Gateway configuration, read once at start-up (flags win over SPECDEC_* variables)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specdec.common.config import (
    MAX_FAN_OUT,
    ConfigError,
    add_setting,
    boolean,
    env_name,
    non_negative,
    one_of,
    parse_value,
    port_number,
    positive,
)
from specdec.common.params import MAX_TOP_LOGPROBS
from specdec.common.tls import (
    ClientTls,
    ServerTls,
    add_replica_tls_arguments,
    add_server_tls_arguments,
    read_tokens,
    replica_tls_from_args,
    server_tls_from_args,
)
from specdec.gateway.canary import Canary, parse_canary
from specdec.gateway.discovery import parse_target
from specdec.gateway.lookup import MAX_TREE_WIDTH, SCOPES, parse_method, tree_width
from specdec.gateway.policy import ADAPTIVE, parse_policy
from specdec.v1 import gateway_pb2

REPLICA_TRANSPORTS = ("dataplane", "grpc")


def _fan_out(value: int) -> str | None:
    return None if 0 <= value <= MAX_FAN_OUT else f"must be in [0, {MAX_FAN_OUT}]"


def address_list(raw: str) -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...], or one dns:/k8s: discovery target (see discovery.py)."""
    if parse_target(raw) is not None:  # raises ValueError when malformed
        return (raw.strip(),)
    addresses = tuple(a.strip() for a in raw.split(",") if a.strip())
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{a!r} is not HOST:PORT")
    if len(set(addresses)) != len(addresses):
        raise ValueError("an address is listed twice")
    return addresses


def non_empty(value) -> str | None:
    return None if value else "must name at least one HOST:PORT"


@dataclass(frozen=True)
class GatewayConfig:
    drafters: tuple[str, ...]
    verifiers: tuple[str, ...]
    redis_url: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 0
    http_port: int = 0  # the OpenAI-compatible HTTP API (specdec.gateway.http); 0: off
    served_model_name: str = ""  # the HTTP API's model name; "": the verifier's model folder
    strict_fields: bool = False  # the HTTP API refuses unknown body fields (400), else ignores
    default_k: int = 4
    ssd: bool = False  # speculative speculative decoding when a request does not say
    ssd_fan_out: int = 0  # branches per round; 0: the drafter's --ssd-fan-out
    k_policy: int = ADAPTIVE  # gateway_pb2.KPolicy when a request does not say
    # Lookup drafts (specdec.gateway.lookup): the default SpeculationMethod, prompt
    # lookup's n-gram lengths, the suffix tries' depth and the cache of recent outputs.
    method: int = gateway_pb2.SPECULATION_METHOD_HYBRID
    tree_width: int = 1  # candidate continuations a lookup round verifies as a tree
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    suffix_depth: int = 24
    suffix_cache_tokens: int = 16384
    suffix_cache_scope: str = "global"  # global, tenant or off
    max_new_tokens: int = 4096
    session_ttl: int = 3600
    max_session_ttl: int = 30 * 24 * 3600
    rpc_timeout: float = 120.0
    startup_timeout: float = 900.0
    grace_seconds: float = 10.0
    dns_interval: float = 5.0  # seconds between two resolutions of a dns: target
    tls: ServerTls | None = None  # TLS on the public port (client certificates optional)
    replica_tls: ClientTls | None = None  # TLS (mTLS with a certificate) to the replicas
    auth_tokens: frozenset[str] = frozenset()  # bearer tokens; empty: no token check
    # How the round's calls reach a replica: "dataplane" (its data port when its Info has
    # one, specdec.gateway.dataplane) or "grpc" (unary calls, specdec.gateway.transport).
    replica_transport: str = "dataplane"
    # The data plane's keepalive: a ping every interval, a replica silent for the timeout
    # is dead (its calls fail over). The timeout must exceed a replica's longest forward.
    data_keepalive: float = 1.0
    data_keepalive_timeout: float = 10.0
    # Recording of finished requests (specdec.gateway.recorder); None: off.
    record_dir: str | None = None
    record_max_bytes: int = 64 * 1024 * 1024  # per file
    record_max_files: int = 16  # the oldest are deleted past this
    # The target's top-m log-probabilities per output token in each recorded row (0: none),
    # from the Verify calls the request makes anyway (specdec distill's KL needs no teacher
    # forward for those rows).
    record_top_logprobs: int = 0
    # A share of new sessions to drafters of one model version (specdec.gateway.canary).
    drafter_canary: Canary | None = None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        where = (
            "HOST:PORT[,HOST:PORT...], dns:[//DNS_SERVER:PORT/]NAME:PORT or "
            "k8s:[NAMESPACE/]SERVICE:PORT"
        )
        add_setting(parser, "--drafter", f"drafter replicas: {where}")
        add_setting(parser, "--verifier", f"verifier replicas: {where}")
        add_setting(parser, "--dns-interval", "seconds between two DNS resolutions (dns:)", 5.0)
        add_setting(parser, "--redis", "Redis URL for sessions (empty: in-process only)", "")
        add_setting(parser, "--host", "address to listen on", "0.0.0.0")
        add_setting(parser, "--port", "gRPC port (0: any free port)", 50051)
        add_setting(
            parser,
            "--metrics-port",
            "Prometheus /metrics port (0: off; the HTTP API's port serves /metrics too)",
            0,
        )
        add_setting(parser, "--http-port", "OpenAI-compatible HTTP API port (0: off)", 0)
        add_setting(
            parser,
            "--served-model-name",
            "HTTP API model name (default: the name of the verifier's model folder)",
            "",
        )
        add_setting(
            parser,
            "--strict-fields",
            "HTTP API: refuse request fields it does not know with 400 (default: ignore them "
            "and log them at debug level, as vLLM does)",
            False,
        )
        add_setting(parser, "--default-k", "draft length when a request sets none", 4)
        add_setting(parser, "--ssd", "SSD (pre-draft during verification) by default", False)
        add_setting(parser, "--ssd-fan-out", "SSD branches per round (0: the drafter's default)", 0)
        add_setting(
            parser,
            "--k-policy",
            "how each round's draft is chosen when a request does not say: adaptive (the "
            "source, length and SSD fan-out that maximise expected tokens per second from the "
            "replicas' measured cost curves and each source's measured acceptance; the "
            "request's k is an upper bound, 0 included) or fixed (the request's k every round; "
            "seeded sampled requests always draft fixed, so they stay reproducible)",
            "adaptive",
        )
        add_setting(
            parser,
            "--method",
            "where drafts come from when a request does not say: model (the drafter), "
            "ngram (prompt lookup), suffix (suffix decoding over the request and recent "
            "outputs) or hybrid (a prompt-lookup match of 3+ tokens or a confident match in "
            "recent outputs, else the drafter's draft extended by prompt lookup)",
            "hybrid",
        )
        add_setting(
            parser,
            "--tree-width",
            "candidate continuations a round may verify together as one token tree (a "
            "lookup's other matches, the drafter's top alternatives, a prediction) when a "
            f"request does not say (1: chains; at most {MAX_TREE_WIDTH})",
            1,
        )
        add_setting(parser, "--prompt-lookup-min", "shortest n-gram prompt lookup matches", 1)
        add_setting(parser, "--prompt-lookup-max", "longest n-gram prompt lookup matches", 5)
        add_setting(parser, "--suffix-depth", "depth of the suffix tries (tokens)", 24)
        add_setting(
            parser,
            "--suffix-cache-tokens",
            "bound of the cache of recent outputs for suffix drafts, in tokens (LRU; 0: none)",
            16384,
        )
        add_setting(
            parser,
            "--suffix-cache-scope",
            "who shares the cache of recent outputs: global, tenant (gRPC metadata "
            "specdec-tenant, HTTP field user) or off",
            "global",
        )
        add_setting(parser, "--max-new-tokens", "largest max_new_tokens a request may ask", 4096)
        add_setting(parser, "--session-ttl", "seconds an idle session is kept", 3600)
        add_setting(parser, "--rpc-timeout", "deadline of each drafter/verifier call (s)", 120.0)
        add_setting(
            parser, "--startup-timeout", "how long to wait for replicas at start (s)", 900.0
        )
        add_setting(parser, "--grace-seconds", "graceful shutdown window on SIGTERM", 10.0)
        add_server_tls_arguments(parser)
        add_replica_tls_arguments(parser)
        add_setting(
            parser,
            "--replica-transport",
            "how the round's calls (Draft, Speculate, Verify) reach the replicas: dataplane "
            "(one TCP connection to each replica's data port, gRPC for a replica without "
            "one) or grpc (unary gRPC calls)",
            "dataplane",
        )
        add_setting(
            parser,
            "--data-keepalive",
            "seconds between two keepalive pings on each data-plane connection",
            1.0,
        )
        add_setting(
            parser,
            "--data-keepalive-timeout",
            "seconds of silence after which a replica's data-plane connection is held dead "
            "and its calls fail over (longer than a replica's longest forward)",
            10.0,
        )
        add_setting(
            parser,
            "--record",
            "directory where finished requests are recorded for `specdec distill` (token "
            "ids: user data; a request with record: false is not); empty: off",
            "",
        )
        add_setting(parser, "--record-max-bytes", "size of one recording file", 64 * 1024 * 1024)
        add_setting(
            parser, "--record-max-files", "recording files kept (the oldest are deleted)", 16
        )
        add_setting(
            parser,
            "--record-top-logprobs",
            "with --record: the target's top M log-probabilities per output token in each "
            "row (0-20; 0: none), for specdec distill's KL",
            0,
        )
        add_setting(
            parser,
            "--drafter-canary",
            "VERSION:PERCENT: send that share of new sessions to the drafters whose model "
            "version (specdec_version.json) is VERSION, the rest to the others; empty: off",
            "",
        )
        add_setting(
            parser,
            "--auth-tokens-file",
            "file of bearer tokens, one per line (a mounted Secret); empty: no token check",
            "",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        def seconds(v: float) -> str | None:
            return None if v > 0 else "must be > 0"

        cfg = cls(
            drafters=parse_value(args, "--drafter", address_list, non_empty),
            verifiers=parse_value(args, "--verifier", address_list, non_empty),
            redis_url=args.redis or None,
            host=parse_value(args, "--host", str),
            port=parse_value(args, "--port", int, port_number),
            metrics_port=parse_value(args, "--metrics-port", int, port_number),
            http_port=parse_value(args, "--http-port", int, port_number),
            served_model_name=parse_value(args, "--served-model-name", str),
            strict_fields=parse_value(args, "--strict-fields", boolean),
            default_k=parse_value(args, "--default-k", int, non_negative),
            ssd=parse_value(args, "--ssd", boolean),
            ssd_fan_out=parse_value(args, "--ssd-fan-out", int, _fan_out),
            k_policy=parse_value(args, "--k-policy", parse_policy),
            method=parse_value(args, "--method", parse_method),
            tree_width=parse_value(args, "--tree-width", int, tree_width),
            prompt_lookup_min=parse_value(args, "--prompt-lookup-min", int, positive),
            prompt_lookup_max=parse_value(args, "--prompt-lookup-max", int, positive),
            suffix_depth=parse_value(
                args, "--suffix-depth", int, lambda v: None if v >= 2 else "must be >= 2"
            ),
            suffix_cache_tokens=parse_value(args, "--suffix-cache-tokens", int, non_negative),
            suffix_cache_scope=parse_value(
                args,
                "--suffix-cache-scope",
                str,
                lambda v: None if v in SCOPES else f"must be one of {', '.join(SCOPES)}",
            ),
            max_new_tokens=parse_value(args, "--max-new-tokens", int, positive),
            session_ttl=parse_value(args, "--session-ttl", int, positive),
            rpc_timeout=parse_value(args, "--rpc-timeout", float, seconds),
            startup_timeout=parse_value(args, "--startup-timeout", float, seconds),
            grace_seconds=parse_value(args, "--grace-seconds", float, non_negative),
            dns_interval=parse_value(args, "--dns-interval", float, seconds),
            tls=server_tls_from_args(args),
            replica_tls=replica_tls_from_args(args),
            auth_tokens=read_tokens(args.auth_tokens_file)
            if args.auth_tokens_file
            else frozenset(),
            replica_transport=parse_value(
                args,
                "--replica-transport",
                str,
                one_of(REPLICA_TRANSPORTS),
            ),
            data_keepalive=parse_value(args, "--data-keepalive", float, seconds),
            data_keepalive_timeout=parse_value(args, "--data-keepalive-timeout", float, seconds),
            record_dir=args.record or None,
            record_max_bytes=parse_value(args, "--record-max-bytes", int, positive),
            record_max_files=parse_value(args, "--record-max-files", int, positive),
            record_top_logprobs=parse_value(
                args,
                "--record-top-logprobs",
                int,
                lambda v: (
                    None if 0 <= v <= MAX_TOP_LOGPROBS else f"must be in [0, {MAX_TOP_LOGPROBS}]"
                ),
            ),
            drafter_canary=parse_value(args, "--drafter-canary", parse_canary),
        )
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ConfigError(
                f"--prompt-lookup-min ({cfg.prompt_lookup_min}) is above --prompt-lookup-max "
                f"({cfg.prompt_lookup_max})"
            )
        if cfg.data_keepalive >= cfg.data_keepalive_timeout:
            raise ConfigError(
                f"--data-keepalive ({cfg.data_keepalive:g} s) must be shorter than "
                f"--data-keepalive-timeout ({cfg.data_keepalive_timeout:g} s)"
            )
        if cfg.redis_url and not cfg.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"--redis / {env_name('--redis')}: not a redis:// URL: {cfg.redis_url!r}"
            )
        return cfg
