"""The goodput guard's plain epochs through the gateway's speculation loop: a plain round
verifies no draft, and the drafter is kept fed beside it (never awaited), so the first
Draft when speculation resumes feeds a few tokens, not all the plain rounds committed.

The replicas are the stand-ins of tests/unit/test_loop_faults.py (objects with the stubs'
async methods; the drafter here records what each Draft fed): what is checked is which
calls the loop makes and when, which the real processes cannot show call by call. The
real stack under the guard is measured by `specdec loadtest` (docs/benchmarks)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specdec.gateway.front.completion import Completion
from specdec.gateway.job import ResolvedSpeculation
from specdec.gateway.round.draft import FEED_LAG
from specdec.gateway.round.policy import AdaptivePolicy, GoodputGuard, GuardMode
from tests.unit.test_loop_faults import FakeDrafter, FakeVerifier, make

OTHER = -1  # another session of the gateway, in a round: the epoch's mode holds


class FeedDrafter(FakeDrafter):
    """Records each Draft's (cached prefix, tokens fed, tokens asked); with `hold`, a
    Draft answers only once `go` is set."""

    def __init__(self, hold: bool = False):
        super().__init__()
        self.fed: list[tuple[int, int, int]] = []
        self.go = asyncio.Event()
        if not hold:
            self.go.set()

    async def Draft(self, request, timeout=None, metadata=None):
        self.fed.append((request.prefix.length, len(request.new_tokens), request.num_draft_tokens))
        await self.go.wait()
        return await super().Draft(request, timeout, metadata)


async def guarded(drafter: FakeDrafter, verifier: FakeVerifier, guard: GoodputGuard):
    """A greedy adaptive request's loop (no SSD) over the stand-ins, under `guard`."""
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    return await make(
        drafter, verifier, policy=policy, speculation=ResolvedSpeculation(k=2), guard=guard
    )


def plain_guard() -> GoodputGuard:
    guard = GoodputGuard()
    guard.mode = GuardMode.PLAIN
    guard.begin(OTHER)
    return guard


async def settle() -> None:
    for _ in range(20):  # event-loop steps: a feed beside a Verify answers in a few
        await asyncio.sleep(0)


async def test_plain_rounds_keep_the_drafter_fed():
    drafter, verifier = FeedDrafter(), FakeVerifier()
    guard = plain_guard()
    fleet, spec = await guarded(drafter, verifier, guard)
    try:
        ctx = list(range(1, 41))  # a prompt of 40 tokens, arrived during the plain epoch
        for i in range(50):
            out = await spec.round(ctx, 2, 200 - i)
            assert out.k == 0 and out.tokens == (6,)  # a plain target step
            ctx.extend(out.tokens)
            await settle()
            # the drafter holds all but the last few tokens, fed beside the Verifies
            assert len(ctx) - spec.calls.drafter.cached <= FEED_LAG
        assert verifier.drafts == [[]] * 50
        assert drafter.fed[0] == (0, 40, 1)  # the prompt, beside the first round
        assert all(fed == FEED_LAG and asked == 1 for _, fed, asked in drafter.fed[1:])
        assert len(drafter.fed) == 1 + 51 // FEED_LAG

        guard.mode = GuardMode.SPEC  # speculation resumes
        out = await spec.round(ctx, 2, 150)
        cached, fed, asked = drafter.fed[-1]
        assert asked == 2 and fed < FEED_LAG and cached + fed == len(ctx)
        assert out.k == 2 and verifier.drafts[-1] == [4, 5]
    finally:
        await fleet.close()


async def test_a_plain_round_never_waits_for_the_drafter():
    """A drafter that does not answer holds up no plain round; the round sends it nothing
    more meanwhile, and the request's end waits for the feed in flight (nothing of the
    request reaches its replicas after it)."""
    drafter, verifier = FeedDrafter(hold=True), FakeVerifier()
    guard = plain_guard()
    fleet, spec = await guarded(drafter, verifier, guard)
    try:
        ctx = list(range(1, 41))
        for i in range(3 * FEED_LAG):
            out = await spec.round(ctx, 2, 200 - i)
            ctx.extend(out.tokens)
        assert drafter.fed == [(0, 40, 1)]  # the prompt's feed, still in flight
        idle = asyncio.ensure_future(spec.idle())
        await settle()
        assert not idle.done()
        drafter.go.set()
        await idle
        assert spec.calls.drafter.cached == 40
    finally:
        await fleet.close()


async def test_no_feed_near_the_end_of_a_request():
    drafter, verifier = FeedDrafter(), FakeVerifier()
    fleet, spec = await guarded(drafter, verifier, plain_guard())
    try:
        ctx = list(range(1, 41))
        for remaining in range(FEED_LAG, 0, -1):  # the last FEED_LAG tokens of the request
            ctx.extend((await spec.round(ctx, 2, remaining)).tokens)
        assert drafter.fed == []
    finally:
        await fleet.close()


class FailingVerifier(FakeVerifier):
    async def Verify(self, request, timeout=None, metadata=None):
        raise RuntimeError("the verifier's call failed")


async def test_a_failed_request_leaves_the_guard():
    """A request whose round fails runs no more rounds: the guard awaits none of it (it
    would otherwise hold the epoch's end for ten mean rounds)."""
    guard = GoodputGuard()
    fleet, spec = await guarded(FeedDrafter(), FailingVerifier(), guard)
    try:
        job = SimpleNamespace(
            output=SimpleNamespace(max_new_tokens=8), speculation=SimpleNamespace(k=2)
        )
        output = SimpleNamespace(finish_reason=None, tokens=[])
        completion = Completion(0, spec, output)  # type: ignore[arg-type]
        with pytest.raises(Exception, match="failed"):
            async for _ in completion.rounds(job, [1, 2, 3], 0.0):  # type: ignore[arg-type]
                pass
        assert id(spec) not in guard._running
    finally:
        await fleet.close()
