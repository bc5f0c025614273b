"""One turn at a time per session, across gateway replicas.

A turn holds the session in this process and, when Redis is reachable, in Redis
(``SET NX PX`` on ``<prefix>-lock:<id>``), so two gateway replicas cannot run turns of one
session at the same time. The Redis lock expires by itself if its gateway dies.

- **Acquisition waits briefly and is cancel-safe.** A session that is busy is retried for
  up to ``wait_seconds`` (a turn sent right after a cancel finds the cancelled turn still
  cleaning up for a few milliseconds; it must not get ABORTED). A caller cancelled during
  acquisition leaves nothing held: the local claim is dropped and a Redis lock that may
  have been set is deleted (only with its own token).
- **Kept alive for the whole turn.** A `TurnLease` refreshes its Redis lock every third of
  the TTL from a task of its own, independent of how long a round or a stream reader
  takes. A refresh that finds another token (the lock lapsed, e.g. Redis was unreachable
  for longer than the TTL, and another gateway took it) marks the lease lost.
- **Fenced.** The session write names the lease (`fence`): the Redis write happens in one
  script only if the lock still holds the lease's token, so a gateway that lost its lock
  cannot overwrite a newer turn. A lock held by nobody (it lapsed, or Redis restarted and
  lost it) is taken back by the keep-alive, or by the write if no newer turn was written
  meanwhile (the record's turn count), so a Redis restart mid-turn costs nothing.

Release and refresh only act for the holder's token. With Redis unreachable only this
process's lock holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from specdec.gateway.sessions.index import STORE_FAILURES, SessionIndex
from specdec.gateway.sessions.record import validate_session_id
from specdec.gateway.tracing import redis_op

log = logging.getLogger(__name__)

# Release / extend a turn lock only if this gateway still holds it (its token).
_DELETE_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
# Extend the lock if this turn holds it; take it back if nobody does (it lapsed, or Redis
# restarted): no other turn can have started without it. 0: another turn holds it.
_REFRESH_IF_OWNER = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder then return redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
return 0
"""

# Pause between two tries of a busy session's lock (seconds).
_RETRY_INTERVAL = 0.02


@dataclass(eq=False)
class TurnLease:
    """A held turn lock: its token, and whether it was lost while held."""

    session_id: str
    token: str
    key: str
    ttl_seconds: float
    lost: bool = False
    _keepalive: asyncio.Task | None = field(default=None, repr=False)

    @property
    def fence(self) -> tuple[str, str, int]:
        """(lock key, token, TTL in ms): what a fenced session write checks in Redis."""
        return self.key, self.token, int(self.ttl_seconds * 1000)


class TurnLocks:
    """Turn locks over a SessionIndex's Redis connection (and its failure accounting)."""

    def __init__(self, index: SessionIndex):
        self.index = index
        self._held: set[str] = set()  # sessions with a turn in flight in this process
        self._cleanup: set[asyncio.Task] = set()

    @redis_op("lock")
    async def lock(
        self, session_id: str, ttl_seconds: float = 60.0, wait_seconds: float = 0.0
    ) -> TurnLease | None:
        """Claim the session for one turn, trying for up to wait_seconds; the lease (kept
        alive until `unlock`), or None if the session stayed busy."""
        validate_session_id(session_id)
        deadline = time.monotonic() + wait_seconds
        while True:
            lease = await self._try_lock(session_id, ttl_seconds)
            if lease is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_RETRY_INTERVAL)
        if lease is not None and self.index.redis is not None:
            lease._keepalive = asyncio.ensure_future(self._keep_alive(lease))
        return lease

    async def _try_lock(self, session_id: str, ttl_seconds: float) -> TurnLease | None:
        if session_id in self._held:
            return None
        lease = TurnLease(session_id, uuid.uuid4().hex, self._key(session_id), ttl_seconds)
        self._held.add(session_id)
        redis = self.index.redis
        if redis is None:
            return lease
        try:
            taken = await redis.set(lease.key, lease.token, nx=True, px=int(ttl_seconds * 1000))
        except STORE_FAILURES as e:
            self.index.failed("lock", e)
            return lease  # Redis down: this process's lock alone
        except BaseException:
            # Cancelled (or worse) with the SET possibly applied: hold nothing.
            self._held.discard(session_id)
            self._spawn(self._delete(lease))
            raise
        self.index.succeeded()
        if not taken:
            self._held.discard(session_id)
            return None
        return lease

    @redis_op("lock refresh")
    async def refresh(self, lease: TurnLease) -> bool:
        """Extend the Redis lock; False (and the lease marked lost) if another holds it."""
        redis = self.index.redis
        if redis is None:
            return True
        try:
            kept = await redis.eval(
                _REFRESH_IF_OWNER, 1, lease.key, lease.token, int(lease.ttl_seconds * 1000)
            )
        except STORE_FAILURES as e:
            self.index.failed("lock", e)
            return True  # unknown; the fenced write decides
        self.index.succeeded()
        if not kept and not lease.lost:
            lease.lost = True
            log.warning(
                "turn lock lost (it lapsed and may be held elsewhere); this turn's history "
                "will not be written",
                extra={"session_id": lease.session_id},
            )
        return bool(kept)

    @redis_op("unlock")
    async def unlock(self, lease: TurnLease) -> None:
        """End the turn: stop the keep-alive and drop the lock, even if the caller is being
        cancelled (the Redis delete runs to completion in a task of its own)."""
        self._held.discard(lease.session_id)
        if lease._keepalive is not None:
            lease._keepalive.cancel()
        if self.index.redis is None:
            return
        task = self._spawn(self._delete(lease))
        await asyncio.shield(task)

    async def _keep_alive(self, lease: TurnLease) -> None:
        while not lease.lost and self.index.redis is not None:
            await asyncio.sleep(lease.ttl_seconds / 3)
            await self.refresh(lease)

    async def _delete(self, lease: TurnLease) -> None:
        redis = self.index.redis
        if redis is None:
            return
        try:
            await redis.eval(_DELETE_IF_OWNER, 1, lease.key, lease.token)
        except STORE_FAILURES as e:
            self.index.failed("lock", e)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        return task

    def _key(self, session_id: str) -> str:
        # "specdec:session-lock:<id>": outside the records' namespace for any session id.
        return self.index.key_prefix.rstrip(":") + "-lock:" + session_id
