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
from specdec.common.prefix import PrefixChain
from specdec.gateway import metrics, tracing
from specdec.gateway.policy import ADAPTIVE, FixedPolicy, Policy
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


def _succeeded(future: asyncio.Future) -> bool:
    """Whether a finished call succeeded (retrieving its exception, so nothing logs
    'never retrieved')."""
    return not future.cancelled() and future.exception() is None


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
    ssd_speculates: int = 0  # Speculates sent
    ssd_late: int = 0  # of them, still running at their verdict (cancelled)
    ssd_hidden_ms: float = 0.0  # Speculate time that overlapped a verification
    ssd_bytes: int = 0  # Speculate requests + responses
    drafter_wait_ms: float = 0.0  # gateway blocked on the drafter
    rounds_by_k: list[int] = field(default_factory=list)  # [k]: rounds that drafted k
    policy_k0_rounds: int = 0  # rounds the adaptive policy chose k = 0
    fan_out_sum: int = 0  # fan-outs asked for, over the Speculates sent
    ssd_paused_rounds: int = 0  # rounds with a draft whose Speculate the policy held back
    queue_sum: int = 0  # verifier queue depths reported, over the rounds

    def record(self, k: int, accepted: int) -> None:
        self.rounds += 1
        if len(self.rounds_by_k) <= k:
            self.rounds_by_k.extend([0] * (k + 1 - len(self.rounds_by_k)))
        self.rounds_by_k[k] += 1
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

    @property
    def mean_k(self) -> float:
        return self.draft_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_fan_out(self) -> float:
        return self.fan_out_sum / self.ssd_speculates if self.ssd_speculates else 0.0

    @property
    def mean_verifier_queue(self) -> float:
        return self.queue_sum / self.rounds if self.rounds else 0.0


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
        deadline: float | None = None,
        policy: Policy | None = None,
    ):
        self.fleet = fleet
        self.session = replica_session
        self.sampling = sampling
        self.drafter = drafter
        self.verifier = verifier
        self.rpc_timeout = rpc_timeout
        # The client's deadline (time.monotonic()), which bounds every call when it is set:
        # a long prefill may take what the client allows, not a constant it cannot see.
        self.deadline = deadline
        self.stats = LoopStats()
        self.ssd = ssd
        self.ssd_fan_out = ssd_fan_out
        # Picks each round's k and each Speculate's fan-out (policy.py); fixed: as asked.
        self.policy: Policy = policy if policy is not None else FixedPolicy(ssd_fan_out)
        self.greedy = sampling_from_proto(sampling).greedy
        # SSD hit under greedy: (context length it follows, the prepared draft).
        self._ready: tuple[int, list[int]] | None = None
        self._without_drafter = False  # the last Draft found no drafter (k = 0 rounds)
        self._late = False  # the last round's Speculate was still running at its verdict
        self._spec_shape = (0, 0)  # (fan-out, k_next) of the Speculate in flight
        self.round_k = 0  # the draft length the last round used (the policy's choice)
        self.round_ssd: str = "off"  # what SSD did in the last round (see _round)
        self.round_late_outcome: str | None = None
        # Block hashes of the request's context, which only grows: O(new tokens) per call.
        self._chain = PrefixChain()

    async def round(self, ctx: Sequence[int], k_max: int, remaining: int) -> list[int]:
        """One speculation round (see _round) of at most k_max drafts, timed and traced;
        the policy picks its k (the request's k under the fixed policy)."""
        k = self.policy.choose_k(k_max)
        if k == 0 and k_max > 0 and self.policy.kind == ADAPTIVE:
            self.stats.policy_k0_rounds += 1
        with tracing.round_span(self, k):
            return await self._round(ctx, k, remaining)

    async def _round(self, ctx: Sequence[int], k: int, remaining: int) -> list[int]:
        """One speculation round after ctx; returns the accepted draft tokens + next token.

        remaining: tokens the request may still generate (>= k + 1); with SSD the drafter
        speculates only when some outcome leaves room for another round with a draft.
        """
        draft_tokens: Sequence[int] = ()
        draft_probs: Sequence[common_pb2.DraftDistribution] = ()
        # What SSD did this round (for its span): "off" (no Speculate), "hit", "miss", or
        # "late" (still running at the verdict: the next round's Draft decides it, and
        # that round reports the outcome in round_late_outcome).
        self.round_ssd, self.round_late_outcome = "off", None
        ready, self._ready = self._ready, None
        if k > 0 and ready is not None and ready[0] == len(ctx):
            draft_tokens = ready[1][:k]
            k = len(draft_tokens)
        elif k > 0:
            waited = time.perf_counter()
            draft = await self._draft(ctx, k)
            drafted = time.perf_counter() - waited
            self.stats.drafter_wait_ms += drafted * 1e3
            if self._late:  # the last round's Speculate answered after its verdict
                self._late = False
                prepared = draft is not None and draft.prepared
                self.stats.ssd_hits += prepared
                self.stats.ssd_misses += not prepared
                # Hidden drafting only: this Draft waited for the late Speculate, so even
                # a prepared draft was on the critical path (a miss for the policy's h).
                self.policy.observe_ssd(False)
                self.round_late_outcome = "hit" if prepared else "miss"
            if draft is None:
                k = 0  # no drafter: this round is a plain target step (the same output)
            else:
                if not draft.prepared:  # a prepared draft ran no model: no drafting time
                    self.policy.observe_draft(k, drafted)
                self.drafter.cached = draft.cached_length
                draft_tokens, draft_probs = draft.draft_tokens, draft.draft_probs
        speculation = None
        fan_out: int | None = 0
        # Outcome "nothing accepted" leaves remaining - 1 tokens: a round of up to
        # remaining - 2 drafts; other outcomes truncate the prepared draft. A branch adds
        # its next token and k_next drafts after ctx + draft: it must fit the context.
        k_next = min(k, remaining - 2, self._max_context() - len(ctx) - k - 1)
        if self.ssd and k > 0 and k_next >= 1:
            fan_out = self.policy.choose_fan_out(k, k_next)
            if fan_out is None:  # the policy paused SSD: Speculate keeps arriving late
                self.stats.ssd_paused_rounds += 1
            else:
                speculation = asyncio.ensure_future(
                    self._speculate(ctx, draft_tokens, k_next, fan_out)
                )
                self._spec_shape = (fan_out, k_next)
                self.stats.ssd_speculates += 1
                self.stats.fan_out_sum += fan_out
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
        self.round_k = k  # what this round drafted (its span's specdec.round.k)
        self.stats.queue_sum += verdict.queue_depth
        self.policy.observe_verify(k, accepted, verified - verify_sent, verdict.queue_depth)
        branches = None
        if speculation is not None:
            branches = self._settle(speculation, verify_sent, verified)
            self._late = branches is None  # decided by the next Draft's `prepared`
            if self._late:
                self.round_ssd = "late"
                self.policy.observe_speculate(fan_out or 0, k_next, None)
                await asyncio.sleep(0)  # the cancel leaves before the next drafter call
        if branches is not None:
            branch = branches.get((accepted, verdict.next_token))
            self.policy.observe_ssd(branch is not None)
            if branch is None:
                self.stats.ssd_misses += 1
                self.round_ssd = "miss"
            else:
                self.stats.ssd_hits += 1
                self.round_ssd = "hit"
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

    def _timeout(self) -> float:
        """Seconds a replica call may take: what is left of the client's deadline, else
        --rpc-timeout (requests without a deadline)."""
        if self.deadline is None:
            return self.rpc_timeout
        return max(0.001, self.deadline - time.monotonic())

    def _max_context(self) -> int:
        infos = [r.info.max_context for r in self.fleet.drafters.replicas if r.info is not None]
        return min(infos, default=0)

    async def _draft(self, ctx: Sequence[int], k: int) -> drafter_pb2.DraftResponse | None:
        """Draft(k), or None when no drafter can draft: losing the drafter is not losing the
        service, the round runs at k = 0 (warned once per outage, counted per round).
        Speculation resumes by itself once the probe brings a drafter back."""
        try:
            draft = await self._call("Draft", self.drafter, ctx, self._draft_request(k))
        except (Unavailable, UpstreamError) as e:
            metrics.DRAFTER_FALLBACK.inc()
            self.drafter.replica, self.drafter.cached = None, 0
            if not self._without_drafter:
                log.warning("no drafter could draft; continuing at k = 0", extra={"why": str(e)})
            self._without_drafter = True
            return None
        if self._without_drafter:
            log.info("drafter back; speculation resumes", extra={"replica": self.drafter.address})
        self._without_drafter = False
        return draft

    def _settle(
        self, speculation: asyncio.Future, verify_sent: float, verified: float
    ) -> dict[tuple[int, int], Sequence[int]] | None:
        """The prepared drafts of a Speculate at the verdict, by outcome ({}: a miss).

        Never waits and never raises: a Speculate that failed is a miss (logged, counted).
        One still running is cancelled (None). If the drafter had started it, it still
        stores its branches, so the next Draft is answered from them without a forward
        when the outcome was prepared; that Draft's `prepared` decides whether the round
        counts as a hit or a miss.
        """
        if not speculation.done():
            # Cancelled, not awaited. The cancel reaches the drafter before the next Draft
            # (one connection, frames in order): a Speculate its model thread has started
            # finishes and stores its branches, and that Draft queues behind it; one not
            # started yet never runs, so it cannot overwrite the cache after that Draft.
            metrics.SSD_LATE.inc()
            self.stats.ssd_late += 1
            speculation.cancel()
            # The drafter worked on it through the whole verification (hidden time); its
            # branches are not known here (ssd_branches counts answered Speculates).
            self.stats.ssd_hidden_ms += (verified - verify_sent) * 1e3
            return None
        if not _succeeded(speculation):
            err = None if speculation.cancelled() else speculation.exception()
            metrics.SSD_FAILED.inc()
            log.info("speculate failed; counted as a miss", extra={"why": str(err)})
            return {}
        response, _, spec_sent, spec_done, replica = self._account(
            speculation, verify_sent, verified
        )
        self.policy.observe_speculate(*self._spec_shape, spec_done - spec_sent)
        if replica is self.drafter.replica:
            self.drafter.cached = response.cached_length
        return {(b.accepted_count, b.next_token): b.draft_tokens for b in response.branches}

    def _account(self, speculation: asyncio.Future, verify_sent: float, verified: float):
        """Add a finished Speculate to the statistics; its result."""
        result = speculation.result()
        response, _, spec_sent, spec_done, _ = result
        self.stats.ssd_branches += len(response.branches)
        self.stats.ssd_bytes += response.ByteSize()  # its requests counted when sent
        self.stats.ssd_hidden_ms += (
            max(0.0, min(spec_done, verified) - max(spec_sent, verify_sent)) * 1e3
        )
        return result

    async def _speculate(
        self, ctx: Sequence[int], draft: Sequence[int], k_next: int, fan_out: int
    ) -> tuple[drafter_pb2.SpeculateResponse, int, float, float, Replica | None]:
        """Speculate(t) for fan_out branches (0: the drafter's default); returns the response, the request's bytes, when it was sent and
        answered (perf_counter seconds) and the replica that answered. Changes no state:
        `_settle` applies it."""
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
                fan_out=fan_out,
                # The request's own rate once it has one; until then the drafter's prior.
                acceptance_rate=self.stats.acceptance_rate if self.stats.draft_tokens else None,
            )
            request_bytes += request.ByteSize()
            self.stats.ssd_bytes += request.ByteSize()
            return request

        # A copy of the placement: a Speculate that fails over or misses must not move
        # the Draft / Verify placement under a round in flight.
        placement = Placement(self.drafter.replica, self.drafter.cached)
        response = await self._call("Speculate", placement, ctx, build, tail=draft)
        return response, request_bytes, sent, time.perf_counter(), placement.replica

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

        The prefix is at most ctx + tail minus its last token (every call carries at least
        one new token); new_tokens is the rest of ctx + tail. Only Speculate has a tail (the
        draft): after a Draft the drafter caches ctx + d_1..d_{k-1}, so it then gets d_k
        alone instead of tokens it already holds.
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
            n = min(placement.cached, len(ctx) + len(tail) - 1)
            prefix = common_pb2.CachedPrefix(length=n, hash=self._chain.hash(ctx, n, tail))
            request = build(prefix, [*ctx[n:], *tail[max(0, n - len(ctx)) :]])
            replica.in_flight += 1
            try:
                return await tracing.call(replica, method_name, request, self._timeout())
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
                    if not others and retries < len(RETRY_BACKOFF) and role == "verifier":
                        # The only replica left: a blip (a restart, a full queue) must not
                        # fail every request at once. Its cache may survive; a miss says so.
                        # (Without a drafter a round runs at k = 0 instead of waiting.)
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
