"""Packed weights through the stack (`--pack-weights true` on both replicas, fp32 tiny
models): greedy output equals `generate()` on the plain target, token for token, at k = 0,
with speculation, with SSD, over a multi-turn session and for concurrent sessions batched
into one forward; Info names the packing."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from specdec.sdk import Client
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.exact import greedy_equals_generate, second_turn_equals_generate
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

N = 24


@pytest.fixture(scope="module")
def packed(test_models):
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy, "--pack-weights", "true")
        v = replica("verifier", test_models.target, "--pack-weights", "true")
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        plain = gateway([d], [v])
        ssd = gateway([d], [v], None, "--ssd")
        procs += [plain, ssd]
        plain.wait_healthy(), ssd.wait_healthy()
        yield {"drafter": d, "verifier": v, "plain": plain, "ssd": ssd}
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize(("which", "k"), [("plain", 0), ("plain", 3), ("ssd", 3)])
def test_greedy_equals_generate(packed, tokenizer, reference, which, k):
    greedy_equals_generate(packed, which, k, PROMPTS[:4], tokenizer, reference, N, 120)


def test_two_turns_and_concurrent_sessions(packed, tokenizer, reference):
    with Client(packed["plain"].address, timeout=120) as client:
        second_turn_equals_generate(client, PROMPTS, "packed-1", tokenizer, reference, N)

        def run(text):
            ids = tokenizer(text).input_ids
            return list(client.generate(token_ids=ids, max_new_tokens=N, k=3).tokens), ids

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for tokens, ids in pool.map(run, PROMPTS[:4]):
                assert tokens == reference(ids, N)


def test_info_names_the_packing(packed):
    for role, stub in (
        ("drafter", drafter_pb2_grpc.DrafterServiceStub),
        ("verifier", verifier_pb2_grpc.VerifierServiceStub),
    ):
        with grpc.insecure_channel(packed[role].address) as channel:
            info = stub(channel).Info(common_pb2.InfoRequest(), timeout=30)
        assert info.dtype == "float32"
        assert info.dtype_reason.endswith("linear weights packed (--pack-weights true)")
