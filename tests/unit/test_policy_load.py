"""The adaptive policy under load, at concurrency 1 to 32, against k = 0 and every fixed k.

specdec.tools.bench.loadsim runs the gateway's policies (one per request, the gateway's
SourcePriors shared) against stand-in replicas: a verifier that batches continuously over
a measured cost surface (the 1.5B target's forwards per shape on a CPU, two dtypes) or a
modelled GPU one, fitting its cost curve and load window with the replica's own code and
reporting them through the wire format; a drafter likewise. The llama.cpp surface is
ragged (no pads: a forward costs its rows' tokens) and its drafter's step is the target's,
as measured. Time is simulated, never the
wall clock; the draws are seeded. Each cell is aggregate tokens per simulated second.
"""

from __future__ import annotations

import pytest

from specdec.common.cost import CostCurve, LoadWindow, ReportedCost, fit_points, to_proto
from specdec.tools.bench import loadsim

SURFACES = loadsim.surfaces()
_SWEEPS: dict[str, dict[int, dict[str, loadsim.Result]]] = {}

# Cells where the policy is not yet within 5% of the best fixed k (strict: a fix shows up).
BEHIND_BEST = {
    ("cpu-float32-packed", 2): "two sessions pipeline (one drafts while the other verifies); "
    "the policy's mix of k = 3..5 unbalances the pipeline that a fixed k = 4 keeps",
    ("cpu-float32-packed", 4): "as at 2: 1.5 rows a forward, the mix of k pads and "
    "unbalances what a fixed k = 4 keeps at 1.8 rows",
    ("gpu-modelled", 32): "the 16+ rows bucket fits one line in tokens a row over forwards "
    "of 16 to 32 rows, so its slope is the rows' spread, not the tokens': it prices k = 4 "
    "and 5 as dear",
}


def sweep(name: str) -> dict[int, dict[str, loadsim.Result]]:
    if name not in _SWEEPS:
        _SWEEPS[name] = loadsim.sweep(loadsim.setup_of(SURFACES[name]))
    return _SWEEPS[name]


CELLS = [(name, c) for name in SURFACES for c in loadsim.CONCURRENCY]


@pytest.mark.parametrize(("name", "concurrency"), CELLS)
def test_the_policy_never_loses_to_k0(name, concurrency):
    row = sweep(name)[concurrency]
    adaptive, k0 = row["adaptive"].tokens_per_s, row["k=0"].tokens_per_s
    assert adaptive >= 0.98 * k0, loadsim.table(name, sweep(name))


@pytest.mark.parametrize(
    ("name", "concurrency"),
    [
        pytest.param(*cell, marks=pytest.mark.xfail(strict=True, reason=BEHIND_BEST[cell]))
        if cell in BEHIND_BEST
        else cell
        for cell in CELLS
    ],
)
def test_the_policy_is_within_5_percent_of_the_best_fixed_k(name, concurrency):
    row = sweep(name)[concurrency]
    best = max(r.tokens_per_s for mode, r in row.items() if mode != "adaptive")
    assert row["adaptive"].tokens_per_s >= 0.95 * best, loadsim.table(name, sweep(name))


def test_under_load_a_compute_bound_verifier_gets_no_draft():
    """bfloat16 on a CPU without bf16 units: a row of 2 tokens costs 1.5 steps at 16 rows
    (and more above), so the policy stops drafting, where alone it speculated least."""
    results = sweep("cpu-bfloat16")
    assert results[16]["adaptive"].mean_k < 0.1
    assert results[32]["adaptive"].mean_k < 0.1
    assert results[8]["adaptive"].mean_k < results[4]["adaptive"].mean_k


def test_on_a_flat_surface_load_keeps_the_long_drafts():
    results = sweep("gpu-modelled")
    for c in (4, 8, 16):
        assert results[c]["adaptive"].mean_k > 4.0


def test_the_load_window_reports_busy_share_and_rows_as_rows_saw_them():
    window = LoadWindow(window=2.0, since=0.0)
    window.add(ended=1.0, seconds=0.5, rows=7, tokens=2)
    window.add(ended=1.5, seconds=0.5, rows=1, tokens=4)
    load = window.load(now=2.0, waiting=3)
    assert load.window_s == pytest.approx(2.0)
    assert load.busy == pytest.approx(0.5)
    assert load.forwards == 2
    assert load.rows_per_forward == pytest.approx((49 + 1) / 8)
    assert load.tokens_per_forward == pytest.approx((14 + 4) / 2)
    assert load.rows_per_second == pytest.approx(4.0)
    assert load.waiting == 3
    later = window.load(now=3.2, waiting=0)  # the first has left, the second half in
    assert later.forwards == 1 and later.busy == pytest.approx(0.3 / 2.0)  # 1.2..1.5


def test_the_surface_reads_between_buckets_and_fills_an_unmeasured_step():
    curve = CostCurve()
    curve.prior = fit_points([(1, 10.0), (2, 12.0), (4, 16.0), (8, 24.0)])
    for _ in range(20):
        curve.add(1, 1, 0.010)  # one row: a step of 10 ms, 2 ms a token
        curve.add(4, 1, 0.016)
        curve.add(4, 8, 0.070)  # 8 rows, only drafts of 3: 32 tokens a forward
        curve.add(2, 8, 0.040)
    load = LoadWindow(since=0.0).load(now=1.0, waiting=0)
    cost = ReportedCost.from_proto(to_proto(curve.buckets(), load))
    assert cost is not None and cost.load is not None
    eight = cost.line(8)
    assert eight.rows == pytest.approx(8.0) and eight.step_samples == 0.0
    # 8 rows of one token: never measured; read off the one-row line at 8 tokens (24 ms),
    # not the probe's shape scaled (which would put it near t(2) = 40 ms)
    assert cost.ms(8, 1) == pytest.approx(24.0, rel=0.05)
    assert cost.ms(8, 4) == pytest.approx(70.0, rel=0.05)
    assert cost.ms(4.5, 4) == pytest.approx((16.0 + 70.0) / 2, rel=0.05)  # halfway in rows
    assert cost.ms(1, 4) == pytest.approx(16.0, rel=0.05)


def test_a_priced_round_is_counted_by_its_load_level():
    from prometheus_client import REGISTRY

    from specdec.gateway.observe import tracing
    from specdec.gateway.outcome import NO_DRAFT, Outcome
    from specdec.gateway.round.policy import Estimate

    estimate = Estimate(rows=9.5, saturation=0.9, gain=1.0)
    assert estimate.level == "8"
    labels = {"rows": estimate.level, "k": "0"}
    name = "specdec_gateway_policy_rounds_by_load_total"
    before = REGISTRY.get_sample_value(name, labels) or 0.0
    gains = (
        REGISTRY.get_sample_value("specdec_gateway_policy_speculation_gain_count", {"rows": "8"})
        or 0.0
    )
    o = Outcome(
        index=0, max_k=4, k=0, draft=(), accepted=0, next_token=1, source=NO_DRAFT,
        draft_seconds=0.0, verify_seconds=0.01, queue_depth=3, resends=0,
        load_level=estimate.level, saturation=estimate.saturation, gain=estimate.gain,
    )  # fmt: skip
    tracing.round_done(None, o)
    assert REGISTRY.get_sample_value(name, labels) == before + 1
    after = REGISTRY.get_sample_value(
        "specdec_gateway_policy_speculation_gain_count", {"rows": "8"}
    )
    assert after == gains + 1
    unpriced = Outcome(
        index=1, max_k=4, k=4, draft=(1, 2, 3, 4), accepted=4, next_token=1, source=NO_DRAFT,
        draft_seconds=0.0, verify_seconds=0.01, queue_depth=3, resends=0,
    )  # fmt: skip
    tracing.round_done(None, unpriced)  # a fixed policy's round: not counted by load
    assert REGISTRY.get_sample_value(name, labels) == before + 1


def test_a_ragged_curve_is_one_line_over_the_tokens_a_forward_computes():
    """llama.cpp's forwards have no pads: 8 rows of one token and one row of 8 tokens cost
    the same, and a row of 5 beside seven of 1 costs its 12 tokens, not 40."""
    curve = CostCurve(ragged=True)
    for _ in range(30):
        for computed in (1, 4, 8, 12, 40):
            curve.add(computed, 8, (2.0 + 10.0 * computed) / 1e3)  # rows are not fitted
    assert [edge for edge, _ in curve.buckets()] == [1]
    window = LoadWindow(since=0.0)
    window.add(ended=1.0, seconds=0.12, rows=8, tokens=5, computed=12)
    load = window.load(now=1.0, waiting=0)
    assert load.tokens_per_forward == pytest.approx(12.0)
    cost = ReportedCost.from_proto(to_proto(curve.buckets(), load, ragged=True))
    assert cost is not None and cost.ragged
    assert cost.row_tokens == pytest.approx(1.5)  # 12 tokens over the 8 rows
    # a row of 3 tokens beside 7 others of 1.5 tokens: 13.5 tokens
    assert cost.ms(8, 3) == pytest.approx(2.0 + 10.0 * 13.5, rel=0.02)
    assert cost.ms(1, 3) == pytest.approx(32.0, rel=0.02)
    padded = ReportedCost.from_proto(to_proto(curve.buckets(), load))
    assert padded is not None and not padded.ragged


def test_a_ragged_curve_keeps_measured_points_and_reads_between_them():
    """llama.cpp's cost is not a line in the tokens (57 ms for one, 450 for 8, 505 for 16):
    a ragged curve keeps a decayed mean point per range of tokens, seeded by the probe, and
    the reader interpolates between them (and beyond the widest, at its cost a token)."""
    curve = CostCurve(ragged=True)
    curve.seed([(1, 57.0), (4, 192.0), (8, 450.0), (16, 505.0)])
    for _ in range(40):
        curve.add(32, 1, 0.845)
    points = curve.points()
    assert [round(n) for n, _, _ in points] == [1, 4, 8, 16, 32]
    cost = ReportedCost.from_proto(to_proto(curve.buckets(), None, True, points))
    assert cost is not None and cost.ragged and len(cost.points) == 5
    assert cost.ragged_ms(12) == pytest.approx((450.0 + 505.0) / 2, rel=0.01)
    assert cost.ragged_ms(24) == pytest.approx((505.0 + 845.0) / 2, rel=0.01)
    assert cost.ragged_ms(64) == pytest.approx(845.0 * 2, rel=0.01)
    assert cost.batch_ms(8, 2) == pytest.approx(505.0, rel=0.01)  # 8 rows of 2: 16 tokens
    # a padded replica reports none
    padded = CostCurve()
    padded.seed([(1, 57.0), (4, 192.0)])
    assert padded.points() == []


def _bound_policy(cost: ReportedCost):
    from types import SimpleNamespace

    from specdec.gateway.round.policy import AdaptivePolicy

    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    verifier = SimpleNamespace(replica=SimpleNamespace(cost=cost))
    drafter = SimpleNamespace(replica=SimpleNamespace(cost=cost))
    policy.bind(drafter, verifier)
    return policy


def _busy_load(rows: int) -> LoadWindow:
    window = LoadWindow(since=0.0)
    for i in range(10):
        window.add(ended=0.2 * (i + 1), seconds=0.2, rows=rows, tokens=1, computed=rows)
    return window


def test_a_ragged_verifier_has_no_free_width_and_prices_a_new_request_under_load():
    """Padded, tokens up to the batch's width cost nothing more; ragged, none is free. And a
    request's first round, before it has a round time of its own, is priced at the load
    the verifier reports, not idle (priced idle, each new request drafted into a full
    verifier, and on llama.cpp at 16 sessions the simulated policy fell to 0.74x of k = 0)."""
    curve = CostCurve(ragged=True)
    curve.prior = fit_points([(1, 50.0), (2, 100.0), (4, 200.0), (8, 400.0), (16, 800.0)])
    load = _busy_load(8).load(now=2.0, waiting=4)
    policy = _bound_policy(ReportedCost.from_proto(to_proto(curve.buckets(), load, ragged=True)))
    assert policy.prices.saturation == pytest.approx(1.0 - 1.0 / 8.0)
    assert policy.batch_width(4) == 1
    assert policy.choose_k(4) == 0  # every draft token costs a step of every waiting row
    flat = CostCurve()
    flat.prior = fit_points([(1, 50.0), (2, 50.5), (4, 51.0), (8, 52.0), (16, 54.0)])
    padded = _bound_policy(ReportedCost.from_proto(to_proto(flat.buckets(), load)))
    assert padded.batch_width(4) > 1


def test_on_a_ragged_verifier_a_drafter_as_dear_prices_its_steps_under_load():
    """The verifier's marginal token is cheap where its surface is flat (9 to 16 tokens a
    forward: 479 to 505 ms), but a drafter as dear as the target takes a forward of its
    own per draft token: with the sessions split between the two queues, speculating at
    16 sessions passes fewer rounds a second than k = 0 (the simulated policy, priced on
    the verifier alone, drafted 3 tokens a round there and fell to 0.65x of k = 0)."""
    curve = CostCurve(ragged=True)
    curve.seed([(1, 57.0), (4, 192.0), (8, 450.0), (9, 479.0), (16, 505.0), (32, 845.0)])
    window = LoadWindow(since=0.0)
    for i in range(4):
        window.add(ended=0.5 * (i + 1), seconds=0.5, rows=16, tokens=1, computed=16)
    load = window.load(now=2.0, waiting=16)
    cost = ReportedCost.from_proto(to_proto(curve.buckets(), load, True, curve.points()))
    policy = _bound_policy(cost)
    assert policy.prices.sessions == pytest.approx(32.0)  # 16 rows in each replica's forwards
    assert (
        policy.prices.network_time(2, 1) > policy.prices.network_time(1, 0) * 1.75
    )  # k=1 yields 1.75
    assert policy.choose_k(4) == 0


MISPRICED = loadsim.setup_of(SURFACES["cpu-float32-packed"], unpriced=0.5)


@pytest.mark.parametrize("concurrency", loadsim.CONCURRENCY)
def test_the_guard_keeps_a_mispriced_policy_from_losing(concurrency):
    """A verifier whose forwards of drafts take half again what it reports (a stand-in
    for the costs of a speculating round the policy does not price): alone the adaptive
    policy loses to k = 0 at 32 sessions; under the gateway's goodput guard it never does,
    stays out of the way at one session, and gives up little of the policy's gain where
    speculation pays. 300 rounds a session: the guard learns over epochs of several rounds."""
    modes = ("k=0", "adaptive", "guarded")
    runs = {m: loadsim.run(MISPRICED, concurrency, m, rounds=300) for m in modes}
    k0, adaptive, guarded = (runs[m].tokens_per_s for m in ("k=0", "adaptive", "guarded"))
    report = {m: (round(r.tokens_per_s, 2), round(r.mean_k, 2)) for m, r in runs.items()}
    assert guarded >= 0.98 * k0, report
    assert guarded >= 0.95 * adaptive, report
    if concurrency == 1:
        assert guarded == adaptive, report
    if concurrency == 32:
        assert adaptive < 0.8 * k0, report  # the stand-in does fool the model
        assert guarded >= 0.98 * k0, report


# A verifier whose drafted forwards take 30% more than it reports, at 32 sessions: where
# speculation loses a little, and one guard over every session finds it.
SHARED = loadsim.setup_of(SURFACES["cpu-float32-packed"], unpriced=0.3)


@pytest.mark.parametrize("seed", [1, 2])
def test_one_guard_over_every_replica_where_separate_guards_speculate_and_lose(seed):
    """32 sessions over 2 gateway replicas. A guard per replica measures its own sessions
    faster speculating (the other replica's plain rows wait for its wide ones), so both
    speculate and every session runs slower than at k = 0; one guard over every session
    (what the replicas share through Redis: specdec.gateway.round.policy.shared) runs
    plain steps. The separate guards' loss is the reason the guard is shared: if it goes,
    so may the sharing."""
    k0 = loadsim.run(SHARED, 32, "k=0", rounds=300, seed=seed).tokens_per_s
    one = loadsim.run(SHARED, 32, "guarded", rounds=300, seed=seed, gateways=1)
    apart = loadsim.run(SHARED, 32, "guarded", rounds=300, seed=seed, gateways=2)
    report = {"k0": k0, "one": one, "apart": apart}
    assert one.tokens_per_s >= 0.97 * k0, report
    assert apart.tokens_per_s < 0.96 * k0, report
    assert one.mean_k < 0.5 * apart.mean_k, report
