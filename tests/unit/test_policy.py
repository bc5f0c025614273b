"""The adaptive k policy (specdec.gateway.round.policy) as a pure object: measurements in,
decisions out, no processes."""

from __future__ import annotations

import pytest

from specdec.gateway.names import Ssd
from specdec.gateway.outcome import DRAFTED, LOOKUP_SUFFIX, Outcome, RequestStats
from specdec.gateway.round.policy import (
    ADAPTIVE,
    FIXED,
    AdaptivePolicy,
    FixedPolicy,
    PolicyParams,
    make_policy,
    parse_policy,
)
from specdec.gateway.round.policy.acceptance import SourcePriors, expected_tokens


def rounds(policy: AdaptivePolicy, n: int, *, k: int, accepted: int, verify_s: float,
           draft_s: float, queue: int = 0) -> None:  # fmt: skip
    """n rounds of k drafts: each Draft took draft_s, each Verify verify_s."""
    for _ in range(n):
        if k:
            policy.observe_draft(k, draft_s)
        policy.observe_verify(k, accepted, verify_s, queue)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.0, 4) == 1.0


def test_parse_policy():
    assert parse_policy("fixed") == FIXED and parse_policy(" Adaptive ") == ADAPTIVE
    with pytest.raises(ValueError, match="must be one of fixed, adaptive, got 'auto'"):
        parse_policy("auto")


def test_fixed_policy_keeps_the_request_k_and_fan_out():
    policy = make_policy(FIXED, ssd=True, fan_out=3)
    assert isinstance(policy, FixedPolicy)
    policy.observe(lookup_outcome(4, 0, queue=50))  # nothing it sees changes it
    assert [policy.choose_k(k) for k in (0, 2, 4)] == [0, 2, 4]
    assert policy.choose_fan_out(4, 4) == 3


def test_drafts_the_upper_bound_until_measured():
    policy = AdaptivePolicy(ssd=True, max_fan_out=6)
    assert policy.choose_k(4) == 4
    assert policy.choose_fan_out(4, 4) == 6
    assert policy.choose_k(0) == 0


def test_acceptance_estimate_is_per_token_with_a_prior():
    policy = AdaptivePolicy(ssd=False, max_fan_out=1, params=PolicyParams(prior_weight=0))
    policy.observe_verify(4, 2, 0.1, 0)  # accepted d1, d2, rejected d3
    policy.observe_verify(4, 4, 0.1, 0)  # all accepted: no rejection
    assert policy.acceptance == pytest.approx(6 / 7)
    with_prior = AdaptivePolicy(ssd=False, max_fan_out=1)
    assert with_prior.acceptance == pytest.approx(PolicyParams().prior_acceptance)


def test_good_acceptance_and_a_cheap_drafter_draft_long():
    """Acceptance 0.9, drafting 10% of a step per token, idle verifier: k grows to the bound."""
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    rounds(policy, 10, k=4, accepted=4, verify_s=0.30, draft_s=0.12)
    rounds(policy, 1, k=4, accepted=3, verify_s=0.30, draft_s=0.12)
    assert policy.acceptance > 0.85
    assert policy.choose_k(4) == 4
    assert policy.choose_k(2) == 2  # never above the request's bound


def test_poor_acceptance_turns_speculation_off():
    """Every first draft token rejected: drafting only costs, so k = 0."""
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    rounds(policy, 12, k=4, accepted=0, verify_s=0.30, draft_s=0.40)
    assert policy.acceptance < 0.3
    assert policy.choose_k(4) == 0


def test_the_model_picks_the_argmax_of_expected_tokens_per_second():
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    rounds(policy, 20, k=2, accepted=1, verify_s=0.33, draft_s=0.24)
    k = policy.choose_k(6)
    rates = [policy.rates(j)[j] for j in range(7)]
    assert rates[k] == max(rates)
    assert 0 < k < 6  # an interior optimum: acceptance ~0.5 with a drafter at 0.37 of a step


def test_saturated_verifier_shrinks_k_to_zero_and_headroom_grows_it_back():
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    rounds(policy, 10, k=4, accepted=3, verify_s=0.30, draft_s=0.12)
    idle_k = policy.choose_k(4)
    assert idle_k >= 3
    # The verifier reports a queue of 8 other requests: every extra token costs a step.
    ks = []
    for _ in range(10):
        k = policy.choose_k(4)
        ks.append(k)
        rounds(policy, 1, k=k, accepted=min(k, 3), verify_s=2.4, draft_s=0.12, queue=8)
    assert policy.prices.token_cost == pytest.approx(1.0, abs=0.05)
    assert ks[-1] == 0 and ks == sorted(ks, reverse=True)
    # Load gone: measured at k = 0 too, so k comes back (to 3 at least: the fourth
    # position, rejected in every round that reached it, may have stopped paying).
    for _ in range(15):
        k = policy.choose_k(4)
        rounds(policy, 1, k=k, accepted=min(k, 3), verify_s=0.30, draft_s=0.12, queue=0)
    assert policy.choose_k(4) >= 3


def test_partial_load_gives_an_intermediate_k():
    idle = AdaptivePolicy(ssd=False, max_fan_out=1)
    loaded = AdaptivePolicy(ssd=False, max_fan_out=1)
    for policy, queue in ((idle, 0), (loaded, 2)):
        for accepted in (8, 5, 2, 8, 6, 3, 8, 7, 4, 8) * 2:  # about 0.8 a position
            rounds(policy, 1, k=8, accepted=accepted, verify_s=0.3, draft_s=0.16, queue=queue)
    assert 0 < loaded.choose_k(8) < idle.choose_k(8)


def test_ssd_hits_hide_drafting_so_k_is_larger():
    plain = AdaptivePolicy(ssd=False, max_fan_out=6)
    ssd = AdaptivePolicy(ssd=True, max_fan_out=6)
    for policy in (plain, ssd):
        for accepted in (3, 2, 1, 3, 3, 0, 2, 3) * 3:  # about 0.7 a position
            rounds(policy, 1, k=3, accepted=accepted, verify_s=0.3, draft_s=0.15)
    for _ in range(10):
        ssd.choose_fan_out(3, 3)
        ssd.fanout.settle(True)  # answered in time, a hit: it saved a Draft
    assert ssd.fanout.hit_rate > 0.95
    assert ssd.choose_k(8) > plain.choose_k(8)


def test_fan_out_fits_the_speculate_inside_the_verify_and_the_draft_a_hit_saves():
    """S(f) <= fit_margin (V + h D(branch_k)): a Speculate may outlast its Verify by what a
    hit saves the next round (its Draft)."""
    params = PolicyParams()
    policy = AdaptivePolicy(ssd=True, max_fan_out=6, params=params)
    rounds(policy, 5, k=2, accepted=2, verify_s=0.40, draft_s=0.1)
    # A Speculate of 3 branches x 2 steps took 0.36 s: one step of one branch is
    # 0.36 / (3 x 1.3) = 0.092 s.
    for _ in range(5):
        policy.observe_speculate(3, 2, 0.36)
    f = policy.choose_fan_out(2, 2)
    step = policy.fanout.step.value
    verify = policy.prices.verify.value * (1 + policy.prices.token_cost * 2)
    h, draft = policy.fanout.hit_rate, policy.prices.draft_cost(2)
    assert h == params.prior_hit_rate and draft == pytest.approx(0.1)
    budget = params.fit_margin * (verify + h * draft)

    def cost(fan_out: int) -> float:
        return step * 3 * (1 + params.branch_cost * (fan_out - 1))

    assert 1 <= f < 6
    assert cost(f) <= budget < cost(f + 1)
    # Negative control: within the Verify alone, fewer branches fit.
    assert cost(f) > params.fit_margin * verify
    # Longer branches take longer: fewer of them fit.
    assert policy.choose_fan_out(2, 4) < f


def late_round(k: int, late: Ssd, draft_s: float, forward_ms: float) -> Outcome:
    """A round after a late Speculate, whose Draft (k tokens, draft_s in all, forward_ms of
    it in the drafter's forwards) decided it: `late` HIT or MISS."""
    return Outcome(
        index=1, max_k=k, k=k, draft=tuple(range(k)), accepted=k, next_token=0,
        source=DRAFTED, draft_seconds=draft_s, verify_seconds=0.2, queue_depth=0,
        resends=0, late_outcome=late, draft_forward_ms=forward_ms,
    )  # fmt: skip


def test_a_late_speculate_is_measured_by_the_draft_that_waited_for_it():
    """The next round's Draft queued behind a late Speculate: what it waited beyond its
    forward and o_d is the Speculate's lateness (w), priced in drafting and kept out of
    o_d; a late hit counts for h."""
    policy = AdaptivePolicy(ssd=True, max_fan_out=6)
    for _ in range(5):
        policy.observe_draft(2, 0.101, forward_ms=100.0)  # o_d = 1 ms
        policy.observe_verify(2, 2, 0.2, 0)
    assert policy.prices.draft_overhead_s == pytest.approx(0.001)
    before = policy.drafting(2)
    policy.choose_fan_out(2, 2)
    policy.observe_speculate(6, 2, None)  # late: 1.25 V until measured
    policy.observe(late_round(2, Ssd.MISS, draft_s=0.181, forward_ms=100.0))  # waited 80 ms
    assert policy.fanout.waits.value == pytest.approx(0.08)
    assert policy.prices.draft_overhead_s == pytest.approx(0.001)  # not 81 ms
    assert policy.fanout.hits.value == 0.0
    assert policy.drafting(2) > before + 0.07
    assert policy.drafting(0) == 0.0
    # A late hit: answered from the Speculate's branches, no forward.
    policy.observe_speculate(6, 2, None)
    policy.observe(late_round(2, Ssd.HIT, draft_s=0.031, forward_ms=0.0))
    assert policy.fanout.hits.value > 0.0
    assert policy.fanout.waits.value < 0.08


def test_late_speculates_that_save_less_than_they_cost_shrink_the_fan_out_then_pause_ssd():
    """Speculates whose next Draft waited 0.5 s for them (a Draft costs 0.1 s): the
    fan-out shrinks, and once `late_limit` of them saved nothing on average SSD pauses for
    `pause_rounds` rounds, then tries again measured afresh."""
    params = PolicyParams(late_limit=3, pause_rounds=5)
    policy = AdaptivePolicy(ssd=True, max_fan_out=6, params=params)
    rounds(policy, 3, k=2, accepted=2, verify_s=0.2, draft_s=0.1)
    fan_outs = []
    for _ in range(20):
        f = policy.choose_fan_out(2, 2)
        if f is None:
            break
        fan_outs.append(f)
        policy.observe_verify(2, 2, 0.2, 0)
        policy.observe_speculate(f, 2, None)  # still running at the verdict
        policy.fanout.settle_late(True, 0.5)  # ... and the next Draft waited 0.5 s for it
    assert fan_outs[0] == 6 and fan_outs[-1] == 1
    assert fan_outs == sorted(fan_outs, reverse=True)
    assert len(fan_outs) == params.late_limit
    # Paused: no Speculate for pause_rounds rounds (the None above was the first of them),
    # and no hidden drafting counted meanwhile.
    assert policy.fanout.hit_rate == 0.0 and policy.fanout.wait == 0.0
    paused = [policy.choose_fan_out(2, 2) for _ in range(params.pause_rounds - 1)]
    assert paused == [None] * (params.pause_rounds - 1)
    assert policy.choose_fan_out(2, 2) == 1  # then it tries again
    assert policy.fanout.settled == 0 and policy.fanout.saved.value is None
    # Speculates answered in time that hit save their Draft: SSD stays on. Ones that
    # only miss save nothing, and pause it.
    for hit, paused in ((True, 0), (False, params.pause_rounds)):
        policy = AdaptivePolicy(ssd=True, max_fan_out=6, params=params)
        rounds(policy, 3, k=2, accepted=2, verify_s=0.2, draft_s=0.1)
        for _ in range(10):
            assert policy.choose_fan_out(2, 2) is not None
            policy.observe_speculate(1, 2, 0.05)
            policy.fanout.settle(hit)
            if policy.fanout.paused:
                break
        assert policy.fanout.paused == paused


def test_late_speculates_that_save_more_than_they_cost_keep_ssd_on():
    """A Speculate 20 ms later than its Verify of 0.2 s, where a hit saves a Draft of 0.1 s
    at h = 0.9: it pays, so SSD neither pauses nor falls to one branch. Negative control:
    the same lateness with hits that save nothing (h = 0) pauses it."""

    def run(hit: bool) -> list[int | None]:
        params = PolicyParams(late_limit=3, pause_rounds=5)
        policy = AdaptivePolicy(ssd=True, max_fan_out=6, params=params)
        rounds(policy, 3, k=2, accepted=2, verify_s=0.2, draft_s=0.1)
        chosen: list[int | None] = []
        for _ in range(30):
            f = policy.choose_fan_out(2, 2)
            chosen.append(f)
            if f is None:
                continue
            policy.observe_verify(2, 2, 0.2, 0)
            policy.observe_speculate(f, 2, None)
            policy.fanout.settle_late(hit, 0.02)
        return chosen

    paying = run(hit=True)
    assert None not in paying and min(paying[5:]) > 1  # type: ignore[type-var]
    assert None in run(hit=False)


def test_a_gateway_whose_speculates_saved_nothing_starts_requests_with_ssd_paused():
    """SsdPrior: once the gateway's Speculates saved nothing on average, a new request's
    SSD starts paused, but one in `ssd_explore_every` (which measures again). Negative
    control: where they paid, every request starts with SSD on."""
    params = PolicyParams(late_limit=3, pause_rounds=5)

    def starts(hit: bool) -> list[bool]:
        priors = SourcePriors()
        first = AdaptivePolicy(ssd=True, max_fan_out=6, params=params, priors=priors)
        rounds(first, 3, k=2, accepted=2, verify_s=0.2, draft_s=0.1)
        for _ in range(params.late_limit):
            first.choose_fan_out(2, 2)
            first.observe_verify(2, 2, 0.2, 0)
            first.observe_speculate(6, 2, None)
            first.fanout.settle_late(hit, 0.05)  # a hit saves a Draft of 0.1 s
        return [
            AdaptivePolicy(ssd=True, max_fan_out=6, params=params, priors=priors).fanout.paused > 0
            for _ in range(8)
        ]

    assert starts(hit=False) == [True, True, True, False] * 2
    assert starts(hit=True) == [False] * 8
    # Without SSD nothing is paused, whatever the gateway measured.
    priors = SourcePriors()
    for _ in range(4):
        priors.ssd.record(-0.1)
    assert AdaptivePolicy(ssd=False, max_fan_out=6, priors=priors).fanout.paused == 0


def lookup_outcome(k: int, accepted: int, queue: int = 0) -> Outcome:
    return Outcome(
        index=0, max_k=k, k=k, draft=tuple(range(k)), accepted=accepted, next_token=0,
        source=LOOKUP_SUFFIX, draft_seconds=0.0, verify_seconds=0.01, queue_depth=queue,
        resends=0,
    )  # fmt: skip


def test_lookup_drafts_are_free_so_long_ones_pay_until_the_verifier_saturates():
    """choose_lookup_k: the bound before anything is measured; with d = 0, the whole bound
    while lookups are accepted; short when they are mostly rejected; 0 at saturation.
    Lookup verdicts do not move the draft model's acceptance."""
    p = AdaptivePolicy(ssd=False, max_fan_out=1)
    assert p.choose_lookup_k(16) == 16 and FixedPolicy().choose_lookup_k(16) == 16
    for _ in range(20):
        p.observe(lookup_outcome(16, 16))
    assert p.choose_lookup_k(16, LOOKUP_SUFFIX) == 16
    assert p.counts() == (0, 0) and p.counts(lookup=True)[0] == 320
    bad = AdaptivePolicy(ssd=False, max_fan_out=1)
    for _ in range(40):
        bad.observe(lookup_outcome(16, 0))
    assert 0 <= bad.choose_lookup_k(16, LOOKUP_SUFFIX) <= 2
    busy = AdaptivePolicy(ssd=False, max_fan_out=1)
    for _ in range(20):
        busy.observe(lookup_outcome(8, 6, queue=8))
    assert busy.choose_lookup_k(16, LOOKUP_SUFFIX) == 0


def extended_outcome(model_k: int, extended: int, accepted: int) -> Outcome:
    k = model_k + extended
    return Outcome(
        index=0, max_k=k, k=k, draft=tuple(range(k)), accepted=accepted, next_token=0,
        source=DRAFTED, draft_seconds=0.01 * model_k, verify_seconds=0.01, queue_depth=0,
        resends=0, extended=extended,
    )  # fmt: skip


def test_a_lookup_extension_counts_apart_from_the_model_draft():
    """A model draft of 3 extended by 5 lookup tokens: the model's acceptance counts its
    own 3 tokens; the extension counts once those were all accepted, as a lookup draft.
    The request's statistics split the round the same way (by_source)."""
    p = AdaptivePolicy(ssd=False, max_fan_out=1)
    stats = RequestStats()
    for o in (
        extended_outcome(3, 5, 1),  # model rejected at its 2nd token: extension unseen
        extended_outcome(3, 5, 3),  # model all accepted, the extension's 1st rejected
        extended_outcome(3, 5, 8),  # everything accepted
    ):
        p.observe(o)
        stats.observe(o)
    assert p.counts() == (7, 1)
    assert p.counts(lookup=True) == (5, 1)
    assert stats.by_source == {"model": [3, 9, 7], "ngram": [3, 15, 5]}
    assert stats.draft_tokens == 24 and stats.accepted_tokens == 12
