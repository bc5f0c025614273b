"""Sessions through crashes, under load, with real processes and a real Redis (issue 46):
a gateway SIGKILLed with turns in flight, Redis SIGKILLed mid-stream and restarted from
its append-only file, Redis restarted empty. Greedy outputs are checked against
generate() over the whole conversation."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from specdec.sdk import AsyncClient, SpecdecError
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

SESSIONS = 4
FIRST, SECOND, THIRD = 8, 400, 8  # new tokens per turn (the tiny models' context is 512)


@pytest.fixture(scope="module")
def replicas(test_models):
    d = replica("drafter", test_models.draft_noisy)
    v = replica("verifier", test_models.target)
    try:
        d.wait_healthy(), v.wait_healthy()
        yield d, v
    finally:
        d.stop(), v.stop()


@contextlib.contextmanager
def two_gateways(replicas, redis_url: str, *flags: str):
    """Two healthy gateways over the replicas on one Redis; stopped after."""
    d, v = replicas
    procs = [gateway([d], [v], redis_url, *flags) for _ in range(2)]
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.stop()


@contextlib.asynccontextmanager
async def two_clients(ga, gb):
    async with (
        AsyncClient(ga.address, timeout=300) as a,
        AsyncClient(gb.address, timeout=300) as b,
    ):
        yield a, b


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def follow_ids(tokenizer) -> list[int]:
    return tokenizer(" and then", add_special_tokens=False).input_ids


async def turns(client: AsyncClient, name: str, ids: dict[int, list[int]], n: int, expected=0):
    """One turn of each session `name`-i at once: prompt ids[i], n new tokens, expecting
    `expected` (or expected(i)) earlier turns; a refused turn raises."""
    return await asyncio.gather(
        *(
            client.generate(
                token_ids=p,
                max_new_tokens=n,
                k=2,
                session_id=f"{name}-{i}",
                session_expected_turns=expected(i) if callable(expected) else expected,
            )
            for i, p in ids.items()
        )
    )


async def first_turns(client: AsyncClient, name: str, prompts: list[list[int]]):
    return await turns(client, name, dict(enumerate(prompts)), FIRST)


def test_gateway_killed_with_turns_in_flight(replicas, tokenizer, reference):
    """Two gateways on one Redis (--turn-lease 2, a test's lease). Gateway A is SIGKILLed
    while four sessions' second turns stream through it; each client retries its turn once
    on gateway B, at once. Every retry waits out the dead gateway's lease (B sees that A
    stopped renewing it) and is served within 5 s of the kill (the lease and two renewals,
    with a margin for a loaded machine); every output is exact and the third turn, on B,
    continues the whole history."""
    follow = follow_ids(tokenizer)
    prompts = [ids_of(tokenizer, PROMPTS[i]) for i in range(SESSIONS)]

    async def run(ga, gb):
        async with two_clients(ga, gb) as (a, b):
            firsts = await first_turns(a, "gk", prompts)
            streaming = [asyncio.Event() for _ in range(SESSIONS)]

            async def second(i: int):
                kw = dict(
                    token_ids=follow,
                    max_new_tokens=SECOND,
                    k=2,
                    session_id=f"gk-{i}",
                    session_expected_turns=1,
                )
                try:
                    async for chunk in a.stream(**kw):
                        streaming[i].set()
                        if chunk.final is not None:
                            return "a", chunk.final, 0.0
                except SpecdecError as e:  # the gateway died: retry once on B
                    assert e.code == grpc.StatusCode.UNAVAILABLE, e
                served = 0.0
                async for chunk in b.stream(**kw):
                    served = served or time.monotonic()
                    if chunk.final is not None:
                        return "b", chunk.final, served
                raise AssertionError("the stream ended without a final message")

            tasks = [asyncio.ensure_future(second(i)) for i in range(SESSIONS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 300)
            killed = time.monotonic()
            ga.kill()
            seconds = await asyncio.gather(*tasks)
            thirds = await turns(b, "gk", dict.fromkeys(range(SESSIONS), follow), THIRD, 2)
        return firsts, seconds, thirds, killed

    with (
        RedisProcess() as server,
        two_gateways(replicas, server.url, "--turn-lease", "2") as (ga, gb),
    ):
        firsts, seconds, thirds, killed = asyncio.run(run(ga, gb))
        assert "stopped answering lapsed" in gb.tail(400)
    for i in range(SESSIONS):
        ctx1 = prompts[i]
        assert list(firsts[i].tokens) == reference(ctx1, FIRST)
        where, final, served = seconds[i]
        assert where == "b", "the turn finished before the kill: nothing was retried"
        assert served - killed < 5.0, f"retried turn served {served - killed:.1f} s after"
        ctx2 = [*ctx1, *firsts[i].tokens, *follow]
        assert final.usage.history_tokens == len(ctx1) + FIRST  # turn 2: full history
        assert list(final.tokens) == reference(ctx2, SECOND)
        ctx3 = [*ctx2, *final.tokens, *follow]
        assert thirds[i].usage.history_tokens == len(ctx2) + SECOND
        assert thirds[i].usage.session_turns == 3
        assert list(thirds[i].tokens) == reference(ctx3, THIRD)


def test_redis_killed_mid_stream_and_restarted_from_its_aof(
    replicas, tokenizer, reference, tmp_path
):
    """Redis with an append-only file (as the chart runs it) is SIGKILLed while four
    sessions' second turns stream; two more sessions run their first turn during the
    outage. Redis restarts from its AOF 5 s after the kill: the next turn of every session
    is served at once (no ABORTED on a replayed lock), with its whole history, exactly."""
    d, v = replicas
    follow = follow_ids(tokenizer)
    prompts = [ids_of(tokenizer, PROMPTS[i]) for i in range(SESSIONS + 2)]
    server = RedisProcess(aof_dir=tmp_path).start()
    g = gateway([d], [v], server.url)
    try:
        g.wait_healthy()

        async def run():
            async with AsyncClient(g.address, timeout=300) as c:
                firsts = await first_turns(c, "aof", prompts[:SESSIONS])
                streaming = [asyncio.Event() for _ in range(SESSIONS)]

                async def second(i: int):
                    async for chunk in c.stream(
                        token_ids=follow, max_new_tokens=SECOND, k=2, session_id=f"aof-{i}"
                    ):
                        streaming[i].set()
                        if chunk.final is not None:
                            return chunk.final
                    raise AssertionError("the stream ended without a final message")

                tasks = [asyncio.ensure_future(second(i)) for i in range(SESSIONS)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 300)
                killed = time.monotonic()
                server.kill()
                outage = {i: prompts[i] for i in range(SESSIONS, SESSIONS + 2)}
                during = await turns(c, "aof", outage, FIRST)  # first turns in the outage
                seconds = await asyncio.gather(*tasks)
                assert all(f.usage.history_tokens > 0 for f in seconds)
                await asyncio.sleep(max(0.0, killed + 5.0 - time.monotonic()))
                await asyncio.to_thread(server.start)  # replays the AOF
                everyone = dict.fromkeys(range(SESSIONS + 2), follow)
                nexts = await turns(  # a refused turn raises here
                    c, "aof", everyone, THIRD, lambda i: 2 if i < SESSIONS else 1
                )
            return firsts, seconds, during, nexts

        firsts, seconds, during, nexts = asyncio.run(run())
        for i in range(SESSIONS):
            ctx2 = [*prompts[i], *firsts[i].tokens, *follow]
            assert list(seconds[i].tokens) == reference(ctx2, SECOND)
            ctx3 = [*ctx2, *seconds[i].tokens, *follow]
            assert nexts[i].usage.history_tokens == len(ctx3) - len(follow)
            assert list(nexts[i].tokens) == reference(ctx3, THIRD)
        for j, first in enumerate(during):
            i = SESSIONS + j
            assert list(first.tokens) == reference(prompts[i], FIRST)
            ctx2 = [*prompts[i], *first.tokens, *follow]
            assert nexts[i].usage.history_tokens == len(prompts[i]) + FIRST
            assert list(nexts[i].tokens) == reference(ctx2, THIRD)
    finally:
        g.stop()
        server.stop()


def test_redis_restarted_empty(replicas, tokenizer, reference):
    """Redis restarts without its data between turns. Sessions whose gateway holds a copy
    continue with their whole history, exactly (the copy is written back, and the other
    gateway then finds it too); a session continued on a gateway without a copy is refused
    with the documented FAILED_PRECONDITION (session_expected_turns), never run as new, and
    starts again with SESSION_MODE_RESET and the whole conversation, exactly."""
    follow = follow_ids(tokenizer)
    prompts = [ids_of(tokenizer, PROMPTS[i]) for i in range(SESSIONS)]

    def turn(client, i, expected=1, **kw):
        return client.generate(
            token_ids=kw.pop("token_ids", follow),
            max_new_tokens=THIRD,
            k=2,
            session_id=f"empty-{i}",
            session_expected_turns=expected,
            **kw,
        )

    async def run(ga, gb, server):
        async with two_clients(ga, gb) as (a, b):
            firsts = await first_turns(a, "empty", prompts)
            server.stop()
            await asyncio.to_thread(server.start)  # the same port, empty
            kept = await asyncio.gather(*(turn(a, i) for i in (0, 1)))
            lost = await asyncio.gather(*(turn(b, i) for i in (2, 3)), return_exceptions=True)
            later = await turn(b, 0, expected=2)  # the copy A wrote back serves B too
            restarted = [
                await turn(
                    b,
                    i,
                    expected=0,
                    reset_session=True,
                    token_ids=[*prompts[i], *firsts[i].tokens, *follow],
                )
                for i in (2, 3)
            ]
        return firsts, kept, lost, later, restarted

    with RedisProcess() as server, two_gateways(replicas, server.url) as (ga, gb):
        firsts, kept, lost, later, restarted = asyncio.run(run(ga, gb, server))
        assert "was missing from the session store" in ga.tail(400)
    for i in (0, 1):
        ctx = [*prompts[i], *firsts[i].tokens, *follow]
        assert kept[i].usage.history_tokens == len(prompts[i]) + FIRST
        assert list(kept[i].tokens) == reference(ctx, THIRD)
    ctx0 = [*prompts[0], *firsts[0].tokens, *follow, *kept[0].tokens, *follow]
    assert later.usage.history_tokens == len(ctx0) - len(follow)
    assert list(later.tokens) == reference(ctx0, THIRD)
    for j, i in enumerate((2, 3)):
        error = lost[j]
        assert isinstance(error, SpecdecError), error
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "history was lost" in error.details
        ctx = [*prompts[i], *firsts[i].tokens, *follow]
        assert restarted[j].usage.history_tokens == 0
        assert list(restarted[j].tokens) == reference(ctx, THIRD)
