"""SSD's side of a round (DESIGN §4): the `Speculate` sent beside the `Verify`, what it
gave at the verdict, and the drafts it prepared.

Speculate(t) leaves with Verify(t): the drafter prepares next-round drafts for the
likeliest outcomes while the verifier works. If the verified outcome (accepted count,
next token) is one of them, that is a hit: under greedy decoding the gateway already holds
the next draft and Verify(t+1) leaves at once; under sampling the Draft(t+1) call is
answered from the prepared branch with its distributions, without a forward. A miss is a
normal Draft. A Speculate still running at the verdict is late: it is cancelled, not
awaited; if the drafter had started it, it still stores its branches and the next Draft
(queued behind it on the drafter) is answered from them when its outcome was prepared,
which that round's outcome reports. The verifier applies the same rule to whatever draft
it gets, so SSD changes speed only, never tokens.

A tree round's Speculate prepares for the outcomes of its first branch (the draft a chain
would be): a path that leaves it is a miss, but for a greedy path through one drafter leaf
(and its continuation) whose prepared "recovered" branch drafted the rest
(`through_leaf`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.gateway.fleet.replicas import Replica
from specdec.gateway.fleet.transport import Method
from specdec.gateway.names import Ssd
from specdec.gateway.observe import metrics
from specdec.gateway.outcome import RequestStats
from specdec.gateway.round.calls import RoundCalls, Verdict
from specdec.gateway.round.policy import Policy
from specdec.gateway.round.tree import DraftTree
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)

# A Speculate's answer: its response, the replica that gave it, and when (perf_counter).
Answered = tuple[drafter_pb2.SpeculateResponse, Replica, float]


@dataclass(slots=True)
class SsdCall:
    """The Speculate sent beside a round's Verify (task None: SSD off or paused)."""

    state: Ssd  # OFF, PAUSED or SENT
    task: asyncio.Task[Answered] | None = None
    fan_out: int | None = None
    branch_k: int = 0
    sent: float = 0.0
    request_bytes: int = 0

    def cancel(self) -> None:
        """The Verify beside it failed: the Speculate goes too (the verifier's error is the
        one raised)."""
        task = self.task
        if task is not None:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: not logged as never retrieved


@dataclass(frozen=True, slots=True)
class SsdVerdict:
    """What a round's Speculate gave once its Verify answered."""

    state: Ssd  # OFF, PAUSED, HIT, MISS or LATE
    branches: int = 0
    seconds: float | None = None  # its round trip, when it answered in time
    bytes: int = 0
    hidden: float = 0.0  # seconds of it that overlapped the Verify


class SsdBranches:
    """One request's SSD: each round's Speculate, its verdict, and what it prepared for
    the rounds after (a greedy hit's draft, a late Speculate the next Draft decides)."""

    def __init__(
        self,
        calls: RoundCalls,
        policy: Policy,
        stats: RequestStats,
        *,
        enabled: bool,
        greedy: bool,
        max_context: int,
    ):
        self.calls = calls
        self.policy = policy
        self.stats = stats  # the request's acceptance rate, sent with each Speculate
        self.enabled = enabled
        self.greedy = greedy
        self.max_context = max_context
        self._ready: tuple[int, list[int]] | None = None  # greedy SSD hit: (ctx length, draft)
        self._late = False  # the last Speculate was still running at its verdict

    def take_prepared(self, context: int) -> list[int] | None:
        """The draft a greedy hit prepared for a context of exactly `context` tokens, once;
        None (and none kept) otherwise."""
        ready, self._ready = self._ready, None
        return ready[1] if ready is not None and ready[0] == context else None

    def drop_prepared(self) -> None:
        """This round drafts otherwise (a lookup): a draft prepared for its context goes
        unused."""
        self._ready = None

    def late_outcome(self, prepared: bool) -> Ssd | None:
        """The last Speculate, if it answered after its verdict, decided by this round's
        draft: a hit when the drafter answered it from a branch that Speculate stored
        (`prepared`), else a miss; None when there was no late Speculate."""
        if not self._late:
            return None
        self._late = False
        return Ssd.HIT if prepared else Ssd.MISS

    def send(
        self, ctx: Sequence[int], draft: Sequence[int], remaining: int, max_branch_k: int
    ) -> SsdCall:
        """The Speculate for the draft under verification (all of it: the model's tokens,
        their lookup extension, or a lookup draft), sent now; it changes no state until
        `settle` reads it. Its branches add their next token and up to max_branch_k
        drafts after ctx + draft: they must fit the context, and the outcome "nothing
        accepted" leaves remaining - 1 tokens, room for a round of remaining - 2 drafts."""
        k = len(draft)
        branch_k = min(max_branch_k, remaining - 2, self.max_context - len(ctx) - k - 1)
        if not self.enabled or k == 0 or branch_k < 1:
            return SsdCall(Ssd.OFF)
        fan_out = self.policy.choose_fan_out(k, branch_k)
        if fan_out is None:  # the policy paused SSD: its Speculates kept arriving late
            return SsdCall(Ssd.PAUSED)
        speculation = SsdCall(Ssd.SENT, fan_out=fan_out, branch_k=branch_k)
        speculation.sent = time.perf_counter()
        speculation.task = asyncio.ensure_future(self._speculate(ctx, draft, speculation))
        return speculation

    async def _speculate(
        self, ctx: Sequence[int], draft: Sequence[int], speculation: SsdCall
    ) -> Answered:
        """Speculate for `speculation`'s branches; its response, the replica that answered
        and when (perf_counter seconds)."""
        calls = self.calls

        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> drafter_pb2.SpeculateRequest:
            request = drafter_pb2.SpeculateRequest(
                session_id=calls.session,
                prefix=prefix,
                new_tokens=new,
                draft_length=len(draft),
                num_draft_tokens=speculation.branch_k,
                sampling=calls.sampling,
                output=calls.output,
                fan_out=speculation.fan_out,
                # The request's own rate once it has one; until then the drafter's prior.
                acceptance_rate=self.stats.acceptance_rate if self.stats.draft_tokens else None,
            )
            speculation.request_bytes += request.ByteSize()
            return request

        # A copy of the placement: a Speculate that fails over or misses must not move
        # the Draft / Verify placement under a round in flight.
        placement = calls.drafter.copy()
        answer = await calls.caller.call(Method.SPECULATE, placement, ctx, build, tail=draft)
        return answer.response, answer.replica, time.perf_counter()

    def settle(
        self, speculation: SsdCall, verdict: Verdict, context: int, tree: DraftTree
    ) -> SsdVerdict:
        """The round's Speculate at its verdict on `tree` after `context` tokens. Never
        waits and never raises: one still running is cancelled (late), one that failed is
        a miss (logged, counted). A hit under greedy decoding keeps the prepared draft for
        the next round. A tree's Speculate covered its first branch: a path that left it
        is a miss."""
        task = speculation.task
        if task is None:
            return SsdVerdict(speculation.state)
        if not task.done():
            # Cancelled, not awaited. The cancel reaches the drafter before the next Draft
            # (one connection, frames in order): a Speculate its model thread has started
            # finishes and stores its branches, and that Draft queues behind it; one not
            # started yet never runs, so it cannot overwrite the cache after that Draft.
            metrics.SSD_LATE.inc()
            task.cancel()
            self._late = True
            return SsdVerdict(Ssd.LATE, hidden=verdict.seconds)
        if task.cancelled() or task.exception() is not None:
            why = "cancelled" if task.cancelled() else str(task.exception())
            metrics.SSD_FAILED.inc()
            log.info("speculate failed; counted as a miss", extra={"why": why})
            return SsdVerdict(Ssd.MISS)
        response, replica, answered = task.result()
        verified = verdict.response
        accepted = tree.accepted_on_chain(verified.accepted_count, verified.accepted_path)
        drafter = self.calls.drafter
        if replica is drafter.replica:  # it holds ctx + the whole draft, of which only
            # ctx + the accepted tokens is the sequence: a call naming more would miss
            drafter.answered(response.cached_length)
            drafter.accepted(context + accepted)
        branch = self._prepared(response, verified, context, tree, accepted)
        return SsdVerdict(
            Ssd.HIT if branch is not None else Ssd.MISS,
            branches=len(response.branches),
            seconds=answered - speculation.sent,
            bytes=response.ByteSize(),
            hidden=max(0.0, min(answered, verdict.answered) - max(speculation.sent, verdict.sent)),
        )

    def _prepared(
        self,
        response: drafter_pb2.SpeculateResponse,
        verdict: verifier_pb2.VerifyResponse,
        context: int,
        tree: DraftTree,
        accepted: int,
    ) -> drafter_pb2.SpeculatedBranch | None:
        """The branch prepared for the verdict's outcome (`accepted` of it on the first
        branch), or None; under greedy decoding its draft is kept for the next round
        (sampling fetches it from the drafter, with its distributions: a Draft without a
        forward)."""
        outcome = (verdict.accepted_count, verdict.next_token)
        left = accepted < verdict.accepted_count  # the path left the first branch
        branch = None
        if not left:
            branch = next(
                (b for b in response.branches if (b.accepted_count, b.next_token) == outcome),
                None,
            )
        if branch is not None and self.greedy:
            self._ready = (context + accepted + 1, list(branch.draft_tokens))
        elif left and self.greedy:
            branch = through_leaf(response, verdict, tree, accepted)
            if branch is not None:  # its draft after the leaf began with the rest of the
                # path (a continued leaf's) and the next token
                path = len(verdict.accepted_path)
                self._ready = (context + path + 1, list(branch.draft_tokens[path - accepted :]))
        return branch


def through_leaf(
    response: drafter_pb2.SpeculateResponse,
    verdict: verifier_pb2.VerifyResponse,
    tree: DraftTree,
    on_chain: int,
) -> drafter_pb2.SpeculatedBranch | None:
    """Under greedy decoding, a tree path that left the first branch at one leaf x (after
    on_chain of its tokens), then took x's continuation c_1..c_j (j >= 0, a continued
    leaf's) and emitted y: the branch SSD prepared for "on_chain accepted, then x" whose
    draft starts with c_1..c_j y (its rest is the drafter's greedy draft after y) and
    whose rest is at least as long as after a terminal leaf (k - 1: a shorter one would
    cost the next round more tokens than the Draft it spares), or None."""
    path = verdict.accepted_path
    if len(path) <= on_chain:
        return None
    leaf = tree.tokens[path[on_chain]]
    rest = [*(tree.tokens[i] for i in path[on_chain + 1 :]), verdict.next_token]
    return next(
        (
            b
            for b in response.branches
            if (b.accepted_count, b.next_token) == (on_chain, leaf)
            and len(b.draft_tokens) - len(rest) >= max(1, tree.chain - 1)
            and list(b.draft_tokens[: len(rest)]) == rest
        ),
        None,
    )
