"""The goodput guard shared by a gateway's replicas (specdec.gateway.round.policy.shared),
against a real redis-server (started per test: tests/unit/conftest.py; no mocks). Each
`SharedGuard` stands for one gateway replica; they share one Redis, as in a deployment."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import pytest
import redis.asyncio as aioredis

from specdec.gateway.round.policy import GoodputGuard, GuardMode, GuardParams
from specdec.gateway.round.policy.guard import Ticket, learnt, restore
from specdec.gateway.round.policy.shared import STREAM_TTL, GuardRole, SharedGuard, State

LEASE, POLL = 2.0, 0.05  # a lease that outlasts a loaded CI machine's pauses
# Epochs short enough to close within a second of rounds of 10 ms.
FAST = GuardParams(min_measure=0.2, measure_rounds=1.0, measure_requests=0.0, settle_rounds=0.5)


@contextlib.asynccontextmanager
async def replicas_on(server):
    """A factory of started SharedGuards, one per simulated gateway replica; closed after.
    (In the test's own event loop: their tasks live there.)"""
    made: list[tuple[SharedGuard, aioredis.Redis]] = []

    async def make(params: GuardParams = FAST, roles: list[GuardRole] | None = None) -> SharedGuard:
        client = aioredis.Redis.from_url(server.url, socket_timeout=0.5)
        guard = SharedGuard(client, lambda: GoodputGuard(params), lease=LEASE, poll=POLL)
        guard.on_role = roles.append if roles is not None else None
        await guard.start()
        made.append((guard, client))
        return guard

    try:
        yield make
    finally:
        for guard, client in made:
            await guard.close()
            await client.aclose()


async def until(check, timeout: float = 20.0) -> None:
    """Wait for `check()` to hold (a bound for a hung test, not a measure of speed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def rounds(guard: SharedGuard, sessions: list[int], stop: asyncio.Event, tickets: list):
    """`sessions` running rounds of 10 ms that commit 2 tokens each, until `stop`; every
    ticket kept. Returns the tokens committed and the seconds they took."""
    loop = asyncio.get_running_loop()
    start, tokens = loop.time(), 0

    async def one(session: int) -> None:
        nonlocal tokens
        while not stop.is_set():
            ticket = guard.begin(session)
            tickets.append(ticket)
            began = loop.time()
            await asyncio.sleep(0.01)
            guard.end(session, ticket, 2, loop.time() - began)
            tokens += 2
        guard.leave(session)

    await asyncio.gather(*(one(s) for s in sessions))
    return tokens, loop.time() - start


async def test_one_replica_leads_and_the_others_follow_its_term(server, raw):
    async with replicas_on(server) as replicas:
        guards = [await replicas() for _ in range(3)]
        await until(
            lambda: all(g.state is not None for g in guards if g.role is GuardRole.FOLLOWER)
        )
        leaders = [g for g in guards if g.role is GuardRole.LEADER]
        assert len(leaders) == 1
        leader = leaders[0]
        assert raw.get("specdec:guard:leader").decode() == leader.term
        for g in guards:
            if g is not leader:
                assert g.role is GuardRole.FOLLOWER
                assert g.state.term == leader.term


async def test_the_leader_measures_the_followers_rounds(server):
    """The leader runs no round of its own: every epoch its guard measures is the
    follower's, at about the rate the follower's sessions committed."""
    async with replicas_on(server) as replicas:
        leader = await replicas()
        follower = await replicas()
        assert (leader.role, follower.role) == (GuardRole.LEADER, GuardRole.FOLLOWER)
        delays: list[float] = []
        leader.on_delay = delays.append
        stop, tickets = asyncio.Event(), []
        work = asyncio.ensure_future(rounds(follower, [1, 2], stop, tickets))
        await until(lambda: leader.guard.measured)
        stop.set()
        tokens, seconds = await work
        ((level, _mode), seen), *_ = leader.guard.measured.items()
        assert level == 2  # the follower's two sessions
        counted, length = seen[0]
        assert counted / length == pytest.approx(tokens / seconds, rel=0.5)
        # The follower's rounds ran under the leader's epochs and term.
        assert {t.term for t in tickets} == {leader.term}
        assert len({t.epoch for t in tickets}) >= 2
        # Each event's delay, by one clock here: not negative (a clock step aside).
        assert delays and min(delays) > -0.05


async def test_the_leaders_load_level_counts_every_replicas_sessions(server):
    """Two sessions on the leader, two on a follower, in rounds at once: the leader's
    epochs are at level 4, the sessions of both (each alone: level 2)."""
    async with replicas_on(server) as replicas:
        leader = await replicas()
        follower = await replicas()
        stop = asyncio.Event()
        work = asyncio.gather(rounds(leader, [1, 2], stop, []), rounds(follower, [1, 2], stop, []))
        await until(lambda: leader.guard.measured)
        stop.set()
        await work
        assert {level for level, _mode in leader.guard.measured} == {4}


async def test_the_leaders_mode_reaches_a_follower_once_its_sessions_are_not_alone(server):
    async with replicas_on(server) as replicas:
        leader = await replicas()
        follower = await replicas()
        leader.guard.mode = GuardMode.PLAIN  # what its epochs decided (test_guard's subject)
        await until(lambda: follower.state is not None and follower.state.mode is GuardMode.PLAIN)
        # One session, alone in every replica: it speculates in a plain epoch.
        assert follower.state.alone
        assert follower.begin(1).mode is GuardMode.SPEC
        follower.begin(2)  # a second: the leader hears of both, and they are not alone
        await until(lambda: not follower.state.alone)
        ticket = follower.begin(1)
        assert (ticket.mode, ticket.alone, ticket.term) == (GuardMode.PLAIN, False, leader.term)


async def test_a_round_of_another_term_counts_nothing(server):
    async with replicas_on(server) as replicas:
        leader = await replicas()
        guard = leader.guard
        for session in (1, 2):
            guard.begin(session)
        guard.measuring_from, guard._length, guard._peak = guard.clock() - 1.0, 10.0, 2
        event = ["x", "e", 0.0, 1, "another", guard.epoch, "spec", False, 5, 0.5]
        leader._apply(json.dumps(event).encode())
        assert guard._tokens == 0.0
        event[4] = leader.term  # the negative control: the same round under its term counts
        event[3] = 2
        leader._apply(json.dumps(event).encode())
        assert guard._tokens == pytest.approx(5.0)
        # A local ticket of another term neither.
        leader.end(1, Ticket(guard.epoch, GuardMode.SPEC, term="another"), 7, 0.5)
        assert guard._tokens == pytest.approx(5.0)


async def test_unreadable_events_are_skipped(server, caplog):
    async with replicas_on(server) as replicas:
        leader = await replicas()
        before = dict(leader.guard._running)
        with caplog.at_level(logging.WARNING, "specdec.gateway.round.policy.shared"):
            for raw in (b"", b"[1]", b'["x", "q", 0.0, 1]', b'["x", "e", 0.0, 1, "t", "no epoch"]'):
                leader._apply(raw)
        assert leader.guard._running == before
        assert sum("unreadable event" in r.message for r in caplog.records) == 4


async def test_a_follower_takes_over_a_crashed_leader_from_what_it_learnt(server, raw):
    async with replicas_on(server) as replicas:
        roles: list[GuardRole] = []
        leader = await replicas()
        follower = await replicas(roles=roles)
        taught = {
            "measured": [[4, "spec", [[90.0, 10.0]]], [4, "plain", [[100.0, 10.0], [98.0, 10.0]]]],
            "since": [[4, 2]],
        }
        restore(leader.guard, taught)
        leader._learnt_epoch = -1  # an epoch closed: published with the next renewal
        await until(lambda: raw.get("specdec:guard:learnt") is not None)
        # The leader's process dies: no release, its lease runs out.
        for task in leader._tasks:
            task.cancel()
        await asyncio.gather(*leader._tasks, return_exceptions=True)
        leader._tasks, leader.role = [], GuardRole.ALONE  # (its close() releases nothing now)
        await until(lambda: follower.role is GuardRole.LEADER)
        assert roles == [GuardRole.FOLLOWER, GuardRole.LEADER]
        assert learnt(follower.guard) == taught
        assert follower.guard.rates(4) == {GuardMode.SPEC: 9.0, GuardMode.PLAIN: 9.9}
        assert State.decode(raw.get("specdec:guard:state")).term == follower.term


async def test_a_leader_that_closes_releases_the_lease(server, raw):
    async with replicas_on(server) as replicas:
        leader = await replicas()
        assert raw.get("specdec:guard:leader") is not None
        await leader.close()
        assert raw.get("specdec:guard:leader") is None
        assert raw.get("specdec:guard:state") is None


async def test_a_leader_whose_lease_was_taken_follows_and_writes_nothing(server, raw):
    async with replicas_on(server) as replicas:
        leader = await replicas()
        raw.set("specdec:guard:leader", "someone-else", px=5000)
        taken = State("someone-else", 7, GuardMode.PLAIN, False).encode()
        raw.set("specdec:guard:state", taken, px=5000)
        await until(lambda: leader.role is GuardRole.FOLLOWER)
        await until(lambda: leader.state is not None)
        assert leader.state.term == "someone-else"
        assert raw.get("specdec:guard:state").decode() == taken


async def test_without_redis_a_replica_decides_alone_then_rejoins(server):
    async with replicas_on(server) as replicas:
        roles: list[GuardRole] = []
        guard = await replicas(roles=roles)
        assert guard.role is GuardRole.LEADER
        server.stop()
        await until(lambda: guard.role is GuardRole.ALONE)
        ticket = guard.begin(1)  # its own guard decides, its tickets count there
        assert ticket.term == guard.term
        guard.end(1, ticket, 3, 0.1)
        assert guard.guard.round_seconds[GuardMode.SPEC] == pytest.approx(0.1)
        server.start()  # empty: no one leads
        await until(lambda: guard.role is GuardRole.LEADER)
        assert roles == [GuardRole.LEADER, GuardRole.ALONE, GuardRole.LEADER]


def test_poll_must_be_well_within_the_lease():
    with pytest.raises(ValueError, match="poll"):
        SharedGuard(None, GoodputGuard, lease=0.3, poll=0.1)  # type: ignore[arg-type]


async def test_events_emitted_while_a_send_is_in_flight_all_arrive(server, raw):
    """A follower's rounds go on emitting while its last events are on their way: none of
    them is lost (the negative control: each event once, in order)."""
    async with replicas_on(server) as replicas:
        await replicas()  # the leader
        follower = await replicas()
        for session in range(200):
            follower.begin(session)
            if session % 10 == 0:
                await asyncio.sleep(0)  # the sender runs between some of them
        await until(lambda: raw.xlen("specdec:guard:events") >= 200)
        await asyncio.sleep(0.2)
        sent = [json.loads(f[b"e"]) for _, f in raw.xrange("specdec:guard:events")]
        assert [e[3] for e in sent] == list(range(200))
        assert follower.dropped == 0
        # The stream outlives its last event by STREAM_TTL, not forever.
        assert 0 < raw.ttl("specdec:guard:events") <= STREAM_TTL


async def test_a_fault_in_a_step_is_logged_and_the_leader_reads_on(server, caplog):
    """An unexpected fault while counting an event (a stand-in: the guard's begin raises
    once) is logged; the leader's reading goes on and counts the next events."""
    async with replicas_on(server) as replicas:
        leader = await replicas()
        follower = await replicas()
        real, faults = leader.guard.begin, []

        def faulty(session):
            if not faults:
                faults.append(session)
                raise RuntimeError("a stand-in fault")
            return real(session)

        leader.guard.begin = faulty
        with caplog.at_level(logging.ERROR, "specdec.gateway.round.policy.shared"):
            follower.begin(1)
            await until(lambda: faults)
            follower.begin(2)
            await until(lambda: (follower.replica, 2) in leader.guard._running)
        assert any("a step failed" in r.message for r in caplog.records)


async def test_close_ends_a_step_that_swallowed_its_cancel(server):
    """A step whose Redis call turns the cancel into an error of its own returns as if it
    had failed; `close` still ends (a bound for a hung close, not a measure of speed)."""
    client = aioredis.Redis.from_url(server.url, socket_timeout=0.5)
    guard = SharedGuard(client, GoodputGuard, lease=LEASE, poll=POLL)

    async def swallowing() -> None:
        # as redis-py may, raising a connection error of its own instead
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)

    guard._send = swallowing
    await guard.start()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(guard.close(), timeout=30)
    await client.aclose()
