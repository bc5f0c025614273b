"""Adaptive speculation (k_policy adaptive) through real processes: greedy output equals
generate() with and without SSD, the policy's decisions show in the statistics (k changes
within a request), sampled output keeps the target's distribution, bad values are refused."""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

import grpc
import pytest

from specdec.sdk import Client
from specdec.sdk.client import build_generate_request
from specdec.tools.distill.data import read_rows
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 32


@pytest.fixture(scope="module")
def adaptive_stack(test_models):
    """One verifier (the target); gateways over the noisy draft (realistic acceptance) with
    the adaptive policy as default, with and without SSD, one with the fixed default, and
    gateways over an unrelated small draft (acceptance near 0)."""
    with ExitStack() as running:

        def started(*procs):  # stopped when the module's tests are done, last first
            for p in procs:
                running.callback(p.stop)
            for p in procs:
                p.wait_healthy()
            return procs

        verifier, noisy, small = started(
            replica("verifier", test_models.target),
            replica("drafter", test_models.draft_noisy),
            replica("drafter", test_models.draft_small),
        )
        adaptive = ("--k-policy", "adaptive")
        flags = {
            "adaptive": (noisy, *adaptive),
            "adaptive-ssd": (noisy, *adaptive, "--ssd"),
            "fixed": (noisy, "--k-policy", "fixed"),
            "small": (small, *adaptive),
            "small-ssd": (small, *adaptive, "--ssd"),
        }
        gws = started(*(gateway([d], [verifier], None, *rest) for d, *rest in flags.values()))
        addresses: dict[str, Any] = {name: g.address for name, g in zip(flags, gws, strict=True)}
        addresses["replicas"] = (verifier, noisy)  # for a test's own gateway
        yield addresses


def check_policy_stats(s, k_max: int) -> None:
    """What the adaptive statistics must say about any request."""
    assert s.k_policy == "adaptive" and s.num_draft_tokens == k_max
    assert sum(s.rounds_by_k) == s.rounds and len(s.rounds_by_k) <= k_max + 1
    assert sum(k * n for k, n in enumerate(s.rounds_by_k)) == s.draft_tokens
    assert math.isclose(s.mean_k, s.draft_tokens / s.rounds, rel_tol=1e-5)
    assert s.policy_k0_rounds <= s.rounds_by_k[0]
    if s.ssd and s.ssd_speculates:
        assert 1 <= s.mean_fan_out <= 6  # sized by the policy, at most the drafter's default


@pytest.mark.parametrize("gw", ["adaptive", "adaptive-ssd"])
def test_adaptive_greedy_equals_generate(adaptive_stack, tokenizer, reference, gw):
    with Client(adaptive_stack[gw], timeout=120) as client:
        for text in PROMPTS[:4]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=4)  # the server default
            assert list(got.tokens) == reference(ids, N), text
            check_policy_stats(got.stats, 4)
            assert got.stats.ssd is (gw == "adaptive-ssd")


@pytest.mark.parametrize("gw", ["small", "small-ssd"])
def test_policy_turns_speculation_off_mid_request(adaptive_stack, tokenizer, reference, gw):
    """An unrelated drafter: almost every draft token is rejected. The policy starts from
    the prior acceptance (0.7), or from what the gateway measured on earlier requests, and
    prices the first round with the replicas' reported curves: it drafts while a draft is
    expected to pay, and every drafting round that ends in a rejection lowers the estimate.
    Once a draft token is expected to yield less than it costs (the verifier's measured
    cost of one more token plus the drafter's time per token, both > 0) k = 0 has the best
    rate: the policy must choose it for most of the request (a round now and then checks
    the drafter again). Greedy output stays exact."""
    with Client(adaptive_stack[gw], timeout=300) as client:
        for text in PROMPTS[:2]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=96, k=4)
            assert list(got.tokens) == reference(ids, 96), text
            s = got.stats
            check_policy_stats(s, 4)
            if s.draft_tokens >= 10:  # the premise, where a rate means something: a
                assert s.acceptance_rate < 0.2  # drafter that rarely agrees (1 of 4 did once)
            assert s.policy_k0_rounds >= s.rounds // 2, s
            assert s.rounds_by_k[0] >= s.policy_k0_rounds


def test_request_overrides_the_default_policy(adaptive_stack, tokenizer, reference):
    ids = tokenizer(PROMPTS[1]).input_ids
    with Client(adaptive_stack["fixed"], timeout=120) as client:
        fixed = client.generate(token_ids=ids, max_new_tokens=N, k=3)
        adaptive = client.generate(token_ids=ids, max_new_tokens=N, k=3, k_policy="adaptive")
    with Client(adaptive_stack["adaptive"], timeout=120) as client:
        forced = client.generate(token_ids=ids, max_new_tokens=N, k=3, k_policy="fixed")
    assert list(fixed.tokens) == list(adaptive.tokens) == list(forced.tokens) == reference(ids, N)
    check_policy_stats(adaptive.stats, 3)
    for s in (fixed.stats, forced.stats):
        assert s.k_policy == "fixed" and s.policy_k0_rounds == 0
        # Every round drafts k = 3 but those that end near max_new_tokens.
        assert s.rounds_by_k[3] >= s.rounds - 2 and sum(s.rounds_by_k) == s.rounds


def test_adaptive_multi_turn_equals_generate(adaptive_stack, tokenizer, reference):
    """Two turns of one session under the adaptive default with SSD: the second turn's
    caches are reused (no resend) and both turns are generate()'s tokens."""
    p1, p2 = tokenizer(PROMPTS[2]).input_ids, tokenizer(" and then").input_ids
    with Client(adaptive_stack["adaptive-ssd"], timeout=120) as client:
        t1 = client.generate(token_ids=p1, max_new_tokens=N, k=4, session_id="adaptive-turns")
        t2 = client.generate(token_ids=p2, max_new_tokens=N, k=4, session_id="adaptive-turns")
    assert list(t1.tokens) == reference(p1, N)
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], N)
    assert t2.stats.k_policy == "adaptive" and t2.stats.cache_misses == 0


def test_seeded_sampling_keeps_the_fixed_policy(adaptive_stack, tokenizer):
    """A seeded sampled request that names no policy drafts fixed (its output is
    reproducible for a given sequence of drafts): the same output twice; one that names
    adaptive gets it."""
    ids = tokenizer(PROMPTS[1]).input_ids
    with Client(adaptive_stack["adaptive"], timeout=120) as client:
        a, b = (
            client.generate(token_ids=ids, max_new_tokens=12, k=3, temperature=1.0, seed=5)
            for _ in range(2)
        )
        asked = client.generate(
            token_ids=ids, max_new_tokens=12, k=3, temperature=1.0, seed=5, k_policy="adaptive"
        )
        unseeded = client.generate(token_ids=ids, max_new_tokens=12, k=3, temperature=1.0)
    assert a.stats.k_policy == b.stats.k_policy == "fixed"
    assert list(a.tokens) == list(b.tokens)
    assert asked.stats.k_policy == unseeded.stats.k_policy == "adaptive"


def test_bad_k_policy_is_invalid_argument(adaptive_stack):
    request = build_generate_request("def f():", max_new_tokens=4)
    request.speculation.k_policy = 7  # proto3 enums are open: the number arrives as sent
    with grpc.insecure_channel(adaptive_stack["fixed"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.k_policy" in e.value.details()
        # and the gateway keeps serving
        ok = stub.Generate(build_generate_request("def f():", max_new_tokens=2), timeout=60)
        assert ok.stats.k_policy == gateway_pb2.K_POLICY_FIXED
    with pytest.raises(ValueError, match="k_policy must be one of fixed, adaptive"):
        build_generate_request("def f():", k_policy="auto")


def test_adaptive_sampling_distribution(adaptive_stack, tokenizer, target_model):
    """Sampled 4-token sequences (temperature 1, top-k 2: 16 possible) through the adaptive
    gateway with SSD follow the target's distribution, every one within 5 sigma.

    Why changing k cannot change the distribution: each round is the exact rule of DESIGN
    §2 for the k it was given, and the policy fixes k before the round from earlier rounds
    only, so conditionally on the tokens so far every round's tokens follow the target.
    Eight requests at a time keep the verifier's queue up, so the policy does change k
    here (asserted: requests with rounds at k = 0 chosen by the policy, the first round's
    among them while the drafter prefills beside it, and rounds with a draft).
    """
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    results = sample_top2(adaptive_stack["adaptive-ssd"], ids, 1200, k=3)
    for r in results:
        check_policy_stats(r.stats, 3)
    policy_k0 = sum(r.stats.policy_k0_rounds for r in results)
    drafted = [sum(r.stats.rounds_by_k[1:]) for r in results]
    changed = sum(
        1 for r, d in zip(results, drafted, strict=True) if d and r.stats.policy_k0_rounds
    )
    assert policy_k0 > 0 and changed > 0, (policy_k0, changed)
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_the_first_round_prefills_the_drafter_beside_the_verifier(
    adaptive_stack, tokenizer, reference, tmp_path
):
    """The adaptive policy's first round of a request drafts nothing: the drafter, which
    holds nothing of the prompt, prefills it beside the verifier's prefill instead of
    before it (the recording shows each round's k and source). A fixed policy drafts its k
    from the first round. Greedy output equals generate()."""
    verifier, noisy = adaptive_stack["replicas"]
    record = {policy: tmp_path / policy for policy in ("adaptive", "fixed")}
    for policy, directory in record.items():
        gw = gateway([noisy], [verifier], None, "--k-policy", policy, "--record", str(directory))
        try:
            gw.wait_healthy()
            with Client(gw.address, timeout=120) as client:
                for text in PROMPTS[:3]:
                    ids = tokenizer(text).input_ids
                    got = client.generate(token_ids=ids, max_new_tokens=N, k=4)
                    assert list(got.tokens) == reference(ids, N), (policy, text)
        finally:
            gw.stop()  # the recorder writes what is queued
    adaptive = [r for f in sorted(record["adaptive"].glob("*.jsonl")) for r in read_rows(f)]
    fixed = [r for f in sorted(record["fixed"].glob("*.jsonl")) for r in read_rows(f)]
    assert len(adaptive) == len(fixed) == 3
    for row in adaptive:
        # (what later rounds draft is the policy's choice from their measured costs)
        assert row["round_k"][0] == 0 and row["round_source"][0] == "none", row
    for row in fixed:
        assert row["round_k"][0] == 4, row


def test_goodput_guard_switches_mid_request_and_stays_exact(adaptive_stack, tokenizer, reference):
    """Concurrent sessions under the goodput guard with short epochs (and SSD): its epochs
    switch between speculation and plain steps while the requests run, the drafter kept
    fed in the plain ones, and every output is still generate()'s. Batches repeat until
    the gateway's metrics show epochs of both modes measured (a few suffice)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_batching import scrape
    from tests.integration.test_gateway import _free_port

    verifier, noisy = adaptive_stack["replicas"]
    port = _free_port()
    flags = ("--k-policy", "adaptive", "--ssd", "--guard-epoch-seconds", "0.05")
    gw = gateway([noisy], [verifier], None, *flags, "--metrics-port", str(port))
    prompts = [tokenizer(text).input_ids for text in PROMPTS[:4]]
    n = 64
    epochs = {}
    try:
        gw.wait_healthy()
        with Client(gw.address, timeout=300) as client, ThreadPoolExecutor(4) as pool:

            def one(ids):
                return client.generate(token_ids=ids, max_new_tokens=n, k=4)

            for _ in range(6):
                for ids, got in zip(prompts, pool.map(one, prompts), strict=True):
                    assert list(got.tokens) == reference(ids, n)
                samples = scrape(port)
                name = "specdec_gateway_guard_epochs_total"
                epochs = {m: samples.get(f'{name}{{mode="{m}"}}', 0) for m in ("spec", "plain")}
                if all(epochs.values()):
                    break
    finally:
        gw.stop()
    assert epochs["spec"] > 0 and epochs["plain"] > 0, epochs
