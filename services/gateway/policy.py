"""How many tokens to draft per round, and how many SSD branches to ask for (k_policy).

`FixedPolicy` is the behaviour from before: every round drafts the request's k (fewer only
near max_new_tokens) and every Speculate asks for the configured fan-out.

`AdaptivePolicy` treats the request's k as an upper bound and picks, before each round,
the k in [0, max_k] that maximises the expected tokens per second of this request:

    E(k) = (1 - a^(k+1)) / (1 - a)      tokens a round yields (accepted drafts + 1), for a
                                         per-token acceptance a, i.i.d. across positions
    T(k) = V(k) + D(k)                   the round's expected time
    V(k) = v (1 + g k)                   Verify: v is the measured time of a round without a
                                         draft; each draft token adds g of it
    D(k) = k d (1 - h)                   Draft: d is the measured drafter time per draft
                                         token; h the share of SSD rounds whose drafting was
                                         hidden (a hit on a Speculate answered in time; one
                                         that was late made the next Draft wait, so it
                                         counts as a miss here), 0 without SSD
    k* = argmax_k E(k) / T(k)            ties go to the smaller k

What is measured (per request, exponential moving averages; nothing is shared between
requests, so the module is pure and needs no processes to test):

- a: the acceptance of a draft position reached, from the verdicts: accepted tokens over
  accepted tokens + rejections (a round with accepted < k ended with one rejection), with
  a prior of `prior_acceptance` worth `prior_weight` positions. This is the per-token rate
  of the geometric model above, not the share of draft tokens accepted (which counts the
  positions after a rejection as rejected).
- v: each Verify's round-trip time, divided by (1 + g k) for the k it verified.
- d: each Draft's round-trip time over its k (a Draft served from an SSD branch is not a
  measurement of drafting).
- the verifier's load L: the queue depth it reports in every VerifyResponse (model
  requests of other sessions it had queued or running when the call arrived).

The load sets g. An idle verifier is memory-bound: checking k + 1 tokens costs little more
than one (g = `idle_token_cost`; 0.05 matches the CPU bench, where a 3-token verification
took 1.08x a 1-token step). A saturated verifier is compute-bound: other sessions' tokens
fill every forward, so each extra draft token costs about what a decoding step costs
(g -> 1), and then E(k) / (1 + k) < 1 for every k >= 1: speculation stops (k = 0) and every
forward goes to tokens that are certain. In between g rises linearly with L up to
`saturation_queue`. Once the load falls, g falls and k grows again: the load is measured
by every Verify, at k = 0 too. Before anything is measured the policy drafts max_k (the
fixed behaviour), so the first rounds measure the drafter. Acceptance and drafter time
are only measured by drafting, so after `probe_interval` rounds in a row at k = 0 one
round drafts a single token to refresh them.

With SSD the policy also sizes each Speculate: a Speculate feeds the draft, then drafts
branch_k tokens for f branches in batched steps, which takes about
S(f) = s (branch_k + 1) (1 + b (f - 1)) (s: measured time of one step for one branch, b:
`branch_cost`, the extra cost of each further row of a batched step). The fan-out is the
largest f <= f_max with S(f) <= `fit_margin` x V(k), so the Speculate is done when the
verdict comes. A Speculate still running at its verdict (late) counts as having taken
longer than that Verify; after `late_limit` late Speculates in a row at fan-out 1, SSD
pauses for `pause_rounds` rounds (no Speculate, h = 0 in T(k)) and then tries again.

Why changing k is exact: every round is an ordinary speculation round (DESIGN §2): given
the tokens so far, the tokens it appends follow the target's distribution for any draft
length fixed before the round, k = 0 (the target alone) included. The policy fixes k
before the round from what earlier rounds produced (verdicts and timings), never from
this round's random draws, so by induction over rounds the whole sequence follows the
target's distribution: a k chosen from the past is like a stopping rule, which cannot
bias what the rule of each round guarantees. Under greedy decoding every round appends
the target's argmax tokens whatever k is, so the output is generate()'s token for token.
(A seeded sampled output is reproducible for a given sequence of k, not across k: the
drafter's and the verifier's draws at a position differ between k = 0 and k > 0.)
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.gateway.outcome import DRAFTED, LOOKUP_SOURCES, SSD_HIT, SSD_LATE, SSD_MISS, Outcome
from specdec.v1 import gateway_pb2

FIXED = gateway_pb2.K_POLICY_FIXED
ADAPTIVE = gateway_pb2.K_POLICY_ADAPTIVE
NAMES = {FIXED: "fixed", ADAPTIVE: "adaptive"}
BY_NAME = {name: value for value, name in NAMES.items()}
# The largest fan-out the adaptive policy asks for when the gateway's --ssd-fan-out is 0:
# the drafter's default --ssd-fan-out (replicas do not report theirs).
ADAPTIVE_MAX_FAN_OUT = 6


def policy_name(value: int) -> str:
    return NAMES[value]


def parse_policy(name: str) -> int:
    """'fixed' / 'adaptive' -> the KPolicy value; ValueError naming the choices."""
    try:
        return BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(f"must be one of {', '.join(BY_NAME)}, got {name!r}") from None


@dataclass(frozen=True)
class PolicyParams:
    """The adaptive policy's constants (see the module docstring)."""

    prior_acceptance: float = 0.7
    prior_weight: float = 4.0  # pseudo-positions of the prior
    idle_token_cost: float = 0.05  # g of an idle verifier
    saturation_queue: float = 4.0  # reported queue depth at which g reaches 1
    smoothing: float = 0.3  # weight of the newest measurement in the moving averages
    prior_hit_rate: float = 0.8  # SSD hit rate before any verdict
    fit_margin: float = 0.9  # a Speculate may take this share of the Verify it hides behind
    branch_cost: float = 0.15  # extra time of each further branch in a batched step
    late_limit: int = 3  # late Speculates in a row at fan-out 1 before SSD pauses
    pause_rounds: int = 16  # rounds without Speculate before SSD is tried again
    probe_interval: int = 32  # rounds in a row at k = 0 before one round drafts 1 token


def expected_tokens(a: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens a round of k drafts yields on average."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class _Ema:
    __slots__ = ("value", "weight")

    def __init__(self, weight: float):
        self.weight = weight
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class FixedPolicy:
    """The request's k every round; the configured fan-out for every Speculate."""

    kind = FIXED

    def __init__(self, fan_out: int = 0):
        self.fan_out = fan_out  # 0: the drafter's default

    def choose_k(self, max_k: int) -> int:
        return max_k

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        return self.fan_out

    def choose_lookup_k(self, bound: int) -> int:
        return max(0, bound)

    def observe(self, outcome: Outcome) -> None:
        """Nothing a round shows changes a fixed policy."""


class AdaptivePolicy:
    """Picks k per round (and the SSD fan-out) from what the request measured so far."""

    kind = ADAPTIVE

    def __init__(self, ssd: bool, max_fan_out: int, params: PolicyParams | None = None):
        self.p = params or PolicyParams()
        self.ssd = ssd
        self.max_fan_out = max(1, max_fan_out)
        self.accepted = 0  # draft tokens accepted
        self.rejections = 0  # rounds that ended with a rejected draft token
        self.verify = _Ema(self.p.smoothing)  # v: seconds of a Verify without a draft
        self.draft = _Ema(self.p.smoothing)  # d: seconds per drafted token
        self.queue = _Ema(self.p.smoothing)  # L: the verifier's reported queue depth
        self.hits = _Ema(self.p.smoothing)  # h: SSD hit (1) or miss (0)
        self.step = _Ema(self.p.smoothing)  # s: seconds of one Speculate step, one branch
        self.late_in_row = 0
        self.paused = 0  # rounds left without Speculate
        self.k0_in_row = 0  # rounds in a row the policy chose k = 0
        self._verify_s: float | None = None  # the last Verify's time (a late Speculate's floor)
        self.lookup_accepted = 0  # the same two counts for lookup drafts
        self.lookup_rejections = 0

    # -- the model -------------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """a: accepted / (accepted + rejections), with the prior's pseudo-positions."""
        n0 = self.p.prior_weight
        return (self.accepted + n0 * self.p.prior_acceptance) / (
            self.accepted + self.rejections + n0
        )

    @property
    def token_cost(self) -> float:
        """g: the share of a verification step one more draft token costs, from the load."""
        g0 = self.p.idle_token_cost
        load = self.queue.value or 0.0
        saturation = min(1.0, load / self.p.saturation_queue) if self.p.saturation_queue else 1.0
        return g0 + (1.0 - g0) * saturation

    @property
    def hit_rate(self) -> float:
        """h: the SSD hit rate used in D(k); 0 without SSD or while it is paused."""
        if not self.ssd or self.paused:
            return 0.0
        return self.p.prior_hit_rate if self.hits.value is None else self.hits.value

    def round_time(self, k: int) -> float:
        """T(k) = v (1 + g k) + k d (1 - h), in seconds (needs v and d measured)."""
        assert self.verify.value is not None and self.draft.value is not None
        v, d = self.verify.value, self.draft.value
        return v * (1.0 + self.token_cost * k) + k * d * (1.0 - self.hit_rate)

    def rate(self, k: int) -> float:
        """E(k) / T(k): expected tokens per second at draft length k."""
        return expected_tokens(self.acceptance, k) / self.round_time(k)

    # -- decisions -------------------------------------------------------------------------

    def choose_k(self, max_k: int) -> int:
        """The round's draft length in [0, max_k]."""
        if max_k <= 0:
            return 0
        if self.verify.value is None or self.draft.value is None:
            return max_k  # nothing measured yet: draft, so the drafter gets measured
        best, best_rate = 0, self.rate(0)
        for k in range(1, max_k + 1):
            r = self.rate(k)
            if r > best_rate * (1.0 + 1e-9):
                best, best_rate = k, r
        if best == 0:
            self.k0_in_row += 1
            if self.k0_in_row > self.p.probe_interval:
                self.k0_in_row = 0
                return 1  # a probe: acceptance and drafter time are measured by drafting
        else:
            self.k0_in_row = 0
        return best

    @property
    def lookup_acceptance(self) -> float:
        """a of lookup drafts (their own counts, the same prior)."""
        n0 = self.p.prior_weight
        return (self.lookup_accepted + n0 * self.p.prior_acceptance) / (
            self.lookup_accepted + self.lookup_rejections + n0
        )

    def choose_lookup_k(self, bound: int) -> int:
        """The longest lookup draft worth verifying, in [0, bound]. A lookup draft costs
        no drafting (d = 0), so k* = argmax E(k) / (1 + g k) with the lookup drafts' own
        acceptance: long drafts pay whenever they are accepted, unless the verifier's
        load makes every draft token cost a step (g -> 1)."""
        if bound <= 0:
            return 0
        if self.verify.value is None:
            return bound
        a, g = self.lookup_acceptance, self.token_cost
        best, best_rate = 0, 1.0
        for k in range(1, bound + 1):
            r = expected_tokens(a, k) / (1.0 + g * k)
            if r > best_rate * (1.0 + 1e-9):
                best, best_rate = k, r
        return best

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        """Branches to ask the next Speculate for (this round drafts k, the branches
        branch_k); None: send no Speculate (SSD paused)."""
        if self.paused:
            self.paused -= 1
            if self.paused == 0:
                self.late_in_row = 0  # try again from one branch
            return None
        if self.step.value is None or self.verify.value is None:
            return self.max_fan_out
        budget = self.p.fit_margin * self.verify.value * (1.0 + self.token_cost * k)
        one = self.step.value * (branch_k + 1)  # S(1)
        fan_out = 1
        for f in range(2, self.max_fan_out + 1):
            if one * (1.0 + self.p.branch_cost * (f - 1)) > budget:
                break
            fan_out = f
        return fan_out

    # -- measurements ----------------------------------------------------------------------

    def observe_draft(self, k: int, seconds: float) -> None:
        """A Draft of k tokens that ran the model took `seconds` (round trip)."""
        if k > 0:
            self.draft.add(seconds / k)

    def observe_verify(
        self,
        k: int,
        accepted: int,
        seconds: float,
        queue: int,
        lookup: bool = False,
        extended: int = 0,
    ) -> None:
        """A Verify of k draft tokens: its verdict, round-trip time and reported queue;
        `lookup`: the draft was a lookup draft (its acceptance is counted apart);
        `extended`: its last tokens were a lookup's continuation of a model draft (counted
        as lookup tokens once the model's were all accepted)."""
        own = k if lookup else k - extended
        if lookup:
            self.lookup_accepted += accepted
            self.lookup_rejections += accepted < k
        else:
            self.accepted += min(accepted, own)
            self.rejections += accepted < own
            if extended and accepted >= own:
                self.lookup_accepted += accepted - own
                self.lookup_rejections += accepted < k
        self.queue.add(float(queue))
        self.verify.add(seconds / (1.0 + self.token_cost * k))
        self._verify_s = seconds

    def observe_speculate(self, fan_out: int, branch_k: int, seconds: float | None) -> None:
        """A Speculate of fan_out branches of branch_k tokens took `seconds`; None: it was
        still running at its verdict (late), so it took longer than that round's Verify."""
        late = seconds is None
        if late:
            seconds = 1.25 * (self._verify_s or 0.0)  # a floor, raised so the fan-out shrinks
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

    def observe(self, o: Outcome) -> None:
        """Learn from a round's outcome (specdec.gateway.outcome): the drafter's time when
        its model ran, the verdict and its time, the Speculate's time, SSD hit or miss.
        A late Speculate (still running at its verdict) took longer than that Verify; the
        next round's Draft then waited for it, so even its prepared draft was on the
        critical path: a miss for h."""
        if o.late_outcome is not None:
            self.observe_ssd(False)
        if o.source == DRAFTED:
            self.observe_draft(o.k, o.draft_seconds)
        self.observe_verify(
            o.k,
            o.accepted,
            o.verify_seconds,
            o.queue_depth,
            o.source in LOOKUP_SOURCES,
            o.extended,
        )
        if o.ssd == SSD_LATE:
            self.observe_speculate(o.fan_out or 0, o.branch_k, None)
        elif o.speculate_seconds is not None:
            self.observe_speculate(o.fan_out or 0, o.branch_k, o.speculate_seconds)
        if o.ssd in (SSD_HIT, SSD_MISS):
            self.observe_ssd(o.ssd == SSD_HIT)


Policy = FixedPolicy | AdaptivePolicy


def make_policy(kind: int, ssd: bool, fan_out: int) -> Policy:
    """The request's policy. fan_out: the gateway's --ssd-fan-out (0: the drafter's
    default, which the adaptive policy takes as ADAPTIVE_MAX_FAN_OUT, its largest)."""
    if kind == ADAPTIVE:
        return AdaptivePolicy(ssd, fan_out or ADAPTIVE_MAX_FAN_OUT)
    return FixedPolicy(fan_out)
