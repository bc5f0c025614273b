"""Drafter and verifier replicas as the gateway sees them: channels, load, health, routing.

Routing (DESIGN §3): a session goes to the replica that holds its KV cache if that replica
is up, else to the least loaded one (fewest requests in flight from this gateway). A replica
whose call fails with UNAVAILABLE is taken out; a background probe puts it back once its
health check answers SERVING and its Info still matches the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.common.serving import CHANNEL_OPTIONS
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

log = logging.getLogger(__name__)


class NoReplica(Exception):
    """No replica of a role is up."""


class IncompatibleReplicas(Exception):
    """Replicas disagree on the vocabulary or tokenizer."""


@dataclass(eq=False)
class Replica:
    role: str  # "drafter" | "verifier"
    address: str
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0
    up: bool = False
    info: common_pb2.ModelInfo | None = None
    served: int = field(default=0)

    def __repr__(self) -> str:
        return f"{self.role}@{self.address}"


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def _stub_for(role: str, channel: grpc.aio.Channel):
    if role == "drafter":
        return drafter_pb2_grpc.DrafterServiceStub(channel)
    return verifier_pb2_grpc.VerifierServiceStub(channel)


class ReplicaPool:
    """All replicas of one role, from a static address list."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        info_timeout: float = 10.0,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        if not addresses:
            raise ValueError(f"no {role} address given")
        self.role = role
        self.info_timeout = info_timeout
        self.replicas = [
            Replica(role, a, ch := _channel(a, credentials), _stub_for(role, ch)) for a in addresses
        ]

    def by_address(self, address: str | None) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    def pick(self, preferred: str | None = None, exclude: Sequence[Replica] = ()) -> Replica:
        """The replica holding the session's cache if up, else the least loaded one."""
        candidates = [r for r in self.replicas if r.up and r not in exclude]
        if not candidates:
            raise NoReplica(
                f"no {self.role} replica is available ({len(self.replicas)} configured)"
            )
        for r in candidates:
            if r.address == preferred:
                return r
        return min(candidates, key=lambda r: (r.in_flight, r.served))

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.up:
            log.warning(
                "replica taken out",
                extra={"replica": replica.address, "role": self.role, "why": why},
            )
        replica.up = False

    async def fetch_info(
        self, replica: Replica, include_tokenizer: bool = False
    ) -> common_pb2.ModelInfo:
        return await replica.stub.Info(
            common_pb2.InfoRequest(include_tokenizer=include_tokenizer), timeout=self.info_timeout
        )

    async def healthy(self, replica: Replica) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas))


def check_compatible(replicas: Sequence[Replica]) -> None:
    """Every replica must share the vocabulary size and the tokenizer (named when not)."""
    first = replicas[0]
    for other in replicas[1:]:
        a, b = first.info, other.info
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
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.drafters = ReplicaPool("drafter", drafters, credentials=credentials)
        self.verifiers = ReplicaPool("verifier", verifiers, credentials=credentials)
        self._probe: asyncio.Task | None = None

    @property
    def all(self) -> list[Replica]:
        return [*self.drafters.replicas, *self.verifiers.replicas]

    def pool(self, role: str) -> ReplicaPool:
        return self.drafters if role == "drafter" else self.verifiers

    async def connect(self, timeout: float) -> common_pb2.ModelInfo:
        """Wait until every replica answers Info, check they agree; returns a verifier's
        Info with the tokenizer. Raises IncompatibleReplicas or TimeoutError."""
        deadline = time.monotonic() + timeout
        pending = list(self.all)
        while pending:
            for r in list(pending):
                if not await self.pool(r.role).healthy(r):
                    continue
                try:
                    r.info = await self.pool(r.role).fetch_info(r)
                except grpc.RpcError as e:
                    log.info("replica not ready", extra={"replica": r.address, "why": e.details()})
                    continue
                r.up = True
                pending.remove(r)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"replicas not serving after {timeout:.0f}s: "
                        + ", ".join(repr(r) for r in pending)
                    )
                await asyncio.sleep(0.5)
        check_compatible(self.all)
        return await self.verifiers.fetch_info(self.verifiers.replicas[0], include_tokenizer=True)

    def start_probe(self, interval: float = 2.0) -> None:
        self._probe = asyncio.ensure_future(self._probe_loop(interval))

    async def _probe_loop(self, interval: float) -> None:
        reference = self.all[0].info
        while True:
            await asyncio.sleep(interval)
            for r in self.all:
                if r.up or not await self.pool(r.role).healthy(r):
                    continue
                try:
                    info = await self.pool(r.role).fetch_info(r)
                except grpc.RpcError:
                    continue
                if (info.vocab_size, info.tokenizer_fingerprint) != (
                    reference.vocab_size,
                    reference.tokenizer_fingerprint,
                ):
                    log.error(
                        "replica came back with another model; kept out",
                        extra={"replica": r.address},
                    )
                    continue
                r.info, r.up = info, True
                log.info("replica back in", extra={"replica": r.address, "role": r.role})

    async def close(self) -> None:
        if self._probe:
            self._probe.cancel()
        await self.drafters.close()
        await self.verifiers.close()
