"""The drafter's proposal cut to its top entries (issue 11, item 6): what travels shrinks
from a dense fp16 row over the vocabulary to a few thousand sparse entries, and the
output distribution stays exact because the draft is drawn from what is sent."""

from __future__ import annotations

import math

import torch

from specdec.drafter.sampler import Sampler
from specdec.replica.convert import encoded_to_proto
from specdec.replica.host import to_host
from specdec.replica.sampling import (
    SamplingParams,
    encoded_rows,
    rejection_sample,
    truncate_proposal,
)

VOCAB = 151_936  # the Qwen2.5 vocabulary of the measurement


def test_truncate_keeps_the_top_mass_within_the_cap():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    assert torch.equal(truncate_proposal(probs, 0, 0.0), probs)  # 0: no cut
    cut = truncate_proposal(probs, 4, 0.05)  # 0.5 + 0.3 + 0.15 = 0.95 >= 1 - 0.05
    torch.testing.assert_close(cut, torch.tensor([0.5, 0.3, 0.15, 0, 0, 0]) / 0.95)
    cut = truncate_proposal(probs, 2, 0.0)  # the cap wins over the mass
    torch.testing.assert_close(cut, torch.tensor([0.5, 0.3, 0, 0, 0, 0]) / 0.8)
    assert float(truncate_proposal(probs, 5, 0.0).sum()) == 1.0


def test_a_dense_row_becomes_a_few_thousand_sparse_entries():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=gen) * 2  # a flat-ish row at T = 1
    params = SamplingParams(temperature=1.0, seed=3)
    whole = encoded(Sampler(params, torch.device("cpu")), logits)[1]
    token, cut = encoded(Sampler(params, torch.device("cpu"), 2048, 1e-4), logits)
    dense_bytes = encoded_to_proto(whole).ByteSize()
    sparse_bytes = encoded_to_proto(cut).ByteSize()
    assert dense_bytes > 2 * VOCAB  # 303,8xx bytes: the figure
    assert cut.is_sparse and cut.token_ids.numel() <= 2048
    assert sparse_bytes <= 8 * 2048 + 64  # 16 KB: about 18x less
    assert token in cut.token_ids.tolist()  # drawn from what is sent


def encoded(sampler: Sampler, logits: torch.Tensor):
    """One draw from a row of logits: the token and its distribution as it travels."""
    tokens, proposal = sampler.draw(logits[None], [10])
    (row,) = encoded_rows(to_host(*sampler.payload([proposal])))
    return int(tokens[0]), row


def test_rejection_sampling_with_a_cut_proposal_is_exact():
    # p over 6 tokens; the drafter's q cut to its top 2 entries. Draft one token from the
    # cut q, verify against p: the output token must follow p exactly.
    n = 60_000
    gen = torch.Generator().manual_seed(11)
    p = torch.tensor([0.1, 0.3, 0.25, 0.2, 0.1, 0.05])
    q = truncate_proposal(torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05]), 2, 0.0)
    draft = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # [n, 1]
    target = torch.stack([p, torch.tensor([0, 0, 0, 0, 0, 1.0])]).expand(n, 2, 6).contiguous()
    accepted, nxt = rejection_sample(draft, q.expand(n, 1, 6).contiguous(), target, gen, False)
    out = torch.where(accepted == 1, draft[:, 0], nxt)  # the first output token
    freq = torch.bincount(out, minlength=6).float() / n
    for i in range(6):
        sd = math.sqrt(float(p[i]) * (1 - float(p[i])) / n)
        assert abs(float(freq[i]) - float(p[i])) <= 4.5 * sd, (i, freq.tolist())
