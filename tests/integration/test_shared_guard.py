"""The goodput guard two gateway processes share through one real Redis, over real replica
processes (specdec.gateway.round.policy.shared): one gateway leads, the other follows and
sends its rounds on the stream; greedy outputs through both, at once, equal generate();
the leader SIGKILLed, the survivor takes the lease once it runs out and stays exact."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from specdec.gateway.round.policy.shared import State
from specdec.sdk import AsyncClient
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

N = 24
LEADER, STATE, EVENTS = (f"specdec:guard:{k}" for k in ("leader", "state", "events"))


@pytest.fixture(scope="module")
def stack(test_models):
    server = RedisProcess().start()
    d = replica("drafter", test_models.draft_noisy)
    v = replica("verifier", test_models.target)
    try:
        d.wait_healthy(), v.wait_healthy()
        yield d, v, server
    finally:
        d.stop(), v.stop()
        server.stop()


def role_of(proc) -> str | None:
    """The last role the gateway logged in the shared guard (None: none yet)."""
    role = None
    for line in proc.tail(400).splitlines():
        if "shared goodput guard" in line:
            for name in ("leader", "follower", "alone"):
                if f'"role": "{name}"' in line:
                    role = name
    return role


def wait_for(check, timeout: float = 60.0) -> None:
    """Wait for `check()` (a bound for a hung test, not a measure of speed)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.1)


async def both_exact(addresses, tokenizer, reference) -> None:
    """Greedy requests through every gateway at once, each equal to generate()."""

    async def through(address: str, texts: list[str]) -> None:
        async with AsyncClient(address, timeout=300) as client:

            async def one(text: str) -> None:
                ids = tokenizer(text).input_ids
                got = await client.generate(token_ids=ids, max_new_tokens=N, k=4)
                assert list(got.tokens) == reference(ids, N), text

            await asyncio.gather(*(one(t) for t in texts))

    await asyncio.gather(*(through(a, PROMPTS[:3]) for a in addresses))


def test_two_gateways_share_one_guard_through_a_leader_crash(stack, tokenizer, reference):
    d, v, server = stack
    raw = redis.Redis.from_url(server.url)
    gws = [gateway([d], [v], server.url, "--k-policy", "adaptive") for _ in range(2)]
    try:
        for g in gws:
            g.wait_healthy()
        wait_for(lambda: sorted(map(role_of, gws), key=str) == ["follower", "leader"])
        leader, follower = sorted(gws, key=lambda g: role_of(g) != "leader")
        term = raw.get(LEADER).decode()
        assert State.decode(raw.get(STATE)).term == term
        asyncio.run(both_exact([g.address for g in gws], tokenizer, reference))
        assert raw.xlen(EVENTS) > 0  # the follower's rounds, for the leader's guard

        leader.kill()  # no release: its lease runs out
        wait_for(lambda: role_of(follower) == "leader")
        sent = raw.xlen(EVENTS)  # the follower's last events were sent meanwhile
        assert raw.get(LEADER).decode() not in (None, term)
        assert State.decode(raw.get(STATE)).term != term
        asyncio.run(both_exact([follower.address], tokenizer, reference))
        assert raw.xlen(EVENTS) == sent  # a leader sends nothing: it counts its own
    finally:
        for g in gws:
            g.stop()
        raw.close()
