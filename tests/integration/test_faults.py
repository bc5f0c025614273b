"""Faults during traffic through real processes on loopback, greedy output checked against
generate(): cancelled turns, SSD at the context limit, a drafter or a verifier killed
mid-stream (issue 11, items 2-4)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from specdec.gateway.sessions import SessionIndex
from specdec.sdk import AsyncClient, Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica, small_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def stack(test_models, redis_server):
    """One drafter, one verifier, one gateway on a real Redis."""
    with small_stack(test_models.draft_noisy, test_models.target, redis_url=redis_server.url) as p:
        yield p


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_turn_right_after_a_cancel_is_not_aborted(stack, tokenizer):
    """The other-language client saw ABORTED 9 times in 9: the cancelled turn was still
    releasing its lock. The cancelled turn keeps nothing in the history."""
    with Client(stack["gateway"].address, timeout=120) as client:
        first = client.generate(
            token_ids=ids_of(tokenizer, PROMPTS[0]), max_new_tokens=8, session_id="cancel-1", k=0
        )
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        for _ in range(9):
            stream = client.stream(" and", max_new_tokens=400, session_id="cancel-1", k=0)
            next(stream)  # the turn is running
            stream.close()  # cancels the call
            got = client.generate(" then", max_new_tokens=4, session_id="cancel-1", k=0)
            assert got.usage.history_tokens == history  # the cancelled turn left nothing
            history += got.usage.prompt_tokens + got.usage.completion_tokens


def test_ssd_at_the_context_limit_never_fails(stack, tokenizer, reference):
    """Near the end of the context a Speculate cannot fit its branches; the request, which
    the gateway accepted, must still complete exactly (the Speculate is skipped or a miss)."""
    base = ids_of(tokenizer, PROMPTS[2])
    n = 24
    prompt = (base * 200)[: 512 - n]  # prompt + max_new_tokens == the tiny models' 512
    with Client(stack["gateway"].address, timeout=120) as client:
        got = client.generate(token_ids=prompt, max_new_tokens=n, k=4, ssd=True)
    assert list(got.tokens) == reference(prompt, n)
    assert got.stats.ssd_hits + got.stats.ssd_misses > 0


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


@pytest.mark.parametrize("ssd", [False, True])
def test_drafter_killed_mid_stream(test_models, redis_server, tokenizer, reference, ssd):
    """Losing the drafter is not losing the service: the stream completes at k = 0 with
    the same output, and speculation resumes when a drafter is back on the address."""
    d = replica("drafter", test_models.draft_noisy)
    v = replica("verifier", test_models.target)
    procs = [d, v]
    try:
        d.wait_healthy(), v.wait_healthy()
        g = gateway([d], [v], redis_server.url)
        procs.append(g)
        g.wait_healthy()
        ids = ids_of(tokenizer, PROMPTS[3])
        n = 300
        with Client(g.address, timeout=120) as client:
            stream = client.stream(token_ids=ids, max_new_tokens=n, k=2, ssd=ssd)
            chunks = [next(stream)]
            port = d.port
            d.kill()
            chunks += list(stream)
            final = chunks[-1].final
            assert final is not None
            assert list(final.tokens) == reference(ids, n)
            assert final.stats.rounds > 0
            # A drafter comes back on the same address: the probe puts it back in.
            back = ServiceProcess.specdec(
                "drafter",
                "serve",
                "drafter",
                "--model",
                str(test_models.draft_noisy),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--threads",
                "1",
            ).start()
            procs.append(back)
            back.wait_healthy()

            def speculating() -> bool:
                got = client.generate(token_ids=ids, max_new_tokens=8, k=2, ssd=ssd)
                assert list(got.tokens) == reference(ids, 8)
                return got.stats.draft_tokens > 0

            wait_until(speculating)
        assert "no drafter could draft" in g.tail(400)  # the fallback did happen
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_verifier_lost_mid_stream_with_another_up(
    test_models, redis_server, tokenizer, reference, fault
):
    """The verifier that holds a session is lost mid-stream: the stream fails over to the
    other verifier with the history resent, and its output is exact.

    SIGKILL closes the replica's sockets. SIGSTOP keeps them open and answers nothing (a
    hung host, a network cut that closed nothing): the data plane's keepalive
    (--data-keepalive-timeout 2) notices. The calls' deadline is the default --rpc-timeout
    of 120 s: the elapsed time, asserted far below it, shows the failover came from the
    keepalive, not from the deadline (a margin for a loaded machine, no tighter bound)."""
    d = replica("drafter", test_models.draft_noisy)
    va = replica("verifier", test_models.target)
    vb = replica("verifier", test_models.target)
    procs = [d, va, vb]
    stopped = None
    try:
        for p in procs:
            p.wait_healthy()
        g = gateway(
            [d], [va, vb], redis_server.url,
            "--data-keepalive", "0.25", "--data-keepalive-timeout", "2",
        )  # fmt: skip
        procs.append(g)
        g.wait_healthy()
        ids = ids_of(tokenizer, PROMPTS[4])
        n, session = 160, f"v-lost-{fault}"  # a session of its own on the module's Redis
        with Client(g.address, timeout=600) as client:
            first = client.generate(token_ids=ids, max_new_tokens=16, k=2, session_id=session)
            assert list(first.tokens) == reference(ids, 16)

            async def placed() -> str:
                index = SessionIndex(redis_server.url)
                try:
                    return (await index.get(session)).verifier
                finally:
                    await index.close()

            holder = {va.address: va, vb.address: vb}[asyncio.run(placed())]
            follow = tokenizer(" and then", add_special_tokens=False).input_ids
            stream = client.stream(token_ids=follow, max_new_tokens=n, k=2, session_id=session)
            chunks = [next(stream)]
            if fault == "SIGKILL":
                holder.kill()
            else:
                os.kill(holder.proc.pid, signal.SIGSTOP)
                stopped = holder
            started = time.monotonic()
            chunks += list(stream)
            elapsed = time.monotonic() - started
            final = chunks[-1].final
            assert final is not None
            ctx = [*ids, *first.tokens, *follow]
            assert list(final.tokens) == reference(ctx, n)
        tail = g.tail(400)
        assert "replica taken out" in tail  # it did fail over
        assert final.stats.cache_misses > 0  # the history was resent to the other verifier
        if fault == "SIGSTOP":
            assert "REASON_KEEPALIVE_TIMEOUT" in tail  # on the keepalive
            assert elapsed < 60, f"the failover took {elapsed:.1f} s of a 120 s deadline"
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        for p in procs:
            p.stop()


def test_replica_calls_are_bounded_by_the_clients_deadline(stack, tokenizer, reference):
    """A gateway whose --rpc-timeout no call could meet (1 ms) still serves a request with
    a deadline of its own: the client's deadline bounds the calls, not the constant."""
    g = gateway([stack["drafter"]], [stack["verifier"]], None, "--rpc-timeout", "0.001")
    try:
        g.wait_healthy()
        ids = ids_of(tokenizer, PROMPTS[5]) * 8  # a longer prefill
        with Client(g.address, timeout=120) as client:
            got = client.generate(token_ids=ids, max_new_tokens=16, k=2)
        assert list(got.tokens) == reference(ids, 16)
    finally:
        g.stop()


def test_redis_restarted_mid_turn(stack, tokenizer, reference):
    """Redis restarts (losing everything) while a turn streams: the turn completes exactly,
    takes its lost lock back, writes its history, and the next turn continues from it."""
    server = RedisProcess().start()
    g = gateway([stack["drafter"]], [stack["verifier"]], server.url)
    try:
        g.wait_healthy()
        ids = ids_of(tokenizer, PROMPTS[1])
        with Client(g.address, timeout=120) as client:
            first = client.generate(token_ids=ids, max_new_tokens=8, session_id="rr", k=2)
            follow = tokenizer(" and", add_special_tokens=False).input_ids
            stream = client.stream(token_ids=follow, max_new_tokens=200, session_id="rr", k=0)
            chunks = [next(stream)]
            server.stop()
            server.start()  # the same port, empty
            chunks += list(stream)
            second = chunks[-1].final
            assert second is not None
            ctx = [*ids, *first.tokens, *follow]
            assert list(second.tokens) == reference(ctx, 200)
            third = client.generate(token_ids=follow, max_new_tokens=4, session_id="rr", k=2)
        assert third.usage.history_tokens == len(ctx) + 200
        assert list(third.tokens) == reference([*ctx, *second.tokens, *follow], 4)
    finally:
        g.stop()
        server.stop()


def test_gateway_killed_between_turns(stack, redis_server, tokenizer, reference):
    """SIGKILL (no graceful stop) after a turn: another gateway continues the session."""
    d, v = stack["drafter"], stack["verifier"]
    p1 = ids_of(tokenizer, PROMPTS[0])
    p2 = tokenizer(" return", add_special_tokens=False).input_ids
    g = gateway([d], [v], redis_server.url)
    try:
        g.wait_healthy()
        with Client(g.address, timeout=120) as c:
            t1 = c.generate(token_ids=p1, max_new_tokens=10, k=4, session_id="killed", ssd=True)
    finally:
        g.kill()
    g2 = gateway([d], [v], redis_server.url)
    try:
        g2.wait_healthy()
        with Client(g2.address, timeout=120) as c:
            t2 = c.generate(token_ids=p2, max_new_tokens=10, k=4, session_id="killed", ssd=True)
    finally:
        g2.stop()
    assert list(t1.tokens) == reference(p1, 10)
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], 10)
    assert t2.usage.history_tokens == len(p1) + 10


def test_failover_under_load_is_exact(test_models, redis_server, tokenizer, reference):
    """Two drafters and two verifiers, eight sessions generating at once (plain
    speculation and SSD, some continuing a session), one replica of each role SIGKILLed
    mid-run: no request fails, and every output equals generate()'s (issue 20)."""
    drafters = [replica("drafter", test_models.draft_noisy) for _ in range(2)]
    verifiers = [replica("verifier", test_models.target) for _ in range(2)]
    procs = [*drafters, *verifiers]
    try:
        for p in procs:
            p.wait_healthy()
        g = gateway(drafters, verifiers, redis_server.url)
        procs.append(g)
        g.wait_healthy()
        n = 160
        jobs = [
            (ids_of(tokenizer, PROMPTS[i % len(PROMPTS)]), {"ssd": i % 2 == 1, "k": 2 + i % 3})
            for i in range(8)
        ]
        for i in (0, 3, 6):
            jobs[i][1]["session_id"] = f"load-kill-{i}"
        started = asyncio.Event()

        async def one(ids, kw):
            async with AsyncClient(g.address, timeout=300) as client:
                tokens = []
                async for chunk in client.stream(token_ids=ids, max_new_tokens=n, **kw):
                    tokens += chunk.tokens
                    if len(tokens) >= 8:
                        started.set()
                    if chunk.final is not None:
                        return chunk.final

        async def run():
            tasks = [asyncio.ensure_future(one(ids, kw)) for ids, kw in jobs]
            await asyncio.wait_for(started.wait(), 300)
            await asyncio.sleep(0.2)  # every session is under way
            drafters[0].kill()
            verifiers[1].kill()
            return await asyncio.gather(*tasks)  # a failed request raises here

        finals = asyncio.run(run())
        for (ids, _), final in zip(jobs, finals, strict=True):
            assert list(final.tokens) == reference(ids, n)
        tail = g.tail(800)
        assert "replica taken out" in tail  # the killed replicas were failed over
        assert sum(f.stats.cache_misses for f in finals) > 0  # some sessions resent
    finally:
        for p in procs:
            p.stop()
