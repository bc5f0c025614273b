"""A reduced draft vocabulary through real processes: greedy output equals `generate()` and
sampled sequences follow the target's distribution, with a drafter whose subset provably
excludes tokens the target chooses (so some of its drafts can never be right)."""

from __future__ import annotations

import math

import pytest

from specdec.sdk import Client
from tests.conftest import PROMPTS, start_up_error
from tests.integration.test_gateway import gateway, replica
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 24
SMALL_N = 64  # --draft-vocab for the second drafter: the tiny vocabulary's smallest ids


@pytest.fixture(scope="module")
def excluded(tokenizer, reference, test_models):
    """Tokens the target chooses in the greedy reference outputs, left out of the subset:
    the first two distinct non-EOS tokens of every output."""
    out: set[int] = set()
    for text in PROMPTS[:4]:
        chosen = [t for t in reference(tokenizer(text).input_ids, N) if t not in EOS]
        out |= set(list(dict.fromkeys(chosen))[:2])
    return out


EOS = {0, 1, 2}  # never excluded (the tokenizer's specials: kept by the drafter anyway)


def sampled_prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPTS[0]).input_ids


@pytest.fixture(scope="module")
def exact(tokenizer, target_model):
    """The target's exact distribution of 4-token continuations under top-k 2."""
    probs = exact_sequence_probs(target_model, sampled_prompt(tokenizer), steps=4, top_k=2)
    assert len(probs) == 16 and math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)
    return probs


@pytest.fixture(scope="module")
def sampling_excluded(exact):
    """The tokens of the likeliest continuation: the sampling drafter never proposes them."""
    return set(max(exact, key=exact.get)) - EOS


def ranking_without(folder, vocab_size: int, excluded: set[int]) -> str:
    path = folder / f"ranking-{len(excluded)}-{min(excluded)}.txt"
    ids = [t for t in range(vocab_size) if t not in excluded]
    path.write_text("# all but the excluded tokens\n" + "\n".join(map(str, ids)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def stack(test_models, tmp_path_factory, excluded, sampling_excluded):
    """One verifier; drafters: the target itself with a ranking file that leaves out
    `excluded` (every other draft is right), the noisy draft with --draft-vocab SMALL_N set
    through its environment variable, and the noisy draft without `sampling_excluded`; a
    gateway over each (the last with SSD, one branch per round)."""
    folder = tmp_path_factory.mktemp("vocab")
    procs = []
    try:
        verifier = replica("verifier", test_models.target)
        same = replica(
            "drafter",
            test_models.target,
            "--draft-vocab-file",
            ranking_without(folder, test_models.vocab_size, excluded),
        )
        noisy = replica(
            "drafter", test_models.draft_noisy, env={"SPECDEC_DRAFT_VOCAB": str(SMALL_N)}
        )
        sampler = replica(
            "drafter",
            test_models.draft_noisy,
            "--draft-vocab-file",
            ranking_without(folder, test_models.vocab_size, sampling_excluded),
        )
        procs += [verifier, same, noisy, sampler]
        for p in procs:
            p.wait_healthy()
        gws = {
            "same": gateway([same], [verifier]),
            "noisy": gateway([noisy], [verifier]),
            "sampler-ssd-1": gateway([sampler], [verifier], None, "--ssd", "--ssd-fan-out", "1"),
        }
        procs += gws.values()
        for g in gws.values():
            g.wait_healthy()
        yield {name: g.address for name, g in gws.items()}
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("ssd", [False, True])
def test_greedy_equals_generate_with_a_reduced_vocabulary(
    stack, tokenizer, reference, excluded, k, ssd
):
    small_misses = chosen_excluded = 0
    rejected = drafted = 0
    for text in PROMPTS[:4]:
        ids = tokenizer(text).input_ids
        want = reference(ids, N)
        small_misses += sum(t >= SMALL_N and t not in EOS for t in want)
        chosen_excluded += len(excluded & set(want))
        for name in ("same", "noisy"):
            with Client(stack[name], timeout=120) as client:
                got = client.generate(token_ids=ids, max_new_tokens=N, k=k, ssd=ssd)
            assert list(got.tokens) == want, (name, text)
            if name == "same":
                drafted += got.stats.draft_tokens
                rejected += got.stats.draft_tokens - got.stats.accepted_tokens
            if ssd and k:
                assert got.stats.ssd_hits + got.stats.ssd_misses > 0
    # The subsets exclude tokens the target really chose...
    assert chosen_excluded > 0 and small_misses > 0
    if k:
        # ...and the target as its own drafter, which would otherwise always agree, has
        # drafts rejected: it could not propose the excluded tokens.
        assert drafted > 0 and rejected > 0


def test_sampling_distribution_with_a_reduced_vocabulary(
    stack, tokenizer, exact, sampling_excluded
):
    """Sampled sequences follow the target's distribution: every one of the 16 possible
    4-token sequences (top-k 2) within 5 sigma, through a drafter whose subset leaves out
    the tokens of the likeliest sequence (they come only from the verifier's residual),
    with SSD on (one branch per round and k = 1, so both SSD paths carry rounds)."""
    ids = sampled_prompt(tokenizer)
    assert sampling_excluded, "the subset must leave out some of the target's possible tokens"
    samples = 1200

    results = sample_top2(stack["sampler-ssd-1"], ids, samples, k=1)
    assert sum(r.stats.ssd_hits for r in results) > 100
    assert sum(r.stats.ssd_misses for r in results) > 100
    counts = check_sequence_counts([tuple(r.tokens) for r in results], exact)
    # The excluded tokens were sampled (only the residual could produce them).
    assert sum(c for s, c in counts.items() if sampling_excluded & set(s)) > samples / 10


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--draft-vocab", "1000000"), "--draft-vocab / SPECDEC_DRAFT_VOCAB: must be in [1, 384]"),
        (("--draft-vocab", "-3"), "--draft-vocab / SPECDEC_DRAFT_VOCAB: must be >= 0"),
        (("--draft-vocab-file", "/no/such/file"), "--draft-vocab-file / SPECDEC_DRAFT_VOCAB_FILE"),
    ],
)
def test_bad_vocabulary_settings_fail_start_up(test_models, flags, message):
    """The first is only found once the model is loaded (its vocabulary), the others
    before; either way the drafter exits 2 with the setting named."""
    stderr = start_up_error("drafter", test_models.draft_small, *flags)
    assert f"configuration error: {message}" in stderr
