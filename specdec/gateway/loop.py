"""The speculation loop of DESIGN §2 as the gateway runs it, one request at a time.

Per round: Draft(k) on a drafter, Verify on a verifier, append the accepted draft tokens and
the next token. Each side's KV cache is tracked as (replica, cached length); a request names
the prefix it builds on, a cache miss or a failed replica makes the next call resend the
full context to a (possibly other) replica. Misses and failover cost time, never tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.common.errors import SpecdecError, is_cache_miss
from specdec.common.prefix import prefix_hash
from specdec.gateway import metrics
from specdec.gateway.replicas import Fleet, NoReplica, Replica
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)

# Pauses before retrying the only replica of a role that answered UNAVAILABLE (seconds).
RETRY_BACKOFF = (0.2, 0.5, 1.0, 2.0)


class UpstreamError(SpecdecError):
    """A replica answered an error the gateway cannot recover from; its code is kept."""

    def __init__(self, replica: Replica, err: grpc.RpcError):
        super().__init__(f"{replica!r}: {err.details()}")
        self.code = err.code()


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class Placement:
    """Which replica holds a session's KV cache on one side, and how many tokens it holds."""

    replica: Replica | None = None
    cached: int = 0

    @property
    def address(self) -> str | None:
        return self.replica.address if self.replica else None


@dataclass
class LoopStats:
    rounds: int = 0
    drafts: int = 0  # rounds that had a draft (k > 0)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    cache_misses: int = 0

    def record(self, k: int, accepted: int) -> None:
        self.rounds += 1
        self.drafts += k > 0
        self.draft_tokens += k
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


class Speculator:
    """Runs rounds for one request against the fleet."""

    def __init__(
        self,
        fleet: Fleet,
        replica_session: str,
        sampling: common_pb2.SamplingParams,
        drafter: Placement,
        verifier: Placement,
        rpc_timeout: float,
    ):
        self.fleet = fleet
        self.session = replica_session
        self.sampling = sampling
        self.drafter = drafter
        self.verifier = verifier
        self.rpc_timeout = rpc_timeout
        self.stats = LoopStats()

    async def round(self, ctx: Sequence[int], k: int) -> list[int]:
        """One speculation round after ctx; returns the accepted draft tokens + next token."""
        draft_tokens: Sequence[int] = ()
        draft_probs: Sequence[common_pb2.DraftDistribution] = ()
        if k > 0:
            draft = await self._call(
                "drafter",
                self.drafter,
                ctx,
                lambda prefix, new: drafter_pb2.DraftRequest(
                    session_id=self.session,
                    prefix=prefix,
                    new_tokens=new,
                    num_draft_tokens=k,
                    sampling=self.sampling,
                ),
            )
            self.drafter.cached = draft.cached_length
            draft_tokens, draft_probs = draft.draft_tokens, draft.draft_probs
        verdict = await self._call(
            "verifier",
            self.verifier,
            ctx,
            lambda prefix, new: verifier_pb2.VerifyRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                draft_tokens=draft_tokens,
                draft_probs=draft_probs,
                sampling=self.sampling,
            ),
        )
        accepted = verdict.accepted_count
        self.verifier.cached = verdict.cached_length
        # The drafter cached d_1..d_{k-1}; what follows the accepted ones is stale.
        self.drafter.cached = min(self.drafter.cached, len(ctx) + accepted)
        self.stats.record(k, accepted)
        return [*draft_tokens[:accepted], verdict.next_token]

    async def _call(
        self,
        role: str,
        placement: Placement,
        ctx: Sequence[int],
        build: Callable[[common_pb2.CachedPrefix, Sequence[int]], object],
    ):
        """Send build(prefix, new_tokens) to the placement's replica, recovering from cache
        misses (resend everything) and unavailable replicas (another replica, everything)."""
        pool = self.fleet.pool(role)
        failed: list[Replica] = []
        retries = 0
        for _ in range(2 * len(pool.replicas) + 2 + len(RETRY_BACKOFF)):
            if placement.replica is None or not placement.replica.up:
                try:
                    chosen = pool.pick(preferred=placement.address, exclude=failed)
                except NoReplica as e:
                    raise Unavailable(str(e)) from None
                if chosen is not placement.replica:
                    placement.replica, placement.cached = chosen, 0
            replica = placement.replica
            n = min(placement.cached, len(ctx) - 1)
            prefix = common_pb2.CachedPrefix(length=n, hash=prefix_hash(ctx[:n]))
            request = build(prefix, ctx[n:])
            method = replica.stub.Draft if role == "drafter" else replica.stub.Verify
            replica.in_flight += 1
            try:
                return await method(request, timeout=self.rpc_timeout)
            except grpc.aio.AioRpcError as err:
                if is_cache_miss(err):
                    self.stats.cache_misses += 1
                    placement.cached = 0
                    continue
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    others = [r for r in pool.up() if r is not replica and r not in failed]
                    if not others and retries < len(RETRY_BACKOFF):
                        # The only replica left: a blip (a restart, a full queue) must not
                        # fail every request at once. Its cache may survive; a miss says so.
                        await asyncio.sleep(RETRY_BACKOFF[retries])
                        retries += 1
                        continue
                    pool.mark_down(replica, err.details() or "unavailable")
                    failed.append(replica)
                    metrics.FAILOVERS.labels(role=role).inc()
                    placement.replica, placement.cached = None, 0
                    continue
                raise UpstreamError(replica, err) from None
            finally:
                replica.in_flight -= 1
                replica.served += 1
        raise Unavailable(f"no {role} replica could serve the request")
