"""Unit tests for the speculation math (specdec.replica.sampling, DESIGN §2).

Two kinds of test, as STYLE §9 asks:
- table cases with hand-built distributions where the outcome is forced;
- a statistical test that speculative sampling reproduces the target's distribution, with
  negative controls proving the same check fails for a wrong verification rule.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch

from specdec.common.params import MAX_TOP_K
from specdec.replica.sampling import (
    EncodedProbs,
    InvalidDistribution,
    SamplingParams,
    decode_probs,
    encode_probs,
    make_generator,
    rejection_sample,
    round_trip,
    sample_from,
    warp,
)

SEEDS = range(8)  # forced outcomes must hold whatever the random numbers


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _one_hot(token: int, vocab: int) -> list[float]:
    row = [0.0] * vocab
    row[token] = 1.0
    return row


# --------------------------------------------------------------------------------------
# rejection_sample: greedy table cases
# --------------------------------------------------------------------------------------


def _greedy_target(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    """Logit-like scores [k+1, vocab] whose argmax per row is given (not one-hot on purpose)."""
    scores = torch.linspace(-1.0, 1.0, vocab).repeat(len(argmaxes), 1)
    for i, t in enumerate(argmaxes):
        scores[i, t] = 5.0
    return scores


@pytest.mark.parametrize(
    ("draft", "target_argmax", "accepted", "next_token"),
    [
        pytest.param([1, 2, 3], [1, 2, 3, 4], 3, 4, id="perfect-match-bonus"),
        pytest.param([0, 2, 3], [1, 2, 3, 4], 0, 1, id="first-mismatch"),
        pytest.param([1, 0, 3], [1, 2, 3, 4], 1, 2, id="mid-mismatch"),
        pytest.param([1, 2, 0], [1, 2, 3, 4], 2, 3, id="last-mismatch"),
        pytest.param([5, 5, 5], [1, 2, 3, 4], 0, 1, id="all-wrong"),
        pytest.param([1, 2, 2], [1, 0, 2, 4], 1, 0, id="later-positions-would-match"),
        pytest.param([], [3], 0, 3, id="empty-draft"),
    ],
)
def test_greedy_table(draft, target_argmax, accepted, next_token):
    k = len(draft)
    draft_tokens = torch.tensor([draft], dtype=torch.long).reshape(1, k)
    target = _greedy_target(target_argmax).unsqueeze(0)  # [1, k+1, V]
    acc, nxt = rejection_sample(draft_tokens, None, target, None, greedy=True)
    assert acc.tolist() == [accepted]
    assert nxt.tolist() == [next_token]
    assert acc.dtype == torch.long and nxt.dtype == torch.long


def test_greedy_with_one_hot_probabilities_from_warp():
    logits = torch.randn(2, 4, 7, generator=_gen(1))
    target = warp(logits, SamplingParams())  # one-hot [2, 4, 7]
    argmax = logits.argmax(-1)
    draft = argmax[:, :3].clone()
    draft[1, 1] = (draft[1, 1] + 1) % 7
    acc, nxt = rejection_sample(draft, None, target, None, greedy=True)
    assert acc.tolist() == [3, 1]
    assert nxt.tolist() == [int(argmax[0, 3]), int(argmax[1, 1])]


def test_greedy_batch_mixed_outcomes_ignores_draft_probs():
    target = torch.stack(
        [
            _greedy_target([1, 2, 3]),  # matches fully
            _greedy_target([4, 4, 0]),  # first mismatch
            _greedy_target([0, 5, 2]),  # second mismatch
        ]
    )
    draft = torch.tensor([[1, 2], [3, 4], [0, 1]])
    junk = torch.full((3, 2, 6), float("nan"))  # ignored when greedy
    acc, nxt = rejection_sample(draft, junk, target, None, greedy=True)
    assert acc.tolist() == [2, 0, 1]
    assert nxt.tolist() == [3, 4, 5]


def test_greedy_empty_draft_batch():
    target = torch.stack([_greedy_target([2]), _greedy_target([5])])
    acc, nxt = rejection_sample(torch.zeros(2, 0, dtype=torch.long), None, target, None, True)
    assert acc.tolist() == [0, 0]
    assert nxt.tolist() == [2, 5]


# --------------------------------------------------------------------------------------
# rejection_sample: sampled table cases (outcomes forced by the distributions)
# --------------------------------------------------------------------------------------


def _sampled(draft, draft_probs, target_probs, seed):
    return rejection_sample(
        torch.tensor(draft, dtype=torch.long),
        _t(draft_probs),
        _t(target_probs),
        _gen(seed),
        greedy=False,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_perfect_match_takes_bonus_from_last_row(seed):
    # p(d) >= q(d) at every position forces acceptance; the last target row is one-hot.
    draft_probs = [[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.9, 0.1]]]
    target_probs = [
        [[0.1, 0.9, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.9, 0.1], _one_hot(0, 4)]
    ]
    acc, nxt = _sampled([[1, 3, 2]], draft_probs, target_probs, seed)
    assert acc.tolist() == [3]
    assert nxt.tolist() == [0]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_bonus_is_drawn_from_last_target_row(seed):
    # All accepted; the bonus row has two tokens, so the bonus must be one of them.
    target_probs = [[[0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5]]]
    draft_probs = [[[0.0, 1.0, 0.0, 0.0]]]
    acc, nxt = _sampled([[1]], draft_probs, target_probs, seed)
    assert acc.tolist() == [1]
    assert nxt.item() in (1, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_early_mismatch_recovers_from_residual(seed):
    # p(d0) = 0 forces rejection of the first token; the residual max(0, p - q) has a single
    # positive entry (token 2), which forces the recovered token. Later positions would
    # accept, but nothing after the first rejection counts.
    draft_probs = [[[0.6, 0.4, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]]
    target_probs = [[[0.0, 0.4, 0.6, 0.0], [0.0, 1.0, 0.0, 0.0], _one_hot(3, 4)]]
    acc, nxt = _sampled([[0, 1]], draft_probs, target_probs, seed)
    assert acc.tolist() == [0]
    assert nxt.tolist() == [2]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_recovered_token_has_p_greater_than_q(seed):
    # Rejection forced (p(d) = 0); the residual has two positive entries (tokens 1 and 3),
    # and the recovered token must be one of them, never a token with p <= q.
    q = [0.5, 0.1, 0.3, 0.1]
    p = [0.0, 0.5, 0.1, 0.4]
    acc, nxt = _sampled([[0]], [[q]], [[p, _one_hot(2, 4)]], seed)
    assert acc.tolist() == [0]
    assert nxt.item() in (1, 3)
    assert p[nxt.item()] > q[nxt.item()]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_mismatch_at_later_position(seed):
    # Position 0 accepted (p >= q), position 1 rejected (p = 0), residual forces token 0.
    draft_probs = [[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]
    target_probs = [[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [1.0, 0.0, 0.0], _one_hot(2, 3)]]
    # residual at position 1: max(0, [0.5, 0, 0.5] - [0.5, 0.5, 0]) = [0, 0, 0.5] -> token 2
    acc, nxt = _sampled([[1, 1, 0]], draft_probs, target_probs, seed)
    assert acc.tolist() == [1]
    assert nxt.tolist() == [2]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_all_rejected(seed):
    # Every draft token has p = 0: the first one is rejected, the rest never count.
    draft_probs = [[_one_hot(0, 3), _one_hot(0, 3), _one_hot(0, 3)]]
    target_probs = [[_one_hot(1, 3), _one_hot(2, 3), _one_hot(1, 3), _one_hot(2, 3)]]
    acc, nxt = _sampled([[0, 0, 0]], draft_probs, target_probs, seed)
    assert acc.tolist() == [0]
    assert nxt.tolist() == [1]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_draft_token_with_zero_draft_probability_is_rejected(seed):
    # q(d) = 0 means d cannot have come from q: rejected even though p(d) = 1. The residual
    # max(0, p - q) = [1, 0, 0, 0] then forces the recovered token 0.
    q = [0.0, 0.0, 0.5, 0.5]
    p = [1.0, 0.0, 0.0, 0.0]
    acc, nxt = _sampled([[0]], [[q]], [[p, _one_hot(3, 4)]], seed)
    assert acc.tolist() == [0]
    assert nxt.tolist() == [0]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_zero_draft_probability_rejected_among_other_positions(seed):
    # First position fine (p >= q), second has q(d) = 0 while p(d) > 0: rejected.
    draft_probs = [[[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]]]
    target_probs = [[[1.0, 0.0, 0.0], [0.6, 0.0, 0.4], _one_hot(1, 3)]]
    # residual at position 1: max(0, [0.6, 0, 0.4] - [0, 0.5, 0.5]) = [0.6, 0, 0] -> token 0
    acc, nxt = _sampled([[0, 0]], draft_probs, target_probs, seed)
    assert acc.tolist() == [1]
    assert nxt.tolist() == [0]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_p_equals_q_everywhere_accepts_all(seed):
    dist = torch.softmax(torch.randn(3, 9, generator=_gen(100 + seed)), dim=-1)  # [k, V]
    bonus = torch.tensor(_one_hot(7, 9))
    target = torch.cat([dist, bonus[None]]).unsqueeze(0)  # [1, k+1, V]
    draft = sample_from(dist, _gen(200 + seed)).unsqueeze(0)  # [1, k]
    acc, nxt = rejection_sample(draft, dist.unsqueeze(0), target, _gen(seed), greedy=False)
    assert acc.tolist() == [3]
    assert nxt.tolist() == [7]


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_rejection_with_empty_residual_falls_back_to_target_row(seed):
    # Unnormalised inputs (rounding taken to the extreme): p(d) = 0 forces rejection but
    # max(0, p - q) is all zero. The rule must still return a token from the target row.
    q = [0.5, 0.6, 0.4]
    p = [0.0, 0.6, 0.4]
    acc, nxt = _sampled([[0]], [[q]], [[p, _one_hot(0, 3)]], seed)
    assert acc.tolist() == [0]
    assert nxt.item() in (1, 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_empty_draft_samples_target_row_zero(seed):
    target = _t([[[0.0, 0.0, 1.0, 0.0]], [[0.0, 0.5, 0.0, 0.5]]])  # [2, 1, 4]
    draft_probs = torch.zeros(2, 0, 4)
    acc, nxt = rejection_sample(
        torch.zeros(2, 0, dtype=torch.long), draft_probs, target, _gen(seed), greedy=False
    )
    assert acc.tolist() == [0, 0]
    assert nxt[0].item() == 2
    assert nxt[1].item() in (1, 3)


def test_sampled_empty_draft_distribution():
    # k = 0 is plain sampling from the target's first row.
    n = 20000
    row = torch.tensor([0.1, 0.0, 0.6, 0.3])
    target = row.expand(n, 1, 4).contiguous()
    acc, nxt = rejection_sample(
        torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0, 4), target, _gen(3), False
    )
    assert (acc == 0).all()
    freq = torch.bincount(nxt, minlength=4).float() / n
    tol = 4.5 * torch.sqrt(row * (1 - row) / n)
    assert ((freq - row).abs() <= tol).all(), freq
    assert freq[1] == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_sampled_batch_with_different_outcomes(seed):
    v = 4
    draft = torch.tensor(
        [
            [0, 1, 2],  # all accepted (p >= q), bonus forced to 3
            [0, 1, 2],  # first rejected (p = 0), residual forces 3
            [0, 1, 2],  # second rejected, residual forces 0
            [0, 1, 2],  # third rejected, residual forces 1
            [2, 2, 2],  # q(d) = 0 at position 0: rejected, residual forces 2
        ]
    )
    q_accept = [_one_hot(0, v), _one_hot(1, v), _one_hot(2, v)]
    draft_probs = _t(
        [
            q_accept,
            [[0.5, 0.0, 0.0, 0.5], _one_hot(1, v), _one_hot(2, v)],
            [_one_hot(0, v), [0.0, 0.5, 0.5, 0.0], _one_hot(2, v)],
            [_one_hot(0, v), _one_hot(1, v), [0.0, 0.0, 0.3, 0.7]],
            [_one_hot(0, v), _one_hot(0, v), _one_hot(0, v)],
        ]
    )
    target_probs = _t(
        [
            [*q_accept, _one_hot(3, v)],
            [[0.0, 0.0, 0.0, 1.0], _one_hot(1, v), _one_hot(2, v), _one_hot(0, v)],
            [_one_hot(0, v), [1.0, 0.0, 0.0, 0.0], _one_hot(2, v), _one_hot(3, v)],
            [_one_hot(0, v), _one_hot(1, v), [0.0, 0.3, 0.0, 0.7], _one_hot(3, v)],
            [_one_hot(2, v), _one_hot(2, v), _one_hot(2, v), _one_hot(1, v)],
        ]
    )
    acc, nxt = rejection_sample(draft, draft_probs, target_probs, _gen(seed), greedy=False)
    assert acc.tolist() == [3, 0, 1, 2, 0]
    assert nxt.tolist() == [3, 3, 0, 1, 2]


def test_sampled_acceptance_rate_and_residual_distribution():
    # One position, p(d)/q(d) = 0.5: accepted with probability 0.5, and the recovered
    # token follows norm(max(0, p - q)) = [0.75, 0.25, 0, 0].
    n = 40000
    q = torch.tensor([0.2, 0.2, 0.6, 0.0])
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draft = torch.full((n, 1), 2, dtype=torch.long)
    target = torch.stack([p, torch.tensor(_one_hot(3, 4))]).expand(n, 2, 4).contiguous()
    acc, nxt = rejection_sample(draft, q.expand(n, 1, 4).contiguous(), target, _gen(9), False)
    rate = acc.float().mean().item()
    assert abs(rate - 1 / 3) <= 4.5 * math.sqrt((1 / 3) * (2 / 3) / n)
    assert (nxt[acc == 1] == 3).all()  # bonus row is one-hot
    rec = nxt[acc == 0]
    assert set(rec.unique().tolist()) <= {0, 1}
    share0 = (rec == 0).float().mean().item()
    assert abs(share0 - 0.75) <= 4.5 * math.sqrt(0.75 * 0.25 / rec.numel())


def test_sampled_same_generator_seed_same_result():
    probs = torch.softmax(torch.randn(64, 4, 11, generator=_gen(5)), -1)
    draft_probs = probs[:, :3].flip(-1).contiguous()
    draft = sample_from(draft_probs, _gen(6))
    a = rejection_sample(draft, draft_probs, probs, _gen(7), False)
    b = rejection_sample(draft, draft_probs, probs, _gen(7), False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rejection_sample_rejects_bad_shapes():
    with pytest.raises(AssertionError):
        rejection_sample(
            torch.zeros(2, 3, dtype=torch.long), None, torch.zeros(2, 3, 5), None, True
        )
    with pytest.raises(AssertionError):
        rejection_sample(
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2, 2, 5),
            torch.zeros(2, 4, 5),
            None,
            False,
        )


# --------------------------------------------------------------------------------------
# warp and SamplingParams
# --------------------------------------------------------------------------------------


def test_warp_greedy_is_one_hot_of_argmax():
    logits = torch.randn(3, 5, 17, generator=_gen(11)).half()
    probs = warp(logits, SamplingParams(temperature=0.0, top_p=0.5, top_k=3))
    assert probs.dtype == torch.float32 and probs.shape == (3, 5, 17)
    expected = torch.nn.functional.one_hot(logits.float().argmax(-1), 17).float()
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_warp_temperature_is_scaled_softmax(temperature):
    logits = torch.randn(4, 50, generator=_gen(12)) * 3
    probs = warp(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


@pytest.mark.parametrize("top_k", [1, 2, 7, 49])
def test_warp_top_k_keeps_exactly_k_largest(top_k):
    logits = torch.randn(6, 50, generator=_gen(13))
    probs = warp(logits, SamplingParams(temperature=0.7, top_k=top_k))
    nonzero = probs > 0
    assert (nonzero.sum(-1) == top_k).all()
    top_idx = logits.topk(top_k, dim=-1).indices
    assert nonzero.gather(-1, top_idx).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    # Kept entries are the renormalised softmax of the kept logits.
    kept = torch.softmax(logits.gather(-1, top_idx) / 0.7, -1)
    torch.testing.assert_close(probs.gather(-1, top_idx), kept)


@pytest.mark.parametrize("top_k", [50, 51, MAX_TOP_K])
def test_warp_top_k_at_or_above_vocab_is_no_filter(top_k):
    logits = torch.randn(2, 50, generator=_gen(14))
    torch.testing.assert_close(
        warp(logits, SamplingParams(temperature=1.0, top_k=top_k)), torch.softmax(logits, -1)
    )


def test_warp_top_p_keeps_smallest_nucleus():
    logits = torch.randn(8, 40, generator=_gen(15)) * 2
    top_p = 0.8
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=top_p))
    full = torch.softmax(logits, -1)
    kept = probs > 0
    # The kept set covers at least top_p of the mass, and dropping its least likely member
    # would not: it is the smallest such "head" of the sorted distribution.
    kept_mass = (full * kept).sum(-1)
    assert (kept_mass >= top_p - 1e-6).all()
    smallest_kept = torch.where(kept, full, torch.full_like(full, 2.0)).min(-1).values
    assert (kept_mass - smallest_kept < top_p + 1e-6).all()
    # Every kept token is more likely than every dropped one.
    largest_dropped = torch.where(kept, torch.zeros_like(full), full).max(-1).values
    assert (smallest_kept > largest_dropped).all()


def test_warp_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def _transformers_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, logits.clone())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 0.9),
        (0.7, 0, 0.5),
        (1.3, 0, 0.95),
        (1.0, 10, 1.0),
        (0.5, 5, 1.0),
        (0.8, 20, 0.7),
        (1.5, 3, 0.3),
        (1.0, 64, 0.99),
        (0.9, 100, 0.6),  # top_k above vocab
        (2.0, 1, 0.5),
        (1.0, 0, 0.01),
    ],
)
@pytest.mark.parametrize("kind", ["normal", "peaked", "ties"])
def test_warp_matches_transformers_warpers(temperature, top_k, top_p, kind):
    pytest.importorskip("transformers")
    g = _gen(zlib.crc32(repr((temperature, top_k, top_p, kind)).encode()))
    if kind == "normal":
        logits = torch.randn(16, 64, generator=g)
    elif kind == "peaked":
        logits = torch.randn(16, 64, generator=g) * 6
    else:  # many exact ties: exercises top-k/top-p tie handling
        logits = torch.randint(-3, 4, (16, 64), generator=g).float()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp(logits, params)
    theirs = _transformers_warp(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.05),
        (0.7, 0, 0.9, 0.1),
        (1.3, 20, 1.0, 0.3),
        (1.0, 0, 1.0, 1.0),  # the most likely token(s) only
    ],
)
@pytest.mark.parametrize("kind", ["normal", "peaked", "ties"])
def test_warp_min_p_matches_transformers(temperature, top_k, top_p, min_p, kind):
    from transformers import MinPLogitsWarper

    g = _gen(zlib.crc32(repr((temperature, top_k, top_p, min_p, kind)).encode()))
    logits = torch.randn(16, 64, generator=g) * (6 if kind == "peaked" else 1)
    if kind == "ties":
        logits = torch.randint(-3, 4, (16, 64), generator=g).float()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    without = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    scores = _transformers_warp(logits, without).log()
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    theirs = MinPLogitsWarper(min_p)(input_ids, scores).softmax(-1)
    ours = warp(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.equal(warp(logits, SamplingParams(min_p=0.5)), warp(logits, SamplingParams()))


def test_sampling_params_defaults_and_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.1).greedy
    SamplingParams(temperature=2.0, top_p=1.0, top_k=MAX_TOP_K, seed=(1 << 64) - 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -1e-12}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": MAX_TOP_K + 1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-6])
def test_warp_tiny_positive_temperature_gives_a_distribution(temperature):
    logits = torch.tensor([1.0, 20.0, 3.0])
    probs = warp(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0]))


# --------------------------------------------------------------------------------------
# Encoding of draft distributions
# --------------------------------------------------------------------------------------


def test_encode_sparse_when_top_k_makes_it_sparse():
    vocab = 1000
    probs = warp(torch.randn(vocab, generator=_gen(21)), SamplingParams(temperature=1.0, top_k=10))
    enc = encode_probs(probs)
    assert enc.is_sparse and enc.dense is None
    assert enc.token_ids.dtype == torch.int32 and enc.probs.dtype == torch.float32
    assert enc.token_ids.numel() == 10
    assert torch.equal(enc.token_ids.long(), torch.nonzero(probs > 0).flatten())
    assert torch.equal(enc.probs, probs[enc.token_ids.long()])  # fp32 exactly
    dec = decode_probs(enc, vocab)
    torch.testing.assert_close(dec, probs, rtol=1e-6, atol=1e-7)


def test_encode_dense_fp16_when_not_sparse():
    vocab = 1000
    probs = warp(torch.randn(vocab, generator=_gen(22)), SamplingParams(temperature=1.0))
    enc = encode_probs(probs)
    assert not enc.is_sparse
    assert enc.token_ids is None and enc.probs is None
    assert enc.dense.dtype == torch.float16 and enc.dense.shape == (vocab,)


@pytest.mark.parametrize(("nonzero", "sparse"), [(1, True), (24, True), (25, False), (100, False)])
def test_encode_chooses_the_smaller_form(nonzero, sparse):
    # sparse costs 8 bytes per entry, dense 2 per vocab entry: sparse iff 8 n < 2 V.
    vocab = 100
    probs = torch.zeros(vocab)
    probs[torch.randperm(vocab, generator=_gen(nonzero))[:nonzero]] = 1.0 / nonzero
    assert encode_probs(probs).is_sparse is sparse


def test_encode_greedy_one_hot_is_sparse():
    probs = warp(torch.randn(5, generator=_gen(23)), SamplingParams())
    enc = encode_probs(probs)
    assert enc.is_sparse and enc.token_ids.numel() == 1
    assert torch.equal(decode_probs(enc, 5), probs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0, top_k=400),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=2.0, top_p=0.3, top_k=100),
        SamplingParams(),
    ],
)
@pytest.mark.parametrize("vocab", [7, 1000, 32000])
def test_round_trip_within_fp16_tolerance(params, vocab):
    probs = warp(torch.randn(vocab, generator=_gen(vocab)) * 3, params)
    enc, dec = round_trip(probs)
    assert dec.dtype == torch.float32 and dec.shape == probs.shape
    assert torch.equal(dec, decode_probs(enc, vocab))
    torch.testing.assert_close(dec.sum(), torch.tensor(1.0), rtol=0, atol=1e-5)
    # fp16: relative error 2^-11 per entry, plus subnormal resolution; renormalisation
    # adds at most the total relative error.
    torch.testing.assert_close(dec, probs, rtol=2e-3, atol=1e-7)
    assert (dec >= 0).all()
    # Zeros stay zeros: the support never grows.
    assert not (dec[probs == 0] > 0).any()


def test_decode_accepts_bf16_dense():
    probs = torch.softmax(torch.randn(64, generator=_gen(24)), -1)
    dec = decode_probs(EncodedProbs(dense=probs.to(torch.bfloat16)), 64)
    torch.testing.assert_close(dec.sum(), torch.tensor(1.0))
    torch.testing.assert_close(dec, probs, rtol=1e-2, atol=1e-6)


def test_decode_renormalises_small_mass_error():
    enc = EncodedProbs(token_ids=torch.tensor([1, 3], dtype=torch.int32), probs=_t([0.3, 0.695]))
    dec = decode_probs(enc, 4)
    torch.testing.assert_close(dec.sum(), torch.tensor(1.0))
    torch.testing.assert_close(dec, _t([0.0, 0.3, 0.0, 0.695]) / 0.995)


def _sparse(ids, probs) -> EncodedProbs:
    return EncodedProbs(token_ids=torch.tensor(ids, dtype=torch.int32), probs=_t(probs))


@pytest.mark.parametrize(
    ("enc", "match"),
    [
        pytest.param(_sparse([0, 10], [0.5, 0.5]), "outside", id="id-too-large"),
        pytest.param(_sparse([0, 9999], [0.5, 0.5]), "outside", id="id-far-too-large"),
        pytest.param(_sparse([-1, 2], [0.5, 0.5]), "outside", id="negative-id"),
        pytest.param(_sparse([3, 3], [0.5, 0.5]), "repeats", id="duplicate-ids"),
        pytest.param(_sparse([1, 2, 3], [0.5, 0.5]), "ids but", id="more-ids"),
        pytest.param(_sparse([1], [0.5, 0.5]), "ids but", id="more-probs"),
        pytest.param(_sparse([], []), "empty", id="empty-sparse"),
        pytest.param(_sparse([1, 2], [1.5, -0.5]), "negative", id="sparse-negative"),
        pytest.param(_sparse([1, 2], [float("nan"), 1.0]), "non-finite", id="sparse-nan"),
        pytest.param(_sparse([1, 2], [float("inf"), 1.0]), "non-finite", id="sparse-inf"),
        pytest.param(_sparse([1, 2], [0.5, 0.3]), "sums to", id="sparse-mass-low"),
        pytest.param(_sparse([1, 2], [0.8, 0.8]), "sums to", id="sparse-mass-high"),
        pytest.param(EncodedProbs(dense=torch.full((9,), 0.1).half()), "entries", id="dense-short"),
        pytest.param(EncodedProbs(dense=torch.full((11,), 0.1).half()), "entries", id="dense-long"),
        pytest.param(
            EncodedProbs(dense=_t([0.5, 0.7, -0.2, 0, 0, 0, 0, 0, 0, 0]).half()),
            "negative",
            id="dense-negative",
        ),
        pytest.param(
            EncodedProbs(dense=_t([float("nan"), 1, 0, 0, 0, 0, 0, 0, 0, 0]).half()),
            "non-finite",
            id="dense-nan",
        ),
        pytest.param(EncodedProbs(dense=torch.zeros(10).half()), "sums to", id="dense-all-zero"),
        pytest.param(
            EncodedProbs(dense=torch.full((10,), 0.2).half()), "sums to", id="dense-mass-2"
        ),
        pytest.param(
            EncodedProbs(dense=torch.full((10,), 0.098).half()), "sums to", id="dense-mass-0.98"
        ),
    ],
)
def test_decode_rejects_malformed(enc, match):
    with pytest.raises(InvalidDistribution, match=match):
        decode_probs(enc, 10)


def test_invalid_distribution_is_a_value_error():
    assert issubclass(InvalidDistribution, ValueError)


# --------------------------------------------------------------------------------------
# make_generator
# --------------------------------------------------------------------------------------


def _draws(gen: torch.Generator) -> torch.Tensor:
    return torch.rand(16, generator=gen)


def test_make_generator_reproducible():
    a = _draws(make_generator(1234, "draft", 7))
    b = _draws(make_generator(1234, "draft", 7))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "other",
    [(1234, "verify", 7), (1234, "draft", 8), (1235, "draft", 7), (0, "draft", 7)],
)
def test_make_generator_streams_differ(other):
    base = _draws(make_generator(1234, "draft", 7))
    assert not torch.equal(base, _draws(make_generator(*other)))


def test_make_generator_ambiguous_looking_keys_differ():
    # "s:ab:1" must not collide across (salt, position) splits.
    a = _draws(make_generator(1, "a:1", 2))
    b = _draws(make_generator(1, "a", 12))
    c = _draws(make_generator(11, "a", 2))
    assert not torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(b, c)


def test_make_generator_unseeded_streams_differ():
    draws = [_draws(make_generator(None, "draft", 0)) for _ in range(3)]
    assert not torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[1], draws[2])


def test_make_generator_large_seed():
    a = _draws(make_generator((1 << 64) - 1, "draft", 0))
    assert torch.equal(a, _draws(make_generator((1 << 64) - 1, "draft", 0)))


# --------------------------------------------------------------------------------------
# Statistical test: speculative sampling reproduces the target distribution
# --------------------------------------------------------------------------------------

VOCAB = 5
N_TOKENS = 3  # the first 3 generated tokens: a joint of VOCAB**3 = 125 cells
N_SAMPLES = 80_000
START = 0
Z_CELL = 5.0  # per-cell bound in standard deviations (~1e-4 false failures per run)
Z_CHI2 = 5.0  # chi-square bound: upper 5-sigma quantile (Wilson-Hilferty)
# k = 3 exercises chains of accepted tokens; with a window of 3 tokens a bonus token (the
# 4th token of an all-accepted round) never lands in the window, so k = 2 covers the bonus.
KS = (3, 2, 1)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # Tiny tensors: intra-op threads only add overhead (10x on a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _markov_logits(seed: int) -> torch.Tensor:
    # Scale 0.7 keeps every joint cell's expected count >= 10 (asserted below).
    return torch.randn(VOCAB, VOCAB, generator=_gen(seed)) * 0.7  # [V, V] row = last token


def _verify_exact(draft_tokens, draft_probs, target_probs, generator):
    return rejection_sample(draft_tokens, draft_probs, target_probs, generator, greedy=False)


def _verify_always_accept(draft_tokens, draft_probs, target_probs, generator):
    """Wrong: accept every draft token and take the bonus; output follows the draft."""
    batch, k = draft_tokens.shape
    return torch.full((batch,), k, dtype=torch.long), sample_from(target_probs[:, k], generator)


def _verify_recover_from_target(draft_tokens, draft_probs, target_probs, generator):
    """Wrong: the right acceptance test, but recover from p instead of norm(max(0, p - q))."""
    batch, k = draft_tokens.shape
    p_d = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_d = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    rejected = ~(torch.rand(batch, k, generator=generator) * q_d < p_d)  # [B, k]
    accepted = torch.where(
        rejected.any(-1), rejected.float().argmax(-1).long(), torch.full((batch,), k)
    )
    return accepted, sample_from(target_probs[torch.arange(batch), accepted], generator)


def _verify_off_by_one_bonus(draft_tokens, draft_probs, target_probs, generator):
    """Wrong: correct rule except the bonus is drawn from row k-1 instead of row k."""
    accepted, nxt = rejection_sample(draft_tokens, draft_probs, target_probs, generator, False)
    k = draft_tokens.shape[1]
    bonus = sample_from(target_probs[:, k - 1], generator)
    return accepted, torch.where(accepted == k, bonus, nxt)


def _speculate(target, draft, verify, k: int, n: int, seed: int) -> torch.Tensor:
    """Run speculation rounds for n independent sequences at once.

    target, draft: [V, V] Markov matrices p(next | last), q(next | last) (rows sum to 1).
    Each round drafts k tokens per row from q, verifies the whole batch with one call of
    `verify`, and appends the accepted tokens plus the next token. Rounds repeat until every
    row has N_TOKENS tokens. Returns the first N_TOKENS generated tokens: [n, N_TOKENS].
    """
    out = torch.full((n, N_TOKENS + k + 1), -1, dtype=torch.long)  # [n, T + k + 1]
    lengths = torch.zeros(n, dtype=torch.long)  # [n]
    last = torch.full((n,), START, dtype=torch.long)  # [n]
    rows = torch.arange(n)
    steps = torch.arange(k + 1)
    round_no = 0
    while int(lengths.min()) < N_TOKENS:
        draft_gen = make_generator(seed, "draft", round_no)
        verify_gen = make_generator(seed, "verify", round_no)
        tokens, dists = [], []
        cur = last
        for _ in range(k):
            q = draft[cur]  # [n, V]
            cur = sample_from(q, draft_gen)  # [n]
            tokens.append(cur)
            dists.append(q)
        draft_tokens = torch.stack(tokens, dim=1)  # [n, k]
        draft_probs = torch.stack(dists, dim=1)  # [n, k, V]
        contexts = torch.cat([last[:, None], draft_tokens], dim=1)  # [n, k+1]
        target_probs = target[contexts]  # [n, k+1, V]: p(. | prefix) at each position
        accepted, next_token = verify(draft_tokens, draft_probs, target_probs, verify_gen)
        new = torch.cat([draft_tokens, torch.zeros(n, 1, dtype=torch.long)], dim=1)  # [n, k+1]
        new[rows, accepted] = next_token
        keep = steps[None, :] <= accepted[:, None]  # [n, k+1]
        pos = lengths[:, None] + steps[None, :]  # [n, k+1]
        keep &= pos < out.shape[1]
        out[rows[:, None].expand_as(pos)[keep], pos[keep]] = new[keep]
        lengths += accepted + 1
        last = next_token
        round_no += 1
    assert round_no <= N_TOKENS  # every round yields at least one token
    return out[:, :N_TOKENS]


def _exact_joint(target) -> torch.Tensor:
    """P(x1, x2, x3) = p(x1|START) p(x2|x1) p(x3|x2): [V, V, V] in float64."""
    t = target.double()
    return t[START][:, None, None] * t[:, :, None] * t[None, :, :]


def _check(counts: torch.Tensor, exact: torch.Tensor) -> list[str]:
    """Failures of the empirical joint (counts [V, V, V]) against the exact joint.

    Per cell (joint and per-position marginals): |emp - exact| <= Z_CELL * sd + 2 / N for
    cells with exact > 0, and exactly zero count where exact == 0. Plus a chi-square bound
    and a total-variation bound over the joint.
    """
    n = int(counts.sum())
    emp = counts.double() / n
    failures = []

    def cells(name, e, x):
        sd = torch.sqrt(x * (1 - x) / n)
        tol = torch.where(x > 0, Z_CELL * sd + 2.0 / n, torch.zeros_like(x))
        for idx in ((e - x).abs() > tol).nonzero().tolist():
            i = tuple(idx)
            failures.append(f"{name}{i}: empirical {float(e[i]):.5f} vs exact {float(x[i]):.5f}")

    cells("joint", emp, exact)
    for axis in range(N_TOKENS):
        others = tuple(a for a in range(N_TOKENS) if a != axis)
        cells(f"marginal[{axis}]", emp.sum(others), exact.sum(others))

    positive = exact > 0
    expected = n * exact[positive]
    chi2 = float(((counts.double()[positive] - expected) ** 2 / expected).sum())
    df = int(positive.sum()) - 1
    a = 2.0 / (9 * df)
    chi2_bound = df * (1 - a + Z_CHI2 * math.sqrt(a)) ** 3
    if chi2 > chi2_bound:
        failures.append(f"chi-square {chi2:.1f} > {chi2_bound:.1f} (df {df})")

    tv = 0.5 * float((emp - exact).abs().sum())
    # E[TV] <= 0.5 * sum(sd); TV moves by <= 1/n per sample, so by McDiarmid
    # P(TV > E[TV] + t) <= exp(-2 n t^2) = 1e-9 for the t below.
    tv_bound = 0.5 * float(torch.sqrt(exact * (1 - exact) / n).sum()) + math.sqrt(
        math.log(1e9) / (2 * n)
    )
    if tv > tv_bound:
        failures.append(f"total variation {tv:.4f} > {tv_bound:.4f}")
    return failures


def _counts(tokens: torch.Tensor) -> torch.Tensor:
    flat = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    return torch.bincount(flat, minlength=VOCAB**3).reshape(VOCAB, VOCAB, VOCAB)


def _round_tripped(probs: torch.Tensor) -> torch.Tensor:
    """A distribution as the verifier receives it, decode(encode(row)) per row: fp16 when
    dense, exact when sparse (the drafter samples from what travels)."""
    return torch.stack([round_trip(row)[1] for row in probs])


SETTINGS = ("dense", "sparse-draft", "sparse-both")


@functools.cache
def _setting(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(target [V, V], draft [V, V]) Markov matrices, both warped, draft round-tripped."""
    target_logits = _markov_logits(1)
    draft_logits = _markov_logits(2)
    sampled = SamplingParams(temperature=1.0)
    if name == "dense":
        target = warp(target_logits, sampled)
        draft = warp(draft_logits, sampled)
    elif name == "sparse-draft":  # draft has zeros where the target has mass
        target = warp(target_logits, sampled)
        draft = warp(draft_logits, SamplingParams(temperature=0.8, top_k=2))
    elif name == "sparse-both":  # target zeros too: those tokens must never appear
        target = warp(target_logits, SamplingParams(temperature=1.2, top_k=4, top_p=0.9))
        draft = warp(draft_logits, SamplingParams(temperature=0.8, top_k=3, top_p=0.8))
    else:
        raise AssertionError(name)
    return target, _round_tripped(draft)


@pytest.mark.parametrize("name", SETTINGS)
def test_settings_are_meaningful(name):
    target, draft = _setting(name)
    torch.testing.assert_close(target.sum(-1), torch.ones(VOCAB))
    torch.testing.assert_close(draft.sum(-1), torch.ones(VOCAB))
    # The draft is clearly different from the target in every row.
    tv_rows = 0.5 * (target - draft).abs().sum(-1)
    assert (tv_rows > 0.2).all(), tv_rows
    if name != "dense":
        assert (draft == 0).any(-1).all()  # every draft row is sparse
        assert ((draft == 0) & (target > 0)).any()  # residual must cover tokens q never drafts
    if name == "sparse-both":
        assert (target == 0).any()
    # Chi-square and normal per-cell bounds are sound: every expected count is >= 10.
    exact = _exact_joint(target)
    assert float(exact[exact > 0].min()) * N_SAMPLES >= 10


def test_harness_power():
    """With N_SAMPLES, a bias of 0.02 in any single token's probability (per-position marginal)
    lies more than 5 sd beyond the per-cell tolerance, so it fails with certainty."""
    worst_sd = math.sqrt(0.25 / N_SAMPLES)
    worst_tol = Z_CELL * worst_sd + 2.0 / N_SAMPLES
    assert 0.02 - 5 * worst_sd > worst_tol


def test_check_detects_a_bias_of_002_in_any_token():
    """Negative control of the check itself: sample the joint with one token's marginal
    probability moved by 0.02 (at one position) and require a failure, for every token,
    position and sign. The unbiased joint passes."""
    target, _ = _setting("dense")
    exact = _exact_joint(target)
    gen = _gen(77)
    checked = 0
    for axis in range(N_TOKENS):
        for token in range(VOCAB):
            for sign in (+1, -1):
                mask = torch.zeros_like(exact, dtype=torch.bool)
                index = [slice(None)] * N_TOKENS
                index[axis] = token
                mask[tuple(index)] = True
                m = float(exact[mask].sum())
                new_m = m + sign * 0.02
                if not 0 < new_m < 1:
                    continue
                biased = torch.where(mask, exact * new_m / m, exact * (1 - new_m) / (1 - m))
                draws = torch.multinomial(biased.flatten().float(), N_SAMPLES, True, generator=gen)
                counts = torch.bincount(draws, minlength=VOCAB**3).reshape(exact.shape)
                assert _check(counts, exact), (axis, token, sign)
                checked += 1
    assert checked >= 2 * N_TOKENS * VOCAB - 2
    draws = torch.multinomial(exact.flatten().float(), N_SAMPLES, True, generator=gen)
    assert _check(torch.bincount(draws, minlength=VOCAB**3).reshape(exact.shape), exact) == []


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", SETTINGS)
def test_speculative_sampling_matches_target_distribution(name, k):
    target, draft = _setting(name)
    tokens = _speculate(target, draft, _verify_exact, k, N_SAMPLES, seed=2024 + k)
    assert (tokens >= 0).all()
    failures = _check(_counts(tokens), _exact_joint(target))
    assert failures == [], f"{name}, k={k}: " + "; ".join(failures[:10])


@pytest.mark.parametrize(
    ("wrong_rule", "name", "k"),
    [
        (_verify_always_accept, "dense", 3),
        (_verify_always_accept, "sparse-both", 3),
        (_verify_recover_from_target, "dense", 3),
        (_verify_recover_from_target, "sparse-draft", 3),
        (_verify_off_by_one_bonus, "dense", 2),
    ],
)
def test_negative_control_wrong_rule_fails_the_check(wrong_rule, name, k):
    target, draft = _setting(name)
    tokens = _speculate(target, draft, wrong_rule, k, N_SAMPLES, seed=2024 + k)
    failures = _check(_counts(tokens), _exact_joint(target))
    assert failures, f"{wrong_rule.__name__} passed the check on {name}, k={k}"


def test_negative_control_draft_alone_fails_the_check():
    """Sampling from the draft model alone (no verification) fails the check too."""
    target, draft = _setting("dense")
    tokens = _speculate(draft, draft, _verify_exact, 3, N_SAMPLES, seed=5)
    assert _check(_counts(tokens), _exact_joint(target))


def test_greedy_verdict_is_rejection_sample_greedy():
    """The host-side rule the verifier applies under greedy decoding gives what the
    batched rule gives, on random drafts and targets (ties included: argmax's first)."""
    from specdec.replica.sampling import greedy_verdict

    gen = torch.Generator().manual_seed(4)
    for k in range(0, 6):
        for _ in range(50):
            logits = torch.randint(0, 3, (1, k + 1, 5), generator=gen).float()  # many ties
            drafts = torch.randint(0, 5, (1, k), generator=gen)
            accepted, nxt = rejection_sample(drafts, None, logits, None, True)
            choices = logits[0].argmax(dim=-1).tolist()
            assert greedy_verdict(drafts[0].tolist(), choices) == (int(accepted), int(nxt))


def test_sampled_model_draft_then_one_hot_extension_in_one_call():
    """A hybrid round: the drafter's token d1 ~ q1 (dense q), then a lookup's extension e
    with one-hot q, verified together. The first token follows p1; where d1 was accepted
    the second follows p2: e with probability p2(e), else the residual, p2 without e."""
    n = 60000
    q1 = torch.tensor([0.1, 0.6, 0.3, 0.0])
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p2 = torch.tensor([0.2, 0.5, 0.3, 0.0])  # the target after d1 (one row for every d1)
    e = 1
    d1 = torch.multinomial(q1, n, replacement=True, generator=_gen(3))
    draft = torch.stack([d1, torch.full((n,), e)], 1)
    draft_probs = torch.stack([q1, torch.tensor(_one_hot(e, 4))]).expand(n, 2, 4).contiguous()
    bonus = torch.tensor(_one_hot(3, 4))
    target = torch.stack([p1, p2, bonus]).expand(n, 3, 4).contiguous()
    acc, nxt = rejection_sample(draft, draft_probs, target, _gen(4), greedy=False)
    first = torch.where(acc >= 1, d1, nxt)
    for v in range(4):
        share = (first == v).float().mean().item()
        assert abs(share - p1[v].item()) <= 4.5 * math.sqrt(p1[v] * (1 - p1[v]) / n) + 1e-9
    took = acc >= 1
    second = torch.where(acc[took] == 2, e, nxt[took])
    m = second.numel()
    for v in range(4):
        share = (second == v).float().mean().item()
        assert abs(share - p2[v].item()) <= 4.5 * math.sqrt(p2[v] * (1 - p2[v]) / m) + 1e-9
    assert (nxt[acc == 2] == 3).all()  # the bonus row
    # The negative control: the same deterministic e sent with a uniform q (a wrong
    # proposal distribution) is accepted whenever p2(e) >= 1/4: the second token is off.
    wrong = torch.stack([q1, torch.full((4,), 0.25)]).expand(n, 2, 4).contiguous()
    acc, nxt = rejection_sample(draft, wrong, target, _gen(4), greedy=False)
    assert (acc[acc >= 1] == 2).float().mean().item() > p2[e].item() + 0.3
