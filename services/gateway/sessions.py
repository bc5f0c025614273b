"""The session index: per-session token history and cache affinity, kept in Redis (DESIGN §3).

One Redis hash per session at ``key_prefix + session_id``::

    v                1 (record format version)
    tokens           the full history, int32 little-endian bytes (a 100k history is 400 KB)
    drafter          address of the drafter replica holding the session's KV cache ("" = none)
    verifier         same for the verifier
    drafter_cached   tokens that drafter caches for the session
    verifier_cached  same for the verifier
    turns            completed turns
    updated_at       unix time of the last put

A put replaces the whole hash and sets its TTL in one MULTI/EXEC, so a record is never half
written and every put refreshes the TTL; reads refresh nothing. Any gateway replica can read
any session, and a gateway restart loses none.

Redis down degrades, never crashes: every call has short socket timeouts, a Redis error is
logged (a WARNING, at most once per ``warn_interval`` seconds per kind of error), counted in
``specdec_gateway_session_store_errors_total{op}``, and the call falls back to a bounded
in-process LRU copy (write-through on every put, filled on every successful get). Records
written locally during an outage are written back to Redis by the next successful ``get`` of
that session, unless Redis holds a newer one. ``url=None`` runs without Redis: sessions live
only in the local cache (still bounded and still expiring).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

__all__ = [
    "MAX_SESSION_ID_LEN",
    "SessionIndex",
    "SessionRecord",
    "validate_session_id",
]

log = logging.getLogger(__name__)

MAX_SESSION_ID_LEN = 256
RECORD_VERSION = b"1"
OPS = ("get", "put", "delete", "ping", "lock")

# Release / extend a turn lock only if this gateway still holds it (its token).
_DELETE_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
_REFRESH_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)

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
_STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


@dataclass
class SessionRecord:
    session_id: str
    tokens: list[int]  # full history: every turn's prompt and completion tokens, in order
    drafter: str | None = None  # address of the drafter replica that holds its KV cache
    verifier: str | None = None
    drafter_cached: int = 0  # tokens that replica caches for this session (its last answer)
    verifier_cached: int = 0
    turns: int = 0
    updated_at: float = 0.0  # unix time

    def copy(self) -> SessionRecord:
        return dataclasses.replace(self, tokens=list(self.tokens))


def validate_session_id(session_id: object) -> str:
    """A non-empty str of at most 256 characters; ValueError otherwise."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError("session_id must be a non-empty string")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise ValueError(
            f"session_id is {len(session_id)} characters; at most {MAX_SESSION_ID_LEN} allowed"
        )
    return session_id


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids -> int32 little-endian bytes; ValueError for ids outside int32."""
    try:
        arr = array("i", tokens)
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of 4")
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def _encode(record: SessionRecord) -> dict[str, bytes | str]:
    return {
        "v": RECORD_VERSION,
        "tokens": pack_tokens(record.tokens),
        "drafter": record.drafter or "",
        "verifier": record.verifier or "",
        "drafter_cached": str(int(record.drafter_cached)),
        "verifier_cached": str(int(record.verifier_cached)),
        "turns": str(int(record.turns)),
        "updated_at": repr(float(record.updated_at)),
    }


def _decode(session_id: str, raw: dict[bytes, bytes]) -> SessionRecord:
    """Hash fields -> record; ValueError (or KeyError) when the hash is not a valid record."""
    if raw.get(b"v") != RECORD_VERSION:
        raise ValueError(f"unknown record version {raw.get(b'v')!r}")

    def text(name: bytes) -> str | None:
        value = raw.get(name, b"").decode()
        return value or None

    return SessionRecord(
        session_id=session_id,
        tokens=unpack_tokens(raw[b"tokens"]),
        drafter=text(b"drafter"),
        verifier=text(b"verifier"),
        drafter_cached=int(raw.get(b"drafter_cached", b"0")),
        verifier_cached=int(raw.get(b"verifier_cached", b"0")),
        turns=int(raw.get(b"turns", b"0")),
        updated_at=float(raw.get(b"updated_at", b"0")),
    )


@dataclass
class _LocalEntry:
    record: SessionRecord
    expires_at: float  # time.monotonic()
    dirty: bool = False  # written while Redis was unreachable; not in Redis yet


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
        if local_capacity < 0:
            raise ValueError(f"local_capacity must be >= 0, got {local_capacity}")
        if op_timeout <= 0:
            raise ValueError(f"op_timeout must be > 0 seconds, got {op_timeout}")
        self.url = url
        self.default_ttl = int(default_ttl)
        self.local_capacity = int(local_capacity)
        self.key_prefix = key_prefix
        self.op_timeout = float(op_timeout)
        self._local: OrderedDict[str, _LocalEntry] = OrderedDict()
        self._turns: set[str] = set()  # sessions with a turn in flight in this process
        self._limiter = _WarnLimiter(self.warn_interval)
        self._available = url is not None
        self._redis: aioredis.Redis | None = None
        if url is not None:
            # One retry without backoff: enough to replace a pooled connection that went stale
            # (Redis restarted) transparently, short enough to degrade fast when it is down.
            self._redis = aioredis.Redis.from_url(
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

    async def get(self, session_id: str) -> SessionRecord | None:
        """The session's record, or None. Falls back to the local copy if Redis fails."""
        key = self.key(session_id)
        if self._redis is None:
            return self._local_get(session_id)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(key)
                pipe.pttl(key)
                raw, pttl = await pipe.execute()
        except _STORE_ERRORS as e:
            self._failed("get", e)
            return self._local_get(session_id)
        self._succeeded()
        remote: SessionRecord | None = None
        if raw:
            try:
                remote = _decode(session_id, raw)
            except (ValueError, KeyError, UnicodeDecodeError) as e:
                self._warn("corrupt", f"session {session_id!r}: unreadable record in Redis: {e}")
                remote = None
        entry = self._local_entry(session_id)
        if (
            entry is not None
            and entry.dirty
            and (remote is None or remote.updated_at < entry.record.updated_at)
        ):
            # Written here during an outage and newer than Redis's copy: write it back.
            await self._write_back(key, entry)
            return entry.record.copy()
        if remote is None:
            self._local.pop(session_id, None)
            return None
        # The local copy expires with the Redis key (PTTL -1: no expiry there; keep the default).
        expires_in = pttl / 1000 if isinstance(pttl, int) and pttl > 0 else self.default_ttl
        self._local_put(remote, expires_in, dirty=False)
        return remote.copy()

    async def put(self, record: SessionRecord, ttl_seconds: int | None = None) -> None:
        """Store the record (replacing any previous one), set ``updated_at`` and the TTL."""
        key = self.key(record.session_id)
        ttl = self.default_ttl if ttl_seconds is None else int(ttl_seconds)
        if ttl <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        record.updated_at = time.time()
        fields = _encode(record)  # validates the tokens before anything is stored
        if self._redis is None:
            self._local_put(record, ttl, dirty=False)
            return
        try:
            await self._write(key, fields, ttl)
        except _STORE_ERRORS as e:
            self._failed("put", e)
            self._local_put(record, ttl, dirty=True)
            return
        self._succeeded()
        self._local_put(record, ttl, dirty=False)

    async def delete(self, session_id: str) -> None:
        """Forget the session (locally at once; in Redis if it is reachable)."""
        key = self.key(session_id)
        self._local.pop(session_id, None)
        if self._redis is None:
            return
        try:
            await self._redis.delete(key)
        except _STORE_ERRORS as e:
            self._failed("delete", e)
            return
        self._succeeded()

    # -- one turn at a time ----------------------------------------------------------------

    async def lock_turn(self, session_id: str, ttl_seconds: float = 60.0) -> str | None:
        """Claim the session for one turn; a token to unlock with, or None if it is taken.

        Held in this process and, when Redis is reachable, in Redis (SET NX PX), so two
        gateway replicas cannot run turns of one session at the same time. The Redis lock
        expires by itself if this gateway dies; `refresh_turn` extends it on long turns.
        With Redis unreachable only this process's lock holds.
        """
        validate_session_id(session_id)
        if session_id in self._turns:
            return None
        token = uuid.uuid4().hex
        self._turns.add(session_id)
        if self._redis is not None:
            try:
                taken = await self._redis.set(
                    self._lock_key(session_id), token, nx=True, px=int(ttl_seconds * 1000)
                )
            except _STORE_ERRORS as e:
                self._failed("lock", e)
            else:
                self._succeeded()
                if not taken:
                    self._turns.discard(session_id)
                    return None
        return token

    async def refresh_turn(self, session_id: str, token: str, ttl_seconds: float = 60.0) -> None:
        if self._redis is None:
            return
        try:
            await self._redis.eval(
                _REFRESH_IF_OWNER, 1, self._lock_key(session_id), token, int(ttl_seconds * 1000)
            )
        except _STORE_ERRORS as e:
            self._failed("lock", e)

    async def unlock_turn(self, session_id: str, token: str) -> None:
        self._turns.discard(session_id)
        if self._redis is None:
            return
        try:
            await self._redis.eval(_DELETE_IF_OWNER, 1, self._lock_key(session_id), token)
        except _STORE_ERRORS as e:
            self._failed("lock", e)

    def _lock_key(self, session_id: str) -> str:
        # "specdec:session-lock:<id>": outside the records' namespace for any session id.
        return self.key_prefix.rstrip(":") + "-lock:" + session_id

    async def ping(self) -> bool:
        """True if Redis answers; False without Redis or when it is unreachable."""
        if self._redis is None:
            return False
        try:
            await self._redis.ping()
        except _STORE_ERRORS as e:
            self._failed("ping", e)
            return False
        self._succeeded()
        return True

    async def close(self) -> None:
        if self._redis is not None:
            redis, self._redis = self._redis, None
            try:
                await redis.aclose()
            except _STORE_ERRORS as e:  # closing a dead connection must not fail shutdown
                log.debug("closing the session store: %s", e)
            self._available = False

    async def __aenter__(self) -> SessionIndex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def local_size(self) -> int:
        """Records in the local LRU copy (including expired ones not yet dropped)."""
        return len(self._local)

    # -- Redis ----------------------------------------------------------------------------

    async def _write(self, key: str, fields: dict[str, bytes | str], ttl: int) -> None:
        assert self._redis is not None
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ttl)
            await pipe.execute()

    async def _write_back(self, key: str, entry: _LocalEntry) -> None:
        remaining = max(1, round(entry.expires_at - time.monotonic()))
        try:
            await self._write(key, _encode(entry.record), remaining)
        except _STORE_ERRORS as e:
            self._failed("put", e)
            return
        entry.dirty = False
        log.info(
            "session %r: local copy written back to the session store", entry.record.session_id
        )

    def _failed(self, op: str, error: BaseException) -> None:
        STORE_ERRORS.labels(op=op).inc()
        STORE_UP.set(0)
        self._available = False
        kind = type(error).__name__
        self._warn(
            kind,
            f"session store (Redis) {op} failed ({kind}: {error}); continuing with the local "
            f"in-process copy, without cross-replica session affinity",
        )

    def _succeeded(self) -> None:
        STORE_UP.set(1)
        if not self._available:
            log.info("session store (Redis) reachable again")
        self._available = True

    def _warn(self, kind: str, message: str) -> None:
        if self._limiter.should_log(kind):
            log.warning(message)

    # -- local LRU --------------------------------------------------------------------------

    def _local_entry(self, session_id: str) -> _LocalEntry | None:
        entry = self._local.get(session_id)
        if entry is None:
            return None
        if entry.expires_at <= time.monotonic():
            del self._local[session_id]
            return None
        self._local.move_to_end(session_id)
        return entry

    def _local_get(self, session_id: str) -> SessionRecord | None:
        entry = self._local_entry(session_id)
        return entry.record.copy() if entry is not None else None

    def _local_put(self, record: SessionRecord, expires_in: float, *, dirty: bool) -> None:
        if self.local_capacity == 0:
            return
        self._local[record.session_id] = _LocalEntry(
            record=record.copy(), expires_at=time.monotonic() + expires_in, dirty=dirty
        )
        self._local.move_to_end(record.session_id)
        while len(self._local) > self.local_capacity:
            self._local.popitem(last=False)
