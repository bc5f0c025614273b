"""How the gateway's speculation loop answers a replica's backpressure (Speculator._call).

The replicas are stand-ins: stubs whose methods raise the grpc.aio error a busy or a full
replica would answer, or return a canned response; no server runs."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from specdec.gateway.loop import Placement, Speculator, UpstreamError
from specdec.gateway.replicas import Fleet
from specdec.v1 import common_pb2, verifier_pb2

BUSY = "replica busy: 3 requests queued for the model (at most 2 wait, --max-queue)"
FULL = "session needs 900 cached tokens, this replica holds at most 512 (--max-cached-tokens)"


def _error(details: str) -> AioRpcError:
    return AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(), Metadata(), details)


class StubReplica:
    """Stands in for a replica's stub: answers Verify/Speculate from a script."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0

    async def _answer(self, request, timeout=None):
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    Verify = Speculate = _answer


async def _speculator(verifiers: list[StubReplica], drafters: list[StubReplica]):
    fleet = Fleet(
        [f"d{i}:1" for i in range(len(drafters))], [f"v{i}:1" for i in range(len(verifiers))]
    )
    for replica, stub in zip(fleet.verifiers.replicas, verifiers, strict=True):
        replica.stub, replica.up = stub, True
    for replica, stub in zip(fleet.drafters.replicas, drafters, strict=True):
        replica.stub, replica.up = stub, True
    spec = Speculator(
        fleet,
        "s",
        common_pb2.SamplingParams(),  # greedy
        Placement(),
        Placement(),
        rpc_timeout=5,
        ssd=True,
    )
    return fleet, spec


def _verify(prefix, new):
    return verifier_pb2.VerifyRequest(session_id="s", prefix=prefix, new_tokens=new)


async def test_busy_replica_passes_the_call_to_another_and_stays_up():
    ok = verifier_pb2.VerifyResponse(next_token=7, cached_length=3)
    busy, roomy = StubReplica(_error(BUSY)), StubReplica(ok)
    fleet, spec = await _speculator([busy, roomy], [StubReplica(ok)])
    spec.verifier.replica = fleet.verifiers.replicas[0]  # the session's cache is on `busy`
    spec.verifier.cached = 2
    answer = await spec._call("Verify", spec.verifier, [1, 2, 3], _verify)
    assert answer is ok and (busy.calls, roomy.calls) == (1, 1)
    assert spec.verifier.replica is fleet.verifiers.replicas[1]
    assert all(r.up for r in fleet.verifiers.replicas)  # not marked down
    await fleet.close()


async def test_every_replica_busy_is_resource_exhausted():
    a, b = StubReplica(_error(BUSY)), StubReplica(_error(BUSY))
    fleet, spec = await _speculator([a, b], [StubReplica(_error(BUSY))])
    with pytest.raises(UpstreamError) as err:
        await spec._call("Verify", spec.verifier, [1, 2, 3], _verify)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.busy
    assert "replica busy" in str(err.value)
    assert (a.calls, b.calls) == (1, 1)  # each tried once, then the answer
    assert all(r.up for r in fleet.verifiers.replicas)
    await fleet.close()


async def test_a_full_kv_cache_is_not_retried():
    a, b = StubReplica(_error(FULL)), StubReplica(_error(FULL))
    fleet, spec = await _speculator([a, b], [StubReplica(_error(FULL))])
    spec.verifier.replica = fleet.verifiers.replicas[0]
    with pytest.raises(UpstreamError) as err:
        await spec._call("Verify", spec.verifier, [1, 2, 3], _verify)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not err.value.busy
    assert (a.calls, b.calls) == (1, 0)
    await fleet.close()


async def test_busy_drafters_make_speculate_an_ssd_miss():
    """A Speculate refused by busy drafters is an SSD miss at the verdict, never the
    request's error; so is one that fails for any other reason (a full KV cache here)."""
    for error in (BUSY, FULL):
        drafter = StubReplica(_error(error))
        fleet, spec = await _speculator([StubReplica(_error(BUSY))], [drafter])
        future = asyncio.ensure_future(spec._speculate([1, 2, 3], [4, 5], 2, 0))
        await asyncio.wait([future])
        assert isinstance(future.exception(), UpstreamError) and drafter.calls == 1
        assert spec._settle(future, 0.0, 0.0) == {}  # the round counts it as a miss
        await fleet.close()
