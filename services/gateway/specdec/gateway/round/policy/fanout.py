"""SSD's fan-out (`FanOut`): how many branches each Speculate asks for, what a Speculate
still running at its verdict costs the next round, and SSD's pause when its Speculates
cost more than they save (specdec.gateway.round.policy.adaptive's docstring)."""

from __future__ import annotations

from specdec.gateway.names import Ssd
from specdec.gateway.outcome import Outcome
from specdec.gateway.round.policy.acceptance import Ema, SsdPrior
from specdec.gateway.round.policy.params import PolicyParams


class FanOut:
    """S(f) = s (branch_k + 1) (1 + c (f - 1)) against the Verify it hides behind and the
    Draft a hit saves; the SSD hit rate h; the wait w a late Speculate gives the next
    round; what the Speculates since SSD last (re)started saved, and the rounds left
    paused."""

    def __init__(
        self, ssd: bool, max_fan_out: int, params: PolicyParams, prior: SsdPrior | None = None
    ) -> None:
        self.p = params
        self.prior = prior
        self.ssd = ssd
        self.max_fan_out = max(1, max_fan_out)
        self.hits = Ema(params.smoothing)  # h: SSD hit (1) or miss (0)
        self.step = Ema(params.smoothing)  # s: seconds of one Speculate step, one branch
        self.waits = Ema(params.smoothing)  # w: seconds a Speculate kept the next round waiting
        self.saved = Ema(params.smoothing)  # seconds a Speculate saved the next round
        self.settled = 0  # Speculates settled since SSD last (re)started
        self.paused = 0  # rounds left without Speculate
        self.verify_s: float | None = None  # the last Verify's time (a late Speculate's floor)
        self._draft = 0.0  # the Draft the Speculate chosen last would save on a hit
        # The last late Speculate, until the next round settles it: (fan_out, branch_k,
        # the Verify it was beside, the Draft a hit saves).
        self._late: tuple[int, int, float, float] | None = None
        if ssd and prior is not None and prior.start_paused():
            self.paused = params.pause_rounds

    @property
    def hit_rate(self) -> float:
        """h: the SSD hit rate used in D; 0 without SSD or while it is paused."""
        if not self.ssd or self.paused:
            return 0.0
        return self.p.prior_hit_rate if self.hits.value is None else self.hits.value

    @property
    def wait(self) -> float:
        """w: the seconds a round's Speculate keeps the next round waiting on average (one
        still running at its verdict: the next Draft queues behind it); 0 without SSD or
        while it is paused."""
        if not self.ssd or self.paused:
            return 0.0
        return self.waits.value or 0.0

    def choose(self, branch_k: int, verify: float | None, draft: float = 0.0) -> int | None:
        """Branches to ask the next Speculate for (each of branch_k tokens), beside a Verify
        of `verify` seconds (None: not known yet), where a Draft of branch_k tokens takes
        `draft` seconds (0: not known); None: send no Speculate (SSD paused).

        A Speculate that outlasts its Verify by w keeps the next round waiting w (its Draft
        queues behind it), and a hit saves that round's Draft: it pays while w < h draft.
        So the largest fan-out whose Speculate takes at most `fit_margin` (V + h draft)."""
        if self.paused:
            self.paused -= 1
            if self.paused == 0:  # try again, measured afresh
                self.saved = Ema(self.p.smoothing)
                self.settled = 0
            return None
        self._draft = max(0.0, draft)
        if self.step.value is None or verify is None:
            return self.max_fan_out
        budget = self.p.fit_margin * (verify + self.hit_rate * self._draft)
        one = self.step.value * (branch_k + 1)  # S(1)
        fan_out = 1
        for f in range(2, self.max_fan_out + 1):
            if one * (1.0 + self.p.branch_cost * (f - 1)) > budget:
                break
            fan_out = f
        return fan_out

    def observe_speculate(self, fan_out: int, branch_k: int, seconds: float | None) -> None:
        """A Speculate of fan_out branches of branch_k tokens took `seconds`; None: it was
        still running at its verdict (late), so it took longer than that round's Verify:
        the next round settles it (`settle_late`)."""
        self.settle_late(None, None)  # an earlier late one no round settled
        if seconds is not None:
            self._step(fan_out, branch_k, seconds)
        else:
            self._late = (fan_out, branch_k, self.verify_s or 0.0, self._draft)

    def settle(self, hit: bool) -> None:
        """The Speculate answered in time was a hit or a miss: a hit saved its Draft."""
        self._settled(hit, 0.0, self._draft)

    def settle_round(self, o: Outcome, draft_overhead: float) -> float:
        """A round that decided the last round's late Speculate (`o.late_outcome`): its
        Draft, if it ran, queued behind it, and what it waited beyond its forward and o_d
        (`draft_overhead`) is the Speculate's lateness (`settle_late`). The Draft's own
        seconds, for its price."""
        draft_seconds = o.draft_seconds
        if o.late_outcome is None:
            return draft_seconds
        hit = o.late_outcome == Ssd.HIT
        if draft_seconds <= 0:  # no Draft measured it
            self.settle_late(hit, None)
            return draft_seconds
        wait = max(0.0, draft_seconds - o.draft_forward_ms / 1e3 - draft_overhead)
        self.settle_late(hit, wait)
        return draft_seconds - wait

    def settle_late(self, hit: bool | None, wait: float | None) -> None:
        """The last late Speculate, decided by the next round: a hit or a miss (None: the
        round drafted otherwise, unknown), its Draft having waited `wait` seconds for it
        (None: no Draft measured it: a quarter of its Verify, at least). It took its
        Verify's time and that; it saved its Draft on a hit, less the wait."""
        if self._late is None:
            return
        fan_out, branch_k, verify, draft = self._late
        self._late = None
        if wait is None:
            wait = 0.25 * verify  # a floor, raised so the fan-out shrinks
        self._step(fan_out, branch_k, verify + wait)
        self._settled(hit, wait, draft)

    def _step(self, fan_out: int, branch_k: int, seconds: float) -> None:
        per_step = seconds / ((branch_k + 1) * (1.0 + self.p.branch_cost * (max(1, fan_out) - 1)))
        if per_step > 0:
            self.step.add(per_step)

    def _settled(self, hit: bool | None, wait: float, draft: float) -> None:
        """A Speculate hit or missed (None: not known, no hit), kept the next round waiting
        `wait` and so saved it its Draft (`draft`) on a hit, less the wait (below 0: it
        cost it). Once `late_limit` have settled since SSD (re)started and they saved
        nothing on average, SSD pauses for `pause_rounds` rounds. The gateway's SsdPrior
        counts it too."""
        if hit is not None:
            self.hits.add(1.0 if hit else 0.0)
        self.waits.add(wait)
        seconds = (draft if hit else 0.0) - wait
        self.saved.add(seconds)
        self.settled += 1
        if self.prior is not None:
            self.prior.record(seconds)
        if self.settled >= self.p.late_limit and (self.saved.value or 0.0) <= 0.0:
            self.paused = self.p.pause_rounds
