"""Compiled forwards through the stack (`--compile` on the verifier, fp32 tiny models):
greedy output equals `generate()` on the target, token for token, at k = 0, k = 3, with
SSD and over two turns of a session; Info and the start-up log report the compile. One
stack (compiling is slow: 20-30 s a graph here): --max-draft-tokens 3 keeps the buckets to
1, 2 and 4 tokens, and --max-batch-size 1 the graphs to one row.

The drafter runs eager here. What a compiled drafter computes is checked in-process against
the same forwards eager, its batched and SSD branch rows included (tests/unit/
test_compiled.py); through the stack it could only change speed, never the tokens, which
the verifier decides. Compiling its six graphs as well took this file from about 90 s to
300 s of a CI worker."""

from __future__ import annotations

import json

import grpc
import pytest

from specdec.sdk import Client
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.exact import greedy_equals_generate, second_turn_equals_generate
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

N = 16
FLAGS = ("--compile", "--max-draft-tokens", "3")


@pytest.fixture(scope="module")
def stack(test_models, tmp_path_factory):
    # Each replica its own inductor cache: two processes compiling the same kernel into one
    # cache directory at once can load the other's half-written .so ("file too short").
    def cache(role):
        return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp(f"inductor-{role}"))}

    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy, "--max-draft-tokens", "3")
        v = replica(
            "verifier", test_models.target, *FLAGS, "--max-batch-size", "1", env=cache("verifier")
        )
        procs += [d, v]
        d.wait_healthy(timeout=600), v.wait_healthy(timeout=600)
        plain = gateway([d], [v])
        ssd = gateway([d], [v], None, "--ssd")
        procs += [plain, ssd]
        plain.wait_healthy(), ssd.wait_healthy()
        yield {"drafter": d, "verifier": v, "plain": plain, "ssd": ssd}
    finally:
        for p in procs:
            p.stop()


def test_greedy_equals_generate(stack, tokenizer, reference):
    for which, k in (("plain", 0), ("plain", 3), ("ssd", 3)):
        greedy_equals_generate(stack, which, k, PROMPTS[:2], tokenizer, reference, N, 300)


def test_two_turns(stack, tokenizer, reference):
    with Client(stack["plain"].address, timeout=300) as client:
        second_turn_equals_generate(client, PROMPTS, "compiled-1", tokenizer, reference, N)


def test_info_and_log_report_the_compile(stack):
    for role, stub, compiled in (
        ("drafter", drafter_pb2_grpc.DrafterServiceStub, False),
        ("verifier", verifier_pb2_grpc.VerifierServiceStub, True),
    ):
        with grpc.insecure_channel(stack[role].address) as channel:
            try:
                info = stub(channel).Info(common_pb2.InfoRequest(), timeout=30)
            except grpc.RpcError as e:
                raise AssertionError(f"{role}: {e}\n{stack[role].tail(80)}") from None
        assert info.compiled is compiled and (info.compile_seconds > 0) is compiled, role
        engine = "dense" if compiled else "paged"  # --engine auto: compiled forwards are dense
        assert info.engine == engine
        loaded = [json.loads(line) for line in stack[role].lines if '"model loaded"' in line]
        assert loaded and loaded[0]["compiled"] is compiled, stack[role].tail()
        assert loaded[0]["engine"] == engine
        if compiled:
            assert loaded[0]["compile_seconds"] > 0
        else:
            assert loaded[0]["compile_seconds"] is None
