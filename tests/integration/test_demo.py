"""`specdec demo` measures every run from the state a fresh request would see: no run drafts
from the gateway's cache of an earlier run's output (the demo once printed 7.2x where a
fresh request got 1.3x, its speculative run replaying its k = 0 run's output).

The demo's own code (`prepare`, `cache_state`, `measure`) runs on the tiny models with the
gateway's /metrics on, and the gateway's count of suffix-cache look-ups that proposed a
draft says whether any request drafted from an earlier request's output.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specdec.cli import build_parser
from specdec.sdk import Client
from specdec.tools import demo
from specdec.tools.launcher import stops_children
from specdec.tools.stack import LocalStack
from tests.integration.test_batching import scrape
from tests.integration.test_gateway import _free_port

pytestmark = pytest.mark.integration


def run_rows(test_models, *extra: str) -> tuple[str, list[demo.Row], dict[str, float]]:
    """The demo's rows on the tiny models: its cache state line, its rows and the gateway's
    metrics after them."""
    port = _free_port()
    argv = ["demo", "--draft-model", str(test_models.draft_noisy)]
    argv += ["--target-model", str(test_models.target), "--dtype", "float32"]
    argv += ["--drafter", "bf16", "--no-pin", "--max-new-tokens", "16", "--k", "3"]
    argv += ["--draft-threads", "1", "--target-threads", "1"]
    argv += [f"--gateway-arg=--metrics-port={port}", *extra]
    args = build_parser().parse_args(argv)
    assert demo.prepare(args) is None
    template = AutoTokenizer.from_pretrained(args.target_model)
    with stops_children(), LocalStack(args) as stack:
        assert stack.gateway is not None
        with Client(stack.gateway.address) as client:
            state = demo.cache_state(client)
        rows = demo.measure(stack.gateway.address, args, template, show=lambda text: None)
        metrics = scrape(port)
    return state, rows, metrics


def test_no_run_drafts_from_an_earlier_runs_output(test_models):
    state, rows, metrics = run_rows(test_models)
    assert "nothing cached" in state
    assert [r.kind for r in rows] == [kind for kind, _ in demo.PROMPTS]
    for r in rows:  # float32: exact
        assert r.spec.tokens == r.base.tokens == r.ssd.tokens
    # The cache was asked every lookup round and never had anything to propose: each
    # request's tenant held no earlier output.
    assert metrics["specdec_gateway_suffix_cache_lookups_total"] > 0
    assert metrics["specdec_gateway_suffix_cache_hits_total"] == 0
    # Each row's k = 0 output was cached under its own tenant (the cache is on).
    assert metrics["specdec_gateway_suffix_cache_entries"] >= 3 * len(rows)


def test_a_shared_cache_is_said_to_overstate(test_models):
    """With the cache shared again (a --gateway-arg wins over the demo's scope), the
    speculative runs draft from the k = 0 runs' outputs, and the demo's cache line says its
    speedups overstate a fresh request's."""
    state, rows, metrics = run_rows(test_models, "--gateway-arg=--suffix-cache-scope=global")
    assert "scope global" in state and "overstates" in state
    assert metrics["specdec_gateway_suffix_cache_hits_total"] > 0
    accepted = [r.spec.stats.by_source.get("suffix", (0, 0, 0))[2] for r in rows]
    assert sum(accepted) > 0
