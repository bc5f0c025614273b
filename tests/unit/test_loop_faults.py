"""The gateway's speculation loop when the drafter misbehaves (issue 11, items 3 and 4).

The replicas here are stand-ins: objects with the stub's async methods that answer what a
drafter / verifier would, so each fault can be made exactly (a Speculate that never
answers, one that fails, no drafter at all). The real processes are exercised in
tests/integration/test_faults.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.common.params import SamplingParams
from specdec.gateway.fleet.caller import Placement, ReplicaCaller
from specdec.gateway.fleet.replicas import Fleet
from specdec.gateway.fleet.transport import GrpcTransport
from specdec.gateway.job import ResolvedSpeculation
from specdec.gateway.round.calls import RoundCalls
from specdec.gateway.round.loop import Speculator
from specdec.gateway.round.policy import FixedPolicy, GoodputGuard, Policy
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2


class RpcFailure(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def speculator(
    fleet: Fleet,
    session: str,
    policy: Policy | None = None,
    speculation: ResolvedSpeculation | None = None,
    guard: GoodputGuard | None = None,
) -> Speculator:
    """A greedy request's loop over the fleet: by default an SSD request at a fixed k of 2
    (the drafter's fan-out)."""
    sampling = SamplingParams()
    calls = RoundCalls(
        ReplicaCaller(fleet, rpc_timeout=5.0),
        session,
        sampling.to_proto(),
        None,
        Placement(),
        Placement(),
    )
    return Speculator(
        calls,
        policy or FixedPolicy(),
        greedy=sampling.greedy,
        processors=sampling.processors,
        speculation=speculation or ResolvedSpeculation(k=2, ssd=True),
        max_context=512,
        guard=guard,
    )


class FakeDrafter:
    """Draft answers d = [4, 5]; Speculate waits for `release` then answers or fails."""

    def __init__(self, speculate_error: grpc.StatusCode | None = None):
        self.release = asyncio.Event()
        self.speculate_error = speculate_error
        self.speculate_calls = 0
        self.speculate_cancelled = 0
        self.prepared = False

    async def Draft(self, request, timeout=None, metadata=None):
        k = request.num_draft_tokens
        return drafter_pb2.DraftResponse(
            draft_tokens=[4, 5][:k],
            cached_length=request.prefix.length + len(request.new_tokens),
            prepared=self.prepared,
        )

    async def Speculate(self, request, timeout=None, metadata=None):
        self.speculate_calls += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.speculate_cancelled += 1
            raise
        if self.speculate_error is not None:
            raise RpcFailure(self.speculate_error, "sequence of 513 tokens exceeds 512")
        # the drafter's cache after feeding what it was sent (the context and the draft)
        return drafter_pb2.SpeculateResponse(
            cached_length=request.prefix.length + len(request.new_tokens)
        )


class FakeVerifier:
    """Accepts the first `accept` draft tokens (all when None), then token 6."""

    def __init__(self, accept: int | None = None):
        self.drafts: list[list[int]] = []
        self.accept = accept

    async def Verify(self, request, timeout=None, metadata=None):
        for _ in range(10):  # a real call yields to the loop: the Speculate beside it starts
            await asyncio.sleep(0)
        self.drafts.append(list(request.draft_tokens))
        n = request.prefix.length + len(request.new_tokens)
        k = len(request.draft_tokens)
        a = k if self.accept is None else min(k, self.accept)
        return verifier_pb2.VerifyResponse(accepted_count=a, next_token=6, cached_length=n + a)


async def make(drafter: FakeDrafter, verifier: FakeVerifier, drafter_up: bool = True, **loop):
    """The fleet of the two stand-ins and a request's loop over it (`loop`: `speculator`'s
    policy, speculation and guard)."""
    fleet = Fleet(["127.0.0.1:1"], ["127.0.0.1:2"])
    (d,) = fleet.drafters.replicas
    (v,) = fleet.verifiers.replicas
    d.transport, v.transport = GrpcTransport(drafter), GrpcTransport(verifier)
    d.info = v.info = common_pb2.ModelInfo(max_context=512, vocab_size=16)
    d.up, v.up = drafter_up, True
    spec = speculator(fleet, "s/x", **loop)
    return fleet, spec


@pytest.mark.parametrize("prepared", [False, True])
async def test_a_late_speculate_is_not_awaited(prepared):
    drafter, verifier = FakeDrafter(), FakeVerifier()
    fleet, spec = await make(drafter, verifier)
    try:
        task = asyncio.ensure_future(spec.round([1, 2, 3], 2, 10))
        for _ in range(200):  # event-loop steps, not time: the round needs a handful
            if task.done():
                break
            await asyncio.sleep(0)
        assert task.done(), "the round waited for a Speculate after its verdict"
        assert task.result().tokens == (4, 5, 6)
        assert drafter.speculate_calls == 1
        assert spec.stats.ssd_misses == spec.stats.ssd_hits == 0  # not known yet
        for _ in range(20):
            await asyncio.sleep(0)
        assert drafter.speculate_cancelled == 1  # cancelled, not left to answer later
        drafter.release.set()
        # The next Draft tells: answered from a prepared branch is a hit, else a miss.
        drafter.prepared = prepared
        await spec.round([1, 2, 3, 4, 5, 6], 2, 7)
        # (plus this round's own Speculate, answered in time with no branches: a miss)
        assert (spec.stats.ssd_hits, spec.stats.ssd_misses) == (int(prepared), 2 - prepared)
    finally:
        await fleet.close()


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # a full KV cache, or every drafter busy
    ],
)
async def test_a_failing_speculate_is_a_miss(code):
    """A Speculate that fails is an SSD miss at its verdict, never the request's error."""
    drafter, verifier = FakeDrafter(speculate_error=code), FakeVerifier()
    drafter.release.set()  # answers at once, with the error
    fleet, spec = await make(drafter, verifier)

    try:
        assert (await spec.round([1, 2, 3], 2, 10)).tokens == (4, 5, 6)
        assert spec.stats.ssd_misses == 1
    finally:
        await fleet.close()


async def test_no_drafter_runs_the_round_at_k0():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    fleet, spec = await make(drafter, verifier, drafter_up=False)
    try:
        assert (await spec.round([1, 2, 3], 2, 10)).tokens == (6,)
        assert verifier.drafts == [[]]  # a plain target step
        assert spec.stats.draft_tokens == 0 and spec.stats.rounds == 1
        fleet.drafters.replicas[0].up = True  # the probe brought it back
        assert (await spec.round([1, 2, 3, 6], 2, 9)).tokens == (4, 5, 6)
        assert verifier.drafts[-1] == [4, 5]
    finally:
        await fleet.close()


async def test_speculate_is_skipped_where_its_branches_cannot_fit_the_context():
    drafter, verifier = FakeDrafter(), FakeVerifier()
    drafter.release.set()
    fleet, spec = await make(drafter, verifier)
    try:
        ctx = (list(range(1, 8)) * 73)[:508]
        await spec.round(ctx, 2, 4)
        assert drafter.speculate_calls == 1  # 508 + 2 + 1 + 1 = 512 fits with branch_k = 1
        await spec.round([*ctx, 1], 2, 3)
        assert drafter.speculate_calls == 1  # 509 + 2 + 1 + 1 > 512: not sent
    finally:
        await fleet.close()


async def test_an_answered_speculate_leaves_only_the_accepted_prefix_cached():
    """A Speculate answered in time leaves the drafter holding the context and the whole
    draft; after a rejection only the context and the accepted tokens are the sequence,
    so that is what the next call may name (a longer prefix would be a cache miss and a
    full resend: a hybrid lookup round's Speculate names the prefix without a Draft
    before it)."""
    drafter, verifier = FakeDrafter(), FakeVerifier(accept=1)
    drafter.release.set()  # answers at once: in time
    fleet, spec = await make(drafter, verifier)
    try:
        outcome = await spec.round([1, 2, 3], 2, 10)
        assert outcome.tokens == (4, 6) and outcome.ssd == "miss"
        assert spec.drafter.cached == 3 + 1  # [1, 2, 3, 4]; the drafter holds [.., 4, 5]
    finally:
        await fleet.close()
