"""Gateway configuration, read once at start-up (flags win over SPECDEC_* variables)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specdec.common.params import MAX_FAN_OUT, MAX_TOP_LOGPROBS
from specdec.common.settings import (
    ConfigError,
    add_settings,
    env_name,
    non_negative,
    one_of,
    port_number,
    positive,
    read_settings,
    setting,
    settings_group,
)
from specdec.common.tls import (
    ClientTls,
    ReplicaTlsSettings,
    ServerTls,
    ServerTlsSettings,
    read_tokens,
)
from specdec.gateway.fleet.canary import Canary, parse_canary
from specdec.gateway.fleet.discovery import parse_target
from specdec.gateway.job import TURN_LEASE_SECONDS, tree_width
from specdec.gateway.round.lookup import BY_NAME as METHOD_BY_NAME
from specdec.gateway.round.lookup import MAX_TREE_WIDTH, SCOPES, parse_method
from specdec.gateway.round.lookup.settings import LookupSettings, SuffixParams
from specdec.gateway.round.policy import ADAPTIVE, GuardParams, parse_policy
from specdec.gateway.round.policy import BY_NAME as POLICY_BY_NAME
from specdec.v1 import gateway_pb2

REPLICA_TRANSPORTS = ("dataplane", "grpc")
METHOD_NAMES = tuple(METHOD_BY_NAME)  # --method
POLICY_NAMES = tuple(POLICY_BY_NAME)  # --k-policy


def _fan_out(value: int) -> str | None:
    return None if 0 <= value <= MAX_FAN_OUT else f"must be in [0, {MAX_FAN_OUT}]"


def address_list(raw: str) -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...], or one dns:/k8s: discovery target (see specdec.gateway.fleet.discovery)."""
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


def non_empty(value: object) -> str | None:
    return None if value else "must name at least one HOST:PORT"


WHERE = (
    "HOST:PORT[,HOST:PORT...], dns:[//DNS_SERVER:PORT/]NAME:PORT or k8s:[NAMESPACE/]SERVICE:PORT"
)


def _top_logprobs(value: int) -> str | None:
    return None if 0 <= value <= MAX_TOP_LOGPROBS else f"must be in [0, {MAX_TOP_LOGPROBS}]"


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings: each field declared with `setting` is a flag of
    `specdec serve gateway` and a SPECDEC_* variable (specdec.common.settings)."""

    drafters: tuple[str, ...] = setting(
        help=f"drafter replicas: {WHERE}", flag="--drafter", convert=address_list, check=non_empty
    )
    verifiers: tuple[str, ...] = setting(
        help=f"verifier replicas: {WHERE}",
        flag="--verifier",
        convert=address_list,
        check=non_empty,
    )
    dns_interval: float = setting(5.0, "seconds between two DNS resolutions (dns:)", check=positive)
    redis_url: str | None = setting(
        None,
        "Redis URL for sessions (empty: in-process only)",
        flag="--redis",
        shown="",
        blank=True,
    )
    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(50051, "gRPC port (0: any free port)", check=port_number)
    metrics_port: int = setting(
        0,
        "Prometheus /metrics port (0: off; the HTTP API's port serves /metrics too)",
        check=port_number,
    )
    # The OpenAI-compatible HTTP API (specdec.gateway.front.http).
    http_port: int = setting(
        8000, "OpenAI-compatible HTTP API port, as vLLM's (0: off)", check=port_number
    )
    served_model_name: str = setting(
        "", "HTTP API model name (default: the name of the verifier's model folder)"
    )
    strict_fields: bool = setting(
        False,
        "HTTP API: refuse request fields it does not know with 400 (default: ignore them "
        "and log them at debug level, as vLLM does)",
    )
    default_k: int = setting(4, "draft length when a request sets none", check=non_negative)
    ssd: bool = setting(False, "SSD (pre-draft during verification) by default")
    ssd_fan_out: int = setting(
        0, "SSD branches per round (0: the drafter's default)", check=_fan_out
    )
    k_policy: int = setting(  # a gateway_pb2.KPolicy
        ADAPTIVE,
        "how each round's draft is chosen when a request does not say: adaptive (the "
        "source, length and SSD fan-out that maximise expected tokens per second from the "
        "replicas' measured cost curves and each source's measured acceptance; the "
        "request's k is an upper bound, 0 included) or fixed (the request's k every round; "
        "seeded sampled requests always draft fixed, so they stay reproducible)",
        convert=parse_policy,
        shown="adaptive",
        choices=POLICY_NAMES,
    )
    goodput_guard: bool = setting(
        True,
        "under the adaptive policy, measure the tokens per second the gateway's requests "
        "commit with speculation on and off at each load level (sessions, in powers of "
        "two, from 2), in alternating epochs, and run the faster (docs/concepts/"
        "cost-model.md#the-goodput-guard); --no-goodput-guard: the policy's model alone",
    )
    guard_scope: str = setting(
        "shared",
        "who the goodput guard measures and decides for: shared (every gateway replica on "
        "the same --redis: one leads, counting all their requests; without --redis, this "
        "replica) or replica (each replica its own requests)",
        choices=("shared", "replica"),
    )
    guard_epoch_seconds: float = setting(
        GuardParams.min_measure,
        "the goodput guard's shortest measurement of an epoch, in seconds (it also counts "
        "four mean rounds and one mean request at least, the request up to 30 s): longer "
        "is steadier, shorter adapts faster",
        check=positive,
    )
    # Lookup drafts (specdec.gateway.round.lookup): the default SpeculationMethod, prompt
    # lookup's n-gram lengths, the suffix tries' depth and the cache of recent outputs.
    method: gateway_pb2.SpeculationMethod = setting(
        gateway_pb2.SPECULATION_METHOD_HYBRID,
        "where drafts come from when a request does not say: model (the drafter), "
        "ngram (prompt lookup), suffix (suffix decoding over the request and recent "
        "outputs) or hybrid (a prompt-lookup match of 3+ tokens or a confident match in "
        "recent outputs, else the drafter's draft extended by prompt lookup)",
        convert=parse_method,
        shown="hybrid",
        choices=METHOD_NAMES,
    )
    tree_width: int = setting(
        1,
        "candidate continuations a round may verify together as one token tree (a "
        "lookup's other matches, the drafter's top alternatives, a prediction) when a "
        f"request does not say (1: chains; at most {MAX_TREE_WIDTH})",
        check=tree_width,
    )
    prompt_lookup_min: int = setting(
        LookupSettings.prompt_lookup_min, "shortest n-gram prompt lookup matches", check=positive
    )
    prompt_lookup_max: int = setting(
        LookupSettings.prompt_lookup_max, "longest n-gram prompt lookup matches", check=positive
    )
    suffix_depth: int = setting(
        SuffixParams.depth,
        "depth of the suffix tries (tokens)",
        check=lambda v: None if v >= 2 else "must be >= 2",
    )
    suffix_cache_tokens: int = setting(
        16384,
        "bound of the cache of recent outputs for suffix drafts, in tokens (LRU; 0: none)",
        check=non_negative,
    )
    suffix_cache_scope: str = setting(
        "global",
        "who shares the cache of recent outputs: global, tenant (gRPC metadata "
        "specdec-tenant, HTTP field user) or off",
        choices=SCOPES,
    )
    max_new_tokens: int = setting(4096, "largest max_new_tokens a request may ask", check=positive)
    session_ttl: int = setting(3600, "seconds an idle session is kept", check=positive)
    max_session_ttl: int = 30 * 24 * 3600  # no flag
    turn_lease: float = setting(
        TURN_LEASE_SECONDS,
        "seconds a session's turn lock lives unless its turn renews it (every quarter): a "
        "gateway that dies frees its sessions this long after its last renewal",
        check=positive,
    )
    rpc_timeout: float = setting(
        120.0, "deadline of each drafter/verifier call (s)", check=positive
    )
    startup_timeout: float = setting(
        900.0, "how long to wait for replicas at start (s)", check=positive
    )
    grace_seconds: float = setting(10.0, "graceful shutdown window on SIGTERM", check=non_negative)
    # TLS on the public port (client certificates optional).
    tls: ServerTls | None = settings_group(ServerTlsSettings)
    # TLS (mTLS with a certificate) to the replicas.
    replica_tls: ClientTls | None = settings_group(ReplicaTlsSettings)
    # How the round's calls reach a replica: "dataplane" (its data port when its Info has
    # one, specdec.gateway.fleet.dataplane) or "grpc" (unary calls, specdec.gateway.fleet.transport).
    replica_transport: str = setting(
        "dataplane",
        "how the round's calls (Draft, Speculate, Verify) reach the replicas: dataplane "
        "(one TCP connection to each replica's data port, gRPC for a replica without "
        "one) or grpc (unary gRPC calls)",
        check=one_of(REPLICA_TRANSPORTS),
    )
    # The data plane's keepalive: a ping every interval, a replica silent for the timeout
    # is dead (its calls fail over). A replica answers pings during a forward too.
    data_keepalive: float = setting(
        1.0,
        "seconds between two keepalive pings on each data-plane connection",
        check=positive,
    )
    data_keepalive_timeout: float = setting(
        10.0,
        "seconds of silence after which a replica's data-plane connection is held dead "
        "and its calls fail over (a replica answers pings during a forward too)",
        check=positive,
    )
    # Recording of finished requests (specdec.gateway.observe.recorder); None: off.
    record_dir: str | None = setting(
        None,
        "directory where finished requests are recorded for `specdec distill` (token "
        "ids: user data; a request with record: false is not); empty: off",
        flag="--record",
        shown="",
        blank=True,
    )
    record_max_bytes: int = setting(64 * 1024 * 1024, "size of one recording file", check=positive)
    record_max_files: int = setting(
        16, "recording files kept (the oldest are deleted)", check=positive
    )
    # From the Verify calls the request makes anyway (specdec distill's KL needs no teacher
    # forward for those rows).
    record_top_logprobs: int = setting(
        0,
        "with --record: the target's top M log-probabilities per output token in each "
        "row (0-20; 0: none), for specdec distill's KL",
        check=_top_logprobs,
    )
    # A share of new sessions to drafters of one model version (specdec.gateway.fleet.canary).
    drafter_canary: Canary | None = setting(
        None,
        "VERSION:PERCENT: send that share of new sessions to the drafters whose model "
        "version (specdec_version.json) is VERSION, the rest to the others; empty: off",
        convert=parse_canary,
        shown="",
    )
    # Bearer tokens; empty: no token check.
    auth_tokens: frozenset[str] = setting(
        frozenset(),
        "file of bearer tokens, one per line (a mounted Secret); empty: no token check",
        flag="--auth-tokens-file",
        convert=read_tokens,
        shown="",
        blank=True,
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_settings(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        cfg = cls(**read_settings(cls, args))
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
