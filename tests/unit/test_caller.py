"""The replica caller (specdec.gateway.fleet.caller): prefixes, cache misses, busy replicas,
failover. The replicas are stand-ins: transports that answer from a script (a response,
or the CallFailed a replica's status would give); no server runs."""

from __future__ import annotations

import grpc
import pytest

from specdec.common.prefix import prefix_hash
from specdec.gateway.fleet.caller import Placement, ReplicaCaller, Unavailable, UpstreamError
from specdec.gateway.fleet.replicas import Fleet
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.v1 import verifier_pb2

BUSY = CallFailed(
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "replica busy: 3 requests queued for the model (at most 2 wait, --max-queue)",
    "REASON_BUSY",
)
FULL = CallFailed(
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "session needs 900 cached tokens, this replica holds at most 512 (--max-cached-tokens)",
    "REASON_CAPACITY",
)
MISS = CallFailed(
    grpc.StatusCode.FAILED_PRECONDITION,
    "cache miss: session 's/x' is not cached here",
    "REASON_CACHE_MISS",
)
DOWN = CallFailed(grpc.StatusCode.UNAVAILABLE, "connection refused")
OK = verifier_pb2.VerifyResponse(next_token=7, cached_length=4)


class ScriptedReplica:
    """A transport that answers each call with the next entry of its script (the last one
    again once the script is used up) and keeps the requests it got."""

    def __init__(self, *script):
        self.script = list(script)
        self.requests: list = []

    async def call(self, method, request, timeout, traceparent=None):
        self.requests.append(request)
        answer = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close(self) -> None:
        pass


def fleet_of(verifiers: list[ScriptedReplica]) -> Fleet:
    fleet = Fleet(["d0:1"], [f"v{i}:1" for i in range(len(verifiers))])
    for replica, transport in zip(fleet.verifiers.replicas, verifiers, strict=True):
        replica.transport, replica.up = transport, True
    return fleet


def verify(prefix, new):
    return verifier_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=new)


async def test_a_call_names_the_cached_prefix_and_sends_only_what_follows():
    replica = ScriptedReplica(OK)
    fleet = fleet_of([replica])
    placement = Placement(fleet.verifiers.replicas[0], cached=3)
    answer = await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, placement, [1, 2, 3, 4], verify)
    assert answer.response is OK and answer.replica is placement.replica and answer.resends == 0
    (request,) = replica.requests
    assert (request.prefix.length, request.prefix.hash) == (3, prefix_hash([1, 2, 3]))
    assert list(request.new_tokens) == [4]
    await fleet.close()


async def test_a_tail_follows_the_context_and_the_prefix_may_reach_into_it():
    replica = ScriptedReplica(OK)
    fleet = fleet_of([replica])
    placement = Placement(fleet.verifiers.replicas[0], cached=5)  # ctx + d_1
    caller = ReplicaCaller(fleet, 5.0)
    await caller.call(Method.VERIFY, placement, [1, 2, 3, 4], verify, tail=[8, 9])
    (request,) = replica.requests
    assert request.prefix.length == 5 and request.prefix.hash == prefix_hash([1, 2, 3, 4, 8])
    assert list(request.new_tokens) == [9]


async def test_a_cache_miss_resends_everything_to_the_same_replica():
    replica = ScriptedReplica(MISS, OK)
    fleet = fleet_of([replica])
    placement = Placement(fleet.verifiers.replicas[0], cached=3)
    answer = await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, placement, [1, 2, 3, 4], verify)
    assert answer.resends == 1 and answer.replica is fleet.verifiers.replicas[0]
    assert [r.prefix.length for r in replica.requests] == [3, 0]
    assert list(replica.requests[1].new_tokens) == [1, 2, 3, 4]
    await fleet.close()


async def test_a_busy_replica_passes_the_call_to_another_and_stays_up():
    busy, roomy = ScriptedReplica(BUSY), ScriptedReplica(OK)
    fleet = fleet_of([busy, roomy])
    placement = Placement(fleet.verifiers.replicas[0], cached=2)  # the cache is on `busy`
    answer = await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, placement, [1, 2, 3], verify)
    assert answer.response is OK and (len(busy.requests), len(roomy.requests)) == (1, 1)
    assert placement.replica is fleet.verifiers.replicas[1] and answer.replica is placement.replica
    assert roomy.requests[0].prefix.length == 0  # nothing is cached there
    assert all(r.up for r in fleet.verifiers.replicas)  # not marked down
    await fleet.close()


async def test_every_replica_busy_is_resource_exhausted():
    a, b = ScriptedReplica(BUSY), ScriptedReplica(BUSY)
    fleet = fleet_of([a, b])
    with pytest.raises(UpstreamError) as err:
        await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, Placement(), [1, 2, 3], verify)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.busy
    assert "replica busy" in str(err.value)
    assert (len(a.requests), len(b.requests)) == (1, 1)  # each tried once, then the answer
    assert all(r.up for r in fleet.verifiers.replicas)
    await fleet.close()


async def test_a_full_kv_cache_is_not_retried():
    a, b = ScriptedReplica(FULL), ScriptedReplica(FULL)
    fleet = fleet_of([a, b])
    placement = Placement(fleet.verifiers.replicas[0])
    with pytest.raises(UpstreamError) as err:
        await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, placement, [1, 2, 3], verify)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not err.value.busy
    assert (len(a.requests), len(b.requests)) == (1, 0)
    await fleet.close()


async def test_an_unavailable_replica_is_taken_out_and_the_call_fails_over():
    dead, alive = ScriptedReplica(DOWN), ScriptedReplica(OK)
    fleet = fleet_of([dead, alive])
    placement = Placement(fleet.verifiers.replicas[0], cached=2)
    answer = await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, placement, [1, 2, 3], verify)
    assert answer.replica is fleet.verifiers.replicas[1] and answer.resends == 1
    assert not fleet.verifiers.replicas[0].up and fleet.verifiers.replicas[1].up
    assert alive.requests[0].prefix.length == 0
    await fleet.close()


async def test_no_replica_left_is_unavailable():
    fleet = fleet_of([ScriptedReplica(OK)])
    fleet.verifiers.replicas[0].up = False
    with pytest.raises(Unavailable, match="no verifier replica is available"):
        await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, Placement(), [1, 2, 3], verify)
    await fleet.close()


async def test_other_errors_are_the_callers_with_their_code():
    bad = CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "new_tokens holds token id 999")
    fleet = fleet_of([ScriptedReplica(bad)])
    with pytest.raises(UpstreamError) as err:
        await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, Placement(), [1, 2, 3], verify)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "999" in str(err.value)
    await fleet.close()


@pytest.mark.parametrize("failure", [MISS, BUSY])
async def test_a_miss_or_busy_is_told_by_its_reason_not_its_wording(failure):
    """The same code and message without the reason is an error like any other: the
    caller resends or redirects only on the reason a replica sent."""
    untyped = CallFailed(failure.code, failure.details)
    replica = ScriptedReplica(untyped, OK)
    fleet = fleet_of([replica, ScriptedReplica(OK)])
    with pytest.raises(UpstreamError) as err:
        await ReplicaCaller(fleet, 5.0).call(Method.VERIFY, Placement(), [1, 2, 3], verify)
    assert err.value.code == failure.code and len(replica.requests) == 1
    await fleet.close()
