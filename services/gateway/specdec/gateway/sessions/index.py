"""SessionIndex: session records in Redis, with a local fallback while Redis is down.

A put replaces the whole hash (format in specdec.gateway.sessions.record) and sets its TTL
in one MULTI/EXEC, so a record is never half written and every put refreshes the TTL;
reads refresh nothing. Any gateway replica can read any session, and a gateway restart
loses none.

Redis down degrades, never crashes: every call has short socket timeouts, a Redis error is
logged (a WARNING, at most once per ``warn_interval`` seconds per kind of error), counted in
``specdec_gateway_session_store_errors_total{op}``, and the call falls back to a bounded
in-process LRU copy (write-through on every put, filled on every successful get). Records
written locally during an outage are written back to Redis as soon as it answers again (and
by the next successful ``get`` of that session), unless Redis holds a newer one. A session
Redis lacks (it restarted without its data, or evicted it) but the local copy holds is
written back and used too, never read as a new session, and so is this gateway's copy of
a record Redis holds an older version of (a write it took and lost: restarted from an AOF
without its last second) (``specdec_gateway_sessions_restored_total{why}``; a WARNING
names a missing one). ``url=None`` runs
without Redis: sessions live only in the local copy (still bounded and still expiring).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from specdec.common.errors import SpecdecError
from specdec.gateway.observe import metrics
from specdec.gateway.observe.tracing import redis_failed, redis_op
from specdec.gateway.sessions.local import LocalCopy, LocalEntry
from specdec.gateway.sessions.record import (
    SessionRecord,
    decode_record,
    encode_record,
    validate_session_id,
)

log = logging.getLogger(__name__)

OPS = ("get", "put", "delete", "ping", "lock")

# Module-level, so any number of SessionIndex objects share one registration.
STORE_ERRORS = Counter(
    "specdec_gateway_session_store_errors_total",
    "Session store (Redis) operations that failed and fell back to the local copy.",
    ["op"],
)
STORE_UP = Gauge(
    "specdec_gateway_session_store_up",
    "1 if the last session store (Redis) operation succeeded, else 0.",
)
for _op in OPS:
    STORE_ERRORS.labels(op=_op)

# Errors that mean "the store is unavailable or misbehaving": degrade, never raise.
STORE_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


class LockLost(SpecdecError):
    """A fenced write found that another turn took the session: its lock holds another
    value, or a newer fencing token was drawn or written."""

    code = grpc.StatusCode.ABORTED


# The next fencing token of a session (KEYS: counter, record): above the last one drawn and
# the one of the stored record, and at least the server's clock in microseconds (exact in
# Lua's doubles until the year 2255), so a Redis restart that lost both never reuses one.
NEXT_FENCE_LUA = """
local function next_fence(counter_key, record_key)
  local t = redis.call('time')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('get', counter_key) or '0')
  local stored = tonumber(redis.call('hget', record_key, 'fence') or '0')
  return math.max(last + 1, stored + 1, now)
end
"""

# Write the record (KEYS[1]) only while the turn lock (KEYS[2]) holds the writer's value
# (ARGV[1]) and no newer fencing token than the writer's (ARGV[4]) was drawn (the counter,
# KEYS[3]) or written (the record's fence): the fence that keeps a turn whose lease lapsed
# from overwriting a newer turn. A lock held by nobody (it lapsed, or Redis restarted and
# lost it) is taken back (PX ARGV[3]). Token 0 (the lock was taken while Redis was
# unreachable) draws one now, unless a newer turn was written meanwhile: the stored
# record's turn count is at least this record's (ARGV[5]). ARGV[2] is the record's TTL in
# seconds, ARGV[6..] its field / value pairs. Returns the token written, 0 if refused.
_PUT_FENCED = (
    NEXT_FENCE_LUA
    + """
local holder = redis.call('get', KEYS[2])
if holder and holder ~= ARGV[1] then return 0 end
local fence = tonumber(ARGV[4])
if fence == 0 then
  local turns = tonumber(redis.call('hget', KEYS[1], 'turns') or '0')
  if turns >= tonumber(ARGV[5]) then return 0 end
  fence = next_fence(KEYS[3], KEYS[1])
else
  if tonumber(redis.call('get', KEYS[3]) or '0') > fence then return 0 end
  if tonumber(redis.call('hget', KEYS[1], 'fence') or '0') > fence then return 0 end
end
if not holder then redis.call('set', KEYS[2], ARGV[1], 'PX', ARGV[3]) end
local token = string.format('%.0f', fence)
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], unpack(ARGV, 6))
redis.call('hset', KEYS[1], 'fence', token)
redis.call('expire', KEYS[1], ARGV[2])
redis.call('set', KEYS[3], token, 'EX', ARGV[2])
return fence
"""
)

# Write a record back from this gateway's copy (KEYS[1]; ARGV[1] its TTL in seconds,
# ARGV[2] its updated_at, ARGV[3..] its field / value pairs) unless Redis holds one written
# at the same time or later (0), or the session was deleted after the copy was written (-1:
# its tombstone, KEYS[2], holds the deletion time). 1 if written.
_RESTORE = """
local deleted = tonumber(redis.call('get', KEYS[2]) or '0')
if deleted >= tonumber(ARGV[2]) then return -1 end
local stored = redis.call('hget', KEYS[1], 'updated_at')
if stored and tonumber(stored) and tonumber(stored) >= tonumber(ARGV[2]) then return 0 end
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], unpack(ARGV, 3))
redis.call('expire', KEYS[1], ARGV[1])
return 1
"""
# Delete a record (KEYS[1]) and leave a tombstone (KEYS[2]: the deletion time, ARGV[1]) for
# as long as the record would have lived (ARGV[2] seconds if it had no TTL), so that no
# gateway writes its older copy back.
_DELETE = """
local ttl = redis.call('ttl', KEYS[1])
if ttl <= 0 then ttl = tonumber(ARGV[2]) end
redis.call('del', KEYS[1])
redis.call('set', KEYS[2], ARGV[1], 'EX', ttl)
return 1
"""


class _Restore(enum.IntEnum):
    """What writing a local copy back did."""

    FAILED = -2  # Redis failed
    DELETED = -1  # the session was deleted after the copy was written
    NEWER = 0  # Redis holds a record written at the same time or later
    WRITTEN = 1


@dataclass(frozen=True)
class Fence:
    """What a fenced session write checks in Redis (SessionIndex.put): a turn lease's lock,
    its value, and its fencing token (specdec.gateway.sessions.turns)."""

    lock_key: str
    counter_key: str
    value: str  # the lock's value while the lease holds it
    lock_ms: int  # the lease length, for a write that takes a lapsed lock back
    number: int  # the fencing token (0: a lease taken while Redis was unreachable)


@dataclass
class _WarnLimiter:
    interval: float
    last: dict[str, float] = field(default_factory=dict)

    def should_log(self, kind: str) -> bool:
        now = time.monotonic()
        last = self.last.get(kind)
        if last is not None and now - last < self.interval:
            return False
        self.last[kind] = now
        return True


class SessionIndex:
    """Session records in Redis with a bounded local LRU fallback (see the module docstring)."""

    warn_interval = 10.0  # seconds between two warnings for the same kind of error

    def __init__(
        self,
        url: str | None,
        *,
        default_ttl: int = 3600,
        local_capacity: int = 1024,
        key_prefix: str = "specdec:session:",
        op_timeout: float = 0.5,
    ) -> None:
        if default_ttl <= 0:
            raise ValueError(f"default_ttl must be > 0 seconds, got {default_ttl}")
        if op_timeout <= 0:
            raise ValueError(f"op_timeout must be > 0 seconds, got {op_timeout}")
        self.url = url
        self.default_ttl = int(default_ttl)
        self.key_prefix = key_prefix
        self.op_timeout = float(op_timeout)
        self.local = LocalCopy(int(local_capacity))
        self._limiter = _WarnLimiter(self.warn_interval)
        self._available = url is not None
        self._flush: asyncio.Future[None] | None = (
            None  # writing dirty records back after an outage
        )
        self.redis: aioredis.Redis | None = None
        if url is not None:
            # One retry without backoff: enough to replace a pooled connection that went stale
            # (Redis restarted) transparently, short enough to degrade fast when it is down.
            self.redis = aioredis.Redis.from_url(
                url,
                socket_timeout=self.op_timeout,
                socket_connect_timeout=self.op_timeout,
                retry=Retry(NoBackoff(), 1),
                decode_responses=False,
            )

    # -- public API ---------------------------------------------------------------------------

    @property
    def redis_available(self) -> bool:
        """Whether the last Redis operation succeeded (always False without Redis)."""
        return self._available

    def key(self, session_id: str) -> str:
        return self.key_prefix + validate_session_id(session_id)

    @redis_op("get")
    async def get(self, session_id: str) -> SessionRecord | None:
        """The session's record, or None. Falls back to the local copy if Redis fails."""
        key = self.key(session_id)
        if self.redis is None:
            return self.local.get(session_id)
        for _ in range(2):  # again once if another gateway wrote it while ours was restored
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hgetall(key)
                    pipe.pttl(key)
                    raw, pttl = await pipe.execute()
            except STORE_FAILURES as e:
                self.failed("get", e)
                return self.local.get(session_id)
            self.succeeded()
            remote: SessionRecord | None = None
            if raw:
                try:
                    remote = decode_record(session_id, raw)
                except (ValueError, KeyError, UnicodeDecodeError) as e:
                    self._warn(
                        "corrupt", f"session {session_id!r}: unreadable record in Redis: {e}"
                    )
                    remote = None
            entry = self.local.entry(session_id)
            if entry is None or not (remote is None or remote.updated_at < entry.record.updated_at):
                break
            # Redis lacks the session (it restarted without persistence, or evicted it), or
            # holds an older record than this gateway's copy: one written here during an
            # outage, or a write Redis took and then lost (restarted from an AOF that had
            # not yet got it: appendfsync everysec): write ours back.
            restored = await self._write_back(key, entry, _why(entry, remote))
            if restored is _Restore.DELETED:
                self.local.pop(session_id)
                return None
            if restored is not _Restore.NEWER:
                return entry.record.copy()
        if remote is None:
            return None
        # The local copy expires with the Redis key (PTTL -1: no expiry there; keep the default).
        expires_in = pttl / 1000 if isinstance(pttl, int) and pttl > 0 else self.default_ttl
        self.local.put(remote, expires_in, dirty=False)
        return remote.copy()

    @redis_op("put")
    async def put(
        self,
        record: SessionRecord,
        ttl_seconds: int | None = None,
        fence: Fence | None = None,
    ) -> None:
        """Store the record (replacing any previous one), set ``updated_at`` and the TTL.

        fence: a turn lease's (specdec.gateway.sessions.turns). Redis then takes the write
        only while that lock holds the lease's value, or holds nothing, and no newer fencing
        token was drawn or written (the lock is taken back), atomically; otherwise LockLost
        and nothing is written. The record's ``fence`` becomes the token written. With Redis
        unreachable the local copy takes it (this process's lock is the fence).
        """
        key = self.key(record.session_id)
        ttl = self.default_ttl if ttl_seconds is None else int(ttl_seconds)
        if ttl <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        record.updated_at = time.time()
        fields = encode_record(record)  # validates the tokens before anything is stored
        if self.redis is None:
            self.local.put(record, ttl, dirty=False)
            return
        try:
            if fence is None:
                await self._write(key, fields, ttl)
            else:
                record.fence = await self._write_fenced(key, fields, ttl, fence)
        except STORE_FAILURES as e:
            self.failed("put", e)
            self.local.put(record, ttl, dirty=True)
            return
        self.succeeded()
        self.local.put(record, ttl, dirty=False)

    @redis_op("delete")
    async def delete(self, session_id: str) -> None:
        """Forget the session (locally at once; in Redis if it is reachable)."""
        key = self.key(session_id)
        self.local.pop(session_id)
        if self.redis is None:
            return
        try:  # the tombstone keeps other gateways from writing their copies back
            await self.redis.eval(
                _DELETE, 2, key, self._tombstone(key), time.time(), self.default_ttl
            )
        except STORE_FAILURES as e:
            self.failed("delete", e)
            return
        self.succeeded()

    @redis_op("ping")
    async def ping(self) -> bool:
        """True if Redis answers; False without Redis or when it is unreachable."""
        if self.redis is None:
            return False
        try:
            await self.redis.ping()
        except STORE_FAILURES as e:
            self.failed("ping", e)
            return False
        self.succeeded()
        return True

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        if self.redis is not None:
            redis, self.redis = self.redis, None
            try:
                await redis.aclose()
            except STORE_FAILURES as e:  # closing a dead connection must not fail shutdown
                log.debug("closing the session store: %s", e)
            self._available = False

    async def __aenter__(self) -> SessionIndex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def local_size(self) -> int:
        """Records in the local LRU copy (including expired ones not yet dropped)."""
        return len(self.local)

    # -- health accounting (shared with the turn locks) -------------------------------------

    def failed(self, op: str, error: BaseException) -> None:
        redis_failed(error)
        STORE_ERRORS.labels(op=op).inc()
        STORE_UP.set(0)
        self._available = False
        kind = type(error).__name__
        self._warn(
            kind,
            f"session store (Redis) {op} failed ({kind}: {error}); continuing with the local "
            f"in-process copy, without cross-replica session affinity",
        )

    def succeeded(self) -> None:
        STORE_UP.set(1)
        if not self._available:
            log.info("session store (Redis) reachable again")
            if self.local.dirty() and (self._flush is None or self._flush.done()):
                # Records written here during the outage go back now, not at their next
                # read here: another gateway may continue those sessions first.
                self._flush = asyncio.ensure_future(self._write_back_dirty())
        self._available = True

    async def _write_back_dirty(self) -> None:
        for session_id in self.local.dirty():
            entry = self.local.entry(session_id)
            if entry is None or not entry.dirty or self.redis is None:
                continue
            outcome = await self._write_back(self.key(session_id), entry, "outage")
            if outcome is _Restore.FAILED:
                return  # unreachable again: the next success starts over
            if outcome is _Restore.DELETED:
                self.local.pop(session_id)

    def _warn(self, kind: str, message: str) -> None:
        if self._limiter.should_log(kind):
            log.warning(message)

    # -- Redis ----------------------------------------------------------------------------

    async def _write(self, key: str, fields: dict[str, bytes | str], ttl: int) -> None:
        assert self.redis is not None
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, items=_pairs(fields))
            pipe.expire(key, ttl)
            await pipe.execute()

    async def _write_fenced(
        self, key: str, fields: dict[str, bytes | str], ttl: int, fence: Fence
    ) -> int:
        """Write under the fence; the fencing token written, or LockLost."""
        assert self.redis is not None
        written = await self.redis.eval(
            _PUT_FENCED,
            3,
            key,
            fence.lock_key,
            fence.counter_key,
            fence.value,
            ttl,
            fence.lock_ms,
            fence.number,
            fields["turns"],
            *_pairs(fields),
        )
        if not written:
            self.succeeded()
            raise LockLost(
                f"session {key[len(self.key_prefix) :]!r}: this turn's lease lapsed and "
                "another turn took the session; this turn's history was not saved"
            )
        return int(written)

    def _tombstone(self, key: str) -> str:
        # "specdec:session-deleted:<id>": outside the records' namespace for any session id.
        return self.key_prefix.rstrip(":") + "-deleted:" + key[len(self.key_prefix) :]

    async def _write_back(self, key: str, entry: LocalEntry, why: str) -> _Restore:
        """Write the local copy back (see _RESTORE); FAILED when Redis failed meanwhile
        (the local copy serves)."""
        record = entry.record
        remaining = max(1, round(entry.expires_at - time.monotonic()))
        fields = encode_record(record)
        assert self.redis is not None
        try:
            got = await self.redis.eval(
                _RESTORE,
                2,
                key,
                self._tombstone(key),
                remaining,
                fields["updated_at"],
                *_pairs(fields),
            )
        except STORE_FAILURES as e:
            self.failed("put", e)
            return _Restore.FAILED
        outcome = _Restore(int(got))
        if outcome is not _Restore.DELETED:
            entry.dirty = False  # Redis holds it, or a record as new or newer
        if outcome is not _Restore.WRITTEN:
            return outcome
        metrics.SESSIONS_RESTORED.labels(why=why).inc()
        if why == "missing":
            self._warn(
                "restored",
                f"session {record.session_id!r} was missing from the session store (Redis "
                "restarted without its data, or evicted it); restored from this gateway's "
                f"copy ({record.turns} turns, {len(record.tokens)} tokens): see "
                "specdec_gateway_sessions_restored_total",
            )
        else:
            log.info("session %r: local copy written back to the session store", record.session_id)
        return outcome


def _why(entry: LocalEntry, remote: SessionRecord | None) -> str:
    """Why this gateway's copy is written back (specdec_gateway_sessions_restored_total)."""
    if entry.dirty:
        return "outage"  # written here while Redis was unreachable
    return "missing" if remote is None else "stale"  # Redis lost it, or its last write


def _pairs(fields: dict[str, bytes | str]) -> list[bytes | str]:
    """A record's hash fields as HSET's arguments: field, value, field, value, ..."""
    return [x for pair in fields.items() for x in pair]
