"""The speculation loop of DESIGN §2 as the gateway runs it, one request at a time.

Per round: Draft(k) on a drafter, Verify on a verifier, append the accepted draft tokens and
the next token. Each side's KV cache is tracked as (replica, cached length); a request names
the prefix it builds on, a cache miss or a failed replica makes the next call resend the
full context to a (possibly other) replica. Misses and failover cost time, never tokens.

With SSD (DESIGN §4) Speculate(t) leaves with Verify(t): the drafter prepares next-round
drafts for the likeliest outcomes while the verifier works. If the verified outcome
(accepted count, next token) is one of them, that is a hit: under greedy decoding the
gateway already holds the next draft and Verify(t+1) leaves at once; under sampling the
Draft(t+1) call is answered from the prepared branch with its distributions, without a
forward. A miss is a normal Draft. The verifier applies the same rule to whatever draft
it gets, so SSD changes speed only, never tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.common.errors import SpecdecError, is_busy, is_cache_miss
from specdec.common.params import sampling_from_proto
from specdec.common.prefix import prefix_hash
from specdec.gateway import metrics, tracing
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
        self.busy = is_busy(err)  # every replica of the role refused: queues full


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
    ssd_hits: int = 0
    ssd_misses: int = 0
    ssd_branches: int = 0
    ssd_hidden_ms: float = 0.0  # Speculate time that overlapped a verification
    ssd_bytes: int = 0  # Speculate requests + responses
    drafter_wait_ms: float = 0.0  # gateway blocked on the drafter

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
        ssd: bool = False,
        ssd_fan_out: int = 0,
    ):
        self.fleet = fleet
        self.session = replica_session
        self.sampling = sampling
        self.drafter = drafter
        self.verifier = verifier
        self.rpc_timeout = rpc_timeout
        self.stats = LoopStats()
        self.ssd = ssd
        self.ssd_fan_out = ssd_fan_out
        self.greedy = sampling_from_proto(sampling).greedy
        # SSD hit under greedy: (context length it follows, the prepared draft).
        self._ready: tuple[int, list[int]] | None = None

    async def round(self, ctx: Sequence[int], k: int, remaining: int) -> list[int]:
        """One speculation round (see _round), timed and traced."""
        with tracing.round_span(self, k):
            return await self._round(ctx, k, remaining)

    async def _round(self, ctx: Sequence[int], k: int, remaining: int) -> list[int]:
        """One speculation round after ctx; returns the accepted draft tokens + next token.

        remaining: tokens the request may still generate (>= k + 1); with SSD the drafter
        speculates only when some outcome leaves room for another round with a draft.
        """
        draft_tokens: Sequence[int] = ()
        draft_probs: Sequence[common_pb2.DraftDistribution] = ()
        ready, self._ready = self._ready, None
        if k > 0 and ready is not None and ready[0] == len(ctx):
            draft_tokens = ready[1][:k]
        elif k > 0:
            waited = time.perf_counter()
            draft = await self._call("Draft", self.drafter, ctx, self._draft_request(k))
            self.stats.drafter_wait_ms += (time.perf_counter() - waited) * 1e3
            self.drafter.cached = draft.cached_length
            draft_tokens, draft_probs = draft.draft_tokens, draft.draft_probs
        speculation = None
        if self.ssd and k > 0 and remaining >= 3:
            # Outcome "nothing accepted" leaves remaining - 1 tokens: a round of up to
            # remaining - 2 drafts; other outcomes truncate the prepared draft.
            speculation = asyncio.ensure_future(
                self._speculate(ctx, draft_tokens, min(k, remaining - 2))
            )
        verify_sent = time.perf_counter()
        try:
            verdict = await self._call(
                "Verify",
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
        except BaseException:
            if speculation is not None:
                speculation.cancel()
                if speculation.done() and not speculation.cancelled():
                    speculation.exception()  # retrieved: the verifier's error is the one raised
            raise
        verified = time.perf_counter()
        accepted = verdict.accepted_count
        self.verifier.cached = verdict.cached_length
        self.stats.record(k, accepted)
        if speculation is not None:
            branches, spec_sent, spec_done = await speculation
            self.stats.drafter_wait_ms += max(0.0, spec_done - verified) * 1e3
            self.stats.ssd_hidden_ms += (
                max(0.0, min(spec_done, verified) - max(spec_sent, verify_sent)) * 1e3
            )
            branch = branches.get((accepted, verdict.next_token))
            if branch is None:
                self.stats.ssd_misses += 1
            else:
                self.stats.ssd_hits += 1
                if self.greedy:  # the next draft is on hand; sampling fetches it from
                    # the drafter, with its distributions (a Draft without a forward)
                    self._ready = (len(ctx) + accepted + 1, list(branch))
        # The drafter cached the draft (all of it with SSD, d_1..d_{k-1} without); what
        # follows the accepted tokens is stale.
        self.drafter.cached = min(self.drafter.cached, len(ctx) + accepted)
        return [*draft_tokens[:accepted], verdict.next_token]

    def _draft_request(self, k: int):
        return lambda prefix, new: drafter_pb2.DraftRequest(
            session_id=self.session,
            prefix=prefix,
            new_tokens=new,
            num_draft_tokens=k,
            sampling=self.sampling,
        )

    async def _speculate(
        self, ctx: Sequence[int], draft: Sequence[int], k_next: int
    ) -> tuple[dict[tuple[int, int], Sequence[int]], float, float]:
        """Speculate(t); returns the prepared drafts by outcome, and when it was sent and
        answered (perf_counter seconds)."""
        sent = time.perf_counter()
        request_bytes = 0

        def build(prefix, new):
            nonlocal request_bytes
            request = drafter_pb2.SpeculateRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                draft_length=len(draft),
                num_draft_tokens=k_next,
                sampling=self.sampling,
                fan_out=self.ssd_fan_out,
                # The request's own rate once it has one; until then the drafter's prior.
                acceptance_rate=self.stats.acceptance_rate if self.stats.draft_tokens else None,
            )
            request_bytes += request.ByteSize()
            return request

        try:
            response = await self._call("Speculate", self.drafter, ctx, build, tail=draft)
        except UpstreamError as e:
            if not e.busy:
                raise
            return {}, sent, time.perf_counter()  # drafters full: an SSD miss, not a failure
        done = time.perf_counter()
        self.drafter.cached = response.cached_length
        self.stats.ssd_branches += len(response.branches)
        self.stats.ssd_bytes += request_bytes + response.ByteSize()
        branches = {(b.accepted_count, b.next_token): b.draft_tokens for b in response.branches}
        return branches, sent, done

    async def _call(
        self,
        method_name: str,
        placement: Placement,
        ctx: Sequence[int],
        build: Callable[[common_pb2.CachedPrefix, Sequence[int]], object],
        tail: Sequence[int] = (),
    ):
        """Send build(prefix, new_tokens) to the placement's replica, recovering from cache
        misses (resend everything) and unavailable replicas (another replica, everything).

        The prefix is at most ctx minus its last token (every call carries at least one
        new token); new_tokens is the rest of ctx followed by `tail`.
        """
        role = "verifier" if method_name == "Verify" else "drafter"
        pool = self.fleet.pool(role)
        failed: list[Replica] = []
        busy: list[Replica] = []  # answered "replica busy" (backpressure): up, but full
        retries = 0
        for _ in range(3 * len(pool.replicas) + 2 + len(RETRY_BACKOFF)):
            if placement.replica is None or not placement.replica.up:
                try:
                    chosen = pool.pick(preferred=placement.address, exclude=[*failed, *busy])
                except NoReplica as e:
                    raise Unavailable(str(e)) from None
                if chosen is not placement.replica:
                    placement.replica, placement.cached = chosen, 0
            replica = placement.replica
            n = min(placement.cached, len(ctx) - 1)
            prefix = common_pb2.CachedPrefix(length=n, hash=prefix_hash(ctx[:n]))
            request = build(prefix, [*ctx[n:], *tail])
            replica.in_flight += 1
            try:
                return await tracing.call(replica, method_name, request, self.rpc_timeout)
            except grpc.aio.AioRpcError as err:
                if is_cache_miss(err):
                    self.stats.cache_misses += 1
                    tracing.note_cache_miss(role, replica.address)
                    placement.cached = 0
                    continue
                if is_busy(err):
                    # Full queue: another replica of the pool (cache lost there), never
                    # marked down; when every one is full the client gets RESOURCE_EXHAUSTED.
                    busy.append(replica)
                    metrics.BUSY_REDIRECTS.labels(role=role).inc()
                    if not [r for r in pool.up() if r not in failed and r not in busy]:
                        raise UpstreamError(replica, err) from None
                    placement.replica, placement.cached = None, 0
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
                    tracing.note_failover(role, replica.address, err.details() or "unavailable")
                    placement.replica, placement.cached = None, 0
                    continue
                raise UpstreamError(replica, err) from None
            finally:
                replica.in_flight -= 1
                replica.served += 1
        raise Unavailable(f"no {role} replica could serve the request")
