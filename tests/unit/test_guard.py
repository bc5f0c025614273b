"""The goodput guard (specdec.gateway.round.policy.guard) on a scripted clock: sessions run
rounds of a fixed length and yield, per mode; the guard must find the faster mode at each
load level, keep trying the other, stay out of the way of one session, count no round of
an earlier epoch, and not wait for a session that left."""

from __future__ import annotations

import heapq

from specdec.gateway.round.policy.guard import GoodputGuard, GuardMode, GuardParams, level_of


class Script:
    """`sessions` sessions running rounds back to back on a simulated clock: a round of
    mode m takes seconds[m] (session i's offset by i ms, so they do not tie) and commits
    tokens[m]."""

    def __init__(self, guard_params: GuardParams | None = None):
        self.now = 0.0
        self.guard = GoodputGuard(guard_params, clock=lambda: self.now)
        self.modes: list[GuardMode] = []

    def run(
        self,
        sessions: int,
        seconds: dict[GuardMode, float],
        tokens: dict[GuardMode, int],
        until: float,
    ) -> None:
        events = []
        for i in range(sessions):
            heapq.heappush(events, (self.now, i, None))
        while events:
            self.now, i, ticket = heapq.heappop(events)
            if ticket is not None:
                self.guard.end(i, ticket, tokens[ticket.mode], seconds[ticket.mode])
            if self.now >= until:
                continue
            ticket = self.guard.begin(i)
            self.modes.append(ticket.mode)
            heapq.heappush(events, (self.now + seconds[ticket.mode] + i / 1e3, i, ticket))


def test_levels_are_powers_of_two():
    assert [level_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 40)] == [
        1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32
    ]  # fmt: skip


def test_it_finds_the_faster_mode_and_keeps_trying_the_other():
    """Plain steps of 1 token in 0.1 s against speculating rounds of 2 tokens in 0.4 s
    (speculation at half the goodput): after trying both, plain runs; speculation is
    tried again now and then, and the rates measured are the true ones (within 10%: the
    scripted sessions' rounds end in bursts, which a window counts whole or not)."""
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.4},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 2},
    )
    script.run(8, seconds, tokens, until=200.0)
    rates = script.guard.rates(8)
    assert abs(rates[GuardMode.PLAIN] - 8 / 0.1) / 80 < 0.1, rates
    assert abs(rates[GuardMode.SPEC] - 8 * 2 / 0.4) / 40 < 0.1, rates
    plain = script.modes.count(GuardMode.PLAIN) / len(script.modes)
    assert plain > 0.9, plain
    assert script.modes[0] == GuardMode.SPEC  # it starts as the policy alone would
    late = script.modes[len(script.modes) // 2 :]
    assert GuardMode.SPEC in late  # still tried


def test_speculation_that_pays_keeps_running():
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.2},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 3},
    )
    script.run(4, seconds, tokens, until=200.0)
    spec = script.modes.count(GuardMode.SPEC) / len(script.modes)
    assert spec > 0.9, spec


def test_one_session_always_speculates_and_measures_nothing():
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.4},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 2},
    )
    script.run(1, seconds, tokens, until=100.0)
    assert set(script.modes) == {GuardMode.SPEC}
    assert script.guard.measured == {}


def test_each_level_decides_for_itself():
    """Speculation loses at 8 sessions and wins at 2: each level keeps its own rates."""
    script = Script()
    script.run(
        8,
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.4},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 2},
        until=100.0,
    )
    script.modes.clear()
    script.run(
        2,
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.2},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 3},
        until=200.0,
    )
    assert script.guard.rates(8)[GuardMode.PLAIN] > script.guard.rates(8)[GuardMode.SPEC]
    assert script.guard.rates(2)[GuardMode.SPEC] > script.guard.rates(2)[GuardMode.PLAIN]
    assert script.modes.count(GuardMode.SPEC) / len(script.modes) > 0.8


def test_a_round_of_an_earlier_epoch_is_not_counted_and_a_leaver_is_not_awaited():
    now = [0.0]
    guard = GoodputGuard(clock=lambda: now[0])
    a, b = guard.begin(1), guard.begin(2)
    now[0] = 0.5
    guard.end(1, a, 1, 0.5)
    guard.end(2, b, 1, 0.5)
    assert guard.measuring_from is not None  # settled: both ended a round of epoch 0
    start, end = guard.measuring_from, guard.measuring_from + guard._length
    now[0] = start + 0.1
    old, other = guard.begin(1), guard.begin(2)  # in flight when epoch 0 closes
    now[0] = end + 0.1
    assert guard.begin(3).epoch == 1  # epoch 1 begins: 1 and 2 are pending
    guard.end(1, old, 100, 0.5)  # begun in epoch 0: not counted; 1 still pending
    assert guard.measuring_from is None and guard._tokens == 0
    now[0] += 0.5
    guard.end(1, guard.begin(1), 1, 0.5)
    guard.end(3, guard.begin(3), 1, 0.5)
    assert guard.measuring_from is None  # 2 is still pending
    guard.leave(2)  # its request is done
    assert guard.measuring_from is not None
    assert other.epoch == 0


def test_requests_one_after_another_are_one_session():
    """Sequential requests (a new session id each) never reach the guard's levels."""
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.4},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 2},
    )
    for request in range(40):
        for _ in range(5):
            t = script.guard.begin(request)
            script.modes.append(t.mode)
            script.now += seconds[t.mode]
            script.guard.end(request, t, tokens[t.mode], seconds[t.mode])
        script.guard.leave(request)
    assert set(script.modes) == {GuardMode.SPEC} and script.guard.measured == {}


def test_a_higher_level_starts_from_what_a_lower_one_measured():
    """Speculation measured slower at 8 sessions: at 16 it is not tried at once, but
    after the plain steps' first epochs there, as a slower mode is."""
    reported: list[tuple[int, str]] = []
    script = Script()
    script.guard.report = lambda level, mode, rate: reported.append((level, mode))
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.4},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 2},
    )
    script.run(8, seconds, tokens, until=60.0)
    assert {m for level, m in reported if level == 8} == {"spec", "plain"}
    reported.clear()
    script.run(16, seconds, tokens, until=script.now + 60.0)
    at_16 = [m for level, m in reported if level == 16]
    assert at_16[:3] == ["plain"] * 3, at_16
    assert "spec" in at_16  # still tried, in its turn


def test_an_epoch_whose_load_stopped_is_not_kept():
    """Sessions that finish within an epoch's count leave idle seconds in it: the epoch
    measured no mode, and is not kept (its rate would read as that mode's loss)."""
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.1},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 1},
    )
    script.run(4, seconds, tokens, until=20.5)  # epochs at 4 sessions; stops within one
    for i in range(4):
        script.guard.leave(i)
    script.now += 10.0
    script.run(4, seconds, tokens, until=script.now + 10.0)
    for level_mode, seen in script.guard.measured.items():
        for t, s in seen:
            assert t / s > 30, (level_mode, seen)  # 4 sessions x 10 tokens a second


def test_a_round_that_never_ends_is_forgotten():
    """A request that failed mid-round reports no end: after ten mean rounds its session
    no longer counts towards the level or holds up the settling."""
    script = Script()
    seconds, tokens = (
        {GuardMode.PLAIN: 0.1, GuardMode.SPEC: 0.1},
        {GuardMode.PLAIN: 1, GuardMode.SPEC: 1},
    )
    for lost in range(100, 106):  # six rounds begun and never ended
        script.guard.begin(lost)
    script.run(2, seconds, tokens, until=30.0)
    assert len(script.guard._running) <= 2
    assert script.guard.rates(2), script.guard.measured  # measured at 2 sessions, not 8
    assert not script.guard.rates(8)
