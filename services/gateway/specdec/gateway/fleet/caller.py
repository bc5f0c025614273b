"""The replica caller: one request's calls to the drafter and verifier pools.

A request keeps, per role, a `Placement` (specdec.gateway.fleet.placement, which owns its
transitions): which replica holds its KV cache and how many of its tokens that cache
holds. `ReplicaCaller.call` sends a round's call to the placement's replica, naming the
cached prefix it builds on (length + hash) and carrying only the tokens after it, and
recovers from what a replica may answer:

- a **cache miss** (the replica does not hold that prefix): resend the whole context to
  the same replica;
- **busy** (its queue is full, backpressure): another replica of the pool, the whole
  context there; when every replica is full, the caller fails with the replica's
  RESOURCE_EXHAUSTED;
- **UNAVAILABLE** (it died, restarts, or left discovery): mark it down, fail over to
  another replica with the whole context; the only verifier left is retried a few times
  with a back-off first (a restart must not fail every request at once);
- a **moved session** (a later turn whose replica is down or gone): the whole context to
  another replica, counted as a resend like a miss.

Misses and failover cost time, never tokens: every call names exactly the tokens it builds
on, and a replica answers only for those. The caller keeps no statistics; each call
returns an `Answer` saying which replica answered and how many resends it took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from specdec.common import telemetry
from specdec.common.errors import SpecdecError, Unavailable
from specdec.common.prefix import PrefixChain
from specdec.gateway.fleet.placement import Placement as Placement
from specdec.gateway.fleet.replicas import Fleet, NoReplica, Replica, ReplicaPool
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.gateway.names import Role
from specdec.gateway.observe import metrics, tracing
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

# Pauses before retrying the only verifier that answered UNAVAILABLE (seconds).
RETRY_BACKOFF = (0.2, 0.5, 1.0, 2.0)
SERVICES = {
    Role.DRAFTER: drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name,
    Role.VERIFIER: verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name,
}


class UpstreamError(SpecdecError):
    """A replica answered an error the gateway cannot recover from: its code, reason and
    message are kept (`replica_details`; `details` names the replica before it)."""

    def __init__(self, replica: Replica, failure: CallFailed):
        super().__init__(f"{replica!r}: {failure.details}", failure.code, failure.reason)
        self.replica_details = failure.details


@dataclass(frozen=True)
class Answer:
    """A call's response, the replica that gave it, and the resends it took (cache misses,
    busy redirects and failovers: each resent the whole context)."""

    response: Any
    replica: Replica
    resends: int


async def traced_call(replica: Replica, method: Method, request: Any, timeout: float) -> Any:
    """A round call to the replica (through its transport) as a CLIENT span, with the
    trace context sent along. Errors (CallFailed) are raised unchanged, recorded on the
    span."""
    if not telemetry.enabled():
        return await replica.transport.call(method, request, timeout)
    service = SERVICES[method.role]
    host, _, port = replica.address.rpartition(":")
    with telemetry.tracer.start_as_current_span(
        f"{service}/{method.rpc}",
        kind=SpanKind.CLIENT,
        attributes={
            **telemetry.rpc_attributes(service, method.rpc),
            "server.address": host,
            "server.port": int(port) if port.isdigit() else 0,
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            response = await replica.transport.call(
                method, request, timeout, telemetry.traceparent()
            )
        except CallFailed as failure:
            telemetry.set_grpc_status(span, failure.code, failure.details)
            if failure.cache_miss:
                span.set_attribute("specdec.cache_miss", True)
            raise
        telemetry.set_grpc_status(span, grpc.StatusCode.OK)
        return response


# Builds a call's request from the prefix it names and the tokens after it.
Build = Callable[[common_pb2.CachedPrefix, list[int]], Any]


class ReplicaCaller:
    """Sends one request's calls; holds the block hashes of its context (which only grows
    at its end, so a call hashes only what was added since the last one)."""

    def __init__(self, fleet: Fleet, rpc_timeout: float, deadline: float | None = None):
        self.fleet = fleet
        self.rpc_timeout = rpc_timeout
        # The client's deadline (time.monotonic()), which bounds every call when it is set:
        # a long prefill may take what the client allows, not a constant it cannot see.
        self.deadline = deadline
        self._chain = PrefixChain()

    def timeout(self) -> float:
        """Seconds a call may take: what is left of the client's deadline, else
        --rpc-timeout (requests without a deadline)."""
        if self.deadline is None:
            return self.rpc_timeout
        return max(0.001, self.deadline - time.monotonic())

    async def call(
        self,
        method: Method,
        placement: Placement,
        ctx: Sequence[int],
        build: Build,
        tail: Sequence[int] = (),
    ) -> Answer:
        """Send build(prefix, new_tokens) to the placement's replica (picking one when it
        has none or it is down) and update the placement on the way: a new replica holds
        nothing, a miss empties the cache. Raises Unavailable or UpstreamError.

        The request sees ctx + tail: the prefix is what the placement caches of it, at
        most all but its last token (every call carries at least one new token), and
        new_tokens is the rest. Only Speculate has a tail (the draft under verification):
        after a Draft the drafter caches ctx + d_1..d_{k-1}, so it then gets d_k alone.
        """
        pool = self.fleet.pool(method.role)
        tries = _Tries()
        for _ in range(3 * len(pool.replicas) + 2 + len(RETRY_BACKOFF)):
            replica = _replica(method, placement, pool, tries)
            n = min(placement.cached, len(ctx) + len(tail) - 1)
            prefix = common_pb2.CachedPrefix(length=n, hash=self._chain.hash(ctx, n, tail))
            new = [*ctx[n:], *tail[max(0, n - len(ctx)) :]] if tail else list(ctx[n:])
            replica.in_flight += 1
            try:
                response = await traced_call(replica, method, build(prefix, new), self.timeout())
                return Answer(response, replica, tries.resends)
            except CallFailed as failure:
                tries.resends += 1
                await _recover(method, placement, pool, replica, failure, tries)
            finally:
                replica.in_flight -= 1
                replica.served += 1
        raise Unavailable(f"no {method.role} replica could serve the request")


@dataclass(slots=True)
class _Tries:
    """What one call met so far: replicas that failed, replicas that answered busy (up,
    but full), retries of the only verifier left, and full-context resends."""

    failed: list[Replica] = field(default_factory=list)
    busy: list[Replica] = field(default_factory=list)
    retries: int = 0
    resends: int = 0


def _replica(method: Method, placement: Placement, pool: ReplicaPool, tries: _Tries) -> Replica:
    """The placement's replica, or (it has none, or it is down) another one of the pool
    that has not failed or answered busy this call. Raises Unavailable when none is left."""
    replica = placement.replica
    if replica is not None and replica.up:
        return replica
    try:
        chosen = pool.pick(
            preferred=placement.address, exclude=[*tries.failed, *tries.busy], rule=placement.rule
        )
    except NoReplica as e:
        raise Unavailable(str(e)) from None
    if chosen is not replica:
        was = placement.address
        if placement.moved(chosen):
            # The session's cache was on a replica that is down or gone (between turns,
            # or a failover below): the whole context goes to another one, a resend
            # like a miss's.
            tries.resends += 1
            tracing.note_moved(method.role, was, chosen.address)
    return chosen  # placement.replica now


async def _recover(
    method: Method,
    placement: Placement,
    pool: ReplicaPool,
    replica: Replica,
    failure: CallFailed,
    tries: _Tries,
) -> None:
    """After a failed call: what the next try sends where (a miss: everything to the same
    replica; busy: another replica; UNAVAILABLE: a back-off for the only verifier left,
    else another replica, this one marked down). Raises UpstreamError when the failure is
    the request's (another error, or every replica busy)."""
    if failure.cache_miss:
        tracing.note_cache_miss(method.role, replica.address)
        placement.missed()
        return
    if failure.busy:
        # Another replica of the pool (the cache is lost there), never marked down; when
        # every one is full the client gets RESOURCE_EXHAUSTED.
        tries.busy.append(replica)
        metrics.BUSY_REDIRECTS.labels(role=method.role).inc()
        if not [r for r in pool.up() if r not in tries.failed and r not in tries.busy]:
            raise UpstreamError(replica, failure) from None
        placement.moved(None)
        return
    if failure.code != grpc.StatusCode.UNAVAILABLE:
        raise UpstreamError(replica, failure) from None
    others = [r for r in pool.up() if r is not replica and r not in tries.failed]
    if not others and tries.retries < len(RETRY_BACKOFF) and method.role == Role.VERIFIER:
        # The only verifier left: a blip (a restart) must not fail every request at once;
        # its cache may survive (a miss says so). Without a drafter a round runs at k = 0
        # instead of waiting.
        await asyncio.sleep(RETRY_BACKOFF[tries.retries])
        tries.retries += 1
        return
    why = failure.details or "unavailable"
    pool.mark_down(replica, why)
    tries.failed.append(replica)
    metrics.FAILOVERS.labels(role=method.role).inc()
    tracing.note_failover(method.role, replica.address, why)
    placement.moved(None)
