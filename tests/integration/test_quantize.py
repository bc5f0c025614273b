"""A drafter with int8 weights (--quantize int8) through real processes: greedy output is
still the target's generate(), with and without SSD; a bad --quantize stops start-up."""

from __future__ import annotations

import pytest

from specdec.sdk import Client
from specdec.tools.launcher import ServiceFailed
from tests.conftest import PROMPTS
from tests.integration.test_gateway import replica, small_stack

pytestmark = pytest.mark.integration

N = 32


@pytest.fixture(scope="module")
def int8_stack(test_models):
    """An int8 drafter (the noisy draft) and a float32 verifier behind one gateway."""
    with small_stack(test_models.draft_noisy, test_models.target, "--quantize", "int8") as procs:
        yield procs


@pytest.mark.parametrize("ssd", [False, True])
def test_int8_drafter_greedy_equals_generate(int8_stack, tokenizer, reference, ssd):
    # The drafter really loaded int8 weights (its load log line says so).
    assert '"quantize": "int8"' in int8_stack["drafter"].tail(200)
    accepted = drafted = 0
    with Client(int8_stack["gateway"].address, timeout=120) as client:
        for text in PROMPTS[:4]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=3, ssd=ssd)
            assert list(got.tokens) == reference(ids, N), f"ssd={ssd} prompt={text!r}"
            assert got.stats.ssd is ssd
            accepted += got.stats.accepted_tokens
            drafted += got.stats.draft_tokens
    assert drafted > 0 and 0 < accepted < drafted  # the int8 drafts were used and checked


def test_bad_quantize_fails_start_up(test_models):
    bad = replica("drafter", test_models.draft_noisy, "--quantize", "int3")
    try:
        with pytest.raises(ServiceFailed, match=r"--quantize / SPECDEC_QUANTIZE: must be one of"):
            bad.wait_healthy(60)
    finally:
        bad.stop()
    mixed = replica("drafter", test_models.draft_noisy, "--quantize", "int8", "--dtype", "bfloat16")
    try:
        with pytest.raises(ServiceFailed, match=r"--quantize .*needs --dtype float32"):
            mixed.wait_healthy(60)
    finally:
        mixed.stop()
