"""The reduced draft vocabulary (--draft-vocab, specdec.drafter.vocab) on the tiny fp32
models: the draft distribution is exactly 0 outside the subset and sums to 1 inside, the
subset's logits are the full model's, every drafter path keeps to the subset, and bad
settings fail start-up naming the setting."""

from __future__ import annotations

import pytest
import torch

from specdec.cli import build_parser
from specdec.common.prefix import prefix_hash
from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.runtime import DrafterRuntime
from specdec.drafter.speculate import BranchStore, SpeculateCall, speculate
from specdec.drafter.vocab import read_ranking, subset_ids
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.replica.sampling import SamplingParams, decode_probs, warp

N = 64  # kept tokens (the tiny tokenizer has a few hundred)
PROMPT = [5, 17, 42, 99, 7, 120]


def drafter_config(model, **kw) -> DrafterConfig:
    return DrafterConfig(role="drafter", model=str(model), max_cached_tokens=1000, **kw)


@pytest.fixture(scope="module")
def reduced(test_models):
    rt = DrafterRuntime(drafter_config(test_models.draft_noisy, draft_vocab=N))
    rt.load()
    return rt


@pytest.fixture(scope="module")
def full(test_models):
    rt = ModelRuntime(drafter_config(test_models.draft_noisy))
    rt.load()
    return rt


def kept(rt) -> torch.Tensor:
    mask = torch.zeros(rt.vocab_size, dtype=torch.bool)  # [vocab]
    mask[rt.head.ids] = True
    return mask


def test_subset_is_the_smallest_ids_plus_eos(reduced):
    ids = reduced.head.ids.tolist()
    assert ids == sorted(set(range(N)) | set(reduced.eos_token_ids))
    assert subset_ids(3, None, 10, [8]) == [0, 1, 2, 8]  # EOS kept although beyond N
    assert reduced.head.weight.shape == (len(ids), reduced.model.config.hidden_size)
    assert reduced.head.weight.dtype == reduced.model.dtype


def test_distribution_is_zero_outside_and_sums_to_one_inside(reduced, full):
    s1 = reduced.store.acquire("a", 0, 0, len(PROMPT))
    s2 = full.store.acquire("a", 0, 0, len(PROMPT))
    rows = reduced.forward(s1, PROMPT)  # [n, vocab]
    reference = full.forward(s2, PROMPT)  # [n, vocab]
    mask = kept(reduced)
    assert rows.shape == reference.shape == (len(PROMPT), reduced.vocab_size)
    assert torch.isneginf(rows[:, ~mask]).all()
    # Inside the subset: the full model's logits (same rows of the same layer).
    torch.testing.assert_close(rows[:, mask], reference[:, mask], rtol=1e-5, atol=1e-5)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)):
        probs = warp(rows, params)  # [n, vocab]
        assert (probs[:, ~mask] == 0).all()
        torch.testing.assert_close(probs[:, mask].sum(-1), torch.ones(len(PROMPT)))
    # Greedy: the argmax over the subset.
    masked = reference.masked_fill(~mask, float("-inf"))
    assert rows.argmax(-1).tolist() == masked.argmax(-1).tolist()
    # A reduced vocabulary really changes the draft here (else this test proves little).
    assert (reference.argmax(-1) != masked.argmax(-1)).any()


@pytest.mark.parametrize("max_entries", [2048, 0])  # sparse proposal, and dense fp16
def test_every_drafter_path_keeps_to_the_subset(test_models, tmp_path, max_entries):
    # A ranking of the highest ids, so a subset-local index (0..N-1) could not pass for
    # a vocabulary id: the first 100 of 383, 382, ... are 284..383 (and EOS).
    ranking = tmp_path / "ranking.txt"
    ranking.write_text("\n".join(map(str, range(test_models.vocab_size - 1, 127, -1))))
    rt = DrafterRuntime(
        drafter_config(
            test_models.draft_noisy,
            draft_vocab=100,
            draft_vocab_file=str(ranking),
            draft_probs_max_entries=max_entries,
        )
    )
    rt.load()
    high = set(range(test_models.vocab_size - 100, test_models.vocab_size))
    assert set(rt.head.ids.tolist()) == high | set(rt.eos_token_ids)
    mask = kept(rt)
    branches = BranchStore()
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        sid = f"s-{params.greedy}"
        d = rt.drive(propose(DraftCall(rt, branches, sid, Prefix(0, 0), PROMPT, 4, params)))
        assert all(mask[t] for t in d.tokens), d.tokens
        for enc in d.probs:  # sampling: what was sampled from, over full-vocabulary ids
            probs = decode_probs(enc, rt.vocab_size)  # [vocab]
            assert probs.shape == (rt.vocab_size,)
            assert (probs[~mask] == 0).all() and probs[mask].sum() == pytest.approx(1.0)
            if enc.token_ids is not None:  # the vocabulary's ids, not the subset's 0..N-1
                assert {int(t) for t in enc.token_ids} <= high | set(rt.eos_token_ids)
        # SSD: the batched branch forwards draw from the subset too. Speculate on the draft
        # just made: the cache is cropped to the prompt less its last token.
        base = PROMPT[:-1]
        spec = rt.drive(
            speculate(
                SpeculateCall(
                    rt,
                    branches,
                    sid,
                    Prefix(len(base), prefix_hash(base)),
                    [PROMPT[-1], *d.tokens],
                    len(d.tokens),
                    3,
                    params,
                    6,
                    0.5,
                    3,
                )
            )
        )
        assert spec.branches
        for b in spec.branches:
            assert all(mask[t] for t in b.tokens), b.tokens
            for enc in b.probs:
                assert (decode_probs(enc, rt.vocab_size)[~mask] == 0).all()


def test_ranking_file(tmp_path, test_models):
    f = tmp_path / "rank.txt"
    f.write_text("# most frequent first\n300 2\n7  # a comment\n\n1\n")
    assert read_ranking(str(f)) == [300, 2, 7, 1]
    assert subset_ids(2, [300, 2, 7, 1], 400, [0]) == [0, 2, 300]
    assert subset_ids(0, [300, 2, 7, 1], 400, []) == [1, 2, 7, 300]
    rt = DrafterRuntime(drafter_config(test_models.draft_noisy, draft_vocab_file=str(f)))
    rt.load()
    assert rt.head.ids.tolist() == sorted({1, 2, 7, 300, *rt.eos_token_ids})


def parse(*argv: str) -> DrafterConfig:
    args = build_parser().parse_args(["serve", "drafter", "--model", "m", *argv])
    return DrafterConfig.from_args(args)


def test_settings_and_environment(tmp_path, monkeypatch):
    assert (parse().draft_vocab, parse().draft_vocab_file) == (0, "")
    assert parse("--draft-vocab", "32768").draft_vocab == 32768
    monkeypatch.setenv("SPECDEC_DRAFT_VOCAB", "1000")
    assert parse().draft_vocab == 1000
    f = tmp_path / "r.txt"
    f.write_text("1 2 3\n")
    monkeypatch.setenv("SPECDEC_DRAFT_VOCAB_FILE", str(f))
    assert parse().draft_vocab_file == str(f)


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        (None, ("--draft-vocab", "-1"), "--draft-vocab / SPECDEC_DRAFT_VOCAB: must be >= 0"),
        (None, ("--draft-vocab", "many"), "--draft-vocab / SPECDEC_DRAFT_VOCAB: cannot read"),
        (None, ("--draft-vocab-file", "/no/such/ranking.txt"), "--draft-vocab-file .*cannot read"),
        ("1 2 x\n", (), "--draft-vocab-file .*:1: 'x' is not a token id"),
        ("1 2\n-4\n", (), "--draft-vocab-file .*:2: '-4' is not a token id"),
        ("1 2\n2\n", (), "--draft-vocab-file .*:2: token 2 repeats"),
        ("# nothing\n", (), "--draft-vocab-file .*holds no token id"),
    ],
)
def test_bad_settings_name_the_setting(tmp_path, content, flags, message):
    if content is not None:
        f = tmp_path / "r.txt"
        f.write_text(content)
        flags = ("--draft-vocab-file", str(f), *flags)
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


@pytest.mark.parametrize(
    ("kw", "content", "message"),
    [
        ({"draft_vocab": 10**6}, None, r"--draft-vocab / SPECDEC_DRAFT_VOCAB: must be in \[1, "),
        ({}, "3 1000000\n", "--draft-vocab-file .*token id 1000000 is outside"),
        ({"draft_vocab": 5}, "3 4\n", "--draft-vocab .*5 exceeds the 2 ids of"),
    ],
)
def test_values_beyond_the_vocabulary_fail_the_load(tmp_path, test_models, kw, content, message):
    if content is not None:
        f = tmp_path / "r.txt"
        f.write_text(content)
        kw = {**kw, "draft_vocab_file": str(f)}
    rt = DrafterRuntime(drafter_config(test_models.draft_small, **kw))
    with pytest.raises(ConfigError, match=message):
        rt.load()


def test_acceptance_accounting_of_the_draftvocab_bench():
    """The bench's greedy rounds under teacher forcing (specdec.tools.bench.draftvocab):
    a round accepts the run of matching drafts, at most k, shorter near the end as the
    gateway's min(k, remaining - 1)."""
    from specdec.tools.bench.draftvocab import simulate

    T, F = True, False
    # j=0: 2 accepted + bonus; j=3: k = min(2, 2): 2 accepted + bonus.
    assert simulate([T, T, F, T, T, T], 2) == (2, 4, 4)
    # j=0: rejected at once; j=1: k = min(2, 1) = 1, accepted + bonus.
    assert simulate([F, T, F], 2) == (2, 3, 1)
    # The last token alone: a round without drafts.
    assert simulate([F, F], 4) == (2, 1, 0)
