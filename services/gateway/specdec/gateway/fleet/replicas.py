"""Drafter and verifier replicas as the gateway sees them: channels, load, health, routing.

Routing (DESIGN §3): a session goes to the replica that holds its KV cache if that replica
is up, else to the least loaded one (fewest requests in flight from this gateway). A replica
whose call fails with UNAVAILABLE is taken out; a background probe puts it back once its
health check answers SERVING and its Info still matches the pool.

How a round's calls reach an admitted replica (`Replica.transport`): its data plane
(specdec.gateway.fleet.dataplane) when its Info names a data port and the gateway allows it
(--replica-transport dataplane, `Fleet.data_plane`), else unary gRPC calls on its channel;
a replica whose data port does not answer at admission is used through gRPC.

Membership is static (the addresses given) or discovered (discovery.py: DNS records or
Kubernetes EndpointSlices). A discovered replica joins like one coming back: once its health
check and Info pass; one that leaves is taken out at once, and its channel closes when its
calls in flight are done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.common.cost import ReportedCost
from specdec.common.serving import CHANNEL_OPTIONS, StartFailed
from specdec.gateway.fleet.canary import VersionRule
from specdec.gateway.fleet.dataplane import DataPlaneSettings, DataPlaneTransport
from specdec.gateway.fleet.discovery import make_discovery
from specdec.gateway.fleet.transport import CallFailed, GrpcTransport, Transport
from specdec.gateway.names import Role
from specdec.gateway.observe import metrics
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger(__name__)

# While start-up waits for replicas, a log line this often says which and why.
WAIT_REPORT_SECONDS = 5.0


class NoReplica(Exception):
    """No replica of a role is up."""


class ReplicasNotServing(StartFailed, TimeoutError):
    """Start-up waited --startup-timeout seconds and some replicas never served; the
    message names each and why."""


class IncompatibleReplicas(StartFailed):
    """Replicas disagree on the vocabulary or tokenizer."""


@dataclass(eq=False)
class Replica:
    role: Role
    address: str
    channel: grpc.aio.Channel
    stub: drafter_pb2_grpc.DrafterServiceStub | verifier_pb2_grpc.VerifierServiceStub
    in_flight: int = 0
    up: bool = False
    info: common_pb2.ModelInfo | None = None
    served: int = field(default=0)
    # How a round's calls reach it (specdec.gateway.fleet.transport); its gRPC stub until the
    # data plane is connected.
    transport: Transport = field(init=False)
    # Its forward cost curve and load as it last reported them (Info, then every Draft and
    # Verify response; specdec.common.cost): the message kept as it came, read only when a
    # policy asks (`cost`), so rounds that price nothing (a fixed policy, k = 0) parse none.
    _cost_message: common_pb2.ForwardCost | None = field(default=None, init=False, repr=False)
    _cost: ReportedCost | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.transport = GrpcTransport(self.stub)

    @property
    def cost(self) -> ReportedCost | None:
        """Its reported cost curve and load, None until one arrives."""
        message, self._cost_message = self._cost_message, None
        if message is not None:
            self._cost = ReportedCost.from_proto(message) or self._cost
        return self._cost

    @cost.setter
    def cost(self, value: ReportedCost | None) -> None:
        self._cost_message, self._cost = None, value

    @property
    def admitted_info(self) -> common_pb2.ModelInfo:
        """Its Info, which a replica has once admitted (RuntimeError before)."""
        if self.info is None:
            raise RuntimeError(f"{self!r} has not been admitted: no Info yet")
        return self.info

    def note_cost(self, message: common_pb2.ForwardCost) -> None:
        """Take the cost curve a response carried (an empty one changes nothing)."""
        if message.buckets:
            self._cost_message = message

    def __repr__(self) -> str:
        return f"{self.role}@{self.address}"

    @property
    def host(self) -> str:
        """The host of its gRPC address (brackets of an IPv6 address removed)."""
        host = self.address.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _channel(
    address: str, credentials: grpc.ChannelCredentials | None, server_name: str = ""
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    # server_name: the name the replicas' certificates carry when the address is a pod IP
    # from discovery (one certificate for a whole pool, not one per pod address).
    options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(
        address, credentials, options=options if server_name else CHANNEL_OPTIONS
    )


def _stub_for(
    role: Role, channel: grpc.aio.Channel
) -> drafter_pb2_grpc.DrafterServiceStub | verifier_pb2_grpc.VerifierServiceStub:
    if role == Role.DRAFTER:
        return drafter_pb2_grpc.DrafterServiceStub(channel)
    return verifier_pb2_grpc.VerifierServiceStub(channel)


class ReplicaPool:
    """All replicas of one role: a static address list, or a discovered one when
    `addresses` is a single dns:/k8s: target (see discovery.py)."""

    def __init__(
        self,
        role: Role,
        addresses: Sequence[str],
        info_timeout: float = 10.0,
        dns_interval: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
    ):
        if not addresses:
            raise ValueError(f"no {role} address given")
        self.role = role
        self.info_timeout = info_timeout
        self.credentials = credentials  # TLS (mTLS with a certificate); None: plaintext
        self.server_name = server_name  # name checked in the replicas' certificates
        self.source = ",".join(addresses)
        self.discovery = make_discovery(addresses[0], dns_interval) if len(addresses) == 1 else None
        self.replicas: list[Replica] = []
        self._closing: set[asyncio.Task[None]] = set()
        if self.discovery is None:
            self.replicas = [self._new(a) for a in addresses]
        self._report()

    @property
    def dynamic(self) -> bool:
        return self.discovery is not None

    def _new(self, address: str) -> Replica:
        channel = _channel(address, self.credentials, self.server_name)
        return Replica(self.role, address, channel, _stub_for(self.role, channel))

    def _report(self) -> None:
        up = sum(r.up for r in self.replicas)
        metrics.REPLICAS.labels(role=self.role, state="up").set(up)
        metrics.REPLICAS.labels(role=self.role, state="down").set(len(self.replicas) - up)

    def set_addresses(self, addresses: frozenset[str]) -> None:
        """Discovery's current set: new addresses join (down until the probe admits them),
        addresses that left are taken out now."""
        known = {r.address for r in self.replicas}
        for r in [r for r in self.replicas if r.address not in addresses]:
            self.mark_down(r, "left the discovered set")
            self.replicas.remove(r)
            task = asyncio.ensure_future(self._close_when_idle(r))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for a in sorted(addresses - known):
            self.replicas.append(self._new(a))
            log.info("replica discovered", extra={"replica": a, "role": self.role})
        self._report()

    @staticmethod
    async def _close_when_idle(replica: Replica, poll: float = 0.5) -> None:
        while replica.in_flight:  # its calls finish or fail over first
            await asyncio.sleep(poll)
        await replica.transport.close()
        await replica.channel.close()

    def by_address(self, address: str | None) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def pick(
        self,
        preferred: str | None = None,
        exclude: Sequence[Replica] = (),
        rule: VersionRule | None = None,
    ) -> Replica:
        """The replica holding the session's cache if up, else the least loaded one (of
        those `rule` allows, when it allows any: specdec.gateway.fleet.canary)."""
        candidates = [r for r in self.replicas if r.up and r not in exclude]
        if not candidates:
            raise NoReplica(
                f"no {self.role} replica is available ({len(self.replicas)} known from "
                f"{self.source})"
            )
        for r in candidates:
            if r.address == preferred:
                return r
        chosen, fell_back = self._least_loaded(candidates, rule)
        if fell_back:
            metrics.CANARY_FALLBACKS.inc()
        return chosen

    @staticmethod
    def _least_loaded(
        candidates: Sequence[Replica], rule: VersionRule | None
    ) -> tuple[Replica, bool]:
        """The least loaded of the candidates `rule` allows (all of them when it allows
        none: the bool says so)."""
        allowed = [r for r in candidates if rule.matches(r.info)] if rule is not None else None
        pool = allowed or candidates
        return min(pool, key=lambda r: (r.in_flight, r.served)), allowed == []

    def cost(self, rule: VersionRule | None = None) -> ReportedCost | None:
        """The cost curve of the replica a new placement would pick (None: none is up, or
        it reported none): what a request prices its first round with. Counts nothing."""
        up = self.up()
        return self._least_loaded(up, rule)[0].cost if up else None

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.up:
            log.warning(
                "replica taken out",
                extra={"replica": replica.address, "role": self.role, "why": why},
            )
        replica.up = False
        self._report()

    async def fetch_info(
        self, replica: Replica, include_tokenizer: bool = False
    ) -> common_pb2.ModelInfo:
        info: common_pb2.ModelInfo = await replica.stub.Info(
            common_pb2.InfoRequest(include_tokenizer=include_tokenizer), timeout=self.info_timeout
        )
        return info

    async def healthy(self, replica: Replica) -> bool:
        return not await self.unhealthy(replica)

    async def unhealthy(self, replica: Replica) -> str:
        """Why the replica does not serve ("" when its health check answers SERVING)."""
        try:
            resp = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0
            )
        except grpc.RpcError as e:
            return f"unreachable: {e.code().name}: {e.details()}"
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return ""
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return f"health {status} (loading its model, or stopping)"

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*(r.transport.close() for r in self.replicas))
        await asyncio.gather(*(r.channel.close() for r in self.replicas))


def check_compatible(replicas: Sequence[Replica]) -> None:
    """Every replica must share the vocabulary size and the tokenizer (named when not)."""
    first = replicas[0]
    for other in replicas[1:]:
        a, b = first.admitted_info, other.admitted_info
        if a.vocab_size != b.vocab_size:
            raise IncompatibleReplicas(
                f"{first!r} ({a.model_id}) has a vocabulary of {a.vocab_size} tokens, "
                f"{other!r} ({b.model_id}) has {b.vocab_size}"
            )
        if a.tokenizer_fingerprint != b.tokenizer_fingerprint:
            raise IncompatibleReplicas(
                f"{first!r} ({a.model_id}) and {other!r} ({b.model_id}) use different "
                f"tokenizers (fingerprints {a.tokenizer_fingerprint[:12]} and "
                f"{b.tokenizer_fingerprint[:12]})"
            )


class Fleet:
    """Drafter and verifier pools together: start-up checks and the recovery probe."""

    def __init__(
        self,
        drafters: Sequence[str],
        verifiers: Sequence[str],
        dns_interval: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        data_plane: DataPlaneSettings | None = None,
    ):
        # How to reach replicas' data ports (None: the round's calls use gRPC only).
        self.data_plane = data_plane
        tls: dict[str, Any] = {"credentials": credentials, "server_name": server_name}
        self.drafters = ReplicaPool(Role.DRAFTER, drafters, dns_interval=dns_interval, **tls)
        self.verifiers = ReplicaPool(Role.VERIFIER, verifiers, dns_interval=dns_interval, **tls)
        self._probe: asyncio.Future[None] | None = None
        self._discovery: list[asyncio.Task[None]] = []
        # What every replica must match, fixed at start: (vocab size, tokenizer fingerprint),
        # and the smallest context and largest draft length k (the replicas' least
        # --max-draft-tokens) the gateway's limits were taken from.
        self.reference: common_pb2.ModelInfo | None = None
        self.min_context = 0
        self.max_k = 0

    @property
    def members(self) -> list[Replica]:
        """Every replica known now, admitted or not."""
        return [*self.drafters.replicas, *self.verifiers.replicas]

    @property
    def infos(self) -> list[common_pb2.ModelInfo]:
        """The Info of every replica admitted at least once."""
        return [r.info for r in self.members if r.info is not None]

    def pool(self, role: Role) -> ReplicaPool:
        return self.drafters if role == Role.DRAFTER else self.verifiers

    def _waiting_for(self, why: dict[str, str] | None = None) -> list[str]:
        """What start-up still waits for: every replica of a static pool, one replica of a
        discovered pool; with `why` (repr of a replica -> why it is not admitted), why."""
        why = why or {}

        def replica(r: Replica, name: str) -> str:
            return f"{name} ({why[repr(r)]})" if repr(r) in why else name

        waiting = []
        for pool in (self.drafters, self.verifiers):
            if pool.dynamic:
                if not pool.up():
                    known = ", ".join(replica(r, r.address) for r in pool.replicas)
                    waiting.append(
                        f"a {pool.role} from {pool.source} ({known or 'none found yet'})"
                    )
            else:
                waiting += [replica(r, repr(r)) for r in pool.replicas if not r.up]
        return waiting

    async def connect(self, timeout: float) -> common_pb2.ModelInfo:
        """Start discovery; wait until every static replica, and one replica of each
        discovered pool, answers Info; check they agree; returns a verifier's Info with the
        tokenizer. Raises IncompatibleReplicas or ReplicasNotServing."""
        for pool in (self.drafters, self.verifiers):
            if pool.discovery is not None:
                self._discovery.append(
                    asyncio.ensure_future(pool.discovery.run(pool.set_addresses))
                )
        start = time.monotonic()
        deadline, report = start + timeout, start + WAIT_REPORT_SECONDS
        why: dict[str, str] = {}  # repr of a replica -> why it is not admitted yet
        while self._waiting_for():
            for r in self.members:
                if r.up:
                    continue
                pool = self.pool(r.role)
                problem = await pool.unhealthy(r)
                if problem:
                    why[repr(r)] = problem
                    continue
                try:
                    info = await pool.fetch_info(r)
                except grpc.RpcError as e:
                    why[repr(r)] = f"Info failed: {e.code().name}: {e.details()}"
                    log.info("replica not ready", extra={"replica": r.address, "why": e.details()})
                    continue
                await self._admit(r, info)
            if waiting := self._waiting_for(why):
                now = time.monotonic()
                if now > deadline:
                    raise ReplicasNotServing(
                        f"replicas not serving after {timeout:.0f}s: " + "; ".join(waiting)
                    )
                if now >= report:  # one line every few seconds: what, and why
                    report = now + WAIT_REPORT_SECONDS
                    log.warning(
                        "waiting for replicas: " + "; ".join(waiting),
                        extra={"waited_s": round(now - start), "timeout_s": timeout},
                    )
                await asyncio.sleep(0.5)
        admitted = [r for r in self.members if r.up]
        check_compatible(admitted)
        self.reference = admitted[0].info
        self.min_context = min(r.admitted_info.max_context for r in admitted)
        self.max_k = min(r.admitted_info.max_draft_tokens for r in admitted)
        return await self.verifiers.fetch_info(self.verifiers.up()[0], include_tokenizer=True)

    def start_probe(self, interval: float = 2.0) -> None:
        self._probe = asyncio.ensure_future(self._probe_loop(interval))

    def refusal(self, info: common_pb2.ModelInfo) -> str | None:
        """Why a replica with this Info may not serve (None: it may)."""
        reference = self.reference
        if reference is None:
            raise RuntimeError("Fleet.refusal before connect(): no reference Info yet")
        if (info.vocab_size, info.tokenizer_fingerprint) != (
            reference.vocab_size,
            reference.tokenizer_fingerprint,
        ):
            return "another vocabulary or tokenizer"
        if info.max_context < self.min_context:
            return f"a context of {info.max_context} tokens, below {self.min_context}"
        if info.max_draft_tokens < self.max_k:
            return f"max_draft_tokens {info.max_draft_tokens}, below the fleet's {self.max_k}"
        return None

    async def _probe_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for r in self.members:
                if r.up or not await self.pool(r.role).healthy(r):
                    continue
                try:
                    info = await self.pool(r.role).fetch_info(r)
                except grpc.RpcError:
                    continue
                why = self.refusal(info)
                if why:
                    log.error(
                        "replica has another model; kept out",
                        extra={"replica": r.address, "role": r.role, "why": why},
                    )
                    continue
                if r not in self.pool(r.role).replicas:  # left while we asked
                    continue
                await self._admit(r, info)
                log.info("replica in", extra={"replica": r.address, "role": r.role})

    async def _admit(self, replica: Replica, info: common_pb2.ModelInfo) -> None:
        """Serve through a replica whose health and Info passed: its transport first."""
        replica.info = info
        replica.note_cost(info.forward_cost)
        old, replica.transport = replica.transport, await self._transport(replica)
        if old is not replica.transport:
            await old.close()
        replica.up = True
        self.pool(replica.role)._report()

    async def _transport(self, replica: Replica) -> Transport:
        """The data plane when the replica has one and it answers, else gRPC."""
        port = replica.admitted_info.data_port
        if self.data_plane is not None and port:
            data_plane = DataPlaneTransport(replica.host, port, self.data_plane)
            try:
                await data_plane.connect()
            except CallFailed as e:
                log.warning(
                    "replica's data plane unreachable; its calls use gRPC",
                    extra={"replica": replica.address, "role": replica.role, "why": e.details},
                )
            else:
                log.info(
                    "replica transport",
                    extra={"replica": replica.address, "transport": "dataplane", "data_port": port},
                )
                return data_plane
        log.info("replica transport", extra={"replica": replica.address, "transport": "grpc"})
        return GrpcTransport(replica.stub)

    async def close(self) -> None:
        if self._probe:
            self._probe.cancel()
        for task in self._discovery:
            task.cancel()
        await self.drafters.close()
        await self.verifiers.close()
