"""Backpressure with real replicas and gateways on loopback: a replica with a small bounded
queue refuses the excess with RESOURCE_EXHAUSTED and keeps serving; a gateway moves the
excess to another replica; with every replica full the client gets RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.common.prefix import prefix_hash
from specdec.sdk import AsyncClient, Reason, ResourceExhausted
from specdec.tools.redisproc import free_port
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

FLOOD = 16  # concurrent requests


@pytest.fixture(scope="module")
def replicas(test_models):
    """A drafter, a verifier that lets nothing wait (--max-queue 0) and a roomy one."""
    procs = [
        replica("drafter", test_models.draft_noisy),
        replica("verifier", test_models.target, "--max-queue", "0"),
        replica("verifier", test_models.target, "--max-queue", "64"),
    ]
    try:
        for p in procs:
            p.wait_healthy()
        yield dict(zip(("drafter", "small", "roomy"), procs, strict=True))
    finally:
        for p in procs:
            p.stop()


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(PROMPTS[i % len(PROMPTS)] * 3).input_ids for i in range(FLOOD)]


def test_full_replica_refuses_the_excess_and_keeps_serving(replicas, tokenizer):
    small = replicas["small"]
    ids = tokenizer(" ".join(PROMPTS) * 2).input_ids[:300]

    def verify(session: str) -> verifier_pb2.VerifyRequest:
        return verifier_pb2.VerifyRequest(
            session_id=session,
            prefix=common_pb2.CachedPrefix(length=0, hash=prefix_hash([])),
            new_tokens=ids,
        )

    async def flood() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(small.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)

            async def one(i: int):
                try:
                    await stub.Verify(verify(f"flood-{i}"), timeout=60)
                    return grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()

            return await asyncio.gather(*(one(i) for i in range(2 * FLOOD)))

    answers = asyncio.run(flood())
    codes = [code for code, _ in answers]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, answers
    refused = [d for code, d in answers if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = codes.count(grpc.StatusCode.OK)
    assert refused and served, answers
    assert all(d.startswith("replica busy: ") and "--max-queue" in d for d in refused)

    with grpc.insecure_channel(small.address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        # Still serving, and a refused request left nothing behind: only the served
        # sessions hold a cache.
        assert stub.Verify(verify("after-flood"), timeout=60).cached_length == len(ids)
        info = stub.Info(common_pb2.InfoRequest(), timeout=10)
        assert info.cached_sessions == served + 1
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def _flood_gateway(address: str, prompts: list[list[int]]):
    async with AsyncClient(address, timeout=120) as client:

        async def one(ids):
            try:
                return await client.generate(token_ids=ids, max_new_tokens=8, k=0)
            except ResourceExhausted as e:
                return e

        return await asyncio.gather(*(one(ids) for ids in prompts))


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_gateway_moves_the_excess_to_another_replica(replicas, tokenizer, reference):
    port = free_port()
    g = gateway(
        [replicas["drafter"]],
        [replicas["small"], replicas["roomy"]],
        None,
        "--metrics-port",
        str(port),
    )
    try:
        g.wait_healthy()
        prompts = _prompts(tokenizer)
        results = asyncio.run(_flood_gateway(g.address, prompts))
        # Every request was served, and exactly: the busy replica's excess went elsewhere.
        for ids, result in zip(prompts, results, strict=True):
            assert not isinstance(result, Exception), result
            assert list(result.tokens) == reference(ids, 8)
        assert _metric(port, "specdec_gateway_replica_busy_redirects_total") > 0
        assert _metric(port, "specdec_gateway_replica_failovers_total") == 0  # none marked down
    finally:
        g.stop()


def test_every_replica_full_is_resource_exhausted(replicas, tokenizer, reference):
    g = gateway([replicas["drafter"]], [replicas["small"]])
    try:
        g.wait_healthy()
        prompts = _prompts(tokenizer)
        results = asyncio.run(_flood_gateway(g.address, prompts))
        refused = [r for r in results if isinstance(r, ResourceExhausted)]
        assert refused, "a replica that lets nothing wait refused nothing"
        for r in refused:
            assert r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "replica busy" in r.details
            assert r.reason is Reason.BUSY and r.busy  # the replica's reason, passed on
        for ids, result in zip(prompts, results, strict=True):
            if not isinstance(result, Exception):
                assert list(result.tokens) == reference(ids, 8)
        # The gateway and the replica keep serving once the flood is over.
        (after,) = asyncio.run(_flood_gateway(g.address, prompts[:1]))
        assert list(after.tokens) == reference(prompts[0], 8)
    finally:
        g.stop()
