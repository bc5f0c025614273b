"""SessionIndex against a real redis-server (started per test via RedisProcess; no mocks)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading

import pytest
import redis
from prometheus_client import REGISTRY

from specdec.gateway.sessions import (
    Holder,
    LockLost,
    SessionBusy,
    SessionIndex,
    SessionRecord,
    TurnLease,
    TurnLocks,
)
from specdec.tools.redisproc import RedisProcess, redis_server_binary

PREFIX = "specdec:session:"
LOGGER = "specdec.gateway.sessions"


@pytest.fixture
async def index(server):
    idx = SessionIndex(server.url)
    yield idx
    await idx.close()


def errors(op: str) -> float:
    return REGISTRY.get_sample_value("specdec_gateway_session_store_errors_total", {"op": op}) or 0


def restored(why: str) -> float:
    return REGISTRY.get_sample_value("specdec_gateway_sessions_restored_total", {"why": why}) or 0


def store_up() -> float | None:
    return REGISTRY.get_sample_value("specdec_gateway_session_store_up")


def record(sid: str = "s1", n: int = 5, **kw) -> SessionRecord:
    return SessionRecord(session_id=sid, tokens=list(range(100, 100 + n)), **kw)


def store_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == logging.WARNING]


# -- RedisProcess -------------------------------------------------------------------------------


def test_redis_process_start_stop_restart():
    assert redis_server_binary()
    with RedisProcess() as proc:
        assert proc.running and proc.url == f"redis://127.0.0.1:{proc.port}/0"
        client = redis.Redis.from_url(proc.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        port = proc.port
        proc.stop()
        assert not proc.running
        proc.start()
        assert proc.port == port and client.ping()
        client.close()
    assert not proc.running


def test_redis_process_bad_binary_is_a_clear_error():
    with pytest.raises(RuntimeError, match="exited"):
        RedisProcess(binary="/bin/false", startup_timeout=5).start()


def test_redis_server_binary_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="SPECDEC_REDIS_SERVER"):
        redis_server_binary()


# -- Redis up ---------------------------------------------------------------------------------


async def test_round_trip_100k_tokens(index, server, raw):
    rng = random.Random(0)
    tokens = [rng.randrange(0, 2**31 - 1) for _ in range(100_000)] + [0, 2**31 - 1]
    rec = SessionRecord(
        "conv-1",
        tokens,
        drafter="10.0.0.1:50051",
        verifier="10.0.0.2:50052",
        drafter_cached=99_990,
        verifier_cached=99_995,
        turns=7,
    )
    await index.put(rec)
    assert rec.updated_at > 0
    assert index.redis_available

    # Stored compactly: int32 little-endian bytes in one hash field.
    stored = raw.hget(PREFIX + "conv-1", "tokens")
    assert len(stored) == 4 * len(tokens)
    assert int.from_bytes(stored[:4], "little") == tokens[0]

    # Read back through Redis (a fresh index has no local copy).
    other = SessionIndex(server.url)
    got = await other.get("conv-1")
    await other.close()
    assert got == rec
    assert got.tokens == tokens
    assert (got.drafter, got.verifier) == ("10.0.0.1:50051", "10.0.0.2:50052")


async def test_none_replicas_round_trip(index, server):
    await index.put(record("s-none"))
    other = SessionIndex(server.url, local_capacity=0)
    got = await other.get("s-none")
    await other.close()
    assert got.drafter is None and got.verifier is None
    assert got.tokens == list(range(100, 105)) and got.turns == 0


async def test_missing_session_is_none(index):
    assert await index.get("nobody") is None
    assert index.redis_available


async def test_ttl_is_set_and_expires(server, raw):
    idx = SessionIndex(server.url, default_ttl=600)
    await idx.put(record("long"))
    assert 0 < raw.ttl(PREFIX + "long") <= 600

    await idx.put(record("short"), ttl_seconds=1)
    assert 0 < raw.ttl(PREFIX + "short") <= 1
    await asyncio.sleep(1.5)
    assert raw.exists(PREFIX + "short") == 0
    assert await idx.get("short") is None  # the local copy expired too
    assert (await idx.get("long")) is not None
    await idx.close()


async def test_put_refreshes_ttl_get_does_not(index, raw):
    await index.put(record("s"), ttl_seconds=100)
    raw.expire(PREFIX + "s", 50)
    assert await index.get("s") is not None
    assert raw.ttl(PREFIX + "s") <= 50
    await index.put(record("s"), ttl_seconds=100)
    assert raw.ttl(PREFIX + "s") > 50


async def test_bad_ttl_rejected(index):
    with pytest.raises(ValueError):
        await index.put(record(), ttl_seconds=0)
    with pytest.raises(ValueError):
        SessionIndex(None, default_ttl=0)


async def test_two_gateway_replicas_share_sessions(server):
    a = SessionIndex(server.url)
    b = SessionIndex(server.url)
    await a.put(record("shared", n=3, turns=1, drafter="d0"))
    got = await b.get("shared")
    assert got.tokens == [100, 101, 102] and got.drafter == "d0"

    # B continues the conversation; A (which has its own local copy) sees B's update.
    got.tokens += [7, 8, 9]
    got.turns = 2
    got.drafter = "d1"
    await b.put(got)
    seen = await a.get("shared")
    assert seen.tokens == [100, 101, 102, 7, 8, 9] and seen.turns == 2 and seen.drafter == "d1"

    await b.delete("shared")
    assert await a.get("shared") is None
    await a.close()
    await b.close()


async def test_gateway_restart_keeps_sessions(server):
    first = SessionIndex(server.url)
    await first.put(record("survivor", n=10, turns=3))
    await first.close()

    restarted = SessionIndex(server.url)
    got = await restarted.get("survivor")
    await restarted.close()
    assert got is not None and got.turns == 3 and len(got.tokens) == 10


async def test_returned_records_are_copies(index):
    rec = record("c")
    await index.put(rec)
    rec.tokens.append(1)  # the caller's list is not the stored one
    got = await index.get("c")
    assert got.tokens == list(range(100, 105))
    got.tokens.clear()
    assert (await index.get("c")).tokens == list(range(100, 105))


async def test_invalid_tokens_rejected(index):
    with pytest.raises(ValueError):
        await index.put(SessionRecord("t", [2**31]))


async def test_corrupt_record_reads_as_missing(index, raw, caplog):
    raw.hset(PREFIX + "bad", mapping={"v": "1", "tokens": b"abc"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await index.get("bad") is None
    assert any("bad" in r.getMessage() for r in store_warnings(caplog))


async def test_ping(index):
    assert await index.ping() is True
    assert store_up() == 1


# -- Redis down and back ------------------------------------------------------------------------


async def test_redis_down_falls_back_to_local_copy(server, caplog):
    idx = SessionIndex(server.url, op_timeout=0.5)
    await idx.put(record("before", n=4))
    assert idx.redis_available
    before = {op: errors(op) for op in ("get", "put", "delete")}

    server.stop()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = await idx.get("before")  # served from the local copy
        assert got is not None and got.tokens == [100, 101, 102, 103]
        assert not idx.redis_available

        await idx.put(record("during", n=2))  # stored locally only
        assert (await idx.get("during")).tokens == [100, 101]
        assert await idx.get("unknown") is None

        await idx.delete("before")
        assert await idx.get("before") is None
        assert await idx.ping() is False

    assert errors("get") >= before["get"] + 3
    assert errors("put") == before["put"] + 1
    assert errors("delete") == before["delete"] + 1
    assert store_up() == 0
    warnings = store_warnings(caplog)
    assert warnings and "local" in warnings[0].getMessage()

    # Rate-limited: a burst of failures does not add one warning per call.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(20):
            await idx.get("during")
    assert store_warnings(caplog) == []
    await idx.close()


async def test_redis_down_from_the_start(caplog):
    proc = RedisProcess()
    proc.start()
    url = proc.url
    proc.stop()
    idx = SessionIndex(url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await idx.get("x") is None
        await idx.put(record("x"))
        assert (await idx.get("x")).tokens == list(range(100, 105))
    assert not idx.redis_available
    assert store_warnings(caplog)
    await idx.close()


async def test_hung_redis_times_out_and_recovers(server, caplog):
    idx = SessionIndex(server.url, op_timeout=0.2)
    await idx.put(record("h", n=2))
    before = errors("get")
    os.kill(server.pid, signal.SIGSTOP)  # accepts nothing, answers nothing
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            got = await idx.get("h")
        assert got is not None and got.tokens == [100, 101]
        assert not idx.redis_available
        assert errors("get") == before + 1
        assert store_warnings(caplog)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert (await idx.get("h")).tokens == [100, 101]
    assert idx.redis_available
    await idx.close()


async def test_redis_restart_on_same_port_reconnects(server, raw):
    idx = SessionIndex(server.url)
    await idx.put(record("a"))
    server.stop()
    await idx.put(record("written-during-outage", n=3))
    assert not idx.redis_available

    server.start()  # same port, empty (no persistence)
    assert await idx.ping() is True
    assert idx.redis_available and store_up() == 1

    await idx.put(record("after", n=2))
    assert raw.exists(PREFIX + "after") == 1
    assert 0 < raw.ttl(PREFIX + "after") <= 3600

    # The record written during the outage is written back on its next get.
    got = await idx.get("written-during-outage")
    assert got is not None and got.tokens == [100, 101, 102]
    assert raw.exists(PREFIX + "written-during-outage") == 1
    other = SessionIndex(server.url, local_capacity=0)
    assert (await other.get("written-during-outage")).tokens == [100, 101, 102]

    # A record Redis lost (it restarted empty) that this gateway's copy still holds is
    # written back and used (issue 46: never read as a new session), and counted.
    before = restored("missing")
    got = await idx.get("a")
    assert got is not None and got.tokens == [100, 101, 102, 103, 104]
    assert (await other.get("a")).tokens == [100, 101, 102, 103, 104]  # back in Redis
    assert restored("missing") == before + 1
    await other.close()
    await idx.close()


async def test_a_deleted_session_is_not_written_back(server, raw):
    """A session one gateway deleted stays deleted: another gateway's older copy of it is
    not written back (the delete's tombstone), and a newer write is not blocked."""
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    try:
        await a.put(record("gone", n=3))
        assert (await b.get("gone")).tokens == [100, 101, 102]  # B holds a copy
        await a.delete("gone")
        assert await b.get("gone") is None
        assert raw.exists(PREFIX + "gone") == 0
        await asyncio.sleep(0.01)
        await a.put(record("gone", n=2))  # the id used again, later
        assert (await b.get("gone")).tokens == [100, 101]
    finally:
        await a.close()
        await b.close()


async def test_outage_copies_go_back_as_soon_as_redis_answers(server):
    """Records written here during an outage are written back when Redis answers again,
    before any read of them here: another gateway continuing them finds them."""
    a = SessionIndex(server.url)
    b = SessionIndex(server.url, local_capacity=0)
    try:
        server.stop()
        await a.put(record("o1", n=2))
        await a.put(record("o2", n=3))
        server.start()
        before = restored("outage")
        assert await a.ping()  # the first success after the outage
        for _ in range(100):
            if restored("outage") == before + 2:
                break
            await asyncio.sleep(0.02)
        assert (await b.get("o1")).tokens == [100, 101]
        assert (await b.get("o2")).tokens == [100, 101, 102]
        assert restored("outage") == before + 2
        assert a.local.dirty() == []
    finally:
        await a.close()
        await b.close()


async def test_a_write_redis_lost_comes_back_from_the_gateways_copy(server, raw):
    """Redis took a write, answered, and lost it (restarted from an AOF that had not got
    its last second: appendfsync everysec): it holds the session's older record. The
    gateway that wrote the newer one still has it (not dirty: Redis had taken it) and
    writes it back on the next get, counted as why=stale."""
    idx = SessionIndex(server.url)
    await idx.put(record("s", n=1))
    older = raw.hgetall(PREFIX + "s")
    await idx.put(record("s", n=2))  # Redis takes it ...
    raw.delete(PREFIX + "s")
    raw.hset(PREFIX + "s", mapping=older)  # ... and loses it: the older record is back
    before = restored("stale")
    got = await idx.get("s")
    assert got is not None and got.tokens == [100, 101]
    other = SessionIndex(server.url, local_capacity=0)
    assert (await other.get("s")).tokens == [100, 101]  # back in Redis
    assert restored("stale") == before + 1
    await other.close()
    await idx.close()


async def test_newer_record_in_redis_wins_over_outage_copy(server):
    a = SessionIndex(server.url)
    b = SessionIndex(server.url)
    await a.put(record("s", n=1))
    server.stop()
    await a.put(record("s", n=2))  # A's local copy, not in Redis
    server.start()
    await asyncio.sleep(0.01)  # B's write is strictly later
    await b.put(record("s", n=3))
    got = await a.get("s")
    assert got.tokens == [100, 101, 102]
    await a.close()
    await b.close()


# -- no Redis, validation, LRU ----------------------------------------------------------------


async def test_without_redis_purely_local():
    idx = SessionIndex(None)
    assert not idx.redis_available
    assert await idx.ping() is False
    rec = record("local", n=3)
    await idx.put(rec)
    assert rec.updated_at > 0
    assert (await idx.get("local")).tokens == [100, 101, 102]
    await idx.delete("local")
    assert await idx.get("local") is None

    await idx.put(record("brief"), ttl_seconds=1)
    await asyncio.sleep(1.2)
    assert await idx.get("brief") is None
    await idx.close()


@pytest.mark.parametrize("bad", ["", "x" * 257, None, 42])
async def test_bad_session_ids(bad):
    idx = SessionIndex(None)
    with pytest.raises(ValueError):
        await idx.get(bad)
    with pytest.raises(ValueError):
        await idx.delete(bad)
    with pytest.raises(ValueError):
        await idx.put(SessionRecord(bad, [1]))


async def test_longest_session_id_accepted(index):
    sid = "s" * 256
    await index.put(record(sid))
    assert (await index.get(sid)).session_id == sid


async def test_local_lru_capacity():
    idx = SessionIndex(None, local_capacity=3)
    for sid in "abc":
        await idx.put(record(sid))
    assert await idx.get("a") is not None  # a is now most recently used
    await idx.put(record("d"))  # evicts b, the least recently used
    assert idx.local_size() == 3
    assert await idx.get("b") is None
    for sid in "acd":
        assert await idx.get(sid) is not None


async def test_local_lru_capacity_during_outage(server):
    idx = SessionIndex(server.url, local_capacity=2)
    server.stop()
    for sid in ("a", "b", "c"):
        await idx.put(record(sid))
    assert idx.local_size() == 2
    assert await idx.get("a") is None
    assert await idx.get("c") is not None
    await idx.close()


async def test_several_indexes_share_module_metrics(server):
    indexes = [SessionIndex(server.url) for _ in range(3)] + [SessionIndex(None)]
    for idx in indexes:
        await idx.close()


# -- one turn at a time ---------------------------------------------------------------------


async def test_turn_lock_spans_gateway_replicas(server, raw):
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        lease = await la.lock("t", ttl_seconds=30)
        assert lease is not None
        assert await la.lock("t") is None  # same gateway
        assert await lb.lock("t") is None  # another gateway, through Redis
        assert 0 < raw.pttl("specdec:session-lock:t") <= 30_000
        assert raw.exists("specdec:session:t") == 0  # the lock is not a session record
        # Only the holder can release it.
        await lb.unlock(TurnLease("t", "not-the-owner", lease.key, 30))
        assert await lb.lock("t") is None
        lease.ttl_seconds = 60
        assert await la.refresh(lease)
        assert raw.pttl("specdec:session-lock:t") > 30_000
        await la.unlock(lease)
        lease_b = await lb.lock("t")
        assert lease_b is not None
        await lb.unlock(lease_b)
    finally:
        await a.close()
        await b.close()


async def test_turn_lock_expires_if_its_gateway_dies(server):
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        assert await la.lock("gone", ttl_seconds=0.3) is not None
        await a.close()  # the gateway dies without unlocking (its keep-alive stops)
        await asyncio.sleep(0.6)
        assert await lb.lock("gone") is not None
    finally:
        await b.close()


async def test_turn_lock_without_redis_is_local(server):
    index = SessionIndex(server.url)
    locks = TurnLocks(index)
    try:
        server.stop()
        lease = await locks.lock("x")
        assert lease is not None and await locks.lock("x") is None
        await locks.unlock(lease)
        assert await locks.lock("x") is not None
    finally:
        await index.close()


async def test_turn_lock_is_kept_alive_for_the_whole_turn(server, raw):
    """A turn longer than the TTL, with nobody refreshing by hand, keeps its lock."""
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        lease = await la.lock("long", ttl_seconds=0.3)
        assert lease is not None
        await asyncio.sleep(1.2)  # four TTLs of a slow round / a slow stream reader
        assert await lb.lock("long") is None
        assert not lease.lost
        await la.unlock(lease)
        assert raw.exists("specdec:session-lock:long") == 0
        assert await lb.lock("long") is not None
    finally:
        await a.close()
        await b.close()


async def test_turn_lock_acquisition_is_cancel_safe(server, raw):
    """Cancelled while its SET is in flight, a lock attempt leaves nothing held."""
    index = SessionIndex(server.url, op_timeout=5.0)
    locks = TurnLocks(index)
    try:
        raw.execute_command("CLIENT", "PAUSE", "400", "WRITE")  # the SET waits in Redis
        attempt = asyncio.ensure_future(locks.lock("c", ttl_seconds=30))
        await asyncio.sleep(0.1)
        assert not attempt.done()
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        await asyncio.sleep(0.6)  # the pause ends; the SET lands, the cleanup deletes it
        assert raw.exists("specdec:session-lock:c") == 0
        lease = await locks.lock("c", ttl_seconds=30)  # neither this process nor Redis holds it
        assert lease is not None
        await locks.unlock(lease)
    finally:
        await index.close()


async def test_turn_lock_waits_for_a_turn_that_is_ending(server):
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        lease = await la.lock("w", ttl_seconds=30)
        asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(la.unlock(lease)))
        assert await lb.lock("w", wait_seconds=0.05) is None  # still held: busy
        got = await lb.lock("w", wait_seconds=2.0)  # held, then released while waiting
        assert got is not None
        await lb.unlock(got)
    finally:
        await a.close()
        await b.close()


async def test_fenced_write_refuses_a_gateway_that_lost_its_lock(server, raw):
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        old = await la.lock("f", ttl_seconds=30)
        raw.delete("specdec:session-lock:f")  # the lock lapses (Redis saw no refresh)
        new = await lb.lock("f", ttl_seconds=30)  # another gateway runs a newer turn
        assert new is not None
        await b.put(record("f", n=7), fence=new.fence)
        with pytest.raises(LockLost) as err:
            await a.put(record("f", n=3), fence=old.fence)
        assert err.value.code.name == "ABORTED"
        got = await SessionIndex(server.url).get("f")
        assert got is not None and len(got.tokens) == 7  # the newer turn's history stands
        assert not await la.refresh(old) and old.lost  # the keep-alive notices it too
        await lb.unlock(new)
    finally:
        await a.close()
        await b.close()


async def test_a_lock_held_by_nobody_is_taken_back(server, raw):
    """Redis lost the lock (it restarted, or the lock lapsed) and nobody took it: the
    keep-alive and the fenced write take it back, unless a newer turn was written."""
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    try:
        lease = await la.lock("r", ttl_seconds=30)
        raw.delete("specdec:session-lock:r")
        assert await la.refresh(lease) and not lease.lost  # taken back
        assert raw.get("specdec:session-lock:r") == lease.token.encode()
        assert await lb.lock("r") is None
        raw.delete("specdec:session-lock:r")
        await a.put(record("r", n=4, turns=3), fence=lease.fence)  # taken back by the write
        assert raw.get("specdec:session-lock:r") == lease.token.encode()
        raw.delete("specdec:session-lock:r")
        newer = await lb.lock("r", ttl_seconds=30)  # another turn runs and ends
        await b.put(record("r", n=9, turns=4), fence=newer.fence)
        await lb.unlock(newer)
        with pytest.raises(LockLost):  # a newer turn was written: refused
            await a.put(record("r", n=5, turns=4), fence=lease.fence)
        got = await b.get("r")
        assert got is not None and len(got.tokens) == 9
    finally:
        await a.close()
        await b.close()


# -- leases that live with their holder (issue 46) --------------------------------------------


def lapsed(holder: str) -> float:
    return (
        REGISTRY.get_sample_value("specdec_gateway_turn_leases_lapsed_total", {"holder": holder})
        or 0
    )


def lock_waits(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "specdec_gateway_turn_lock_wait_seconds_count", {"outcome": outcome}
        )
        or 0
    )


def unlocks_retried() -> float:
    return REGISTRY.get_sample_value("specdec_gateway_turn_unlocks_retried_total") or 0


@pytest.mark.parametrize("newer_turn", ["writes", "holds", "released"])
async def test_a_paused_holder_cannot_write_after_its_lease_lapsed(server, raw, newer_turn):
    """The fencing token. Gateway A's turn is paused past its lease (its event loop blocked,
    as by a long GC pause or SIGSTOP: no renewal runs); gateway B takes the session. A wakes
    and writes its turn late: refused whether B's newer turn wrote its history, still holds
    the lock, or released it without writing (a failed turn): the newer token was drawn."""
    acquired, resume = threading.Event(), threading.Event()
    late: dict[str, object] = {}

    async def paused_holder() -> None:
        index = SessionIndex(server.url)
        locks = TurnLocks(index)
        try:
            lease = await locks.lock("p", ttl_seconds=0.4)
            assert lease is not None and lease.number > 0
            late["number"] = lease.number
            acquired.set()
            resume.wait(30)  # blocks this loop: the keep-alive cannot renew
            try:
                await index.put(record("p", n=3, turns=1), fence=lease.fence)
                late["result"] = "written"
            except LockLost as e:
                late["result"] = e
            await locks.unlock(lease)
        finally:
            await index.close()

    thread = threading.Thread(target=lambda: asyncio.run(paused_holder()))
    thread.start()
    b = SessionIndex(server.url)
    lb = TurnLocks(b)
    try:
        assert await asyncio.to_thread(acquired.wait, 30)
        before = lapsed("other")
        newer = await lb.acquire("p", ttl_seconds=5, wait_seconds=1.0)  # waits for the lapse
        assert isinstance(newer, TurnLease), newer
        assert newer.number > late["number"]  # the fencing token orders the turns
        assert lapsed("other") == before + 1
        if newer_turn == "writes":
            await b.put(record("p", n=7, turns=1), fence=newer.fence)
        if newer_turn != "holds":
            await lb.unlock(newer)
        resume.set()
        await asyncio.to_thread(thread.join, 30)
        assert isinstance(late["result"], LockLost), late
        assert late["result"].code.name == "ABORTED"
        stored = await SessionIndex(server.url).get("p")
        if newer_turn == "writes":
            assert stored is not None and len(stored.tokens) == 7 and stored.fence == newer.number
        else:
            assert stored is None  # nothing from the lapsed holder
        if newer_turn == "holds":  # and the late writer did not touch the newer lock
            assert raw.get("specdec:session-lock:p") == newer.token.encode()
            await lb.unlock(newer)
    finally:
        resume.set()
        thread.join(30)
        await b.close()


async def test_a_holder_that_stopped_answering_is_named_and_outlived(server):
    """A gateway dies mid-turn (no renewal, no release): a turn elsewhere is told who holds
    the session, that it stopped answering and when its lease lapses, then is served once
    it lapsed; a live holder is named as busy with a short retry hint."""
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a, holder="gw-a"), TurnLocks(b, holder="gw-b")
    try:
        live = await la.lock("d", ttl_seconds=30)
        assert live is not None
        busy = await lb.acquire("d", ttl_seconds=30, wait_seconds=0.0)
        assert isinstance(busy, Holder) and not busy.stopped and busy.gateway == "gw-a"
        assert busy.retry_after == 1.0
        assert "turn in progress on gateway gw-a" in busy.describe("d")
        error = busy.error("d")
        assert isinstance(error, SessionBusy) and error.code.name == "ABORTED"
        await la.unlock(live)

        lease = await la.lock("d", ttl_seconds=2.0)
        assert lease is not None and lease._keepalive is not None
        lease._keepalive.cancel()  # the gateway died: nothing renews the lease
        await asyncio.sleep(1.2)  # more than two missed renewals (every 0.5 s)
        stuck = await lb.acquire("d", ttl_seconds=30, wait_seconds=0.0, wait_for_lapse=False)
        assert isinstance(stuck, Holder) and stuck.stopped, stuck
        assert 0 < stuck.lapses_in <= 1.0 and stuck.retry_after == stuck.lapses_in
        message = stuck.describe("d")
        assert "gw-a, which stopped answering" in message and "lapses in" in message
        waits = lock_waits("acquired")
        served = await lb.acquire("d", ttl_seconds=30, wait_seconds=0.0)  # waits the lapse
        assert isinstance(served, TurnLease)
        assert lock_waits("acquired") == waits + 1
        await lb.unlock(served)
    finally:
        await a.close()
        await b.close()


async def test_a_release_that_failed_while_redis_was_down_is_retried(tmp_path):
    """Redis is SIGKILLed with a turn in flight and restarted from its append-only file,
    which replays the turn's lock; the release that failed meanwhile is retried when Redis
    answers, so no stale lock is left for the session's next turn on any gateway."""
    server = RedisProcess(aof_dir=tmp_path, appendfsync="always").start()
    a, b = SessionIndex(server.url), SessionIndex(server.url)
    la, lb = TurnLocks(a), TurnLocks(b)
    raw = redis.Redis.from_url(server.url)
    try:
        lease = await la.lock("u", ttl_seconds=30)  # a long lease: only the release frees it
        assert lease is not None
        server.kill()
        await la.unlock(lease)  # fails: Redis is down
        assert la.unreleased == 1
        before = unlocks_retried()
        server.start()  # the AOF replays the lock
        deadline = asyncio.get_running_loop().time() + 10
        while la.unreleased and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert la.unreleased == 0
        assert raw.exists("specdec:session-lock:u") == 0
        assert unlocks_retried() == before + 1
        got = await lb.lock("u", ttl_seconds=30)
        assert got is not None
        await lb.unlock(got)
    finally:
        raw.close()
        await a.close()
        await b.close()
        server.stop()


async def test_this_gateways_own_stale_lock_is_dropped_at_once(server, raw):
    """A lock of this gateway that no turn here holds (an append-only-file replay of a
    release that never reached Redis): its next turn of the session drops it and runs."""
    index = SessionIndex(server.url)
    locks = TurnLocks(index, holder="gw-self")
    try:
        raw.set("specdec:session-lock:o", "gw-self|30000|old", px=30_000)
        lease = await locks.lock("o", ttl_seconds=30)
        assert lease is not None and raw.get("specdec:session-lock:o") == lease.token.encode()
        await locks.unlock(lease)
    finally:
        await index.close()


async def test_fencing_tokens_keep_increasing_across_an_empty_restart(server):
    """Tokens are at least Redis's clock in microseconds: a restart that lost the counter
    and the record never hands out a token a lapsed holder from before could beat."""
    index = SessionIndex(server.url)
    locks = TurnLocks(index)
    try:
        first = await locks.lock("m", ttl_seconds=30)
        assert first is not None
        await index.put(record("m", n=2, turns=1), fence=first.fence)
        await locks.unlock(first)
        server.stop()
        server.start()  # empty
        second = await locks.lock("m", ttl_seconds=30)
        assert second is not None and second.number > first.number
        await locks.unlock(second)
    finally:
        await index.close()
