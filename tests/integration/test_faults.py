"""Faults during traffic through real processes on loopback (issue 11): cancelled turns."""

from __future__ import annotations

import pytest

from specdec.sdk import Client
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def stack(test_models, redis_server):
    """One drafter, one verifier, one gateway on a real Redis."""
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy)
        v = replica("verifier", test_models.target)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        g = gateway([d], [v], redis_server.url)
        procs.append(g)
        g.wait_healthy()
        yield {"drafter": d, "verifier": v, "gateway": g}
    finally:
        for p in procs:
            p.stop()


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_turn_right_after_a_cancel_is_not_aborted(stack, tokenizer):
    """The other-language client saw ABORTED 9 times in 9: the cancelled turn was still
    releasing its lock. The cancelled turn keeps nothing in the history."""
    with Client(stack["gateway"].address, timeout=120) as client:
        first = client.generate(
            token_ids=ids_of(tokenizer, PROMPTS[0]), max_new_tokens=8, session_id="cancel-1", k=0
        )
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        for _ in range(9):
            stream = client.stream(" and", max_new_tokens=400, session_id="cancel-1", k=0)
            next(stream)  # the turn is running
            stream.close()  # cancels the call
            got = client.generate(" then", max_new_tokens=4, session_id="cancel-1", k=0)
            assert got.usage.history_tokens == history  # the cancelled turn left nothing
            history += got.usage.prompt_tokens + got.usage.completion_tokens
