"""One turn at a time per session, across gateway replicas: a lease that lives with its holder.

A turn holds the session in this process and, when Redis is reachable, in Redis: the key
``<prefix>-lock:<id>`` holds ``<holder>|<lease ms>|<nonce>`` (the holding gateway, its lease
length, a value no other turn has) with a short TTL, the *lease*.

- **The lease lives with its holder.** A `TurnLease` renews it every quarter of its length
  from a task of its own, independent of how long a round or a stream reader takes. A
  gateway that dies stops renewing: its lease lapses within one lease length (seconds,
  ``--turn-lease``), and a turn retried on another gateway is then served. A waiting turn
  reads from the lock's remaining TTL when the holder last renewed it; a holder that missed
  two renewals has *stopped answering*, and the waiting turn waits for its lease to lapse
  (at most one lease length) instead of giving up after ``wait_seconds``.
- **Fenced.** Taking the lock draws a *fencing token*: a number larger than any earlier one
  for the session (``<prefix>-fence:<id>`` and the record's own ``fence``), at least the
  Redis server's clock in microseconds, so tokens keep increasing across a Redis restart
  that lost everything. The session write names the lease (`Fence`): Redis takes it, in
  one script, only while the lock holds the lease's value and no newer token was drawn or
  written; a holder that was paused past its lease (another turn took the session) is
  refused whatever it writes late. A lock held by nobody (it lapsed with no other taker,
  or Redis restarted and lost it) is taken back by the renewal or the write when no newer
  token was drawn meanwhile, so a Redis restart mid-turn costs nothing.
- **No stale lock outlives a Redis outage.** A release that fails (Redis unreachable) is
  kept and retried until Redis answers; this gateway's next turn of the session retries it
  first. A lease restored by an append-only-file replay lapses by itself within one lease
  length of its last renewal, as every lease does: nothing but renewal keeps one.
- **Acquisition waits briefly and is cancel-safe.** A session that is busy is retried for
  up to ``wait_seconds`` (a turn sent right after a cancel finds the cancelled turn still
  cleaning up for a few milliseconds; it must not be refused). A caller cancelled during
  acquisition leaves nothing held: the local claim is dropped and a Redis lock that may
  have been set is deleted (only with its own value).

Release and renewal only act for the holder's value. With Redis unreachable only this
process's lock holds (fencing token 0: the write then takes the lock and a token itself,
unless a newer turn was written meanwhile, by the record's turn count).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from specdec.common.errors import SpecdecError
from specdec.gateway.job import TURN_LEASE_SECONDS
from specdec.gateway.observe import metrics
from specdec.gateway.observe.tracing import redis_op
from specdec.gateway.sessions.index import (
    NEXT_FENCE_LUA,
    STORE_FAILURES,
    Fence,
    SessionIndex,
)
from specdec.gateway.sessions.record import validate_session_id

_T = TypeVar("_T")

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = TURN_LEASE_SECONDS  # --turn-lease
RENEWALS_PER_LEASE = 4
# A holder that missed this many renewals has stopped answering (its lease will lapse).
MISSED_RENEWALS = 2

# Take the lock (KEYS: lock, counter, record; ARGV: value, lease ms): {1, fence} or, when
# held, {0, the holder's value, its PTTL}. The counter lives as long as the record (or the
# lease, for a session with no record yet).
_ACQUIRE = (
    NEXT_FENCE_LUA
    + """
local held = redis.call('get', KEYS[1])
if held then return {0, held, redis.call('pttl', KEYS[1])} end
local fence = next_fence(KEYS[2], KEYS[3])
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
local keep = math.max(tonumber(ARGV[2]), redis.call('pttl', KEYS[3]))
redis.call('set', KEYS[2], string.format('%.0f', fence), 'PX', keep)
return {1, fence}
"""
)
# Renew the lease (KEYS: lock, counter; ARGV: value, lease ms, fence): 1 if this turn holds
# it, or held it and nobody else took it since (it lapsed, or Redis restarted: taken back);
# 0 if another turn took the session.
_RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
if holder then return 0 end
local fence = tonumber(ARGV[3])
if fence > 0 and tonumber(redis.call('get', KEYS[2]) or '0') > fence then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Release the lock if this turn holds it (KEYS: lock; ARGV: value).
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)

# Pause between two tries of a busy session's lock (seconds); of a lock whose holder
# stopped answering (waiting for it to lapse); between two retries of failed releases.
_RETRY_INTERVAL = 0.02
_LAPSE_POLL = 0.05
_RELEASE_RETRY_INTERVAL = 0.25
# A turn refused by a live holder is told to retry after this long (the holder's turn is
# running; nothing says when it ends).
BUSY_RETRY_AFTER = 1.0


class SessionBusy(SpecdecError):
    """The session has a turn in flight (its lock is held): ABORTED, with when to retry."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, details: str, retry_after: float):
        super().__init__(details)
        self.retry_after = retry_after


class SessionLost(SpecdecError):
    """The session holds fewer turns than the request expected: its history was lost (the
    session store restarted without its data and no gateway had a copy)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    error_code = "session_lost"


@dataclass(eq=False)
class TurnLease:
    """A held turn lock: its value (``token``), its fencing token, whether it was lost."""

    session_id: str
    token: str
    key: str
    ttl_seconds: float
    number: int = 0  # fencing token (0: taken while Redis was unreachable)
    lost: bool = False
    _keepalive: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def fence(self) -> Fence:
        return Fence(
            self.key,
            fence_key(self.key),
            self.token,
            max(1, int(self.ttl_seconds * 1000)),
            self.number,
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a session's turn lock, as a refused turn reports it.

    here: this process (the turn runs on this gateway). Otherwise, from Redis: the holding
    gateway, its lease length, how long ago it last renewed it and when it lapses (the
    lock's remaining TTL) unless renewed.
    """

    gateway: str
    here: bool = False
    lease: float = 0.0  # seconds
    lapses_in: float = 0.0  # seconds
    value: str = ""  # the lock's value in Redis

    @property
    def renewed_ago(self) -> float:
        return max(0.0, self.lease - self.lapses_in)

    @property
    def stopped(self) -> bool:
        """The holder missed MISSED_RENEWALS renewals: it stopped answering."""
        if self.here or self.lease <= 0:
            return False
        return self.renewed_ago > self.lease * MISSED_RENEWALS / RENEWALS_PER_LEASE

    @property
    def retry_after(self) -> float:
        """Seconds after which a retry may be served: the lapse of a holder that stopped
        answering, else BUSY_RETRY_AFTER."""
        return max(self.lapses_in, 0.001) if self.stopped else BUSY_RETRY_AFTER

    def describe(self, session_id: str) -> str:
        if self.here:
            return (
                f"session {session_id!r} has a turn in progress on this gateway; send a "
                "session's turns one after another"
            )
        if self.stopped:
            return (
                f"session {session_id!r} is locked by gateway {self.gateway}, which stopped "
                f"answering: it has not renewed its turn lease for {self.renewed_ago:.1f} s; "
                f"the lease lapses in {self.lapses_in:.1f} s, then the session's next turn "
                "is served"
            )
        return (
            f"session {session_id!r} has a turn in progress on gateway {self.gateway} (its "
            f"lease was renewed {self.renewed_ago:.1f} s ago and lapses {self.lease:g} s "
            "after that gateway stops renewing it); send a session's turns one after another"
        )

    def error(self, session_id: str) -> SessionBusy:
        return SessionBusy(self.describe(session_id), self.retry_after)

    @classmethod
    def parse(cls, value: bytes | str, pttl: int) -> Holder:
        """From the lock's value and PTTL (ms) in Redis."""
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.rsplit("|", 2)
        lease_ms = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0
        gateway = parts[0] if len(parts) == 3 else "(unknown)"
        lapses = pttl / 1000 if pttl > 0 else float(lease_ms) / 1000
        return cls(gateway, lease=lease_ms / 1000, lapses_in=lapses, value=text)


def fence_key(lock_key: str) -> str:
    """The key of the session's fencing-token counter, beside its lock."""
    return lock_key.replace("-lock:", "-fence:", 1)


def holder_id() -> str:
    """This gateway, as its locks name it: host, process and a nonce per TurnLocks."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class TurnLocks:
    """Turn locks over a SessionIndex's Redis connection (and its failure accounting)."""

    def __init__(self, index: SessionIndex, holder: str | None = None):
        self.index = index
        self.holder = holder or holder_id()
        self._held: set[str] = set()  # sessions with a turn in flight in this process
        self._cleanup: set[asyncio.Future[Any]] = set()
        self._unreleased: dict[str, str] = {}  # lock key -> value whose release failed
        self._release_retry: asyncio.Future[None] | None = None

    async def lock(
        self,
        session_id: str,
        ttl_seconds: float = DEFAULT_LEASE_SECONDS,
        wait_seconds: float = 0.0,
    ) -> TurnLease | None:
        """`acquire`, None when the session stayed busy."""
        got = await self.acquire(session_id, ttl_seconds, wait_seconds)
        return got if isinstance(got, TurnLease) else None

    @redis_op("lock")
    async def acquire(
        self,
        session_id: str,
        ttl_seconds: float = DEFAULT_LEASE_SECONDS,
        wait_seconds: float = 0.0,
        *,
        wait_for_lapse: bool = True,
    ) -> TurnLease | Holder:
        """Claim the session for one turn, trying for up to wait_seconds (and, while its
        holder has stopped answering and wait_for_lapse, until that lease lapses): the
        lease (kept alive until `unlock`), or who holds the session."""
        validate_session_id(session_id)
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        started = time.monotonic()
        deadline = started + wait_seconds
        outlived = False  # waited for the lease of a holder that stopped answering
        while True:
            got = await self._try_lock(session_id, ttl_seconds)
            if isinstance(got, TurnLease):
                break
            now = time.monotonic()
            if got.stopped and wait_for_lapse:
                outlived = True
                deadline = max(deadline, now + min(got.lapses_in, got.lease) + _LAPSE_POLL)
            if now >= deadline:
                break
            await asyncio.sleep(_LAPSE_POLL if got.stopped else _RETRY_INTERVAL)
        waited = time.monotonic() - started
        if not isinstance(got, TurnLease):
            metrics.TURN_LOCK_WAIT.labels(outcome="busy").observe(waited)
            return got
        metrics.TURN_LOCK_WAIT.labels(outcome="acquired").observe(waited)
        if outlived:
            metrics.TURN_LEASES_LAPSED.labels(holder="other").inc()
            log.info(
                "turn lock of a gateway that stopped answering lapsed; the session is served here",
                extra={"session_id": session_id, "waited_s": round(waited, 3)},
            )
        if self.index.redis is not None:
            got._keepalive = asyncio.ensure_future(self._keep_alive(got))
        return got

    async def _try_lock(
        self, session_id: str, ttl_seconds: float, *, orphan_dropped: bool = False
    ) -> TurnLease | Holder:
        if session_id in self._held:
            return Holder(self.holder, here=True)
        lease_ms = max(1, int(ttl_seconds * 1000))
        key = self._key(session_id)
        lease = TurnLease(
            session_id, f"{self.holder}|{lease_ms}|{uuid.uuid4().hex}", key, ttl_seconds
        )
        self._held.add(session_id)
        redis = self.index.redis
        if redis is None:
            return lease
        try:
            if key in self._unreleased:  # this gateway's earlier turn of it: release first
                await self._release(key, self._unreleased[key])
            got = await redis.eval(
                _ACQUIRE, 3, key, fence_key(key), self.index.key(session_id), lease.token, lease_ms
            )
        except STORE_FAILURES as e:
            self.index.failed("lock", e)
            return lease  # Redis down: this process's lock alone (fencing token 0)
        except BaseException:
            # Cancelled (or worse) with the script possibly applied: hold nothing.
            self._held.discard(session_id)
            self._spawn(self._delete(key, lease.token))
            raise
        self.index.succeeded()
        if got[0] == 1:
            lease.number = int(got[1])
            return lease
        self._held.discard(session_id)
        holder = Holder.parse(got[1], int(got[2]))
        if holder.gateway == self.holder and not orphan_dropped:
            # A lock of this gateway's own that no turn here holds: a release that never
            # reached Redis (an append-only-file replay can bring one back). Drop it, retry.
            await self._release(key, holder.value)
            return await self._try_lock(session_id, ttl_seconds, orphan_dropped=True)
        return holder

    @redis_op("lock refresh")
    async def refresh(self, lease: TurnLease) -> bool:
        """Renew the lease; False (and the lease marked lost) if another turn took it."""
        redis = self.index.redis
        if redis is None:
            return True
        fence = lease.fence
        try:
            kept = await redis.eval(
                _RENEW, 2, lease.key, fence.counter_key, lease.token, fence.lock_ms, lease.number
            )
        except STORE_FAILURES as e:
            self.index.failed("lock", e)
            return True  # unknown; the fenced write decides
        self.index.succeeded()
        if not kept:
            self.lost(lease)
        return bool(kept)

    def lost(self, lease: TurnLease) -> None:
        """The lease lapsed and another turn took the session (its renewal or its write
        found out): counted once, and this turn's history is not written."""
        if lease.lost:
            return
        lease.lost = True
        metrics.TURN_LEASES_LAPSED.labels(holder="this").inc()
        log.warning(
            "turn lease lapsed and another turn took the session; this turn's history is "
            "not written",
            extra={"session_id": lease.session_id},
        )

    @redis_op("unlock")
    async def unlock(self, lease: TurnLease) -> None:
        """End the turn: stop the keep-alive and drop the lock, even if the caller is being
        cancelled (the Redis delete runs to completion in a task of its own; one that fails
        is retried until Redis answers)."""
        self._held.discard(lease.session_id)
        if lease._keepalive is not None:
            lease._keepalive.cancel()
        if self.index.redis is None:
            return
        task = self._spawn(self._delete(lease.key, lease.token))
        await asyncio.shield(task)

    @property
    def unreleased(self) -> int:
        """Locks whose release failed and waits for Redis to answer."""
        return len(self._unreleased)

    async def close(self) -> None:
        """Stop retrying releases (the service is stopping)."""
        if self._release_retry is not None:
            self._release_retry.cancel()

    async def _keep_alive(self, lease: TurnLease) -> None:
        while not lease.lost and self.index.redis is not None:
            await asyncio.sleep(lease.ttl_seconds / RENEWALS_PER_LEASE)
            await self.refresh(lease)

    async def _delete(self, key: str, value: str) -> None:
        if not await self._release(key, value):
            self._unreleased[key] = value
            if self._release_retry is None or self._release_retry.done():
                self._release_retry = asyncio.ensure_future(self._retry_releases())

    async def _release(self, key: str, value: str) -> bool:
        """Delete the lock if it holds value; False when Redis could not be asked."""
        redis = self.index.redis
        if redis is None:
            return True
        try:
            await redis.eval(_RELEASE, 1, key, value)
        except STORE_FAILURES as e:
            self.index.failed("lock", e)
            return False
        self.index.succeeded()
        if self._unreleased.get(key) == value:
            del self._unreleased[key]
            metrics.TURN_UNLOCKS_RETRIED.inc()
        return True

    async def _retry_releases(self) -> None:
        while self._unreleased and self.index.redis is not None:
            await asyncio.sleep(_RELEASE_RETRY_INTERVAL)
            for key, value in list(self._unreleased.items()):
                if not await self._release(key, value):
                    break  # still unreachable

    def _spawn(self, coro: Awaitable[_T]) -> asyncio.Future[_T]:
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        return task

    def _key(self, session_id: str) -> str:
        # "specdec:session-lock:<id>": outside the records' namespace for any session id.
        return self.index.key_prefix.rstrip(":") + "-lock:" + session_id
