"""SessionIndex against a real redis-server (started per test via RedisProcess; no mocks)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal

import pytest
import redis
from prometheus_client import REGISTRY

from specdec.gateway.sessions import LockLost, SessionIndex, SessionRecord, TurnLease, TurnLocks
from specdec.tools.redisproc import RedisProcess, redis_server_binary

PREFIX = "specdec:session:"
LOGGER = "specdec.gateway.sessions"


@pytest.fixture
def server():
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
async def index(server):
    idx = SessionIndex(server.url)
    yield idx
    await idx.close()


def errors(op: str) -> float:
    return REGISTRY.get_sample_value("specdec_gateway_session_store_errors_total", {"op": op}) or 0


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

    # A record only cached locally (not dirty) is not resurrected: Redis is authoritative.
    assert await idx.get("a") is None
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
