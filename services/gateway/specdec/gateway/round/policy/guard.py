"""`GoodputGuard`: the gateway's measured check that speculation pays at the load it runs at.

The adaptive policy prices each round from what the replicas report. Under load those
reports move with the policy's own choices: speculating rounds fragment the verifier's
forwards, and at fewer rows a forward a draft looks cheaper. Some costs of a speculating
round are not priced at all: a session's Draft, and the drafter's prefill beside the
verifier, keep it out of the verifier's next forward. So beside the model the gateway
measures what it cares about: the tokens its requests commit per second.

Time is cut into epochs. In each, every adaptive request of this gateway replica either
speculates as its policy decides (`SPEC`), or runs plain target steps (`PLAIN`: each round
is a k = 0 round, with no draft and no Speculate; beside its Verify the drafter is fed what
it lacks once that is a few tokens, never awaited, so that speculation resumes without a
long catch-up: specdec.gateway.round.draft.Drafts.feed_beside). An epoch first lets
the previous mode's rounds settle: once every session that was running has finished a
round begun in the epoch (or that round is forgotten, below), it waits one more of the
epoch's mean rounds (its mode, at this load), so that every round overlapping what
follows began in the epoch. Then it measures the next `measure_rounds` such rounds (at
least `min_measure` seconds) and at least one mean request (from its first round to its
end; up to `max_measure` seconds): in a closed loop whose requests end together, the next
prompts' forwards, which hold every session, come once a request, and a shorter
measurement saw them or not by where its bounds fell. It measures fluidly: a round of the
epoch's mode (or of a session alone with a request, which speculates in a plain epoch too)
that committed n tokens in s seconds counts n times the share of its s seconds that fell
within the measurement.
A round is thus counted once whatever the measurement's bounds cut, and the rounds that
one batched forward of the verifier ends together count as the seconds they ran, not as
one instant's burst. Rounds still running when the measurement ends are waited for (the
epoch's mode runs on meanwhile; a round begun after the end counts nothing) until each
has ended or its session has left; a round that never reports its end (its request
failed) is forgotten ten of the longer mean rounds after it began. The epoch's rate is
the tokens counted over the measurement's seconds.

Its load level is the most sessions in a round at once during the measurement, in powers
of two (1, 2-3, 4-7, 8-15, 16-31, 32+): requests one after another are one session. Its
mean concurrency is the number of sessions with a request in progress (from a round of
it to its end, time between rounds included), averaged over the measurement. An epoch
is not kept where it measured no level's steady state: a ramp, whose mean concurrency is
below `steady` times its peak (a load that drained or grew within it) or whose level is
not the epoch before's; or a lull, in which no round ended for a quarter of its
measurement (two of its mean rounds at least). Per level the guard keeps each mode's last
`window` epochs (their tokens over their seconds), rates each mode by the median of its
epochs' rates (`rates`: an epoch that caught an unusual burst of prompts moves it
little), and runs plain steps where they measured clearly faster than speculation
(`clear_margin`: `margin`, or less once the epochs' own spread shows it), else
speculation (the policy's own choice); the slower runs now and then (`_next`), so a
change of the drafts' acceptance or of the machine is seen. The window, the median and
the spread's weight `z` were chosen on simulated epochs (specdec.tools.bench.guardsim).
Below `min_sessions` the guard stays out of the way: one session's speed
is its own, which the policy's model prices well, and a session alone speculates in any
epoch. An epoch that saw one session measures nothing and leaves the mode as it was, so
the load's return runs the mode its level ran (it used to speculate there, whatever the
level had learnt).

Exact: the mode is fixed before a round, from past timings only, as every other choice of
the adaptive policy is (specdec.gateway.round.policy.adaptive), and a plain round is an
ordinary k = 0 round.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol

# A session's key: a round loop's id on its own gateway replica, (replica, id) for a round
# another replica reports (specdec.gateway.round.policy.shared).
GuardSession = Hashable


class GuardMode(str, Enum):
    """What an epoch's adaptive rounds do."""

    SPEC = "spec"  # as the adaptive policy decides
    PLAIN = "plain"  # k = 0: plain target steps


@dataclass(frozen=True)
class GuardParams:
    """The guard's constants (this module's docstring)."""

    min_sessions: int = 2  # below this many sessions an epoch speculates and measures nothing
    # ... and a session speculates in any epoch once it has been alone with a request
    # (fewer than min_sessions) for this many of the epoch's mean rounds: a closed loop's
    # next request comes sooner, and the load has not gone
    alone_rounds: float = 1.0
    settle_rounds: float = 1.0  # ... and this many more after every session's first round
    measure_rounds: float = 4.0  # an epoch measures this many mean round times, once settled
    min_measure: float = 2.0  # seconds: the shortest measurement
    measure_requests: float = 1.0  # ... and this many mean requests' durations
    max_measure: float = 30.0  # ... which count up to this many seconds
    steady: float = 0.6  # a mean concurrency below this share of the peak: a ramp
    window: int = 8  # epochs of each mode a level remembers
    # a mode's rate: the median of its epochs' rates, or "pooled" (tokens over seconds)
    summary: Literal["median", "pooled"] = "median"
    margin: float = 0.1  # plain steps run where they measured this share faster, at least
    # ... or, once each mode has `spread_epochs` epochs at the level, `z` standard errors
    # of the two means' difference (the epochs' own spread), and `min_margin` at least
    spread_epochs: int = 3
    z: float = 0.5
    min_margin: float = 0.03
    explore_every: int = 4  # the other mode's epochs at a level: one in this many, at least
    gap_step: float = 0.05  # ... and one more epoch between for each such share it is slower
    max_explore_every: int = 40  # ... and at least one in this many
    # ... while a mode has one epoch at the level, its gap less this (one epoch's spread,
    # a share, scaled by how few epochs each mode has: `explore_turns`)
    first_spread: float = 0.1
    smoothing: float = 0.2  # weight of the newest round in the mean round time


@dataclass(frozen=True, slots=True)
class Ticket:
    """The epoch and mode a round began under."""

    epoch: int
    mode: GuardMode
    alone: bool = False  # its session was alone with a request: it speculates in any epoch
    term: str = ""  # the leading replica's term it was issued under (a shared guard's)


class RoundGuard(Protocol):
    """What a request's round loop asks of a guard: this replica's `GoodputGuard`, or the
    one its replicas share (specdec.gateway.round.policy.shared.SharedGuard)."""

    def begin(self, session: GuardSession) -> Ticket: ...

    def end(self, session: GuardSession, ticket: Ticket, tokens: int, seconds: float) -> None: ...

    def leave(self, session: GuardSession) -> None: ...


def level_of(sessions: int) -> int:
    """The load level of `sessions` sessions: the largest power of two at most it."""
    level = 1
    while level * 2 <= sessions:
        level *= 2
    return level


def rate_of(seen: Sequence[tuple[float, float]], summary: str = "median") -> float:
    """A mode's rate from its epochs (tokens, seconds): the median of their rates, or
    ("pooled") their tokens over their seconds."""
    if summary == "pooled":
        return sum(t for t, _ in seen) / sum(s for _, s in seen)
    return statistics.median(t / s for t, s in seen)


def clear_margin(
    p: GuardParams, spec: Sequence[tuple[float, float]], plain: Sequence[tuple[float, float]]
) -> float:
    """How much faster than speculation plain steps must measure at a level, as a share of
    speculation's rate, from each mode's epochs there (tokens, seconds): `margin` until
    each mode has `spread_epochs`; then what their own spread makes clear, `z` standard
    errors of the difference of the two modes' mean epoch rates (`min_margin` at least,
    `margin` at most). Epochs of one request still spread by 10 to 30% once requests end
    apart (how many prompts' forwards an epoch sees is chance), yet plain steps that
    measured 9% faster over 4 epochs each, spread 7 and 11%, are faster: a constant margin
    kept them off."""
    means, variances = [], []
    for seen in (spec, plain):
        if len(seen) < max(2, p.spread_epochs):
            return p.margin
        rates = [t / s for t, s in seen]
        means.append(mean := sum(rates) / len(rates))
        variances.append(sum((r - mean) ** 2 for r in rates) / (len(rates) - 1) / len(rates))
    if means[0] <= 0:  # speculation's
        return p.margin
    clear = p.z * math.sqrt(sum(variances)) / means[0]
    return min(p.margin, max(p.min_margin, clear))


def explore_turns(p: GuardParams, gap: float, counts: Sequence[int] | None) -> int:
    """Every how many epochs at a level the slower mode runs, where it measured `gap`
    (a share) slower: `explore_every`, and one more for each `gap_step` (so trying it
    again costs about as much whatever the gap), `max_explore_every` at most. While a mode
    has one epoch there (`counts`, each mode's epochs; None: the gap was inherited from a
    level below), its gap less what one epoch's spread (`first_spread`) could make of it:
    one speculating epoch 45% below plain steps' is not tried again after four epochs."""
    if counts is not None and min(counts) < 2:
        gap -= p.first_spread * math.sqrt(sum(1.0 / max(1, n) for n in counts))
    if gap <= 0:
        return p.explore_every
    return min(p.max_explore_every, round(p.explore_every * (1.0 + gap / p.gap_step)))


class GoodputGuard:
    """One gateway replica's epochs of speculation on or off, and what each measured."""

    def __init__(
        self,
        params: GuardParams | None = None,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[int, str, float], None] | None = None,
    ):
        """`report(level, mode, tokens per second)`: each epoch measured (the metrics)."""
        self.p = params or GuardParams()
        self.clock = clock
        self.report = report
        self.epoch = 0
        self.mode = GuardMode.SPEC
        self.round_seconds = dict.fromkeys(GuardMode, 0.0)  # each mode's mean round (0: none seen)
        self.request_seconds = 0.0  # the mean request: its first round to its end (0: none seen)
        self.last_seen: dict[GuardSession, float] = {}  # session -> when its last round ended
        # (tokens, seconds) of each mode's last epochs at each level
        self.measured: dict[tuple[int, GuardMode], deque[tuple[float, float]]] = {}
        self._level = 0  # the level of the last epoch that closed
        self._since: dict[int, int] = {}  # level -> epochs since its slower mode last ran
        self.started = 0.0  # when the epoch began
        self.measuring_from: float | None = None  # when it began to measure (None: settling)
        self._pending: set[GuardSession] = set()  # sessions yet to finish a round of the epoch
        self._length = 0.0  # seconds the epoch measures, once settled
        self._tokens = 0.0  # tokens counted: each round's share within the measurement
        self._present: dict[GuardSession, float] = {}  # with a request -> its first round began
        self._area, self._area_at = 0.0, 0.0  # sessions present x seconds in the count, to when
        self._settled: list[float] = []  # seconds of the epoch's rounds ended settling
        self._last_counted: float | None = None  # when the last counted round ended in it
        self._peak: int | None = None  # the most sessions in a round at once in the measurement
        self._awaited: set[GuardSession] | None = None  # in a round when it ended (None: before)
        self._lost_any = False  # a round it awaited was lost
        self._running: dict[GuardSession, float] = {}  # sessions in a round -> when it began
        self._crowded_at = -math.inf  # when min_sessions had a request at once, last
        self._begin(self.clock())

    # -- what the rounds report -------------------------------------------------------------

    def begin(self, session: GuardSession) -> Ticket:
        """A round of `session` begins: the epoch and the mode it runs under."""
        now = self.clock()
        self._observe(now)
        self._advance(now)
        self._running[session] = now
        self._present.setdefault(session, now)
        start = self.measuring_from
        if start is not None and self._peak is not None and now < start + self._length:
            self._peak = max(self._peak, len(self._running))  # rounds begun within it
        alone = self.is_alone(now)
        return Ticket(self.epoch, GuardMode.SPEC if alone else self.mode, alone)

    def end(self, session: GuardSession, ticket: Ticket, tokens: int, seconds: float) -> None:
        """A round of `session` begun under `ticket` (`seconds` ago) committed `tokens`."""
        now = self.clock()
        self._observe(now)
        self.last_seen[session] = now
        self._running.pop(session, None)
        self.round_seconds[ticket.mode] = self._smoothed(self.round_seconds[ticket.mode], seconds)
        # A round of the epoch's mode, or of a session alone in it (which speculates in
        # a plain epoch too: that is what running plain steps does with such a session;
        # uncounted, its seconds were a plain epoch's with none of its tokens).
        ours = ticket.epoch == self.epoch and (ticket.mode == self.mode or ticket.alone)
        if self.measuring_from is not None:
            if ours:
                self._count(now, tokens, seconds)
        elif ours:
            self._pending.discard(session)
            self._settled.append(seconds)
            self._settle(now)
        if self._awaited is not None:
            self._awaited.discard(session)
        self._advance(now)

    def leave(self, session: GuardSession) -> None:
        """`session`'s request is done: no round of it is awaited."""
        now = self.clock()
        self._observe(now)
        self.last_seen.pop(session, None)
        self._running.pop(session, None)
        self._pending.discard(session)
        if len(self._present) >= self.p.min_sessions:
            self._crowded_at = now
        arrived = self._present.pop(session, None)
        if arrived is not None:
            self.request_seconds = self._smoothed(self.request_seconds, now - arrived)
        if self._awaited is not None:
            self._awaited.discard(session)
        if self.measuring_from is None:
            self._settle(now)
        self._advance(now)

    # -- what it decided ----------------------------------------------------------------------

    def is_alone(self, now: float | None = None) -> bool:
        """Whether a round beginning `now` (the clock's) is alone, and speculates whatever
        the epoch's mode: its session alone with a request (the load gone), not in a round
        (a batched forward's sessions begin their next rounds one by one), for
        `alone_rounds` of the epoch's rounds (not a closed loop's turnaround, which cost
        plain epochs 4% at 2 sessions on llama.cpp). A shared guard's followers are told."""
        now = self.clock() if now is None else now
        if len(self._present) >= self.p.min_sessions:
            self._crowded_at = now
        return len(self._present) < self.p.min_sessions and (
            now - self._crowded_at >= self.p.alone_rounds * self.round_seconds[self.mode]
        )

    def rates(self, level: int) -> dict[GuardMode, float]:
        """Each measured mode's tokens per second at `level`, from its remembered epochs:
        the median of their rates (`summary`; "pooled": their tokens over their seconds)."""
        out = {}
        for mode in GuardMode:
            seen = self.measured.get((level, mode))
            if seen:
                out[mode] = rate_of(seen, self.p.summary)
        return out

    # -- epochs -------------------------------------------------------------------------------

    def _begin(self, now: float) -> None:
        self.started = now
        self.measuring_from = None
        # Sessions in a round or seen within the last few: the epoch measures once each
        # has finished a round begun under its mode.
        recent = 3.0 * self._longest()
        self._running = {s: t for s, t in self._running.items() if not self._lost(now, t)}
        # A session not seen since (its request failed, or its replica crashed, without
        # a word) is forgotten.
        self.last_seen = {s: t for s, t in self.last_seen.items() if now - t <= recent}
        self._pending = set(self._running) | set(self.last_seen)
        self._tokens = 0.0
        self._area, self._area_at = 0.0, 0.0
        # less any that left without a word
        self._present = {s: t for s, t in self._present.items() if s in self._pending}
        self._settled = []
        self._last_counted = None
        self._peak = None
        self._awaited = None
        self._lost_any = False  # a round it awaited was lost

    def _smoothed(self, mean: float, seconds: float) -> float:
        """A mean time (0: none seen yet) with `seconds` seen: `smoothing` its weight."""
        a = self.p.smoothing
        return (1 - a) * mean + a * seconds if mean else seconds

    def _longest(self) -> float:
        """The longer of the modes' mean rounds (0: none seen)."""
        return max(self.round_seconds.values())

    def _lost(self, now: float, began: float) -> bool:
        """Whether a round begun at `began` and still running is forgotten: it never
        reported its end (its request failed), ten of the longer mean rounds on."""
        lost = 10.0 * self._longest()
        return bool(lost) and now - began > lost

    def _settle(self, now: float) -> None:
        """Once no session is pending and a round of the epoch has ended: wait
        `settle_rounds` more of its rounds, then measure the next `measure_rounds` (at
        least `min_measure` seconds), and at least `measure_requests` mean requests (up to
        `max_measure` seconds). A round here is the mean of the epoch's own rounds so far
        (its mode at this load), not of earlier loads'. A closed loop's sessions whose
        requests end together prefill their next prompts together: a measurement shorter
        than a request sees the prompts' forwards, which hold every session, or misses
        them, by where its bounds fall."""
        if not self._pending and self._settled:
            p = self.p
            mean = sum(self._settled) / len(self._settled)
            self.measuring_from = now + p.settle_rounds * mean
            cycle = min(p.max_measure, p.measure_requests * self.request_seconds)
            self._length = max(p.min_measure, p.measure_rounds * mean, cycle)

    def _observe(self, now: float) -> None:
        """Before `now`'s event changes who is in a round or present: once the
        measurement has begun, the sessions in a round at its start are its first peak,
        and the sessions present since the last event count their seconds within it."""
        start = self.measuring_from
        if start is None or now < start:
            return
        if self._peak is None:
            self._peak = len(self._running)
        lo, hi = max(self._area_at, start), min(now, start + self._length)
        if hi > lo:
            self._area += len(self._present) * (hi - lo)
        self._area_at = max(self._area_at, now)

    def _count(self, now: float, tokens: int, seconds: float) -> None:
        """A round of the epoch (its mode's, or a session's alone) that ended `now` after
        `seconds`: its tokens, by the share of its seconds within the measurement."""
        start = self.measuring_from
        assert start is not None
        end = start + self._length
        if seconds > 0:
            share = (min(now, end) - max(now - seconds, start)) / seconds
        else:
            share = 1.0 if start < now <= end else 0.0
        if share <= 0:
            return
        self._tokens += tokens * share
        if now <= end:
            self._last_counted = now

    def _advance(self, now: float) -> None:
        """Close the epoch once it has measured long enough and no round it measured is
        still running, and pick the next one's mode."""
        if self.measuring_from is None:
            stale = 3.0 * self._longest()
            if stale and now - self.started > stale:  # a session that left without a word
                self._pending = {
                    s
                    for s in self._pending
                    if now - self.last_seen.get(s, 0.0) <= stale
                    or (s in self._running and not self._lost(now, self._running[s]))
                }
                self._settle(now)
            return
        end = self.measuring_from + self._length
        if now < end:
            return
        # The rounds running at the end: each counts its share once it has ended.
        if self._awaited is None:
            self._awaited = {s for s, t in self._running.items() if t < end}
        lost = {
            s for s in self._awaited if s in self._running and self._lost(now, self._running[s])
        }
        self._lost_any = self._lost_any or bool(lost)
        self._awaited = {s for s in self._awaited if s in self._running and s not in lost}
        if self._awaited:
            return
        peak = self._peak or 0
        level = level_of(peak)
        # The load drained or grew within the count (its mean well below its peak), or
        # stopped (a lull, below): the epoch measured no level's steady
        # state of its mode.
        ramp = self._area < self.p.steady * peak * self._length
        # A lull: no round of it ended for a quarter of the measurement (two of its mean
        # rounds at least, as batched rounds end together).
        quiet = max(self._length / 4, 2.0 * self.round_seconds[self.mode])
        stopped = self._last_counted is None or end - self._last_counted > quiet
        # A round lost within it: what it committed is not known.
        stopped = stopped or self._lost_any
        if peak < self.p.min_sessions:
            pass  # a session alone speculates by its ticket; the mode awaits the load
        elif level != self._level or ramp or stopped:
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
        slower one once in `explore_turns` epochs, else the faster. Speculation not yet
        measured at a level above one where it measured slower is taken to be as much
        slower (load only shrinks what it gains), and waits the turn that gap gives it (one
        speculating epoch in four, at a 25% gap, would cost the level 6% where nothing
        suggests that speculation pays)."""
        rates = self.rates(level)
        spec, plain = GuardMode.SPEC, GuardMode.PLAIN
        ratio = self._lower_ratio(level) if spec not in rates else None
        inherited = ratio is not None and ratio * (1.0 + self.p.margin) < 1.0
        if ratio is not None and inherited:
            if plain not in rates:
                return plain
            rates[spec] = rates[plain] * ratio
        for mode in GuardMode:
            if mode not in rates:
                return mode
        # Speculation is the policy's own choice: plain steps must measure clearly faster.
        margin = clear_margin(
            self.p, self.measured.get((level, spec), ()), self.measured.get((level, plain), ())
        )
        best = plain if rates[plain] > rates[spec] * (1.0 + margin) else spec
        other = plain if best == spec else spec
        gap = max(0.0, 1.0 - rates[other] / rates[best]) if rates[best] > 0 else 0.0
        counts = [len(self.measured.get((level, m), ())) for m in GuardMode]
        every = explore_turns(self.p, gap, None if inherited else counts)
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


def learnt(guard: GoodputGuard) -> dict[str, Any]:
    """What `guard` measured and when it last tried the slower mode, per level, as
    JSON-ready data: what a replica taking over the shared guard starts from (`restore`)."""
    return {
        "measured": [
            [level, mode.value, [list(e) for e in seen]]
            for (level, mode), seen in guard.measured.items()
        ],
        "since": [[level, n] for level, n in guard._since.items()],
    }


def restore(guard: GoodputGuard, data: dict[str, Any]) -> None:
    """Start `guard` from what another `learnt` (its epochs in progress are not carried:
    its first epoch settles and measures anew). Raises ValueError or KeyError on data not
    in that form."""
    measured = {}
    for level, mode, seen in data["measured"]:
        epochs = [(float(t), float(s)) for t, s in seen]
        if any(s <= 0 or t < 0 for t, s in epochs):
            raise ValueError(f"an epoch of no time or negative tokens: {epochs}")
        measured[(int(level), GuardMode(mode))] = deque(epochs, maxlen=guard.p.window)
    guard.measured = measured
    guard._since = {int(level): int(n) for level, n in data["since"]}
