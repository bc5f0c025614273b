"""A reduced draft vocabulary through real processes: greedy output equals `generate()` and
sampled sequences follow the target's distribution, with a drafter whose subset provably
excludes tokens the target chooses (so some of its drafts can never be right)."""

from __future__ import annotations

import asyncio
import itertools
import math
import subprocess
import sys

import pytest

from specdec.sdk import AsyncClient, Client
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica
from tests.integration.test_ssd import exact_sequence_probs

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


@pytest.fixture(scope="module")
def stack(test_models, tmp_path_factory, excluded):
    """One verifier; drafters: the target itself with a ranking file that leaves out
    `excluded` (every other draft is right), the noisy draft with --draft-vocab SMALL_N set
    through its environment variable; a gateway over each."""
    ranking = tmp_path_factory.mktemp("vocab") / "ranking.txt"
    ids = [t for t in range(test_models.vocab_size) if t not in excluded]
    ranking.write_text("# all but the excluded tokens\n" + "\n".join(map(str, ids)) + "\n")
    procs = []
    try:
        verifier = replica("verifier", test_models.target)
        same = replica("drafter", test_models.target, "--draft-vocab-file", str(ranking))
        noisy = replica(
            "drafter", test_models.draft_noisy, env={"SPECDEC_DRAFT_VOCAB": str(SMALL_N)}
        )
        procs += [verifier, same, noisy]
        for p in procs:
            p.wait_healthy()
        gws = {
            "same": gateway([same], [verifier]),
            "noisy": gateway([noisy], [verifier]),
            "noisy-ssd-1": gateway(
                [noisy], [verifier], None, "--ssd", "true", "--ssd-fan-out", "1"
            ),
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


def test_sampling_distribution_with_a_reduced_vocabulary(stack, tokenizer, target_model):
    """Sampled sequences follow the target's distribution: every one of the 16 possible
    4-token sequences (top-k 2) within 5 sigma, through a drafter whose subset leaves out
    tokens of those sequences (they come only from the verifier's residual), with SSD on
    (one branch per round, so both SSD paths carry rounds)."""
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    assert len(exact) == 16 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    outside = {t for s in exact for t in s if t >= SMALL_N and t not in EOS}
    assert outside, "the subset must leave out some of the target's possible tokens"
    samples = 1200

    async def draw() -> list:
        async with AsyncClient(stack["noisy-ssd-1"], timeout=120) as client:
            sem = asyncio.Semaphore(8)

            async def one():
                async with sem:
                    return await client.generate(
                        token_ids=ids, max_new_tokens=4, k=2, temperature=1.0, top_k=2
                    )

            return await asyncio.gather(*(one() for _ in range(samples)))

    results = asyncio.run(draw())
    assert sum(r.stats.ssd_hits for r in results) > 50
    assert sum(r.stats.ssd_misses for r in results) > 50
    counts = {s: 0 for s in exact}
    for r in results:
        s = tuple(r.tokens)
        assert s in counts, f"{s} is impossible under top-k 2"
        counts[s] += 1
    assert sum(c for s, c in counts.items() if outside & set(s)) > 0
    for s, p in exact.items():
        sigma = math.sqrt(samples * p * (1 - p))
        assert abs(counts[s] - samples * p) <= 5 * sigma + 1, (s, counts[s], samples * p)
    # The test can fail: a distribution that differs by 0.1 in one cell is caught.
    biased = dict(exact)
    a, b = itertools.islice(sorted(exact, key=exact.get, reverse=True), 2)
    shift = min(0.1, biased[b])
    biased[a] += shift
    biased[b] -= shift
    assert any(
        abs(counts[s] - samples * p) > 5 * math.sqrt(samples * p * (1 - p)) + 1
        for s, p in biased.items()
        if 0 < p < 1
    )


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
    result = subprocess.run(
        [
            *(sys.executable, "-m", "specdec", "serve", "drafter"),
            *("--model", str(test_models.draft_small), "--port", "0", "--host", "127.0.0.1"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"configuration error: {message}" in result.stderr
