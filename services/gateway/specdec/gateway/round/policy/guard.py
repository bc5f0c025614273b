"""`GoodputGuard`: the gateway's measured check that speculation pays at the load it runs at.

The adaptive policy prices each round from what the replicas report. Under load those
reports move with the policy's own choices: speculating rounds fragment the verifier's
forwards, and at fewer rows a forward a draft looks cheaper. Some costs of a speculating
round are not priced at all: a session's Draft, and the drafter's prefill beside the
verifier, keep it out of the verifier's next forward. So beside the model the gateway
measures what it cares about: the tokens its requests commit per second.

Time is cut into epochs. In each, every adaptive request of this gateway replica either
speculates as its policy decides (`SPEC`), or runs plain target steps (`PLAIN`: each round
is a k = 0 round, with no draft, no Speculate and no prefill beside). An epoch first lets
the previous mode's rounds settle: once every session that was running has finished a
round begun in the epoch, it waits one more of the epoch's mean rounds (its mode, at this
load). Then it counts the tokens of the rounds that end in the next `measure_rounds` such
rounds (at least `min_measure` seconds). Its load level is the most sessions in a round at
once during it, in powers of two (1, 2-3, 4-7, 8-15, 16-31, 32+): requests one after
another are one session; an epoch at another level than the one before is a ramp, and
one whose rounds stopped ending for half its count a lull: neither is kept. Per level the guard keeps each mode's last `window` epochs (their tokens over
their seconds) and runs plain steps where they measured `margin` faster than speculation,
else speculation (the policy's own choice); the slower runs now and then (`_next`), so a
change of the drafts' acceptance or of the machine is seen. Below `min_sessions` the guard stays out
of the way: one session's speed is its own, which the policy's model prices well, and
every epoch speculates.

Exact: the mode is fixed before a round, from past timings only, as every other choice of
the adaptive policy is (specdec.gateway.round.policy.adaptive), and a plain round is an
ordinary k = 0 round.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class GuardMode(str, Enum):
    """What an epoch's adaptive rounds do."""

    SPEC = "spec"  # as the adaptive policy decides
    PLAIN = "plain"  # k = 0: plain target steps


@dataclass(frozen=True)
class GuardParams:
    """The guard's constants (this module's docstring)."""

    min_sessions: int = 2  # below this many sessions an epoch speculates and measures nothing
    settle_rounds: float = 1.0  # ... and this many more after every session's first round
    measure_rounds: float = 4.0  # an epoch measures this many mean round times, once settled
    min_measure: float = 2.0  # seconds: the shortest measurement
    window: int = 4  # epochs of each mode a level remembers
    margin: float = 0.1  # plain steps run where they measured this share faster, at least
    explore_every: int = 4  # the other mode's epochs at a level: one in this many, at least
    gap_step: float = 0.05  # ... and one more epoch between for each such share it is slower
    max_explore_every: int = 40  # ... and at least one in this many
    smoothing: float = 0.2  # weight of the newest round in the mean round time


@dataclass(frozen=True, slots=True)
class Ticket:
    """The epoch and mode a round began under."""

    epoch: int
    mode: GuardMode


def level_of(sessions: int) -> int:
    """The load level of `sessions` sessions: the largest power of two at most it."""
    level = 1
    while level * 2 <= sessions:
        level *= 2
    return level


class GoodputGuard:
    """One gateway replica's epochs of speculation on or off, and what each measured."""

    def __init__(
        self,
        params: GuardParams | None = None,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[int, str, float], None] | None = None,
    ):
        """`report(level, mode, tokens per second)`: each epoch measured (the gateway's
        metrics)."""
        self.p = params or GuardParams()
        self.clock = clock
        self.report = report
        self.epoch = 0
        self.mode = GuardMode.SPEC
        self.round_seconds = dict.fromkeys(GuardMode, 0.0)  # each mode's mean round (0: none seen)
        self.last_seen: dict[int, float] = {}  # session -> when its last round ended
        # (tokens, seconds) of each mode's last epochs at each level
        self.measured: dict[tuple[int, GuardMode], deque[tuple[int, float]]] = {}
        self._level = 0  # the level of the last epoch that closed
        self._since: dict[int, int] = {}  # level -> epochs since its slower mode last ran
        self.started = 0.0  # when the epoch began
        self.measuring_from: float | None = None  # when it began to count (None: settling)
        self._pending: set[int] = set()  # sessions yet to finish a round of the epoch
        self._tokens = 0  # tokens counted
        self._length = 0.0  # seconds the epoch counts, once settled
        self._settled: list[float] = []  # seconds of the epoch's rounds ended settling
        self._last_counted: float | None = None  # when the last counted round ended
        self._peak = 0  # the most sessions in a round at once in the epoch
        self._running: dict[int, float] = {}  # sessions in a round -> when it began
        self._begin(self.clock())

    # -- what the rounds report -------------------------------------------------------------

    def begin(self, session: int) -> Ticket:
        """A round of `session` begins: the epoch and the mode it runs under."""
        now = self.clock()
        self._advance(now)
        self._running[session] = now
        self._peak = max(self._peak, len(self._running))
        # A session alone (the load gone) speculates at once, whatever the epoch's mode.
        alone = len(self._running) < self.p.min_sessions
        return Ticket(self.epoch, GuardMode.SPEC if alone else self.mode)

    def end(self, session: int, ticket: Ticket, tokens: int, seconds: float) -> None:
        """A round of `session` begun under `ticket` committed `tokens` in `seconds`."""
        now = self.clock()
        self.last_seen[session] = now
        self._running.pop(session, None)
        a, mean = self.p.smoothing, self.round_seconds[ticket.mode]
        self.round_seconds[ticket.mode] = (1 - a) * mean + a * seconds if mean else seconds
        if ticket.epoch == self.epoch and ticket.mode == self.mode:
            if self.measuring_from is None:
                self._pending.discard(session)
                self._settled.append(seconds)
                self._settle(now)
            elif self.measuring_from < now < self.measuring_from + self._length:
                self._tokens += tokens
                self._last_counted = now
        self._advance(now)

    def leave(self, session: int) -> None:
        """`session`'s request is done: no round of it is awaited."""
        self.last_seen.pop(session, None)
        self._running.pop(session, None)
        self._pending.discard(session)
        if self.measuring_from is None:
            self._settle(self.clock())

    # -- what it decided ----------------------------------------------------------------------

    def rates(self, level: int) -> dict[GuardMode, float]:
        """The tokens per second measured at `level` over each mode's remembered epochs,
        per mode measured."""
        out = {}
        for mode in GuardMode:
            seen = self.measured.get((level, mode))
            if seen:
                out[mode] = sum(t for t, _ in seen) / sum(s for _, s in seen)
        return out

    # -- epochs -------------------------------------------------------------------------------

    def _begin(self, now: float) -> None:
        self.started = now
        self.measuring_from = None
        # Sessions in a round or seen within the last few: the epoch measures once each
        # has finished a round begun under its mode.
        recent = 3.0 * self._longest()
        # A round that never reported its end (its request failed) is forgotten after
        # ten of the longer mean rounds.
        lost = 10.0 * self._longest()
        self._running = {s: t for s, t in self._running.items() if not lost or now - t <= lost}
        self._pending = set(self._running) | {
            s for s, t in self.last_seen.items() if now - t <= recent
        }
        self._tokens = 0
        self._peak = len(self._running)
        self._settled = []
        self._last_counted = None

    def _longest(self) -> float:
        """The longer of the modes' mean rounds (0: none seen)."""
        return max(self.round_seconds.values())

    def _settle(self, now: float) -> None:
        """Once no session is pending and a round of the epoch has ended: wait
        `settle_rounds` more of its rounds, then count the rounds that end in the next
        `measure_rounds` (at least `min_measure` seconds). A round here is the mean of the
        epoch's own rounds so far (its mode at this load), not of earlier loads'."""
        if not self._pending and self._settled:
            mean = sum(self._settled) / len(self._settled)
            self.measuring_from = now + self.p.settle_rounds * mean
            self._length = max(self.p.min_measure, self.p.measure_rounds * mean)

    def _advance(self, now: float) -> None:
        """Close the epoch once it has measured long enough, and pick the next one's mode."""
        if self.measuring_from is None:
            stale = 3.0 * self._longest()
            if stale and now - self.started > stale:  # a session that left without a word
                self._pending = {
                    s for s in self._pending if now - self.last_seen.get(s, 0.0) <= stale
                }
                self._settle(now)
            return
        if now < self.measuring_from + self._length:
            return
        level = level_of(self._peak)
        end = self.measuring_from + self._length
        # The load stopped within the count (its sessions done, a lull): the seconds after
        # the last counted round measured no mode.
        stopped = self._last_counted is None or end - self._last_counted > self._length / 2
        if self._peak < self.p.min_sessions:
            self.mode = GuardMode.SPEC
        elif level != self._level or stopped:  # a ramp or a lull, not a level's steady state
            self.mode = self._next(level)
        else:
            seen = self.measured.setdefault((level, self.mode), deque(maxlen=self.p.window))
            seen.append((self._tokens, self._length))
            if self.report is not None:
                self.report(level, self.mode.value, self._tokens / self._length)
            self.mode = self._next(level)
        self._level = level
        self.epoch += 1
        self._begin(now)

    def _next(self, level: int) -> GuardMode:
        """The mode of the next epoch at `level`: one not measured there yet, else the
        slower one once in `every` epochs, else the faster. `every` grows with how much
        slower it measured (so trying it again costs about as much whatever the gap),
        once each mode has been measured twice there. Speculation not yet measured at a
        level above one where it measured slower is taken to be as much slower (load only
        shrinks what it gains), and waits its turn."""
        rates = self.rates(level)
        spec, plain = GuardMode.SPEC, GuardMode.PLAIN
        ratio = self._lower_ratio(level)
        if spec not in rates and ratio is not None and ratio * (1.0 + self.p.margin) < 1.0:
            if plain not in rates:
                return plain
            rates[spec] = rates[plain] * ratio
        for mode in GuardMode:
            if mode not in rates:
                return mode
        # Speculation is the policy's own choice: plain steps must measure clearly faster.
        best = plain if rates[plain] > rates[spec] * (1.0 + self.p.margin) else spec
        other = plain if best == spec else spec
        every = self.p.explore_every
        if all(len(self.measured.get((level, m), ())) >= 2 for m in GuardMode):
            gap = max(0.0, 1.0 - rates[other] / rates[best]) if rates[best] > 0 else 0.0
            every = min(self.p.max_explore_every, round(every * (1.0 + gap / self.p.gap_step)))
        self._since[level] = self._since.get(level, 0) + 1
        if self._since[level] >= every:
            self._since[level] = 0
            return other
        return best

    def _lower_ratio(self, level: int) -> float | None:
        """Speculation's rate over plain steps' at the nearest level below `level` that
        measured both (None: none did)."""
        below = level // 2
        while below >= 1:
            rates = self.rates(below)
            if len(rates) == len(GuardMode) and rates[GuardMode.PLAIN] > 0:
                return rates[GuardMode.SPEC] / rates[GuardMode.PLAIN]
            below //= 2
        return None
