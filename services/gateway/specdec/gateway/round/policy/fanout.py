"""SSD's fan-out (`FanOut`): how many branches each Speculate asks for, so that it is done
when the verdict comes, and SSD's pause when its Speculates keep arriving late
(specdec.gateway.round.policy.adaptive's docstring)."""

from __future__ import annotations

from specdec.gateway.round.policy.acceptance import Ema
from specdec.gateway.round.policy.params import PolicyParams


class FanOut:
    """S(f) = s (branch_k + 1) (1 + c (f - 1)) against the Verify it hides behind; the
    SSD hit rate h; the late Speculates in a row and the rounds left paused."""

    def __init__(self, ssd: bool, max_fan_out: int, params: PolicyParams) -> None:
        self.p = params
        self.ssd = ssd
        self.max_fan_out = max(1, max_fan_out)
        self.hits = Ema(params.smoothing)  # h: SSD hit (1) or miss (0)
        self.step = Ema(params.smoothing)  # s: seconds of one Speculate step, one branch
        self.late_in_row = 0
        self.paused = 0  # rounds left without Speculate
        self.verify_s: float | None = None  # the last Verify's time (a late Speculate's floor)

    @property
    def hit_rate(self) -> float:
        """h: the SSD hit rate used in D; 0 without SSD or while it is paused."""
        if not self.ssd or self.paused:
            return 0.0
        return self.p.prior_hit_rate if self.hits.value is None else self.hits.value

    def choose(self, branch_k: int, verify: float | None) -> int | None:
        """Branches to ask the next Speculate for (each of branch_k tokens), hidden behind
        a Verify of `verify` seconds (None: not known yet); None: send no Speculate (SSD
        paused)."""
        if self.paused:
            self.paused -= 1
            if self.paused == 0:
                self.late_in_row = 0  # try again from one branch
            return None
        if self.step.value is None or verify is None:
            return self.max_fan_out
        budget = self.p.fit_margin * verify
        one = self.step.value * (branch_k + 1)  # S(1)
        fan_out = 1
        for f in range(2, self.max_fan_out + 1):
            if one * (1.0 + self.p.branch_cost * (f - 1)) > budget:
                break
            fan_out = f
        return fan_out

    def observe_speculate(self, fan_out: int, branch_k: int, seconds: float | None) -> None:
        """A Speculate of fan_out branches of branch_k tokens took `seconds`; None: it was
        still running at its verdict (late), so it took longer than that round's Verify."""
        late = seconds is None
        if seconds is None:
            seconds = 1.25 * (self.verify_s or 0.0)  # a floor, raised so the fan-out shrinks
        per_step = seconds / ((branch_k + 1) * (1.0 + self.p.branch_cost * (max(1, fan_out) - 1)))
        if per_step > 0:
            self.step.add(per_step)
        if not late:
            self.late_in_row = 0
        elif fan_out <= 1:
            self.late_in_row += 1
            if self.late_in_row >= self.p.late_limit:
                self.paused = self.p.pause_rounds

    def observe_ssd(self, hit: bool) -> None:
        self.hits.add(1.0 if hit else 0.0)
