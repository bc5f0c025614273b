"""The logits processors (specdec.replica.processors, specdec.common.controls): each against
transformers' own processor (or an independent reference where transformers has none), the
vectorised Verify rows against one row at a time, the drafter's running counts against
the Verify rows, range checks, and the statistical test of DESIGN §2 with a penalty: a
speculative sampler whose target rows see the draft prefix reproduces the penalised
target's joint distribution, and one whose rows ignore the draft tokens is caught."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from specdec.common.controls import Controls, check_sampling_controls, controls_from_proto
from specdec.common.errors import InvalidRequest
from specdec.replica.processors import TokenCounts, draft_position_logits, verify_logits
from specdec.replica.sampling import SamplingParams, make_generator, rejection_sample, warp
from specdec.v1 import common_pb2
from tests.unit.test_sampling import N_SAMPLES, N_TOKENS, VOCAB, _check, _counts

V = 50


class PresenceFrequencyReference(LogitsProcessor):
    """OpenAI's definition, written independently of specdec: logit -= frequency * count -
    presence * [count > 0], counting the tokens generated after the first `prompt_length`."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            for token, count in enumerate(torch.bincount(ids[self.prompt_length :], minlength=0)):
                if count:
                    scores[row, token] -= self.frequency * count + self.presence
        return scores


def reference_processors(controls: Controls, prompt_length: int) -> LogitsProcessorList:
    """transformers' processors for controls, in specdec's order (output starts at
    prompt_length)."""
    out = LogitsProcessorList()
    if controls.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in controls.logit_bias]))
    if controls.min_tokens:
        out.append(
            MinNewTokensLengthLogitsProcessor(
                prompt_length, controls.min_tokens, list(controls.min_tokens_ids)
            )
        )
    if controls.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(controls.repetition_penalty))
    if controls.presence_penalty or controls.frequency_penalty:
        out.append(
            PresenceFrequencyReference(
                prompt_length, controls.presence_penalty, controls.frequency_penalty
            )
        )
    return out


CASES = {
    "presence": Controls(presence_penalty=1.5),
    "frequency": Controls(frequency_penalty=0.7),
    "negative-penalties": Controls(presence_penalty=-0.5, frequency_penalty=-1.0),
    "repetition": Controls(repetition_penalty=1.8),
    "repetition-below-1": Controls(repetition_penalty=0.6),
    "logit_bias": Controls(logit_bias=((3, 5.0), (7, -100.0), (49, 2.5))),
    "min_tokens": Controls(min_tokens=4, min_tokens_ids=(2, 9)),
    "all": Controls(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias=((2, 3.0), (5, -4.0)),
        min_tokens=3,
        min_tokens_ids=(2,),
    ),
}


def _with_start(controls: Controls, start: int) -> Controls:
    return Controls(**{**controls.__dict__, "output_start": start})


@pytest.mark.parametrize("name", CASES)
def test_each_processor_equals_transformers(name):
    """A sequence of a prompt and an output (with repeats): specdec's processed logits at
    every output length equal transformers' processors applied in the same order."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 12, (9,), generator=gen).tolist()
    output = torch.randint(0, 12, (7,), generator=gen).tolist()
    controls = _with_start(CASES[name], len(prompt))
    reference = reference_processors(controls, len(prompt))
    for n in range(len(output) + 1):
        seq = prompt + output[:n]
        logits = torch.randn(1, V, generator=gen) * 3
        expected = reference(torch.tensor([seq]), logits.clone())
        counts = TokenCounts(controls, seq, [()], V, "cpu")
        got = counts.process(logits, torch.tensor([len(seq)]))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        if name == "min_tokens":
            assert bool(torch.isinf(got[0, 2])) == (n < 4)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("k", [0, 1, 4])
def test_verify_rows_see_the_draft_before_them(name, k):
    """Row i of verify_logits is the processors with sequence + d_1..d_i, computed one row
    at a time; the draft repeats tokens of the sequence and of itself."""
    gen = torch.Generator().manual_seed(11 + k)
    seq = torch.randint(0, 10, (12,), generator=gen).tolist()
    draft = torch.randint(0, 10, (k,), generator=gen).tolist()
    controls = _with_start(CASES[name], 8)
    logits = torch.randn(k + 1, V, generator=gen) * 3
    got = verify_logits(controls, seq, draft, logits)
    for i in range(k + 1):
        prefix = seq + draft[:i]
        one = TokenCounts(controls, prefix, [()], V, "cpu").process(
            logits[i : i + 1], torch.tensor([len(prefix)])
        )
        torch.testing.assert_close(got[i : i + 1], one, rtol=0, atol=1e-6)
    assert verify_logits(None, seq, draft, logits) is logits


def test_drafter_counts_follow_drawn_tokens_and_branch_tails():
    """TokenCounts over rows with different tails, advanced by appended tokens, gives each
    row what verify_logits gives for that row's sequence."""
    controls = _with_start(CASES["all"], 5)
    gen = torch.Generator().manual_seed(5)
    common = torch.randint(0, 10, (8,), generator=gen).tolist()
    tails = [[], [3], [3, 3, 1]]
    counts = TokenCounts(controls, common, tails, V, "cpu")
    sequences = [common + t for t in tails]
    for _ in range(3):
        logits = torch.randn(len(tails), V, generator=gen)
        positions = torch.tensor([len(s) for s in sequences])
        got = counts.process(logits, positions)
        for r, s in enumerate(sequences):
            row = verify_logits(controls, s, [], logits[r : r + 1])
            torch.testing.assert_close(got[r : r + 1], row, rtol=0, atol=1e-6)
        drawn = got.argmax(-1)
        counts.append(drawn)
        for r, t in enumerate(drawn.tolist()):
            sequences[r].append(t)


def test_greedy_is_the_argmax_of_processed_logits():
    """A penalty that flips the argmax: the processed argmax is the penalised choice."""
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 6] = 3.0, 2.0
    controls = Controls(presence_penalty=2.0, output_start=1)
    rows = verify_logits(controls, [9, 4], [], logits)  # 4 is in the output
    assert int(rows.argmax(-1)) == 6
    assert int(verify_logits(_with_start(controls, 2), [9, 4], [], logits).argmax(-1)) == 4


def _proto(**kw) -> common_pb2.SamplingParams:
    bias = kw.pop("logit_bias", {})
    msg = common_pb2.SamplingParams(**kw)
    msg.logit_bias.update(bias)
    return msg


def _processors(msg: common_pb2.SamplingParams) -> Controls:
    """The logits processors of a wire message's sampling, as a replica reads them."""
    return SamplingParams.from_proto(msg).processors


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (_proto(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (_proto(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
        (_proto(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
        (_proto(repetition_penalty=-1), "repetition_penalty must be a finite number > 0"),
        (_proto(repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
        (_proto(logit_bias={V: 1.0}), f"logit_bias token id {V} is outside the vocabulary"),
        (_proto(logit_bias={-1: 1.0}), "logit_bias token id -1 is outside"),
        (_proto(logit_bias={3: 101.0}), "logit_bias of token 3 must be in [-100, 100]"),
        (_proto(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
    ],
)
def test_bad_sampling_controls_are_refused_by_name(sampling, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        check_sampling_controls(_processors(sampling), V if "300" not in message else 1000)


def test_output_controls_are_checked():
    plain = common_pb2.SamplingParams(presence_penalty=1.0)
    with pytest.raises(InvalidRequest, match=r"output\.output_start 9 lies beyond"):
        controls_from_proto(_processors(plain), common_pb2.OutputControls(output_start=9), V, 8)
    with pytest.raises(InvalidRequest, match=f"min_tokens_ids holds {V}, outside"):
        controls_from_proto(
            _processors(plain), common_pb2.OutputControls(min_tokens=2, min_tokens_ids=[1, V]), V, 8
        )
    with pytest.raises(InvalidRequest, match="at most 320"):
        controls_from_proto(
            _processors(plain), common_pb2.OutputControls(min_tokens_ids=range(321)), 1000, 8
        )
    # Neutral values: no processors at all (the replicas skip them).
    assert (
        controls_from_proto(SamplingParams().processors, common_pb2.OutputControls(), V, 8) is None
    )
    assert (
        controls_from_proto(
            SamplingParams(repetition_penalty=1.0).processors,
            common_pb2.OutputControls(min_tokens=3),  # no ids to mask
            V,
            8,
        )
        is None
    )
    got = controls_from_proto(
        _processors(_proto(repetition_penalty=0, logit_bias={7: 1.0, 2: -1.0})),
        common_pb2.OutputControls(output_start=4, min_tokens=2, min_tokens_ids=[5, 1, 5]),
        V,
        8,
    )
    assert got == Controls(
        logit_bias=((2, -1.0), (7, 1.0)), output_start=4, min_tokens=2, min_tokens_ids=(1, 5)
    )


# --------------------------------------------------------------------------------------
# Statistical test with a penalty (the harness of tests/unit/test_sampling.py)
# --------------------------------------------------------------------------------------

# Penalties strong enough that a token's distribution depends on the whole output so far.
PENALISED = Controls(frequency_penalty=0.5, presence_penalty=0.3, output_start=1)
START = 0  # the prompt is one token; the output starts after it


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    yield
    torch.set_num_threads(threads)


def _markov(seed: int) -> torch.Tensor:
    """Raw logits [V, V] of a Markov chain (row: the last token), before the processors."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.7


def _speculate_penalised(target, draft, k, n, seed, *, rows="draft-prefix", draft_processed=True):
    """n sequences [START, x1, x2, ...] sampled speculatively at temperature 1 under
    PENALISED; returns their first N_TOKENS output tokens [n, N_TOKENS].

    target, draft: raw Markov logits [V, V]. The drafter draws from its processed
    distributions (draft_processed False: its raw ones; exactness must not depend on it).
    The verifier's k+1 rows: "draft-prefix" is draft_position_logits (row i counts
    d_1..d_i, the rule); "stale" counts only the tokens before the draft for every row
    (the bug it prevents).
    """
    sampled = SamplingParams(temperature=1.0)
    counts = TokenCounts(PENALISED, [START], [()] * n, VOCAB, "cpu")  # no output yet
    out = torch.full((n, N_TOKENS + k + 1), -1, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)  # output tokens so far
    last = torch.full((n,), START, dtype=torch.long)
    index, steps = torch.arange(n), torch.arange(k + 1)
    round_no = 0
    while int(lengths.min()) < N_TOKENS:
        gen_d = make_generator(seed, "draft", round_no)
        gen_v = make_generator(seed, "verify", round_no)
        drafting = counts.clone()
        tokens, dists, cur = [], [], last
        for i in range(k):
            row = draft[cur]  # [n, V]
            if draft_processed:
                row = drafting.process(row, 1 + lengths + i)
            q = warp(row, sampled)
            cur = torch.multinomial(q, 1, generator=gen_d)[:, 0]
            drafting.append(cur)
            tokens.append(cur)
            dists.append(q)
        drafts = torch.stack(tokens, 1) if k else torch.empty(n, 0, dtype=torch.long)
        draft_probs = torch.stack(dists, 1) if k else torch.empty(n, 0, VOCAB)
        raw = target[torch.cat([last[:, None], drafts], 1)]  # [n, k+1, V]
        if rows == "draft-prefix":
            processed = draft_position_logits(counts, drafts, raw, 1 + lengths)
        else:
            stale = counts.clone()
            stale.output = counts.output.repeat_interleave(k + 1, 0)
            positions = (1 + lengths).repeat_interleave(k + 1)
            processed = stale.process(raw.reshape(-1, VOCAB), positions).view(n, k + 1, VOCAB)
        accepted, nxt = rejection_sample(
            drafts, draft_probs, warp(processed, sampled), gen_v, False
        )
        new = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)  # [n, k+1]
        new[index, accepted] = nxt
        for j in range(k + 1):
            counts.append(new[:, j], j <= accepted)
        keep = (steps[None, :] <= accepted[:, None]) & (
            lengths[:, None] + steps[None, :] < out.shape[1]
        )
        pos = lengths[:, None] + steps[None, :]
        out[index[:, None].expand_as(pos)[keep], pos[keep]] = new[keep]
        lengths += accepted + 1
        last = nxt
        round_no += 1
    return out[:, :N_TOKENS]


def _exact_penalised_joint(target) -> torch.Tensor:
    """P(x1, x2, x3) of the penalised target alone, by enumeration: [V, V, V] float64."""
    sampled = SamplingParams(temperature=1.0)
    joint = torch.zeros((VOCAB,) * N_TOKENS, dtype=torch.float64)
    for xs in itertools.product(range(VOCAB), repeat=N_TOKENS):
        p, seq = 1.0, [START]
        for x in xs:
            row = verify_logits(PENALISED, seq, [], target[seq[-1]][None])
            p *= float(warp(row, sampled)[0, x])
            seq.append(x)
        joint[xs] = p
    return joint


def test_penalised_joint_is_far_from_the_unpenalised_one():
    """The setting is meaningful: the penalty moves the joint well beyond the harness's
    tolerance, and every cell is large enough for its normal bound."""
    target = _markov(1)
    exact = _exact_penalised_joint(target)
    assert math.isclose(float(exact.sum()), 1.0, rel_tol=1e-6)
    plain = warp(target, SamplingParams(temperature=1.0)).double()
    unpenalised = plain[START][:, None, None] * plain[:, :, None] * plain[None, :, :]
    assert 0.5 * float((exact - unpenalised).abs().sum()) > 0.1
    assert float(exact.min()) * N_SAMPLES >= 10


@pytest.mark.parametrize(("k", "draft_processed"), [(3, True), (2, True), (3, False)])
def test_speculative_sampling_with_a_penalty_matches_the_penalised_target(k, draft_processed):
    target, draft = _markov(1), _markov(2)
    tokens = _speculate_penalised(
        target, draft, k, N_SAMPLES, seed=31 + k, draft_processed=draft_processed
    )
    failures = _check(_counts(tokens), _exact_penalised_joint(target))
    assert failures == [], f"k={k}: " + "; ".join(failures[:10])


def test_negative_control_rows_without_the_draft_prefix_fail_the_check():
    """A verifier that processes every row with the counts before the draft (ignoring
    d_1..d_i) samples from the wrong distribution, and the check catches it."""
    target, draft = _markov(1), _markov(2)
    tokens = _speculate_penalised(target, draft, 3, N_SAMPLES, seed=34, rows="stale")
    assert _check(_counts(tokens), _exact_penalised_joint(target))
