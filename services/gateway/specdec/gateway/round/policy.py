"""What each round drafts: the source, its length (0 included) and the SSD fan-out (k_policy).

`FixedPolicy` drafts what it is given: the request's k every round (fewer only near
max_new_tokens), a lookup match whole, every extension whole, the configured fan-out.

`AdaptivePolicy` (the default) treats the request's k as an upper bound and picks, before
each round, the draft that maximises this request's expected tokens per second, from what
was measured so far:

    E(d)  = 1 + sum_{j=1..len(d)} prod_{i<j} a_s(i)    tokens the round yields: the accepted
                                                       drafts + the next token
    T(d)  = (1 - u) [V(1 + len(d)) + D(d)]            what the round costs (its price): its
          + u [F(max(n, W)) + (R - 1) max(0, F(n) - F(W))]   own time idle, the batch's
                                                       under load (n = 1 + len(d))
    V(n)  = o + F(n),  F(n) = r t_v(R, n)              the verifier's forward of n tokens a
                                                       row at R rows: its reported surface
    D(d)  = (max(o_d, w_d) + k d_t) (1 - h)            drafting, for the draft model's k tokens
    rate  = E(d) / T(d);  d* = argmax over the candidates, ties to the shorter

Idle (u = 0), T is the round's own time: the request's tokens per second. Under load the
price is the batch's. u, the verifier's saturation, is the share of its time that other
sessions' rows use: its reported busy share times the share of the rows it served that
were not this request's (1 - this request's rounds per second / the replica's rows per
second). At u = 1 every second this round spends off the verifier (the round trip o, which
then holds the queue's wait, and drafting) is a second the verifier spends on other rows:
no cost to the batch's goodput. What the round takes from everyone is the forward: at the
batch width W (`batch_width`: where R rows all drafting k_b tokens at the gateway's
acceptance for the source yield the most tokens per second of the forward; every request
reads the same acceptance and surface, so under load they agree on it), and beyond W the
marginal time its tokens add to the batched forward, once for every row that waits for
it. A replica whose forwards have no pads (llama.cpp: ForwardCost.ragged) pads no row to a
width: F reads its measured points at the tokens the forward computes, this row's and the
other rows', and under load a round is priced at what the replicas pass when every session
runs rounds like it (`network_time`): the S sessions split between the verifier's queue and
the drafter's so that both pass as many rounds a second. A drafter as dear as the target
(llama.cpp's 0.5B GGUF against its 1.5B) then holds the rows that would fill the verifier's
forwards, which the verifier's cheap marginal token alone does not show. Priced per request instead, the queue's wait looks like a fixed cost that a longer
draft amortises, which is how speculation lost to k = 0 at 8 and 16 sessions
(docs/concepts/cost-model.md#under-load). Between the two u weighs them, and the upper
confidence bounds below shrink by 1 - u (a draft tried for what it might yield is paid by
every row).

- a_s(i), the acceptance of draft position i of source s (the draft model, prompt lookup,
  suffix, a prediction, and the lookup extension of a model draft under hybrid): accepted /
  reached at that position, shrunk towards the request's pooled rate for the source
  (`position_weight` pseudo-positions), which is shrunk towards the gateway's rate for that
  source over earlier requests (`SourcePriors`). The gateway's rate weighs what it has
  seen: as many pseudo-positions as it counted, between `prior_weight` (a gateway that has
  seen nothing, at `prior_acceptance`) and `max_prior_weight` (requests differ, so no
  history outweighs a request's own rounds for long). So a new request starts from what
  the gateway has seen, and one early rejection does not undo it.
- Each a_s(i) enters the decision optimistically, as an upper confidence bound:
  a + c sqrt(a (1 - a) ln(e + t) / n), n the positions behind the source's estimate (all
  it reached and the prior's pseudo-positions), t the request's rounds, c `exploration`. A source
  whose estimate rests on few rounds is tried, and one held at 0 is tried again once the
  rounds since have grown its bound enough; a source measured well below paying (lookups
  at 5% on a compute-bound verifier) stays at 0. This replaces a probe every fixed number
  of rounds: exploring costs rounds in proportion to the doubt, not to the clock.
- t_v(R, n): the verifier replica's forward cost surface (specdec.common.cost): a line
  a + b n per batch bucket, fitted on the replica from the forwards it runs and seeded by
  a probe at its start, reported in Info and every Verify response with the mean rows of
  each bucket's forwards, read between buckets at R rows: the mean rows of the verifier's
  forwards over the last seconds (its reported load; 1 + its queue depth from a replica
  that reports none). r corrects it for this request (its context length, say): the EMA
  of the forward time the verifier reported over the surface's value; o is the round trip
  beyond that forward (network, serialisation, the gateway, the queue's wait). With no
  curve reported (an older replica) the policy falls back to V(n) = v (1 + g (n - 1)), v
  measured, g from the load (`idle_token_cost` idle, 1 at `saturation_queue`), and u = 0.
- d_t: the drafter's time per draft token, the EMA of each Draft's reported forward time
  over its k (before the first Draft, the drafter's reported t_d(1)); o_d: a Draft's round
  trip beyond its forwards (before the first, the Verify's o). w_d: the drafter's queue as
  it reports it now (any request's call brings its load): its waiting requests over its
  rows per forward, times its mean forward. A busy drafter pool makes drafts late: that
  lateness prices the draft model's rounds, and lookup drafts (no drafter) and SSD's
  prepared drafts (h) take the rounds over. h: the SSD hit rate, 0 without SSD or while
  SSD is paused.

The candidates of a round, each with its zero:
- the draft model: k in [0, max_k] (`choose_k`); under hybrid, once the draft is back, its
  lookup extension of e in [0, available] tokens (`choose_extension`), priced with the
  extension's own per-position acceptance (it is verified only where the model's draft was
  accepted whole) and the drafting already spent;
- a lookup draft of source s: l in [0, its length] (`choose_lookup_k`); under hybrid a
  confident match is taken only when its best rate is at least the draft model's
  (`lookup_or_model`), else the round falls back to the model;
- nothing: k = 0, the target alone through the same services.

With SSD the policy also sizes each Speculate: a Speculate feeds the draft, then drafts
branch_k tokens for f branches in batched steps, which takes about
S(f) = s (branch_k + 1) (1 + c (f - 1)) (s: measured time of one step for one branch, c:
`branch_cost`, the extra cost of each further row of a batched step). The fan-out is the
largest f <= f_max with S(f) <= `fit_margin` x V(1 + k), so the Speculate is done when the
verdict comes. A Speculate still running at its verdict (late) counts as having taken
longer than that Verify; after `late_limit` late Speculates in a row at fan-out 1, SSD
pauses for `pause_rounds` rounds (no Speculate, h = 0) and then tries again.

Why changing the draft is exact: every round is an ordinary speculation round (DESIGN §2):
given the tokens so far, the tokens it appends follow the target's distribution for any
draft fixed before the round, none (the target alone) included. The policy fixes the
source and length before the round from what earlier rounds produced (verdicts and
timings, this request's and the gateway's) and from the tokens so far, never from this
round's random draws, so by induction over rounds the whole sequence follows the target's
distribution: a choice made from the past is like a stopping rule, which cannot bias what
the rule of each round guarantees. An extension's length depends on the model's draft
tokens too: a proposal may decide to stop or go on from the draft prefix it drew (its
next proposal is then one-hot), and the rule verifies each position against that prefix.
Under greedy decoding every round appends the target's argmax tokens whatever it drafts,
so the output is generate()'s token for token. A seeded sampled output is reproducible for
a given sequence of drafts, not across them, and the adaptive policy's choices depend on
timings: a seeded sampled request that names no policy gets the fixed one
(specdec.gateway.job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specdec.common.cost import BUCKETS, Line, Load, ReportedCost
from specdec.gateway.names import LOOKUP_SOURCES, DraftMethod, KPolicy, Role, Source, Ssd
from specdec.gateway.outcome import Outcome

# The gateway_pb2.KPolicy values (a request's, the configuration's).
FIXED = KPolicy.FIXED.proto
ADAPTIVE = KPolicy.ADAPTIVE.proto
BY_NAME = {policy.value: policy.proto for policy in KPolicy}
# The largest fan-out the adaptive policy asks for when the gateway's --ssd-fan-out is 0:
# the drafter's default --ssd-fan-out (replicas do not report theirs).
ADAPTIVE_MAX_FAN_OUT = 6

# Draft sources whose acceptance is measured apart (LOOKUP_SOURCES, then these two).
MODEL = DraftMethod.MODEL.value
EXTENSION = "extension"  # a lookup's continuation of a model draft (hybrid)
MAX_POSITIONS = 32  # draft positions whose acceptance is counted one by one
# A call that fed more tokens than this (a prefill, a resend) is not a measurement of a
# round's cost (the replicas' curves stop there too, specdec.common.cost).
MAX_FED = 32


def parse_policy(name: str) -> int:
    """'fixed' / 'adaptive' -> the KPolicy value; ValueError naming the choices."""
    try:
        return BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(f"must be one of {', '.join(BY_NAME)}, got {name!r}") from None


@dataclass(frozen=True)
class PolicyParams:
    """The adaptive policy's constants (see the module docstring)."""

    prior_acceptance: float = 0.7  # of the draft model, before the gateway has seen any
    prior_lookup_acceptance: float = 0.5  # of lookup drafts and extensions, likewise
    prior_weight: float = 4.0  # pseudo-positions of the prior of a gateway that saw nothing
    max_prior_weight: float = 16.0  # the most pseudo-positions the gateway's history is worth
    position_weight: float = 8.0  # pseudo-positions pooling a position towards its source
    exploration: float = 0.5  # c of the upper confidence bound on each acceptance
    idle_token_cost: float = 0.05  # g of an idle verifier (no cost curve reported)
    saturation_queue: float = 4.0  # reported queue depth at which g reaches 1
    smoothing: float = 0.3  # weight of the newest measurement in the moving averages
    prior_hit_rate: float = 0.8  # SSD hit rate before any verdict
    fit_margin: float = 0.9  # a Speculate may take this share of the Verify it hides behind
    branch_cost: float = 0.15  # extra time of each further branch in a batched step
    late_limit: int = 3  # late Speculates in a row at fan-out 1 before SSD pauses
    pause_rounds: int = 16  # rounds without Speculate before SSD is tried again


def expected_tokens(a: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens a round of k drafts yields on average."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What the adaptive policy priced its last decision at: the verifier's rows per
    forward (R), its saturation (u) and the chosen draft's expected tokens per second
    over k = 0's (1.0: speculation not paying, or none chosen)."""

    rows: float
    saturation: float
    gain: float

    @property
    def level(self) -> str:
        """The load level as a metric label: the cost bucket of R rows ("1", "2", "4",
        "8", "16": its lowest rows)."""
        level = BUCKETS[0]
        for edge in BUCKETS:
            if self.rows >= edge - 1e-9:
                level = edge
        return str(level)


class _Ema:
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


class SourcePriors:
    """The gateway's acceptance per draft source over the rounds it served, whatever their
    policy (decayed counts): each new request's adaptive policy starts from them (one
    instance per gateway)."""

    def __init__(self, decay: float = 0.999):
        self.decay = decay
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


def _argmax(rates: list[float]) -> int:
    """The index of the largest rate; ties (within 1e-9) go to the smaller index."""
    best = 0
    for i, r in enumerate(rates):
        if r > rates[best] * (1.0 + 1e-9):
            best = i
    return best


class FixedPolicy:
    """The request's k every round; lookups and extensions whole; the configured fan-out."""

    kind = KPolicy.FIXED
    estimate: Estimate | None = None  # a fixed policy prices nothing

    def __init__(self, fan_out: int = 0, priors: SourcePriors | None = None):
        self.fan_out = fan_out  # 0: the drafter's default
        self.priors = priors  # the gateway's acceptance per source, fed by every round

    def bind(self, drafter: Any, verifier: Any, fleet: Any = None) -> None:
        """Nothing to read from the placements."""

    def choose_k(self, max_k: int) -> int:
        return max_k

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        return self.fan_out

    def choose_lookup_k(self, bound: int, source: str = Source.NGRAM) -> int:
        return max(0, bound)

    def lookup_or_model(self, source: str, length: int, max_k: int) -> int:
        return max(0, length)

    def choose_extension(self, k: int, available: int) -> int:
        return max(0, available)

    @staticmethod
    def tree_sizes(
        k: int, branches: int, bound: int, source: str = Source.NGRAM
    ) -> tuple[int, int]:
        """A lookup draft the policy sized to k tokens, with `branches` other candidates,
        as a tree of at most bound nodes: (the draft's tokens, each other branch's). Here
        each other branch gets k / (2 branches) tokens (at least one) and the draft what
        is left of the bound."""
        if k <= 0 or branches <= 0:
            return k, 0
        share = max(1, k // (2 * branches))
        return max(1, min(k, bound - branches * share)), share

    @staticmethod
    def model_tree(k: int, width: int, bound: int) -> tuple[int, int]:
        """The nodes a model draft of k tokens may add as a dynamic tree, at most bound, and
        the tokens continuing each continued leaf (DraftRequest.tree_nodes, tree_depth):
        here width - 1 leaves (the drafter's likeliest alternatives) continued by half the
        draft's length, shortened to fit the bound; where not even one token fits, half
        the draft's length (at least width - 1) of terminal leaves."""
        if k <= 0 or width <= 1:
            return 0, 0
        leaves = width - 1
        depth = max(1, k // 2)
        while depth > 0 and leaves * (1 + depth) > bound:
            depth -= 1
        if depth:
            return leaves * (1 + depth), depth
        return max(0, min(bound, max(width - 1, k // 2))), 0

    def observe(self, outcome: Outcome) -> None:
        """Nothing a round shows changes a fixed policy; the gateway's priors learn from it."""
        if self.priors is not None:
            self.priors.observe_outcome(outcome)


class AdaptivePolicy:
    """Picks each round's draft (and the SSD fan-out) to maximise expected tokens per
    second, from what the request and the gateway measured so far."""

    kind = KPolicy.ADAPTIVE

    def __init__(
        self,
        ssd: bool,
        max_fan_out: int,
        params: PolicyParams | None = None,
        priors: SourcePriors | None = None,
    ):
        self.p = p = params or PolicyParams()
        self.ssd = ssd
        self.max_fan_out = max(1, max_fan_out)
        self.priors = priors
        self.sources: dict[str, Acceptance] = {}
        for source in (MODEL, EXTENSION, *LOOKUP_SOURCES):
            default = p.prior_acceptance if source == MODEL else p.prior_lookup_acceptance
            prior, weight = default, p.prior_weight
            if priors is not None:
                prior, weight = priors.prior(source, default, weight, p.max_prior_weight)
            self.sources[source] = Acceptance(prior, weight, p.position_weight)
        # A tree's other branches, in the rounds whose first branch failed at its first
        # token: a(0) = P(one of them accepted), then along the one accepted.
        self.alternatives = Acceptance(p.prior_lookup_acceptance / 2, p.prior_weight)
        # The drafter's alternatives (a dynamic tree's leaves): rounds whose path took one,
        # per leaf verified.
        self.leaves = _Ema(p.smoothing)
        self.verify = _Ema(p.smoothing)  # v: seconds of a Verify without a draft (no curve)
        self.draft = _Ema(p.smoothing)  # d_t: seconds per drafted token (its forwards)
        self.draft_overhead = _Ema(p.smoothing)  # o_d: a Draft's round trip beyond them
        self.queue = _Ema(p.smoothing)  # the verifier's reported queue depth
        self.hits = _Ema(p.smoothing)  # h: SSD hit (1) or miss (0)
        self.step = _Ema(p.smoothing)  # s: seconds of one Speculate step, one branch
        self.overhead = _Ema(p.smoothing)  # o: a Verify's round trip beyond its forward
        self.scale = _Ema(p.smoothing)  # r: reported forward time over the curve's
        self.round = _Ema(p.smoothing)  # seconds of one of this request's rounds
        self.estimate: Estimate | None = None  # the last decision's (Outcome.estimate)
        self.late_in_row = 0
        self.paused = 0  # rounds left without Speculate
        self.rounds = 0  # t: the request's rounds so far
        self._verify_s: float | None = None  # the last Verify's time (a late Speculate's floor)
        self._drafter: Any = None  # the request's Placements (their replica's reported cost)
        self._verifier: Any = None
        self._fleet: Any = None  # the gateway's pools: the cost before a placement has a replica

    def bind(self, drafter: Any, verifier: Any, fleet: Any = None) -> None:
        """The request's placements (specdec.gateway.fleet.caller.Placement): the policy reads
        the cost curve their replica reports; before the first call has placed one, the
        curve of the replica the fleet's pool would pick (specdec.gateway.fleet.replicas.Fleet),
        so the first round is priced too."""
        self._drafter, self._verifier, self._fleet = drafter, verifier, fleet

    # -- what was measured -------------------------------------------------------------------

    @property
    def model(self) -> Acceptance:
        return self.sources[MODEL]

    @property
    def acceptance(self) -> float:
        """The draft model's pooled per-token acceptance."""
        return self.model.pooled

    @property
    def accepted(self) -> int:
        return self.model.total_accepted

    @property
    def rejections(self) -> int:
        return self.model.rejections

    @property
    def lookup_accepted(self) -> int:
        return sum(self.sources[s].total_accepted for s in (*LOOKUP_SOURCES, EXTENSION))

    @property
    def lookup_rejections(self) -> int:
        return sum(self.sources[s].rejections for s in (*LOOKUP_SOURCES, EXTENSION))

    @property
    def explore(self) -> float:
        """c sqrt(ln(e + t)) (1 - u): the scale of the upper confidence bounds this round.
        Under load a draft tried for what it might yield costs every row of the forward,
        so the doubt is worth less as the verifier saturates."""
        scale = self.p.exploration * math.sqrt(math.log(math.e + self.rounds))
        return scale * (1.0 - self.saturation)

    @property
    def token_cost(self) -> float:
        """g without a cost curve: the share of a step one more token costs, from the load."""
        g0 = self.p.idle_token_cost
        load = self.queue.value or 0.0
        saturation = min(1.0, load / self.p.saturation_queue) if self.p.saturation_queue else 1.0
        return g0 + (1.0 - g0) * saturation

    @property
    def hit_rate(self) -> float:
        """h: the SSD hit rate used in D; 0 without SSD or while it is paused."""
        if not self.ssd or self.paused:
            return 0.0
        return self.p.prior_hit_rate if self.hits.value is None else self.hits.value

    def _cost(self, placement: Any, role: str) -> ReportedCost | None:
        replica = getattr(placement, "replica", None)
        if replica is None and self._fleet is not None:
            return self._fleet.pool(role).cost(getattr(placement, "rule", None))
        return getattr(replica, "cost", None)

    def verifier_load(self) -> Load | None:
        """The verifier's load as it last reported it (None: not reported)."""
        cost = self._cost(self._verifier, Role.VERIFIER)
        return cost.load if cost is not None else None

    @property
    def rows(self) -> float:
        """R: the rows a forward of the verifier holds: the mean of its forwards over the
        last seconds as it reports them, else 1 + the queue depth it reported."""
        load = self.verifier_load()
        if load is not None and load.forwards > 0:
            return max(1.0, load.rows_per_forward)
        return 1.0 + round(self.queue.value or 0.0)

    @property
    def saturation(self) -> float:
        """u: the share of the verifier's time that other sessions' rows use: its busy
        share times the share of the rows it served that were not this request's (0 when
        it reports no load). Before this request has a round, its share is one row of
        the forwards the verifier reports: a request that starts under load is priced
        as one (priced idle, every new request drafted into a full verifier)."""
        load = self.verifier_load()
        if load is None or load.rows_per_second <= 0:
            return 0.0
        if not self.round.value:
            return load.busy * max(0.0, 1.0 - 1.0 / max(1.0, load.rows_per_forward))
        own = 1.0 / self.round.value  # this request's rows per second (one per round)
        return load.busy * max(0.0, 1.0 - own / load.rows_per_second)

    def verifier_line(self) -> Line | None:
        """The verifier's reported t_v for the rows its load puts in a forward (the
        bucket's line; `_forward_ms` reads the surface between buckets)."""
        cost = self._cost(self._verifier, Role.VERIFIER)
        if cost is None:
            return None
        return cost.line(round(self.rows))

    def _forward_ms(self, tokens: int) -> float | None:
        """t_v(R, n) in ms as reported (None: no curve)."""
        line = self.verifier_line()
        if line is None:
            return None
        cost = self._cost(self._verifier, Role.VERIFIER)
        return cost.ms(self.rows, tokens) if cost is not None else line.ms(tokens)

    def verify_time(self, tokens: int) -> float | None:
        """V(n): seconds of a Verify that feeds n tokens; None before anything is known."""
        ms = self._forward_ms(tokens)
        if ms is not None:
            scale = self.scale.value if self.scale.value is not None else 1.0
            return (self.overhead.value or 0.0) + scale * ms / 1e3
        if self.verify.value is None:
            return None
        return self.verify.value * (1.0 + self.token_cost * (tokens - 1))

    def price(self, tokens: int, drafting: float = 0.0, width: int = 1, steps: int = 0) -> float:
        """T: what a round that verifies `tokens` tokens after `drafting` seconds of
        drafting (`steps` drafter forwards) costs: its own time V(n) + drafting idle;
        saturated, the batch's forward at the batch width W (`width`, tokens a row) and,
        beyond it, the marginal time its tokens add to that forward, once for every row
        that waits for it; on a ragged verifier, the replicas' time a round when every
        session runs rounds like it (`network_time`). u weighs the two (the module
        docstring)."""
        verify = self.verify_time(tokens)
        assert verify is not None
        own = verify + drafting
        u = self.saturation if self.verifier_line() is not None else 0.0
        if u <= 0.0:
            return own
        cost = self._cost(self._verifier, Role.VERIFIER)
        if cost is not None and cost.ragged:
            return (1.0 - u) * own + u * self.network_time(tokens, steps)
        scale = self.scale.value if self.scale.value is not None else 1.0
        forward = self._forward_ms(tokens)
        at_width = self._forward_ms(max(1, width))
        assert forward is not None and at_width is not None
        beyond = max(0.0, forward - at_width)
        batch = scale * (max(forward, at_width) + (self.rows - 1.0) * beyond) / 1e3
        return (1.0 - u) * own + u * batch

    @property
    def sessions(self) -> float:
        """S: the sessions sharing the replicas, as their loads show them: the rows of the
        verifier's forwards and, while the drafter is busy, the rows of its forwards."""
        rows = self.rows
        cost = self._cost(self._drafter, Role.DRAFTER)
        load = cost.load if cost is not None else None
        if load is not None and load.forwards > 0:
            rows += load.busy * max(1.0, load.rows_per_forward)
        return rows

    def network_time(self, tokens: int, steps: int) -> float:
        """S / X: seconds of the replicas a round costs when the S sessions sharing them
        all run rounds like it (`tokens` verified a row, `steps` drafter forwards before):
        the sessions split between the verifier's queue (x rows a forward of t_v(x, n))
        and the drafter's (S - x rows, `steps` forwards of t_d(S - x, 1) a round) so that
        both pass as many rounds a second, and X is that rate."""
        verifier = self._cost(self._verifier, Role.VERIFIER)
        assert verifier is not None
        scale = self.scale.value if self.scale.value is not None else 1.0
        total = max(1.0, self.sessions)

        def verify_ms(rows: float) -> float:
            return scale * verifier.batch_ms(rows, tokens)

        drafter = self._cost(self._drafter, Role.DRAFTER)
        if steps <= 0 or drafter is None:
            return verify_ms(total) / 1e3
        lo, hi = min(1.0, total), total
        for _ in range(30):  # rounds a second through the verifier rise with x, the drafter's fall
            x = (lo + hi) / 2
            drafting = max(total - x, 1e-9)
            if x / verify_ms(x) < drafting / (steps * drafter.batch_ms(max(drafting, 1.0), 1)):
                lo = x
            else:
                hi = x
        x = (lo + hi) / 2
        return total * verify_ms(x) / x / 1e3

    def batch_width(self, max_k: int, source: str = MODEL) -> int:
        """W = 1 + k_b: the width (tokens a row) at which a batch of R rows, every one
        drafting k_b tokens of `source` at the gateway's acceptance for it (its
        SourcePriors; this request's without them), yields the most tokens per second of
        the verifier's forward: (1 + E(k)) / F(1 + k). Every request of the gateway reads
        the same acceptance and the same surface, so under load they agree on one width
        and pad no row for another's longer draft."""
        if max_k <= 0 or self.verifier_line() is None:
            return 1
        cost = self._cost(self._verifier, Role.VERIFIER)
        assert cost is not None
        if self.priors is not None:
            default = self.p.prior_acceptance if source == MODEL else self.p.prior_lookup_acceptance
            rate, _ = self.priors.prior(
                source, default, self.p.prior_weight, self.p.max_prior_weight
            )
        else:
            rate = self.sources[source].pooled
        rates = []
        for k in range(max_k + 1):
            ms = cost.batch_ms(self.rows, 1 + k)
            rates.append(expected_tokens(rate, k) / max(ms, 1e-9))
        return 1 + _argmax(rates)

    def drafter_wait(self) -> float:
        """w_d: seconds a Draft would wait in the drafter's queue, from the load it
        reports: its waiting requests over its rows per forward, times its mean forward
        (0 when it reports none)."""
        cost = self._cost(self._drafter, Role.DRAFTER)
        load = cost.load if cost is not None else None
        if load is None or not load.waiting or load.forwards <= 0:
            return 0.0
        return load.waiting / max(1.0, load.rows_per_forward) * load.forward_s

    def draft_time(self) -> float | None:
        """d_t: seconds per model draft token; None before anything is known."""
        if self.draft.value is not None:
            return self.draft.value
        cost = self._cost(self._drafter, Role.DRAFTER)
        if cost is None:
            return None
        return cost.line(1).ms(1) / 1e3

    def draft_cost(self, k: int) -> float:
        """D(k): seconds of a Draft of k tokens, max(o_d, w_d) + k d_t (0 for k = 0); o_d
        is the Draft's measured round trip beyond its forwards, before one the Verify's;
        w_d the wait the drafter's reported queue promises now."""
        if k <= 0:
            return 0.0
        d = self.draft_time() or 0.0
        fixed = self.draft_overhead.value
        if fixed is None:
            fixed = self.overhead.value or 0.0
        return max(fixed, self.drafter_wait()) + k * d

    # -- the model -----------------------------------------------------------------------------

    def round_time(self, k: int, width: int = 1) -> float:
        """T(k) of a draft model round, in seconds: V(1 + k) + D(k) (1 - h) idle, priced
        at the batch's cost under load (`price`)."""
        assert self.draft_time() is not None
        return self.price(1 + k, self.draft_cost(k) * (1.0 - self.hit_rate), width, k)

    def _estimate(self, rates: list[float], chosen: int) -> int:
        """Keep what the decision priced (`estimate`); `chosen`, for the caller."""
        gain = rates[chosen] / rates[0] if rates and rates[0] > 0 else 1.0
        self.estimate = Estimate(self.rows, self.saturation, gain)
        return chosen

    def rates(self, max_k: int) -> list[float]:
        """[max_k + 1]: expected tokens per second of a model draft of 0..max_k tokens."""
        expected = self.model.expected(max_k, self.explore)
        width = self.batch_width(max_k) if self.saturation > 0 else 1
        return [(1.0 + expected[k]) / self.round_time(k, width) for k in range(max_k + 1)]

    def rate(self, k: int) -> float:
        """E(k) / T(k): expected tokens per second at draft length k."""
        return self.rates(k)[k]

    # -- decisions -----------------------------------------------------------------------------

    def choose_k(self, max_k: int) -> int:
        """The draft model's k in [0, max_k]."""
        if max_k <= 0:
            return 0
        if self.verify_time(1) is None or self.draft_time() is None:
            return max_k  # nothing known yet: draft, so the costs get measured
        rates = self.rates(max_k)
        return self._estimate(rates, _argmax(rates))

    def _lookup_rates(
        self,
        source: str,
        length: int,
        first: float = 0.0,
        survive: float = 1.0,
        drafting: float = 0.0,
        model_k: int = 0,
    ) -> list[float]:
        """[length + 1]: rates of verifying 0..length lookup tokens of `source` after a
        model draft of model_k tokens expected to yield `first` accepted tokens, all of
        them accepted with probability `survive`, that took `drafting` seconds."""
        expected = self.sources[source].expected(length, self.explore)
        width = 1
        if self.saturation > 0:
            width = self.batch_width(model_k + length, MODEL if model_k else source)
        out = []
        for n in range(length + 1):
            time = self.price(1 + model_k + n, drafting, width, model_k)
            out.append((1.0 + first + survive * expected[n]) / time)
        return out

    def choose_lookup_k(self, bound: int, source: str = Source.NGRAM) -> int:
        """How many tokens of a lookup draft of `source` to verify, in [0, bound]."""
        if bound <= 0:
            return 0
        if self.verify_time(1) is None:
            return bound
        rates = self._lookup_rates(source, bound)
        return self._estimate(rates, _argmax(rates))

    def lookup_or_model(self, source: str, length: int, max_k: int) -> int:
        """Under hybrid, a confident lookup draft of `length` tokens against the draft
        model: the lookup tokens to verify, or 0 when the draft model's best round is
        expected to be faster."""
        n = self.choose_lookup_k(length, source)
        if n == 0 or max_k <= 0 or self.verify_time(1) is None or self.draft_time() is None:
            return n
        lookup = self._lookup_rates(source, n)[n]
        return n if lookup >= max(self.rates(max_k)) else 0

    def choose_extension(self, k: int, available: int) -> int:
        """Lookup tokens to verify after a model draft of k tokens (hybrid), in
        [0, available]: worth their verification where the model's draft survives."""
        if available <= 0 or k <= 0:
            return 0
        if self.verify_time(1) is None or self.draft_time() is None:
            return available
        drafting = self.draft_cost(k) * (1.0 - self.hit_rate)
        explore = self.explore
        first = self.model.expected(k, explore)[k]
        survive = self.model.survive(k, explore)
        rates = self._lookup_rates(EXTENSION, available, first, survive, drafting, k)
        return _argmax(rates)

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        """Branches to ask the next Speculate for (this round drafts k, the branches
        branch_k); None: send no Speculate (SSD paused)."""
        if self.paused:
            self.paused -= 1
            if self.paused == 0:
                self.late_in_row = 0  # try again from one branch
            return None
        verify = self.verify_time(1 + k)
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

    # -- measurements --------------------------------------------------------------------------

    def observe_draft(self, k: int, seconds: float, forward_ms: float = 0.0, fed: int = 0) -> None:
        """A Draft of k tokens that ran the model took `seconds` (round trip), forward_ms of
        it in the drafter's forwards as it reported (0: not known: all of it per token),
        after feeding `fed` new tokens. A Draft that fed more than MAX_FED (the prompt's
        prefill, a resend after a miss) says nothing of the cost of drafting: skipped."""
        if k <= 0 or fed > MAX_FED:
            return
        if forward_ms > 0:
            self.draft.add(forward_ms / 1e3 / k)
            self.draft_overhead.add(max(0.0, seconds - forward_ms / 1e3))
        else:
            self.draft.add(seconds / k)

    def observe_verify(
        self,
        k: int,
        accepted: int,
        seconds: float,
        queue: int,
        lookup: bool | str = False,
        extended: int = 0,
        forward_ms: float = 0.0,
        fed: int = 0,
    ) -> None:
        """A Verify of k draft tokens: its verdict, round trip and reported queue.
        `lookup`: the draft was a lookup draft (True: prompt lookup, or its source);
        `extended`: its last tokens were a lookup's extension of a model draft (counted
        once the model's were all accepted); forward_ms: the time the verifier reported
        for the call, fed: the tokens it fed (0: not known)."""
        source = (lookup if isinstance(lookup, str) else Source.NGRAM) if lookup else None
        for name, n, got in drafts_of(k, accepted, source, extended):
            if n > 0:
                self.sources[name].observe(n, got)
        self.rounds += 1
        self.queue.add(float(queue))
        self._verify_s = seconds
        predicted = self._forward_ms(fed) if 0 < fed <= MAX_FED else None
        if predicted is not None and forward_ms > 0:
            self.overhead.add(max(0.0, seconds - forward_ms / 1e3))
            if predicted > 0:
                self.scale.add(forward_ms / predicted)
        self.verify.add(seconds / (1.0 + self.token_cost * k))

    def observe_speculate(self, fan_out: int, branch_k: int, seconds: float | None) -> None:
        """A Speculate of fan_out branches of branch_k tokens took `seconds`; None: it was
        still running at its verdict (late), so it took longer than that round's Verify."""
        late = seconds is None
        if seconds is None:
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

    def tree_sizes(
        self, k: int, branches: int, bound: int, source: str = Source.NGRAM
    ) -> tuple[int, int]:
        """A lookup draft of `source` the policy sized to k tokens, with `branches` other
        candidates, as a tree of at most bound nodes: (the draft's tokens c, each other
        branch's s), the pair that maximises expected tokens per second,
        (1 + E_draft(c) + (1 - a(0)) E_other(s)) / V(1 + c + s branches), from the
        verifier's cost curve V, the source's acceptance a and the measured acceptance of
        the other branches in rounds whose draft failed at its first token. s = 0 is a
        chain of k: a steep curve (compute-bound verification) gives it."""
        if k <= 0 or branches <= 0 or self.verify_time(1) is None:
            return FixedPolicy.tree_sizes(k, branches, bound, source)
        own = self.sources[source].expected(k, self.explore)
        missed = 1.0 - self.sources[source].rate(0, self.explore)
        other = self.alternatives.expected(max(0, (bound - 1) // branches), self.explore)
        best, best_rate = (k, 0), 0.0
        width = self.batch_width(k, source) if self.saturation > 0 else 1
        for c in range(1, k + 1):
            for s in range((bound - c) // branches + 1):
                time = self.price(1 + c + s * branches, 0.0, width)
                rate = (1.0 + own[c] + missed * other[s]) / time
                if rate > best_rate * (1.0 + 1e-9):
                    best, best_rate = (c, s), rate
        return best

    def model_tree(self, k: int, width: int, bound: int) -> tuple[int, int]:
        """The nodes a model draft of k tokens may add and the tokens continuing each
        continued leaf (DraftRequest.tree_nodes, tree_depth): the (n, D) with n in 0..bound
        that maximises expected tokens per second,
        (1 + E(k) + g (r (1 + E(D)) + t (1 - a))) / (V(1 + k + n) + D(k + D) (1 - h)):
        r = n // (1 + D) leaves continued by D tokens (0 when D is 0), t = n - r (1 + D)
        terminal ones; g the measured rate of rounds whose path took a leaf, per leaf sent
        (before any, a tenth of the draft model's acceptance); E the model's expected
        accepted tokens (a continuation is the drafter drafting after a token it got
        right); D(k + D) the Draft with D more forwards. A taken terminal leaf only moves a
        token between rounds (docs/concepts/trees.md) unless the position after it is a
        miss too, which saves that round: it is worth 1 - a, a the model's acceptance; a
        continued one spares the next round the tokens it drew. A steep cost curve gives
        (0, 0): a chain; a costly drafter forward gives D = 0."""
        if k <= 0 or bound <= 0 or self.verify_time(1) is None or self.draft_time() is None:
            return FixedPolicy.model_tree(k, width, bound)
        expected = self.model.expected(max(k, bound), self.explore)
        g = self.leaves.value if self.leaves.value is not None else self.acceptance / 10
        most = k * (width - 1)  # the alternatives there are
        best, best_rate = (0, 0), 0.0
        width = self.batch_width(k) if self.saturation > 0 else 1
        for depth in range(min(k, bound - 1) + 1):
            drafting = self.draft_cost(k + depth) * (1.0 - self.hit_rate)
            for n in range(1 if depth else 0, bound + 1):
                rows = n // (1 + depth) if depth else 0
                terminal = n - rows * (1 + depth)
                if rows + terminal > most or (depth and rows == 0):
                    continue
                gain = g * (rows * (1.0 + expected[depth]) + terminal * (1.0 - self.acceptance))
                time = self.price(1 + k + n, drafting, width, k + depth)
                rate = (1.0 + expected[k] + gain) / time
                if rate > best_rate * (1.0 + 1e-9):
                    best, best_rate = (n, depth), rate
        return best

    def observe(self, o: Outcome) -> None:
        """Learn from a round's outcome (specdec.gateway.outcome): the drafter's time when
        its model ran, the verdict and its time, the Speculate's time, SSD hit or miss.
        A late Speculate (still running at its verdict) took longer than that Verify; the
        next round's Draft then waited for it, so even its prepared draft was on the
        critical path: a miss for h."""
        if self.priors is not None:
            self.priors.observe_outcome(o)
        if o.seconds > 0:
            self.round.add(o.seconds)
        if o.late_outcome is not None:
            self.observe_ssd(False)
        if o.source == Source.DRAFTED:  # a tree's leaves took no forward of their own, its
            # continuations one per token of the longest
            self.observe_draft(
                o.chain + o.tree_depth if o.tree else o.k - o.extended,
                o.draft_seconds,
                o.draft_forward_ms,
                o.draft_fed,
            )
        k, accepted = o.chain_verdict
        if o.tree and o.source == Source.DRAFTED:  # the drafter's alternatives: was one taken?
            self.leaves.add((1.0 if o.branch else 0.0) / max(1, o.tree_leaves))
        elif o.width > 1 and (o.branch is None or o.branch > 0):  # the first branch failed
            share = (o.k - o.chain) // (o.width - 1)
            self.alternatives.observe(share, o.accepted if o.branch else 0)
        self.observe_verify(
            k,
            accepted,
            o.verify_seconds,
            o.queue_depth,
            o.source if o.source in LOOKUP_SOURCES else False,
            o.extended,
            o.verify_forward_ms,
            o.verify_fed,
        )
        if o.ssd == Ssd.LATE:
            self.observe_speculate(o.fan_out or 0, o.branch_k, None)
        elif o.speculate_seconds is not None:
            self.observe_speculate(o.fan_out or 0, o.branch_k, o.speculate_seconds)
        if o.ssd in (Ssd.HIT, Ssd.MISS):
            self.observe_ssd(o.ssd == Ssd.HIT)


Policy = FixedPolicy | AdaptivePolicy


def make_policy(
    kind: KPolicy, ssd: bool, fan_out: int, priors: SourcePriors | None = None
) -> Policy:
    """The request's policy. fan_out: the gateway's --ssd-fan-out (0: the drafter's
    default, which the adaptive policy takes as ADAPTIVE_MAX_FAN_OUT, its largest)."""
    if kind == KPolicy.ADAPTIVE:
        return AdaptivePolicy(ssd, fan_out or ADAPTIVE_MAX_FAN_OUT, priors=priors)
    return FixedPolicy(fan_out, priors)
