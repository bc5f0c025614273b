"""`SharedGuard`: one goodput guard for every replica of a gateway, kept through Redis.

The goodput guard (specdec.gateway.round.policy.guard) runs speculation or plain steps in
epochs and keeps the faster. Each gateway replica running its own guard measures only its
own requests, and under load a speculating round's cost falls mostly on the others: its
wider rows lengthen every batched forward of the shared verifier. With the sessions split
over several replicas, a replica that speculates while the others run plain steps measures
its own requests faster, though every session together runs slower, so separate guards
drift towards speculation where it loses. Simulated (`specdec.tools.bench.loadsim`, a
verifier whose drafted forwards cost 30% more than it reports): at 32 sessions split over 4
replicas, 4 separate guards ran at 0.94x of `k = 0`, one guard over every session at 0.99x.

So the replicas share one guard:

- **The leader.** One replica holds the lease `<prefix>leader` (`SET NX PX`, renewed every
  third of `lease`) under a term of its own. Its `GoodputGuard` counts every replica's
  rounds: its own as they run, the others' as they report them on the stream
  `<prefix>events`. Whenever what a round beginning now would run under changes (epoch,
  mode, or a session alone), and at each renewal, it publishes that as `<prefix>state`
  (expiring with the lease); whenever an epoch closes, what its guard has learnt, as
  `<prefix>learnt` (`specdec.gateway.round.policy.guard.learnt`). Both are written only while the lease is its
  own (one script), so a replica that lost the lease cannot overwrite its successor's.
- **Followers.** Every other replica reads the state every `poll` seconds. A round begins
  under the leader's epoch, mode and term; its begin, its end (tokens, seconds, the ticket)
  and its request's leave go on the stream, written by a background task: a round never
  waits for Redis. A ticket of another term (a leader since replaced) counts nothing.
- **Taking over.** Where no state is published (the leader stopped and released the lease,
  or its lease ran out), the first follower to take the lease starts a guard of its own,
  from what was learnt, reading the events from then on. Until then rounds speculate as the
  policy decides, as they do without a guard.
- **Redis unreachable.** A replica that cannot reach Redis decides alone: its own guard
  over its own rounds, as a replica without sharing, until Redis answers again; a leader
  keeps its guard through it.

One replica (the `specdec up` stack) is its own leader: its rounds run exactly as under a
`GoodputGuard` of its own, and Redis carries a state it reads from no one. Exact: a round's
mode is fixed when it begins, from past timings only, as under one guard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import redis.asyncio as aioredis

from specdec.gateway.round.policy.guard import (
    GoodputGuard,
    GuardMode,
    GuardSession,
    Ticket,
    learnt,
    restore,
)
from specdec.gateway.sessions.index import STORE_FAILURES

log = logging.getLogger(__name__)

# The leader's renewal and publication, in one step: only while the lease is its own.
# KEYS: leader, state, learnt; ARGV: term, lease (ms), state, learnt ("": unchanged), its TTL (s)
_PUBLISH = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('pexpire', KEYS[1], ARGV[2])
redis.call('set', KEYS[2], ARGV[3], 'px', ARGV[2])
if ARGV[4] ~= '' then redis.call('set', KEYS[3], ARGV[4], 'ex', ARGV[5]) end
return 1
"""
# A leader's release on close: the lease and its state, only while its own.
_RELEASE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('del', KEYS[1], KEYS[2])
return 1
"""
STREAM_LENGTH = 10_000  # events the stream keeps (about: Redis trims in whole nodes)
OUTBOX = 10_000  # events a follower holds while Redis is slow; beyond, the oldest go
LEARNT_TTL = 7 * 24 * 3600  # seconds what the guard learnt outlives the last leader
STREAM_TTL = 3600  # seconds the events outlive the last one sent


class GuardRole(str, Enum):
    """What a replica does in the shared guard."""

    LEADER = "leader"  # its guard counts every replica's rounds and decides for all
    FOLLOWER = "follower"  # its rounds run under the leader's state
    ALONE = "alone"  # Redis unreachable: its own guard over its own rounds


@dataclasses.dataclass(frozen=True)
class State:
    """What a round beginning now runs under: the leader's term, epoch and mode, and
    whether a session is alone (it then speculates in any epoch: `GoodputGuard.begin`)."""

    term: str
    epoch: int
    mode: GuardMode
    alone: bool

    def encode(self) -> str:
        return json.dumps([self.term, self.epoch, self.mode.value, self.alone])

    @classmethod
    def decode(cls, raw: bytes | str) -> State:
        """Raises ValueError (or TypeError) on a state not in this form."""
        term, epoch, mode, alone = json.loads(raw)
        return cls(str(term), int(epoch), GuardMode(mode), bool(alone))


class SharedGuard:
    """This replica's part in the guard its gateway's replicas share (this module's
    docstring); `begin`, `end` and `leave` as a `GoodputGuard`'s, for a request's rounds."""

    def __init__(
        self,
        redis: aioredis.Redis,
        make_guard: Callable[[], GoodputGuard],
        prefix: str = "specdec:guard:",
        lease: float = 3.0,
        poll: float = 0.1,
        on_role: Callable[[GuardRole], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_delay: Callable[[float], None] | None = None,
    ):
        """`make_guard`: a guard for this replica to lead with. `on_role`: each change of
        this replica's role; `on_delay`: while leading, each other replica's event's seconds
        from its sending to its counting, by the two machines' clocks (the gateway's
        metrics)."""
        if lease <= 0 or poll <= 0 or poll >= lease / 3:
            raise ValueError(f"need 0 < poll < lease / 3, got poll {poll} s, lease {lease} s")
        self.redis = redis
        self.make_guard = make_guard
        self.keys = [prefix + name for name in ("leader", "state", "learnt")]
        self.stream = prefix + "events"
        self.lease, self.poll = lease, poll
        self.on_role = on_role
        self.on_delay = on_delay
        self.clock = clock
        self.replica = uuid.uuid4().hex  # this replica's name on the stream
        self.role = GuardRole.ALONE  # until Redis first answers
        self.guard = make_guard()  # the guard in charge while leading or alone
        self.term = uuid.uuid4().hex  # its term
        self.state: State | None = None  # the leader's, while following
        self._published: State | None = None
        self._renewed = -math.inf
        self._learnt_epoch = -1  # the guard's epoch when what it learnt was last published
        self._read_from = "0-0"  # the last event read, while leading
        self._outbox: list[str] = []  # events to send, while following
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.dropped = 0  # events a follower could not send

    # -- a request's rounds ---------------------------------------------------------------------

    def begin(self, session: GuardSession) -> Ticket:
        """A round of `session` begins: the epoch and mode it runs under."""
        if self.role is GuardRole.FOLLOWER:
            self._emit(["b", session])
            state = self.state
            if state is None:  # the leader gone, its successor not yet known
                return Ticket(-1, GuardMode.SPEC)
            mode = GuardMode.SPEC if state.alone else state.mode
            return Ticket(state.epoch, mode, state.alone, state.term)
        return dataclasses.replace(self.guard.begin(session), term=self.term)

    def end(self, session: GuardSession, ticket: Ticket, tokens: int, seconds: float) -> None:
        """A round of `session` begun under `ticket` (`seconds` ago) committed `tokens`."""
        if self.role is GuardRole.FOLLOWER:
            settled = [ticket.term, ticket.epoch, ticket.mode.value, ticket.alone]
            self._emit(["e", session, *settled, tokens, seconds])
            return
        self.guard.end(session, self._ours(ticket), tokens, seconds)

    def leave(self, session: GuardSession) -> None:
        """`session`'s request is done: no round of it is awaited."""
        if self.role is GuardRole.FOLLOWER:
            self._emit(["l", session])
            return
        self.guard.leave(session)

    def _ours(self, ticket: Ticket) -> Ticket:
        """A ticket as this replica's guard reads it: one of another term (issued under
        another leader, or this replica's earlier guard) is of no epoch of this guard."""
        return ticket if ticket.term == self.term else dataclasses.replace(ticket, epoch=-1)

    # -- the replicas ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Take part: the first look at Redis now, then the background tasks."""
        await self._tick()
        for step in (self._next_tick, self._send, self._read):
            self._tasks.append(asyncio.ensure_future(self._forever(step)))

    async def close(self) -> None:
        """Stop; a leader releases the lease at once (a follower takes over within `poll`)
        and a follower sends what it holds."""
        self._stopping = True  # a step whose Redis call turned the cancel into an error ends
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            if self.role is GuardRole.LEADER:
                await self.redis.eval(_RELEASE, 2, *self.keys[:2], self.term)
            elif self.role is GuardRole.FOLLOWER:
                await self._flush()
        except STORE_FAILURES as e:
            log.warning("shared goodput guard: Redis failed on close", extra={"why": str(e)})

    async def _forever(self, step: Callable[[], Awaitable[None]]) -> None:
        """`step` again and again: a fault in one is logged, and the next runs a poll on
        (the guard's part goes on, whatever one step met), until `close`."""
        while not self._stopping:
            try:
                await step()
            except Exception:
                log.exception("shared goodput guard: a step failed", extra={"step": step.__name__})
                await asyncio.sleep(self.poll)

    async def _next_tick(self) -> None:
        await asyncio.sleep(self.poll)
        await self._tick()

    async def _tick(self) -> None:
        """Lead (renew and publish), or follow (read the state), or take the lease where
        no one publishes; Redis unreachable: decide alone."""
        try:
            if self.role is GuardRole.LEADER:
                await self._publish()
                return
            raw = await self.redis.get(self.keys[1])
            if raw is not None:
                try:
                    self.state = State.decode(raw)
                except (ValueError, TypeError) as e:
                    log.warning("shared goodput guard: unreadable state", extra={"why": str(e)})
                    self.state = None
                if self.state is not None and self.state.term == self.term:
                    # Its own, published before Redis failed: it leads on if the lease is
                    # still its own (else `_publish` follows).
                    self._become(GuardRole.LEADER)
                    await self._publish()
                    return
                self._become(GuardRole.FOLLOWER)
                return
            self.state = None
            term = uuid.uuid4().hex
            if await self.redis.set(self.keys[0], term, nx=True, px=self._lease_ms()):
                await self._lead(term)
            else:
                self._become(GuardRole.FOLLOWER)  # a leader that has not published yet
        except STORE_FAILURES as e:
            if self.role is not GuardRole.ALONE:
                log.warning(
                    "shared goodput guard: Redis unreachable, this replica decides alone",
                    extra={"why": str(e)},
                )
            if self.role is GuardRole.FOLLOWER:
                self.guard, self.term = self.make_guard(), uuid.uuid4().hex
            self._become(GuardRole.ALONE)

    async def _lead(self, term: str) -> None:
        """The lease is this replica's under `term`: a guard of its own from what was
        learnt, the events from now on, and its state published."""
        guard = self.make_guard()
        raw = await self.redis.get(self.keys[2])
        if raw is not None:
            try:
                restore(guard, json.loads(raw))
            except (ValueError, TypeError, KeyError) as e:
                log.warning("shared goodput guard: unreadable learnt", extra={"why": str(e)})
        last: Any = await self.redis.xrevrange(self.stream, count=1)
        self._read_from = last[0][0].decode() if last else "0-0"
        self.guard, self.term = guard, term
        self._published, self._renewed, self._learnt_epoch = None, -math.inf, guard.epoch
        self._become(GuardRole.LEADER)
        await self._publish()

    async def _publish(self) -> None:
        """Renew the lease and publish the state once it changed or a renewal is due, and
        what was learnt once an epoch closed; the lease lost: follow."""
        guard = self.guard
        state = State(self.term, guard.epoch, guard.mode, guard.is_alone())
        now = self.clock()
        if state == self._published and now - self._renewed < self.lease / 3:
            return
        taught = json.dumps(learnt(guard)) if guard.epoch != self._learnt_epoch else ""
        kept = await self.redis.eval(
            _PUBLISH,
            3,
            *self.keys,
            self.term,
            self._lease_ms(),
            state.encode(),
            taught,
            LEARNT_TTL,
        )
        if not kept:
            log.warning("shared goodput guard: the lease went to another replica")
            self.state = None
            self._become(GuardRole.FOLLOWER)
            return
        self._published, self._renewed, self._learnt_epoch = state, now, guard.epoch

    def _become(self, role: GuardRole) -> None:
        if role is not self.role:
            log.info("shared goodput guard", extra={"role": role.value, "was": self.role.value})
            self.role = role
            if self.on_role is not None:
                self.on_role(role)

    def _lease_ms(self) -> int:
        return max(1, round(self.lease * 1e3))

    # -- the events -----------------------------------------------------------------------------

    def _emit(self, event: list[Any]) -> None:
        """A follower's round event, for the stream (sent by `_send`)."""
        if len(self._outbox) >= OUTBOX:
            del self._outbox[0]
            self.dropped += 1
        kind, *rest = event
        self._outbox.append(json.dumps([self.replica, kind, time.time(), *rest]))
        self._wake.set()

    async def _send(self) -> None:
        await self._wake.wait()
        self._wake.clear()
        try:
            await self._flush()
        except STORE_FAILURES:
            await asyncio.sleep(self.poll)
            self._wake.set()  # kept, and tried again

    async def _flush(self) -> None:
        """Send the events held, in order, in one pipeline; on a failure they are kept,
        before any that came meanwhile (the oldest dropped beyond `OUTBOX`)."""
        events, self._outbox = self._outbox, []
        if not events:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for event in events:
                    pipe.xadd(self.stream, {"e": event}, maxlen=STREAM_LENGTH, approximate=True)
                pipe.expire(self.stream, STREAM_TTL)
                await pipe.execute()
        except BaseException:
            held = events + self._outbox
            self.dropped += max(0, len(held) - OUTBOX)
            self._outbox = held[-OUTBOX:]
            raise

    async def _read(self) -> None:
        """While leading: the other replicas' events, into this replica's guard."""
        if self.role is not GuardRole.LEADER:
            await asyncio.sleep(self.poll)
            return
        try:
            reply: Any = await self.redis.xread(
                {self.stream: self._read_from}, count=1000, block=round(self.poll * 1e3)
            )
        except STORE_FAILURES:
            await asyncio.sleep(self.poll)
            return
        for _, entries in reply or ():  # nothing within the block: None or empty
            for event_id, fields in entries:
                self._read_from = event_id.decode()
                if self.role is GuardRole.LEADER:
                    self._apply(fields.get(b"e", b""))

    def _apply(self, raw: bytes) -> None:
        """One event of another replica, into the guard (its own events it counted already);
        one not in the form `_emit` writes is logged and skipped."""
        try:
            replica, kind, sent, sid, *rest = json.loads(raw)
            if replica == self.replica:
                return
            if self.on_delay is not None:
                self.on_delay(time.time() - float(sent))
            session = (str(replica), int(sid))
            if kind == "b":
                self.guard.begin(session)
            elif kind == "e":
                term, epoch, mode, alone, tokens, seconds = rest
                ticket = self._ours(Ticket(int(epoch), GuardMode(mode), bool(alone), str(term)))
                self.guard.end(session, ticket, int(tokens), float(seconds))
            elif kind == "l":
                self.guard.leave(session)
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except (ValueError, TypeError) as e:
            log.warning("shared goodput guard: unreadable event", extra={"why": str(e)})
