"""SSD with batching across sessions through real processes on the tiny fp32 models
(issue 14, item 2): concurrent sessions' Speculate branch steps share the drafter's
forwards, greedy output stays exactly generate() for every session, and sampled sequences
still follow the target's distribution."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.conftest import PROMPTS
from tests.integration.test_batching import N, _generate_all, prompts, scrape
from tests.integration.test_gateway import _free_port, gateway, replica
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

SESSIONS = 8
ROWS = 16  # the drafter's --max-batch-size


@pytest.fixture(scope="module", params=["dense", "paged"])
def ssd_batch_stack(test_models, request):
    """A drafter batching up to 16 rows (with /metrics), a verifier batching 8 sessions,
    both on one KV engine; a gateway with SSD on at the drafter's fan-out (6) and one with
    fan-out 1."""
    procs = []
    try:
        port = _free_port()
        engine = ("--engine", request.param)
        d = replica("drafter", test_models.draft_noisy, "--metrics-port", str(port),
                    "--max-batch-size", str(ROWS), "--ssd-fan-out", "6", *engine)  # fmt: skip
        v = replica("verifier", test_models.target, "--max-batch-size", str(SESSIONS), *engine)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        gws = {
            "wide": gateway([d], [v], None, "--ssd"),
            "one": gateway([d], [v], None, "--ssd", "--ssd-fan-out", "1"),
        }
        procs += gws.values()
        for g in gws.values():
            g.wait_healthy()
        yield {"gateways": {name: g.address for name, g in gws.items()}, "port": port}
    finally:
        for p in procs:
            p.stop()


def forwards_wider_than(before: dict, after: dict, rows: int) -> tuple[float, float]:
    """(forwards, forwards of more than `rows` rows) of the drafter between two scrapes,
    over every kind."""
    name = "specdec_drafter_model_forward_batch_size"

    def total(sample: dict, suffix: str) -> float:
        return sum(v for k, v in sample.items() if k.startswith(name + suffix))

    def bucket(sample: dict) -> float:
        le = f'le="{float(rows)}"'
        return sum(v for k, v in sample.items() if k.startswith(name + "_bucket") and le in k)

    count = total(after, "_count") - total(before, "_count")
    return count, count - (bucket(after) - bucket(before))


def test_concurrent_ssd_sessions_are_exact_and_share_branch_forwards(
    ssd_batch_stack, tokenizer, reference
):
    """Eight sessions of 5 to 54 prompt tokens, greedy, k = 3, six branches per round.
    Before branch steps were batched a drafter forward held at most 8 rows (one per
    session, or one Speculate's 6 branches); a forward of more than 8 rows holds the
    branches of one session with rows of others (in practice several sessions' branches)."""
    before = scrape(ssd_batch_stack["port"])
    jobs = [(ids, {}) for ids in prompts(tokenizer)]
    address = ssd_batch_stack["gateways"]["wide"]
    results = asyncio.run(_generate_all(address, jobs, k=3, ssd=True))
    for (ids, _), result in zip(jobs, results, strict=True):
        assert list(result.tokens) == reference(ids, N), f"prompt of {len(ids)} tokens"
        assert result.stats.ssd_hits + result.stats.ssd_misses > 0
    after = scrape(ssd_batch_stack["port"])
    forwards, wide = forwards_wider_than(before, after, SESSIONS)
    assert wide > 0, f"no drafter forward of more than {SESSIONS} rows in {forwards}"
    _, too_wide = forwards_wider_than(before, after, ROWS)
    assert too_wide == 0  # --max-batch-size rows (no group is wider than it here)


def test_ssd_sampling_distribution_with_branch_batching(ssd_batch_stack, tokenizer, target_model):
    """Sampled sequences through a stack that batches branch steps across sessions (eight
    generations at a time) follow the target's distribution: every one of the 16 possible
    4-token sequences (top-k 2) within 5 sigma (tests.integration.test_ssd's check)."""
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    assert len(exact) == 16 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    results = sample_top2(ssd_batch_stack["gateways"]["one"], ids, 1200, k=1)
    hits = sum(r.stats.ssd_hits for r in results)
    misses = sum(r.stats.ssd_misses for r in results)
    assert hits > 100 and misses > 100  # both SSD paths carried the sampled rounds
    check_sequence_counts([tuple(r.tokens) for r in results], exact)
