"""How the drafter ranks verification outcomes for SSD (pure function, no model)."""

import pytest
import torch

from specdec.drafter.config import CONFIDENCE, GEOMETRIC
from specdec.drafter.speculate import rank_outcomes


def probs(*rows: dict[int, float], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for t, p in row.items():
            out[i, t] = p
    return out


def test_outcomes_are_ranked_by_outcome_and_token_probability():
    # k = 2, draft (3, 5). Row 0: after x; row 1: after d_1; row 2: after d_2 (bonus).
    q = probs({3: 0.6, 1: 0.3, 2: 0.1}, {5: 0.5, 4: 0.5}, {7: 0.9, 6: 0.1})
    keys = rank_outcomes(q, [3, 5], alpha=0.5, fan_out=10, max_per_outcome=3, outcomes=GEOMETRIC)
    # P(a=0) = 0.5, P(a=1) = 0.25, P(a=2) = 0.25, times q renormalised without the rejected
    # token: (0,1) 0.375, (1,4) 0.25, (2,7) 0.225, (0,2) 0.125, (2,6) 0.025.
    assert keys == [(0, 1), (1, 4), (2, 7), (0, 2), (2, 6)]


def test_fan_out_and_cap():
    q = probs({0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1}, {0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1})
    keys = rank_outcomes(q, [0], alpha=0.9, fan_out=3, max_per_outcome=2, outcomes=GEOMETRIC)
    assert len(keys) == 3
    assert sum(a == 1 for a, _ in keys) == 2  # the likely "all accepted" outcome, capped at 2
    assert (0, 0) not in keys  # d_1 = 0 was rejected in outcome a = 0


def test_a_one_hot_row_has_no_recovered_candidate():
    # top-k 1 (or greedy ranking of a one-hot): after a rejection nothing else is possible.
    q = probs({2: 1.0}, {4: 1.0})
    assert rank_outcomes(q, [2], alpha=0.5, fan_out=5, max_per_outcome=3, outcomes=GEOMETRIC) == [
        (1, 4)
    ]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_extreme_acceptance_keeps_every_outcome_possible(alpha):
    q = probs({1: 0.5, 2: 0.5}, {3: 1.0})
    keys = rank_outcomes(q, [1], alpha=alpha, fan_out=5, max_per_outcome=3, outcomes=GEOMETRIC)
    assert set(keys) == {(0, 2), (1, 3)}


def test_confidence_ranks_each_outcome_by_the_drafters_probability_of_the_draft():
    # k = 2, draft (3, 5): the drafter gives d_1 0.6 and d_2 0.4, so P(a=0) = 0.4,
    # P(a=1) = 0.6 * 0.6 = 0.36, P(a=2) = 0.6 * 0.4 = 0.24; times q without the rejected
    # token: (1,4) 0.36, (0,1) 0.4 * 0.75 = 0.3, (2,7) 0.216, (0,2) 0.1, (2,6) 0.024.
    q = probs({3: 0.6, 1: 0.3, 2: 0.1}, {5: 0.4, 4: 0.6}, {7: 0.9, 6: 0.1})
    keys = rank_outcomes(q, [3, 5], alpha=0.5, fan_out=10, max_per_outcome=3)
    assert keys == [(1, 4), (0, 1), (2, 7), (0, 2), (2, 6)]
    assert keys == rank_outcomes(q, [3, 5], 0.5, 10, 3, outcomes=CONFIDENCE)  # the default
    # geometric at 0.5 ranks the same rows by 0.5, 0.25, 0.25 instead
    assert rank_outcomes(q, [3, 5], 0.5, 10, 3, outcomes=GEOMETRIC)[0] == (0, 1)


def test_confidence_follows_a_lookup_draft_where_the_drafter_agrees_and_stops_where_not():
    # A 4-token lookup draft (1, 2, 3, 4): the drafter agrees with d_1..d_2 (0.95) and
    # doubts d_3 (0.1). Its branches go to the rejection of d_3 (a = 2); geometric ranking
    # at the request's rate of 0.5 spends them on a = 0 and a = 1 instead.
    q = probs(
        {1: 0.95, 0: 0.05},
        {2: 0.95, 0: 0.05},
        {3: 0.1, 6: 0.8, 7: 0.1},
        {4: 0.9, 0: 0.1},
        {5: 1.0},
    )
    confident = rank_outcomes(q, [1, 2, 3, 4], alpha=0.5, fan_out=2, max_per_outcome=3)
    assert confident[0] == (2, 6)
    geometric = rank_outcomes(q, [1, 2, 3, 4], 0.5, 2, 3, outcomes=GEOMETRIC)
    assert geometric == [(0, 0), (1, 0)]


def test_an_unknown_outcome_model_is_refused():
    with pytest.raises(ValueError, match="unknown outcome model 'exponential'"):
        rank_outcomes(probs({1: 1.0}, {2: 1.0}), [1], 0.5, 2, 3, outcomes="exponential")
