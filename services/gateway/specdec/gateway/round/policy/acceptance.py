"""What drafts of each source yield: per-position acceptance (`Acceptance`), the gateway's
rate per source over the requests it served (`SourcePriors`), and the expected tokens of a
draft. The adaptive policy (specdec.gateway.round.policy.adaptive) reads them; every policy
feeds the gateway's priors."""

from __future__ import annotations

import math

from specdec.gateway.names import LOOKUP_SOURCES, DraftMethod
from specdec.gateway.outcome import Outcome
from specdec.gateway.round.policy.params import PolicyParams

# Draft sources whose acceptance is measured apart (LOOKUP_SOURCES, then these two).
MODEL = DraftMethod.MODEL.value
EXTENSION = "extension"  # a lookup's continuation of a model draft (hybrid)
MAX_POSITIONS = 32  # draft positions whose acceptance is counted one by one


def expected_tokens(a: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens a round of k drafts yields on average."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Ema:
    """An exponential moving average; None until the first value."""

    __slots__ = ("value", "weight")

    def __init__(self, weight: float):
        self.weight = weight
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


def drafts_of(
    k: int, accepted: int, lookup: str | None, extended: int
) -> list[tuple[str, int, int]]:
    """A verdict on k draft tokens split by source: (source, its tokens, accepted of them).
    lookup: the lookup source of a lookup draft (None: the draft model's); extended: the
    last tokens were a lookup extension of the model's draft, verified only where the
    model's were all accepted."""
    if lookup:
        return [(lookup, k, accepted)]
    own = k - extended
    out = [(MODEL, own, min(accepted, own))]
    if extended and accepted >= own:
        out.append((EXTENSION, extended, accepted - own))
    return out


class SsdPrior:
    """What the gateway's Speculates saved the rounds after them, over every request (one
    instance per gateway, in its SourcePriors): where they saved nothing on average, a new
    request starts with SSD paused, but one in `ssd_explore_every`, which measures again."""

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.p = params or PolicyParams()
        self.saved = Ema(self.p.smoothing / 4)
        self.settled = 0
        self.starts = 0  # requests that found SSD not paying

    def record(self, seconds: float) -> None:
        self.saved.add(seconds)
        self.settled += 1

    def start_paused(self) -> bool:
        """Whether a new request's SSD starts paused."""
        if self.settled < self.p.late_limit or (self.saved.value or 0.0) > 0.0:
            return False
        self.starts += 1
        return self.starts % self.p.ssd_explore_every != 0


class SourcePriors:
    """The gateway's acceptance per draft source over the rounds it served, whatever their
    policy (decayed counts), and what its Speculates saved (`ssd`, `SsdPrior`): each new
    request's adaptive policy starts from them (one instance per gateway)."""

    def __init__(self, decay: float = 0.999):
        self.decay = decay
        self.ssd = SsdPrior()
        self._counts: dict[str, list[float]] = {}  # source -> [accepted, reached]

    def observe(self, source: str, accepted: int, reached: int) -> None:
        row = self._counts.setdefault(source, [0.0, 0.0])
        row[0] = row[0] * self.decay + accepted
        row[1] = row[1] * self.decay + reached

    def observe_outcome(self, o: Outcome) -> None:
        """A round's verdict, by source (rounds without a draft count nothing)."""
        lookup = o.source if o.source in LOOKUP_SOURCES else None
        for source, k, accepted in drafts_of(*o.chain_verdict, lookup, o.extended):
            if k > 0:
                self.observe(source, accepted, min(k, accepted + 1))

    def prior(
        self, source: str, default: float, weight: float, max_weight: float
    ) -> tuple[float, float]:
        """(rate, weight): the source's rate over the rounds seen, shrunk towards `default`
        (`weight` pseudo-positions), and what it is worth to a new request: the positions
        counted, between weight and max_weight."""
        accepted, reached = self._counts.get(source, (0.0, 0.0))
        rate = (accepted + weight * default) / (reached + weight)
        return rate, min(max_weight, max(weight, reached))

    def snapshot(self) -> dict[str, float]:
        return {s: a / r for s, (a, r) in self._counts.items() if r > 0}


class Acceptance:
    """Per-position acceptance of one draft source: a(i) = P(position i accepted | the
    positions before it were), from accepted / reached counts shrunk towards the pooled
    rate (`position_weight` pseudo-positions), itself shrunk towards `prior` (`weight`
    pseudo-positions). `explore` > 0 asks for an upper confidence bound instead of the
    estimate (module docstring)."""

    def __init__(self, prior: float, weight: float, position_weight: float | None = None):
        self.prior = prior
        self.weight = weight
        self.position_weight = weight if position_weight is None else position_weight
        self.reached = [0] * MAX_POSITIONS
        self.accepted = [0] * MAX_POSITIONS

    def observe(self, k: int, accepted: int) -> tuple[int, int]:
        """A draft of k tokens of this source, `accepted` of them: (accepted, reached)."""
        reached = min(k, accepted + 1)
        for i in range(min(reached, MAX_POSITIONS)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted
        return accepted, reached

    @property
    def total_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def rejections(self) -> int:
        return sum(self.reached) - sum(self.accepted)

    @property
    def pooled(self) -> float:
        w = self.weight
        return (sum(self.accepted) + w * self.prior) / (sum(self.reached) + w)

    def rate(self, i: int, explore: float = 0.0) -> float:
        """a(i); with explore = c sqrt(ln(e + t)), its upper confidence bound."""
        pooled, w = self.pooled, self.position_weight
        if i >= MAX_POSITIONS:
            mean = pooled
        else:
            mean = (self.accepted[i] + w * pooled) / (self.reached[i] + w)
        n = sum(self.reached) + self.weight  # the bound is the source's, not the position's
        if explore <= 0.0 or n <= 0:
            return mean
        return min(1.0, mean + explore * math.sqrt(mean * (1.0 - mean) / n))

    def expected(self, k: int, explore: float = 0.0) -> list[float]:
        """[k + 1]: the expected accepted tokens of a draft of 0..k tokens."""
        out, survive, total = [0.0], 1.0, 0.0
        for i in range(k):
            survive *= self.rate(i, explore)
            total += survive
            out.append(total)
        return out

    def survive(self, k: int, explore: float = 0.0) -> float:
        """P(all of the first k positions accepted)."""
        p = 1.0
        for i in range(k):
            p *= self.rate(i, explore)
        return p


def starting_acceptance(p: PolicyParams, priors: SourcePriors | None) -> dict[str, Acceptance]:
    """Each source's acceptance at a request's start: the gateway's rate for it (its
    SourcePriors), else the params' prior."""
    sources = {}
    for source in (MODEL, EXTENSION, *LOOKUP_SOURCES):
        default = p.prior_acceptance if source == MODEL else p.prior_lookup_acceptance
        prior, weight = default, p.prior_weight
        if priors is not None:
            prior, weight = priors.prior(source, default, weight, p.max_prior_weight)
        sources[source] = Acceptance(prior, weight, p.position_weight)
    return sources


def argmax(rates: list[float]) -> int:
    """The index of the largest rate; ties (within 1e-9) go to the smaller index."""
    best = 0
    for i, r in enumerate(rates):
        if r > rates[best] * (1.0 + 1e-9):
            best = i
    return best
