"""`AdaptivePolicy` (the default) treats the request's k as an upper bound and picks, before
each round, the draft that maximises this request's expected tokens per second, from what
was measured so far:

    E(d)  = 1 + sum_{j=1..len(d)} prod_{i<j} a_s(i)    tokens the round yields: the accepted
                                                       drafts + the next token
    T(d)  = (1 - u) [V(1 + len(d)) + D(d)]            what the round costs (its price): its
          + u [F(max(n, W)) + (R - 1) max(0, F(n) - F(W))]   own time idle, the batch's
                                                       under load (n = 1 + len(d))
    V(n)  = o + F(n),  F(n) = r t_v(R, n)              the verifier's forward of n tokens a
                                                       row at R rows: its reported surface
    D(d)  = (max(o_d, w_d) + k d_t) (1 - h) + w        drafting, for the draft model's k tokens
    rate  = E(d) / T(d);  d* = argmax over the candidates, ties to the shorter

Idle (u = 0), T is the round's own time: the request's tokens per second. Under load the
price is the batch's. u, the verifier's saturation, is the share of its time that other
sessions' rows use: its reported busy share times the share of the rows it served that
were not this request's (1 - this request's rounds per second / the replica's rows per
second). At u = 1 every second this round spends off the verifier (the round trip o, which
then holds the queue's wait, and drafting) is a second the verifier spends on other rows:
no cost to the batch's goodput. What the round takes from everyone is the forward: at the
batch width W (`AdaptivePolicy.batch_width`: where R rows all drafting k_b tokens at the gateway's
acceptance for the source yield the most tokens per second of the forward; every request
reads the same acceptance and surface, so under load they agree on it), and beyond W the
marginal time its tokens add to the batched forward, once for every row that waits for
it. A replica whose forwards have no pads (llama.cpp: ForwardCost.ragged) pads no row to a
width: F reads its measured points at the tokens the forward computes, this row's and the
other rows', and under load a round is priced at what the replicas pass when every session
runs rounds like it (`Prices.network_time`): the S sessions split between the verifier's queue and
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
  SSD is paused; w: the mean wait a round's Speculate gives the next round (below), 0
  likewise.

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
`branch_cost`, the extra cost of each further row of a batched step). A Speculate still
running at its verdict (late) is not wasted: the next round's Draft queues behind it on
the drafter and, on a hit, is answered from its branches without a forward. So it keeps
the next round waiting w = S(f) - V(1 + k), and saves that round's Draft, D(branch_k), on
a hit: it pays while w < h D(branch_k). The fan-out is the largest f <= f_max with
S(f) <= `fit_margin` x (V(1 + k) + h D(branch_k)). The next round settles a late
Speculate: its Draft's round trip beyond its forward and o_d is w (kept out of o_d; a
quarter of the Verify when no Draft measured it), which prices drafting as
D(k) (1 - h) + w, and a hit it prepared counts for h. Each Speculate saved the next round
D(branch_k) if it hit, less w; once `late_limit` have settled since SSD (re)started and
they saved nothing on average (on a CPU, a drafter as dear as a third of the target
whose Speculates outlast the Verify), SSD pauses for `pause_rounds` rounds (no
Speculate, h = 0) and then tries again, measured afresh.

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
from typing import Any

from specdec.gateway.names import LOOKUP_SOURCES, KPolicy, Source, Ssd
from specdec.gateway.outcome import Outcome
from specdec.gateway.round.policy.acceptance import (
    EXTENSION,
    MODEL,
    Acceptance,
    Ema,
    SourcePriors,
    argmax,
    drafts_of,
    expected_tokens,
    starting_acceptance,
)
from specdec.gateway.round.policy.fanout import FanOut
from specdec.gateway.round.policy.fixed import FixedPolicy
from specdec.gateway.round.policy.params import Estimate, PolicyParams
from specdec.gateway.round.policy.prices import Prices
from specdec.gateway.round.policy.trees import lookup_tree_sizes, model_tree_sizes


class AdaptivePolicy:
    """Picks each round's draft (and the SSD fan-out) to maximise expected tokens per
    second, from what the request and the gateway measured so far: the acceptance of each
    source (`sources`), what a round costs (`prices`) and SSD's fan-out (`fanout`)."""

    kind = KPolicy.ADAPTIVE
    prefills_beside = True  # a prefill's round drafts nothing (Drafts.prefill_beside)

    def __init__(
        self,
        ssd: bool,
        max_fan_out: int,
        params: PolicyParams | None = None,
        priors: SourcePriors | None = None,
    ):
        self.p = p = params or PolicyParams()
        self.priors = priors
        self.prices = Prices(p)
        self.fanout = FanOut(ssd, max_fan_out, p, priors.ssd if priors is not None else None)
        self.sources = starting_acceptance(p, priors)
        self.model = self.sources[MODEL]  # the draft model's
        # A tree's other branches, in the rounds whose first branch failed at its first
        # token: a(0) = P(one of them accepted), then along the one accepted.
        self.alternatives = Acceptance(p.prior_lookup_acceptance / 2, p.prior_weight)
        # The drafter's alternatives (a dynamic tree's leaves): rounds whose path took one,
        # per leaf verified.
        self.leaves = Ema(p.smoothing)
        self.estimate: Estimate | None = None  # the last decision's (Outcome.estimate)
        self.rounds = 0  # t: the request's rounds so far

    def bind(self, drafter: Any, verifier: Any, fleet: Any = None) -> None:
        """The request's placements, whose replicas' reported costs price its rounds
        (`Prices.bind`)."""
        self.prices.bind(drafter, verifier, fleet)

    # -- what was measured -------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """The draft model's pooled per-token acceptance."""
        return self.model.pooled

    def counts(self, lookup: bool = False) -> tuple[int, int]:
        """(accepted, rejected) draft tokens of the draft model, or with `lookup` of the
        lookup sources and extensions."""
        sources = (*LOOKUP_SOURCES, EXTENSION) if lookup else (MODEL,)
        seen = [self.sources[s] for s in sources]
        return sum(a.total_accepted for a in seen), sum(a.rejections for a in seen)

    @property
    def explore(self) -> float:
        """c sqrt(ln(e + t)) (1 - u): the scale of the upper confidence bounds this round.
        Under load a draft tried for what it might yield costs every row of the forward,
        so the doubt is worth less as the verifier saturates."""
        scale = self.p.exploration * math.sqrt(math.log(math.e + self.rounds))
        return scale * (1.0 - self.prices.saturation)

    def _known(self, drafting: bool = True) -> bool:
        """Whether a Verify (and, with `drafting`, a Draft) can be priced yet."""
        prices = self.prices
        return prices.verify_time(1) is not None and (
            not drafting or prices.draft_time() is not None
        )

    def batch_width(self, max_k: int, source: str = MODEL) -> int:
        """W = 1 + k_b: the width (tokens a row) at which a batch of R rows, every one
        drafting k_b tokens of `source` at the gateway's acceptance for it (its
        SourcePriors; this request's without them), yields the most tokens per second of
        the verifier's forward: (1 + E(k)) / F(1 + k). Every request of the gateway reads
        the same acceptance and the same surface, so under load they agree on one width
        and pad no row for another's longer draft."""
        cost = self.prices.verifier
        if max_k <= 0 or cost is None:
            return 1
        if self.priors is not None:
            default = self.p.prior_acceptance if source == MODEL else self.p.prior_lookup_acceptance
            rate, _ = self.priors.prior(
                source, default, self.p.prior_weight, self.p.max_prior_weight
            )
        else:
            rate = self.sources[source].pooled
        rows = self.prices.rows
        rates = [
            expected_tokens(rate, k) / max(cost.batch_ms(rows, 1 + k), 1e-9)
            for k in range(max_k + 1)
        ]
        return 1 + argmax(rates)

    def _width(self, max_k: int, source: str = MODEL) -> int:
        """W under load (`batch_width`); 1 while the verifier is not saturated."""
        return self.batch_width(max_k, source) if self.prices.saturation > 0 else 1

    # -- the model -----------------------------------------------------------------------------

    def drafting(self, k: int) -> float:
        """D(k) (1 - h) + w: the seconds a Draft of k tokens keeps the round waiting, and
        the wait its Speculate, if late, gives the next (0 for k = 0)."""
        if k <= 0:
            return 0.0
        fanout = self.fanout
        return self.prices.draft_cost(k) * (1.0 - fanout.hit_rate) + fanout.wait

    def round_time(self, k: int, width: int = 1) -> float:
        """T(k) of a draft model round, in seconds: V(1 + k) + D(k) (1 - h) + w idle, priced
        at the batch's cost under load (`Prices.price`)."""
        assert self.prices.draft_time() is not None
        return self.prices.price(1 + k, self.drafting(k), width, k)

    def _estimate(self, rates: list[float], chosen: int) -> int:
        """Keep what the decision priced (`estimate`); `chosen`, for the caller."""
        gain = rates[chosen] / rates[0] if rates and rates[0] > 0 else 1.0
        self.estimate = Estimate(self.prices.rows, self.prices.saturation, gain)
        return chosen

    def rates(self, max_k: int) -> list[float]:
        """[max_k + 1]: expected tokens per second of a model draft of 0..max_k tokens."""
        expected = self.model.expected(max_k, self.explore)
        width = self._width(max_k)
        return [(1.0 + expected[k]) / self.round_time(k, width) for k in range(max_k + 1)]

    # -- decisions -----------------------------------------------------------------------------

    def choose_k(self, max_k: int) -> int:
        """The draft model's k in [0, max_k]."""
        if max_k <= 0:
            return 0
        if not self._known():
            return max_k  # nothing known yet: draft, so the costs get measured
        rates = self.rates(max_k)
        return self._estimate(rates, argmax(rates))

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
        width = self._width(model_k + length, MODEL if model_k else source)
        out = []
        for n in range(length + 1):
            time = self.prices.price(1 + model_k + n, drafting, width, model_k)
            out.append((1.0 + first + survive * expected[n]) / time)
        return out

    def choose_lookup_k(self, bound: int, source: str = Source.NGRAM) -> int:
        """How many tokens of a lookup draft of `source` to verify, in [0, bound]."""
        if bound <= 0:
            return 0
        if not self._known(drafting=False):
            return bound
        rates = self._lookup_rates(source, bound)
        return self._estimate(rates, argmax(rates))

    def lookup_or_model(self, source: str, length: int, max_k: int) -> int:
        """Under hybrid, a confident lookup draft of `length` tokens against the draft
        model: the lookup tokens to verify, or 0 when the draft model's best round is
        expected to be faster."""
        n = self.choose_lookup_k(length, source)
        if n == 0 or max_k <= 0 or not self._known():
            return n
        lookup = self._lookup_rates(source, n)[n]
        return n if lookup >= max(self.rates(max_k)) else 0

    def choose_extension(self, k: int, available: int) -> int:
        """Lookup tokens to verify after a model draft of k tokens (hybrid), in
        [0, available]: worth their verification where the model's draft survives."""
        if available <= 0 or k <= 0:
            return 0
        if not self._known():
            return available
        explore = self.explore
        first = self.model.expected(k, explore)[k]
        survive = self.model.survive(k, explore)
        rates = self._lookup_rates(EXTENSION, available, first, survive, self.drafting(k), k)
        return argmax(rates)

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        """Branches to ask the next Speculate for (this round drafts k, the branches
        branch_k); None: send no Speculate (SSD paused)."""
        draft = self.prices.draft_cost(branch_k) if self._known() else 0.0
        return self.fanout.choose(branch_k, self.prices.verify_time(1 + k), draft)

    def tree_sizes(
        self, k: int, branches: int, bound: int, source: str = Source.NGRAM
    ) -> tuple[int, int]:
        """A lookup draft of `source` sized to k tokens, with `branches` other candidates,
        as a tree of at most bound nodes: (the draft's tokens, each other branch's), from
        the source's acceptance, the other branches' and the price (`trees.lookup_tree_sizes`)."""
        if k <= 0 or branches <= 0 or not self._known(drafting=False):
            return FixedPolicy.tree_sizes(k, branches, bound, source)
        explore, width = self.explore, self._width(k, source)
        return lookup_tree_sizes(
            self.sources[source].expected(k, explore),
            1.0 - self.sources[source].rate(0, explore),
            self.alternatives.expected(max(0, (bound - 1) // branches), explore),
            k,
            branches,
            bound,
            lambda nodes: self.prices.price(1 + nodes, 0.0, width),
        )

    def model_tree(self, k: int, width: int, bound: int) -> tuple[int, int]:
        """(nodes, depth) of a model draft of k tokens' tree (`trees.model_tree_sizes`; g before
        a round took a leaf: a tenth of the acceptance)."""
        if k <= 0 or bound <= 0 or not self._known():
            return FixedPolicy.model_tree(k, width, bound)
        g = self.leaves.value if self.leaves.value is not None else self.acceptance / 10
        batch = self._width(k)
        return model_tree_sizes(
            self.model.expected(max(k, bound), self.explore),
            g,
            self.acceptance,
            k,
            width,
            bound,
            lambda n, depth: self.prices.price(
                1 + k + n, self.drafting(k + depth), batch, k + depth
            ),
        )

    # -- measurements --------------------------------------------------------------------------

    def observe_draft(self, k: int, seconds: float, forward_ms: float = 0.0, fed: int = 0) -> None:
        """A Draft's time (`Prices.observe_draft`)."""
        self.prices.observe_draft(k, seconds, forward_ms, fed)

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
        self.fanout.verify_s = seconds
        self.prices.observe_verify(k, seconds, queue, forward_ms, fed)

    def observe_speculate(self, fan_out: int, branch_k: int, seconds: float | None) -> None:
        """A Speculate's time, None when late (`FanOut.observe_speculate`)."""
        self.fanout.observe_speculate(fan_out, branch_k, seconds)

    def observe(self, o: Outcome) -> None:
        """Learn from a round's outcome (specdec.gateway.outcome): the drafter's time when
        its model ran, the verdict and its time, the Speculate's time, SSD hit or miss,
        and the last round's late Speculate (`FanOut.settle_round`)."""
        if self.priors is not None:
            self.priors.observe_outcome(o)
        if o.seconds > 0:
            self.prices.round.add(o.seconds)
        draft_seconds = self.fanout.settle_round(o, self.prices.draft_overhead_s)
        if o.source == Source.DRAFTED:  # a tree's leaves took no forward of their own, its
            # continuations one per token of the longest
            self.observe_draft(
                o.chain + o.tree_depth if o.tree else o.k - o.extended,
                draft_seconds,
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
            self.fanout.settle(o.ssd == Ssd.HIT)
