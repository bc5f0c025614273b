"""The adaptive policy against simulated hardware: a verifier whose forward of n tokens
takes a + b·n (its reported cost curve, specdec.common.cost), a drafter whose token costs
d, and draft sources whose tokens are accepted i.i.d. at a rate of their own. Each round
is simulated exactly as the gateway's loop asks the policy (specdec.gateway.round.loop): a
lookup draft sized by `choose_lookup_k` / `lookup_or_model`, else a model draft of
`choose_k` tokens extended by `choose_extension`. Time is the simulation's, never the
wall clock: the assertions are on what the policy chose and on the modelled tokens per
second, against the same simulation at k = 0 and at every fixed k.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from specdec.common.cost import Line, ReportedCost, fit_points
from specdec.gateway.outcome import DRAFTED, LOOKUP_NGRAM, NO_DRAFT, Outcome
from specdec.gateway.round.policy import AdaptivePolicy, FixedPolicy, PolicyParams, SourcePriors


@dataclass(frozen=True)
class Machine:
    step_ms: float  # t(1): one target step
    per_token: float  # b as a share of a step
    draft_share: float = 0.2  # c: a drafter token over a target step
    model_acceptance: float = 0.8
    lookup_acceptance: float = 0.8  # of lookup drafts and extensions
    lookup_length: int = 8  # tokens a lookup match offers
    lookup_every: int = 1  # a confident lookup match every this many rounds (hybrid)

    @property
    def line(self) -> Line:
        b = self.per_token * self.step_ms
        return Line(self.step_ms - b, b, 20.0, 16)

    def verify_s(self, n: int) -> float:
        return self.line.ms(n) / 1e3


def placement(line: Line | None) -> SimpleNamespace:
    cost = ReportedCost(((1, line),)) if line is not None else None
    return SimpleNamespace(replica=SimpleNamespace(cost=cost))


def accepted_count(rng: random.Random, k: int, rate: float) -> int:
    n = 0
    while n < k and rng.random() < rate:
        n += 1
    return n


def simulate(policy, m: Machine, method: str, max_k: int = 6, rounds: int = 400, seed: int = 1):
    """Tokens per simulated second, and the outcomes, of `rounds` rounds of `method`."""
    rng = random.Random(seed)
    policy.bind(placement(Line(m.step_ms * m.draft_share, 0.0, 20.0, 16)), placement(m.line))
    tokens, seconds, outcomes = 0, 0.0, []
    for index in range(rounds):
        lookup_k, model_k, extended, source, draft_s = 0, 0, 0, NO_DRAFT, 0.0
        has_lookup = method == "ngram" or (method == "hybrid" and index % m.lookup_every == 0)
        if has_lookup:
            if method == "hybrid":
                lookup_k = policy.lookup_or_model(LOOKUP_NGRAM, m.lookup_length, max_k)
            else:
                lookup_k = policy.choose_lookup_k(m.lookup_length, LOOKUP_NGRAM)
        if lookup_k:
            source, k = LOOKUP_NGRAM, lookup_k
            accepted = accepted_count(rng, k, m.lookup_acceptance)
        elif method in ("model", "hybrid"):
            model_k = policy.choose_k(max_k)
            if model_k:
                source, draft_s = DRAFTED, model_k * m.draft_share * m.step_ms / 1e3
                if method == "hybrid":
                    extended = policy.choose_extension(model_k, m.lookup_length)
            k = model_k + extended
            accepted = accepted_count(rng, model_k, m.model_acceptance)
            if accepted == model_k and extended:
                accepted += accepted_count(rng, extended, m.lookup_acceptance)
        else:
            k, accepted = 0, 0
        verify_s = m.verify_s(1 + k)
        o = Outcome(
            index=index, max_k=max_k, k=k, draft=tuple(range(k)), accepted=accepted,
            next_token=0, source=source, draft_seconds=draft_s, verify_seconds=verify_s,
            queue_depth=0, resends=0, extended=extended, verify_forward_ms=verify_s * 1e3,
            verify_fed=1 + k, draft_forward_ms=draft_s * 1e3,
        )  # fmt: skip
        policy.observe(o)
        outcomes.append(o)
        tokens += accepted + 1
        seconds += verify_s + draft_s
    return tokens / seconds, outcomes


def adaptive() -> AdaptivePolicy:
    return AdaptivePolicy(ssd=False, max_fan_out=1)


COMPUTE_BOUND = dict(step_ms=400.0, per_token=0.3)  # an AVX2 CPU: each token 0.3 of a step
MEMORY_BOUND = dict(step_ms=10.0, per_token=0.02)  # an idle GPU


@pytest.mark.parametrize("method", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize(
    "acceptances", [(0.8, 0.8), (0.5, 0.3), (0.2, 0.05)], ids=["good", "middling", "poor"]
)
def test_compute_bound_every_method_keeps_at_least_the_target_alone(method, acceptances):
    m = Machine(**COMPUTE_BOUND, model_acceptance=acceptances[0], lookup_acceptance=acceptances[1])
    baseline = 1 / m.verify_s(1)  # k = 0
    rate, _ = simulate(adaptive(), m, method)
    assert rate >= 0.97 * baseline, (rate / baseline, method, acceptances)


def test_compute_bound_poor_lookups_shrink_to_nothing():
    """b = 0.3 of a step a token and 5% of lookup tokens accepted: the n-gram drafts the
    policy verifies shrink to 0 (the probes aside), where the fixed policy verifies the
    whole match every round."""
    m = Machine(**COMPUTE_BOUND, lookup_acceptance=0.05)
    _, outcomes = simulate(adaptive(), m, "ngram")
    late = outcomes[100:]
    assert sum(o.k for o in late) / len(late) < 0.1
    fixed_rate, _ = simulate(FixedPolicy(), m, "ngram")
    assert fixed_rate < 0.5 / m.verify_s(1)  # the premise: drafting whole matches loses


def test_memory_bound_k_grows_to_the_best_fixed_k():
    """b = 0.02 of a step: verifying more tokens is nearly free, so the policy's k is the
    best fixed k of the same simulation, within one."""
    for acceptance in (0.6, 0.8, 0.9):
        m = Machine(**MEMORY_BOUND, model_acceptance=acceptance)
        rates = [simulate(_Fixed(k), m, "model", max_k=k)[0] for k in range(0, 9)]
        best_k = max(range(len(rates)), key=rates.__getitem__)
        _, outcomes = simulate(adaptive(), m, "model", max_k=8)
        late = outcomes[100:]
        ks = sorted(o.k for o in late)
        median_k = ks[len(ks) // 2]
        assert abs(median_k - best_k) <= 1, (acceptance, median_k, best_k, rates)


def test_compute_bound_k_is_smaller_than_memory_bound_k():
    fast, slow = (Machine(**kind, model_acceptance=0.8) for kind in (MEMORY_BOUND, COMPUTE_BOUND))
    ks = []
    for m in (fast, slow):
        _, outcomes = simulate(adaptive(), m, "model", max_k=8)
        ks.append(sum(o.k for o in outcomes[100:]) / 300)
    assert ks[0] > ks[1]


def test_hybrid_prices_extensions_by_their_own_acceptance():
    """Model drafts accepted well, extensions never: the extension shrinks to nothing,
    the model's k stays; extensions always accepted on a memory-bound verifier: whole."""
    poor = Machine(**COMPUTE_BOUND, model_acceptance=0.9, lookup_acceptance=0.0, lookup_every=10**9)
    _, outcomes = simulate(adaptive(), poor, "hybrid")
    late = outcomes[100:]
    assert sum(o.extended for o in late) == 0
    assert sum(o.k for o in late) > 0
    good = Machine(**MEMORY_BOUND, model_acceptance=0.9, lookup_acceptance=1.0, lookup_every=10**9)
    _, outcomes = simulate(adaptive(), good, "hybrid")
    full = [o for o in outcomes[100:] if o.k and o.accepted >= o.k - o.extended]
    assert full and all(o.extended == good.lookup_length for o in full)


def test_priors_carry_acceptance_to_the_next_request():
    """A gateway that saw lookups fail starts a new request at 0 lookup tokens on a
    compute-bound verifier; a fresh gateway starts by trying them. The first request
    measures only a few tokens before it stops drafting them, too little evidence to
    hold the next one back: the second request checks again, the third does not."""
    m = Machine(**COMPUTE_BOUND, lookup_acceptance=0.02)
    priors = SourcePriors()
    drafted = []
    for seed in (1, 2, 3):
        policy = AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
        _, outcomes = simulate(policy, m, "ngram", rounds=50, seed=seed)
        drafted.append(sum(o.k for o in outcomes))
    assert drafted[0] > drafted[1] > 0 and drafted[2] <= 1, drafted
    assert priors.snapshot()[LOOKUP_NGRAM] < 0.1
    informed = AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
    fresh = AdaptivePolicy(ssd=False, max_fan_out=1)
    for policy in (informed, fresh):
        policy.bind(placement(None), placement(m.line))
    assert informed.choose_lookup_k(8, LOOKUP_NGRAM) == 0
    assert fresh.choose_lookup_k(8, LOOKUP_NGRAM) > 0


def test_without_a_cost_curve_the_policy_measures_its_own():
    """An older verifier reports no curve: the policy drafts the bound until a Verify and
    a Draft are measured, then decides from its own measurements."""
    policy = adaptive()
    policy.bind(placement(None), placement(None))
    assert policy.choose_k(4) == 4
    assert policy.choose_lookup_k(8, LOOKUP_NGRAM) == 8


class _Fixed(FixedPolicy):
    """A fixed k for the simulation (the request's bound)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def choose_k(self, max_k: int) -> int:
        return min(self.k, max_k)


def test_a_drafts_fixed_cost_is_apart_from_its_cost_per_token():
    """Draft round trips of 5 ms + 1 ms a token, 1 ms a token in forwards as reported: a
    draft of k tokens is priced 5 + k ms, not k times the round trip of the k measured."""
    policy = adaptive()
    policy.bind(placement(None), placement(Line(10.0, 0.1, 20.0, 16)))
    for _ in range(10):
        policy.observe_draft(2, (5.0 + 2.0) / 1e3, forward_ms=2.0)
    assert policy.prices.draft_cost(4) == pytest.approx(9.0 / 1e3, rel=0.01)
    assert policy.prices.draft_cost(1) == pytest.approx(6.0 / 1e3, rel=0.01)
    assert policy.prices.draft_cost(0) == 0.0


def rejected_at_once(k: int, m: Machine) -> Outcome:
    """A model round of k drafts whose first token was rejected, on machine m."""
    verify_s, draft_s = m.verify_s(1 + k), k * m.draft_share * m.step_ms / 1e3
    return Outcome(
        index=0, max_k=k, k=k, draft=tuple(range(k)), accepted=0, next_token=0,
        source=DRAFTED, draft_seconds=draft_s, verify_seconds=verify_s, queue_depth=0,
        resends=0, verify_forward_ms=verify_s * 1e3, verify_fed=1 + k,
        draft_forward_ms=draft_s * 1e3, draft_fed=1,
    )  # fmt: skip


def test_rounds_of_any_policy_teach_the_next_adaptive_request():
    """Compute-bound (verifying 4 tokens costs 2 steps): after fixed-policy requests whose
    drafts were accepted 95% of the time, the gateway's priors carry the weight of what
    they counted, so the next adaptive request drafts k = 3 at once and goes on drafting 3
    after its first two drafts were rejected at their first token. (Weighted as 4
    positions, one such rejection moved the estimate from 0.85 to 0.54 and held a
    48-token request at k = 0: docs/benchmarks/2026-11-26-cost-model.md.) A fresh gateway
    starts from the 0.7 prior, with less evidence behind it."""
    m = Machine(step_ms=530.0, per_token=0.34, draft_share=0.18, model_acceptance=0.95)
    drafter = placement(Line(m.step_ms * m.draft_share, 0.0, 20.0, 16))
    priors = SourcePriors()
    simulate(FixedPolicy(priors=priors), m, "model", max_k=3, rounds=40)
    informed = AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
    fresh = AdaptivePolicy(ssd=False, max_fan_out=1, priors=SourcePriors())
    for policy in (informed, fresh):
        policy.bind(drafter, placement(m.line))
    assert informed.model.weight == PolicyParams().max_prior_weight
    assert fresh.model.weight == PolicyParams().prior_weight
    assert informed.choose_k(3) == 3
    for _ in range(2):
        informed.observe(rejected_at_once(informed.choose_k(3), m))
        assert informed.choose_k(3) >= 2


def test_a_source_held_at_zero_is_tried_again_as_the_doubt_grows():
    """Compute-bound, the model's draft accepted 40% of the time (below paying): the policy
    drafts less and less often, though it comes back to check; accepted 5% of the time
    (far below), it stays at 0 once measured (upper confidence bounds instead of probes)."""
    below = Machine(**COMPUTE_BOUND, model_acceptance=0.4)
    _, outcomes = simulate(adaptive(), below, "model")
    drafted = [o.index for o in outcomes if o.k]
    late = [i for i in drafted if i >= 50]
    assert late and len(late) < 0.1 * (len(outcomes) - 50)
    far = Machine(**COMPUTE_BOUND, model_acceptance=0.05)
    _, outcomes = simulate(adaptive(), far, "model")
    assert sum(1 for o in outcomes[20:] if o.k) <= 0.01 * len(outcomes)


def test_a_draft_that_prefilled_the_prompt_is_not_the_cost_of_drafting():
    """The first Draft of a request feeds the prompt (seconds of prefill on a CPU): taken as
    a cost per draft token it held the policy at k = 0 for the rest of the request."""
    policy = adaptive()
    policy.bind(placement(Line(85.0, 7.0, 20.0, 16)), placement(Line(460.0, 152.0, 20.0, 16)))
    policy.observe_draft(3, 12.0, forward_ms=11_900.0, fed=300)  # the prompt's prefill
    assert policy.prices.draft.value is None  # still the drafter's reported curve
    assert policy.choose_k(3) >= 2  # 2 at the 0.7 prior: drafting pays
    policy.observe_draft(3, 0.30, forward_ms=280.0, fed=4)
    assert policy.prices.draft_time() == pytest.approx(280.0 / 3 / 1e3)


async def test_the_first_round_is_priced_before_a_replica_is_placed():
    """A request's placements hold no replica until its first call picks one: the policy
    prices that round with the curve of the replica the pool would pick. (Without it the
    first round of a lookup method verified its whole 16-token match in the prompt's
    prefill: 2.6 s more to the first token on a compute-bound CPU.)"""
    from specdec.gateway.fleet.caller import Placement
    from specdec.gateway.fleet.replicas import Fleet

    m = Machine(**COMPUTE_BOUND)
    fleet = Fleet(["d0:1"], ["v0:1"])
    for pool, line in ((fleet.drafters, Line(80.0, 0.0, 20.0, 16)), (fleet.verifiers, m.line)):
        pool.replicas[0].up, pool.replicas[0].cost = True, ReportedCost(((1, line),))
    priors = SourcePriors()
    priors.observe(LOOKUP_NGRAM, 1, 10)  # the gateway saw its lookups fail
    policy = AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
    policy.bind(Placement(), Placement(), fleet)
    assert policy.prices.verifier_line() == m.line
    assert policy.choose_lookup_k(16, LOOKUP_NGRAM) == 0
    unplaced = AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
    unplaced.bind(Placement(), Placement())  # no fleet: nothing known yet, so the bound
    assert unplaced.choose_lookup_k(16, LOOKUP_NGRAM) == 16
    for pool in (fleet.drafters, fleet.verifiers):
        await pool.replicas[0].channel.close()


def test_a_first_token_dearer_than_the_line_says_is_priced_as_measured():
    """A bfloat16 verifier on a CPU without bf16 units (specdec.common.cost's example): one
    token 535 ms, two 957, four 1,167. Lookups whose first token is accepted a third of the
    time cost more than they yield there; the single line a bench run on that machine
    fitted (556 + 157·n ms) prices the first token at a fifth of a step, and drafts them."""
    points = [(1, 535.0), (2, 957.0), (3, 1054.0), (4, 1167.0), (6, 1491.0), (8, 1816.0)]
    stepped = fit_points(points)
    one_line = Line(555.6, 157.44, 100.0, 16)
    chosen = []
    for line in (stepped, one_line):
        policy = adaptive()
        policy.bind(placement(Line(110.0, 7.0, 20.0, 16)), placement(line))
        for _ in range(40):  # 30% of lookup tokens accepted at each position
            policy.sources[LOOKUP_NGRAM].observe(3, 1)
            policy.sources[LOOKUP_NGRAM].observe(3, 0)
            policy.sources[LOOKUP_NGRAM].observe(3, 0)
        chosen.append(policy.choose_lookup_k(8, LOOKUP_NGRAM))
    assert chosen[0] == 0 and chosen[1] > 0, chosen
