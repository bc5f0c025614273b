"""One turn at a time per session, across gateway replicas.

A turn holds the session in this process and, when Redis is reachable, in Redis
(``SET NX PX`` on ``<prefix>-lock:<id>``), so two gateway replicas cannot run turns of one
session at the same time. The Redis lock expires by itself if its gateway dies; `refresh`
extends it on long turns. Release and refresh only act for the holder's token. With Redis
unreachable only this process's lock holds.
"""

from __future__ import annotations

import uuid

from specdec.gateway.sessions.index import STORE_FAILURES, SessionIndex
from specdec.gateway.sessions.record import validate_session_id
from specdec.gateway.tracing import redis_op

# Release / extend a turn lock only if this gateway still holds it (its token).
_DELETE_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
_REFRESH_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)


class TurnLocks:
    """Turn locks over a SessionIndex's Redis connection (and its failure accounting)."""

    def __init__(self, index: SessionIndex):
        self.index = index
        self._held: set[str] = set()  # sessions with a turn in flight in this process

    @redis_op("lock")
    async def lock(self, session_id: str, ttl_seconds: float = 60.0) -> str | None:
        """Claim the session for one turn; a token to unlock with, or None if it is taken."""
        validate_session_id(session_id)
        if session_id in self._held:
            return None
        token = uuid.uuid4().hex
        self._held.add(session_id)
        redis = self.index.redis
        if redis is not None:
            try:
                taken = await redis.set(
                    self._key(session_id), token, nx=True, px=int(ttl_seconds * 1000)
                )
            except STORE_FAILURES as e:
                self.index.failed("lock", e)
            else:
                self.index.succeeded()
                if not taken:
                    self._held.discard(session_id)
                    return None
        return token

    @redis_op("lock refresh")
    async def refresh(self, session_id: str, token: str, ttl_seconds: float = 60.0) -> None:
        redis = self.index.redis
        if redis is None:
            return
        try:
            await redis.eval(
                _REFRESH_IF_OWNER, 1, self._key(session_id), token, int(ttl_seconds * 1000)
            )
        except STORE_FAILURES as e:
            self.index.failed("lock", e)

    @redis_op("unlock")
    async def unlock(self, session_id: str, token: str) -> None:
        self._held.discard(session_id)
        redis = self.index.redis
        if redis is None:
            return
        try:
            await redis.eval(_DELETE_IF_OWNER, 1, self._key(session_id), token)
        except STORE_FAILURES as e:
            self.index.failed("lock", e)

    def _key(self, session_id: str) -> str:
        # "specdec:session-lock:<id>": outside the records' namespace for any session id.
        return self.index.key_prefix.rstrip(":") + "-lock:" + session_id
