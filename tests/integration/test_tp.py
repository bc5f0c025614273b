"""A tensor-parallel verifier (--tensor-parallel 2, gloo on CPU) through the whole stack:
greedy output equals the target's generate() token for token, as with one rank, for plain
drafting at k = 0 and k = 3, SSD, two turns of one session, a rollback-heavy run and
concurrent sessions (batched forwards the follower replays); Info and the start-up log
report the size; a follower that dies takes the verifier down, saying so.

One stack for the module: the last test kills the verifier's follower rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import pytest

from specdec.common.prefix import prefix_hash
from specdec.sdk import AsyncClient, Client
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack

pytestmark = pytest.mark.integration

N = 24


@pytest.fixture(scope="module")
def stack(test_models):
    """A verifier of 2 ranks (the target), one drafter (the noisy draft), a gateway."""
    flags = ("--tensor-parallel", "2")
    with small_stack(test_models.draft_noisy, test_models.target, verifier_flags=flags) as s:
        yield {"verifier": s["verifier"], "gateway": s["gateway"].address}


def logged(proc, message: str) -> dict:
    """The first JSON log line of proc with this message."""
    for line in proc.lines:
        if f'"message": "{message}"' in line:
            return json.loads(line)
    raise AssertionError(f"no {message!r} in the log:\n{proc.tail()}")


def test_info_and_start_up_log_report_the_ranks(stack):
    verifier = stack["verifier"]
    with grpc.insecure_channel(verifier.address) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=30
        )
    assert info.tensor_parallel == 2 and info.engine == "dense"
    assert logged(verifier, "model loaded")["tensor_parallel"] == 2
    assert len(logged(verifier, "tensor-parallel ranks started")["follower_pids"]) == 1


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_equals_generate(stack, tokenizer, reference, k):
    with Client(stack["gateway"], timeout=120) as client:
        for text in PROMPTS[:2]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=k)
            assert list(got.tokens) == reference(ids, N), (k, text)


def test_ssd_and_rollback_heavy_drafts(stack, tokenizer, reference):
    """SSD (the drafter speculates during the verify), and k = 8 with a draft that agrees
    on about 3 tokens of 4: most rounds roll rejected drafts back on both ranks."""
    with Client(stack["gateway"], timeout=120) as client:
        ids = tokenizer(PROMPTS[2]).input_ids
        got = client.generate(token_ids=ids, max_new_tokens=N, k=3, ssd=True)
        assert list(got.tokens) == reference(ids, N)
        assert got.stats.ssd
        ids = tokenizer(PROMPTS[3]).input_ids
        got = client.generate(token_ids=ids, max_new_tokens=N, k=8)
        assert list(got.tokens) == reference(ids, N)
        assert got.stats.acceptance_rate < 1.0  # some drafts were rejected and rolled back


def test_two_turns_and_concurrent_sessions(stack, tokenizer, reference):
    """A second turn builds on the first's cache on both ranks; n = 2 choices fork the
    prompt's session; three sessions at once share batched forwards, which the follower
    replays as one."""
    a, b = tokenizer(PROMPTS[4]).input_ids, tokenizer(PROMPTS[5]).input_ids
    with Client(stack["gateway"], timeout=120) as client:
        first = client.generate(token_ids=a, max_new_tokens=12, k=3, session_id="tp-chat")
        second = client.generate(token_ids=b, max_new_tokens=12, k=3, session_id="tp-chat")
        both = client.generate(token_ids=b, max_new_tokens=12, k=3, n=2)  # a fork each
    assert list(first.tokens) == reference(a, 12)
    assert list(second.tokens) == reference([*a, *first.tokens, *b], 12)
    assert second.stats.cache_misses == 0
    assert [list(c.tokens) for c in both.choices] == [reference(b, 12)] * 2

    async def together():
        async with AsyncClient(stack["gateway"], timeout=120) as client:
            calls = [
                client.generate(token_ids=tokenizer(t).input_ids, max_new_tokens=N, k=2)
                for t in PROMPTS[:3]
            ]
            return await asyncio.gather(*calls)

    for text, got in zip(PROMPTS[:3], asyncio.run(together()), strict=True):
        assert list(got.tokens) == reference(tokenizer(text).input_ids, N), text


def test_a_token_tree_is_refused(stack, tokenizer):
    """A Verify with draft_parents: UNIMPLEMENTED, naming the setting; the replica serves on."""
    ids = tokenizer(PROMPTS[0]).input_ids
    request = verifier_pb2.VerifyRequest(
        session_id="tp-tree",
        prefix=common_pb2.CachedPrefix(length=0, hash=prefix_hash([])),
        new_tokens=ids,
        draft_tokens=ids[:3],
        draft_parents=[-1, -1, 0],
    )
    with grpc.insecure_channel(stack["verifier"].address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--tensor-parallel" in e.value.details()
        del request.draft_parents[:]
        assert stub.Verify(request, timeout=60).cached_length >= len(ids)


def test_a_follower_dying_takes_the_verifier_down(stack):
    verifier = stack["verifier"]
    (follower,) = logged(verifier, "tensor-parallel ranks started")["follower_pids"]
    os.kill(follower, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while verifier.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not verifier.alive(), "the verifier kept running without its follower"
    assert verifier.proc.returncode == 1
    error = logged(
        verifier,
        "tensor-parallel rank exited; this verifier cannot run its model "
        "without it, so it stops (exit status 1)",
    )
    assert (error["rank"], error["exit_code"]) == (1, -signal.SIGKILL)
