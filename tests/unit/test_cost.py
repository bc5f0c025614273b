"""The forward cost curve (specdec.common.cost): t(n) = a + b·n fitted per batch bucket,
robust to stalls, following a change, reported and read back through its proto."""

from __future__ import annotations

import random

import pytest

from specdec.common.cost import CostCurve, Line, ReportedCost, bucket_of, fit_points, to_proto


def test_a_line_is_recovered_from_noisy_forwards():
    rng = random.Random(3)
    curve = CostCurve()
    for _ in range(200):
        n = rng.choice((1, 2, 4, 9, 16))
        curve.add(n, 1, (5.0 + 0.8 * n) * rng.uniform(0.97, 1.03) / 1e3)
    line = curve.line(1)
    assert line.base_ms == pytest.approx(5.0, rel=0.1)
    assert line.per_token_ms == pytest.approx(0.8, rel=0.1)
    assert line.widest == 16


def test_stalls_move_the_fit_little():
    """One forward in ten stalled (10x): the Huber weights keep the line near the truth."""
    rng = random.Random(5)
    curve = CostCurve()
    for i in range(300):
        n = rng.choice((1, 4, 8))
        ms = 10.0 + 1.0 * n
        curve.add(n, 1, (ms * 10 if i % 10 == 9 else ms) / 1e3)
    line = curve.line(1)
    assert line.ms(1) == pytest.approx(11.0, rel=0.25)
    assert line.ms(8) == pytest.approx(18.0, rel=0.25)


def test_the_fit_follows_a_change_of_cost():
    curve = CostCurve()
    for i in range(200):
        curve.add(1 + i % 8, 1, (2.0 + 0.1 * (1 + i % 8)) / 1e3)
    for i in range(300):  # the device got busy: every token costs 10x
        curve.add(1 + i % 8, 1, (2.0 + 1.0 * (1 + i % 8)) / 1e3)
    assert curve.line(1).per_token_ms == pytest.approx(1.0, rel=0.15)


def test_one_width_borrows_its_slope_from_the_probe():
    """A verifier at k = 0 sees n = 1 only: its step time is measured, its slope is the
    probe's share of a step."""
    curve = CostCurve()
    curve.prior = fit_points([(1, 10.0), (4, 13.0), (16, 25.0)])  # b = 1, a = 9
    for _ in range(50):
        curve.add(1, 1, 20.0 / 1e3)  # the step got slower (a longer context, say)
    line = curve.line(1)
    assert line.ms(1) == pytest.approx(20.0, rel=0.01)
    assert line.step_share == pytest.approx(curve.prior.step_share, rel=0.01)


def test_buckets_by_rows_and_what_is_not_fitted():
    curve = CostCurve()
    assert curve.line(1) is None
    curve.add(1, 1, 0.010)
    curve.add(2, 1, 0.011)
    for rows in (8, 9, 15):
        curve.add(1, rows, 0.030)
        curve.add(2, rows, 0.040)
    curve.add(100, 1, 5.0)  # a prefill chunk: not in the decode range
    curve.add(0, 1, 1.0)
    assert [edge for edge, _ in curve.buckets()] == [1, 8]
    assert curve.line(4).ms(1) == pytest.approx(10.0)  # borrowed from the narrower bucket
    assert curve.line(8).ms(2) == pytest.approx(40.0)
    assert [bucket_of(r) for r in (1, 2, 3, 4, 7, 8, 16, 64)] == [0, 1, 1, 2, 2, 3, 4, 4]


def test_reported_cost_round_trips_through_the_proto():
    lines = [(1, Line(3.0, 0.5, 12.0, 16)), (8, Line(9.0, 2.0, 5.0, 4))]
    got = ReportedCost.from_proto(to_proto(lines))
    assert got is not None
    assert got.line(1).ms(4) == pytest.approx(5.0)
    assert got.line(3).ms(4) == pytest.approx(5.0)
    assert got.line(20).ms(4) == pytest.approx(17.0)
    assert ReportedCost.from_proto(to_proto([])) is None


# A bfloat16 1.5B model on a CPU without bf16 units, one thread, 300 tokens of context: ms
# of a forward of n tokens (one token runs on another path than several).
BF16_CPU = {1: 535.0, 2: 957.0, 3: 1054.0, 4: 1167.0, 6: 1491.0, 8: 1816.0}


def test_the_one_token_forward_is_fitted_apart_from_the_line():
    """One line through every width put t(1) a third too high and t(2) too low; the step
    fitted apart keeps each width within a few percent of what it measured."""
    curve = CostCurve()
    rng = random.Random(7)
    for _ in range(300):
        n = rng.choice(tuple(BF16_CPU))
        curve.add(n, 1, BF16_CPU[n] * rng.uniform(0.98, 1.02) / 1e3)
    line = curve.line(1)
    for n, ms in BF16_CPU.items():
        assert line.ms(n) == pytest.approx(ms, rel=0.05), n


def test_the_probe_fits_a_step_and_a_line():
    line = fit_points(list(BF16_CPU.items()))
    assert line.step_ms == pytest.approx(535.0)
    assert line.ms(2) == pytest.approx(957.0, rel=0.05)
    assert line.ms(8) == pytest.approx(1816.0, rel=0.03)
    flat = fit_points([(1, 10.0), (4, 13.0)])  # one wide width: the line is flat there
    assert (flat.ms(1), flat.ms(4)) == (10.0, 13.0)


def test_wide_forwards_alone_take_the_step_from_the_probe():
    """A bucket that has seen forwards of 4 tokens only: the line is the probe's scaled to
    them, and so is the step."""
    curve = CostCurve()
    curve.prior = fit_points(list(BF16_CPU.items()))
    for _ in range(20):
        curve.add(4, 1, 2 * BF16_CPU[4] / 1e3)  # twice as slow (another load, say)
    line = curve.line(1)
    assert line.ms(4) == pytest.approx(2 * BF16_CPU[4], rel=0.01)
    prior = curve.prior
    assert line.ms(1) / line.ms(4) == pytest.approx(prior.ms(1) / prior.ms(4), rel=0.01)


def test_the_step_round_trips_through_the_proto():
    lines = [(1, Line(800.0, 150.0, 12.0, 16, 535.0))]
    got = ReportedCost.from_proto(to_proto(lines))
    assert got is not None
    assert (got.line(1).ms(1), got.line(1).ms(2)) == (535.0, 1100.0)
    without = ReportedCost.from_proto(to_proto([(1, Line(800.0, 150.0, 12.0, 16))]))
    assert without is not None and without.line(1).ms(1) == 950.0  # an older replica's
