"""The cost model through real processes, on stand-in models whose forward of n tokens waits
a + b·n (tools/specdec/tools/bench/standin_model.py): a compute-bound verifier (b = 0.3 of a step per
token, like an AVX2 CPU in bfloat16) and a memory-bound one (b = 0.005 of a step, like an
idle GPU). The replicas fit their own cost curve and report it; the gateway's default
(adaptive) policy must choose short or no drafts on the first and long ones on the second.
Assertions are on the drafts the policy chose and on the output, never on wall time.

The stand-in target's output cycles through a period of 16 tokens and leaves it at a share
of positions (`noise`), which prompt lookup cannot predict: lookup acceptance is set by the
noise, the drafter's by its own disagreement."""

from __future__ import annotations

from contextlib import ExitStack

import grpc
import pytest

from specdec.common.cost import ReportedCost
from specdec.sdk import Client
from specdec.tools.bench.standin import build_standins
from specdec.v1 import common_pb2, verifier_pb2_grpc
from tests.integration.test_gateway import gateway, replica

N = 96
MAX_K = 6


def _stack(running: ExitStack, standins, *flags: str) -> dict[str, str]:
    """A drafter and a verifier on the stand-ins; gateways with the default policy
    (adaptive) under each method, and one with the fixed policy."""
    procs = [
        replica(role, model, "--trust-remote-code", "--max-batch-size", "1")
        for role, model in (("drafter", standins.draft), ("verifier", standins.target))
    ]
    for p in procs:
        running.callback(p.stop)
    for p in procs:
        p.wait_healthy()
    drafter, verifier = procs
    names = {  # the served default is adaptive; the harness's gateway() pins fixed
        "model": ("--method", "model", "--k-policy", "adaptive"),
        "ngram": ("--method", "ngram", "--k-policy", "adaptive"),
        "hybrid": ("--method", "hybrid", "--k-policy", "adaptive"),
        "fixed-ngram": ("--method", "ngram", "--k-policy", "fixed"),
    }
    gws = []
    for extra in names.values():
        g = gateway([drafter], [verifier], None, *extra, *flags)
        running.callback(g.stop)
        gws.append(g)
    for g in gws:
        g.wait_healthy()
    out = {name: g.address for name, g in zip(names, gws, strict=True)}
    out["verifier"] = verifier.address
    return out


@pytest.fixture(scope="module")
def compute_bound(tmp_path_factory):
    standins = build_standins(
        tmp_path_factory.mktemp("compute"),
        target_ms=1.4,
        target_per_token_ms=0.6,  # t(1) = 2.0 ms, each further token 0.3 of it
        draft_ms=0.6,
        acceptance=0.25,  # a drafter that agrees at 25% of positions
        period=16,
        noise=0.85,  # prompt lookup: almost every draft rejected
    )
    with ExitStack() as running:
        yield standins, _stack(running, standins)


@pytest.fixture(scope="module")
def memory_bound(tmp_path_factory):
    standins = build_standins(
        tmp_path_factory.mktemp("memory"),
        target_ms=20.0,
        target_per_token_ms=0.1,  # each further token 0.005 of a step
        draft_ms=0.5,
        acceptance=0.97,
        period=16,
        noise=0.05,
    )
    with ExitStack() as running:
        yield standins, _stack(running, standins)


def _prompt(standins) -> list[int]:
    return standins.prompt_ids(list(range(3, 15)))


def _generate(stack: dict[str, str], gateway: str, ids: list[int], k: int = MAX_K):
    with Client(stack[gateway], timeout=300) as client:
        return client.generate(token_ids=ids, max_new_tokens=N, k=k)


def test_the_verifier_reports_the_curve_it_runs_on(compute_bound):
    """Its Info carries t(n) = a + b·n fitted from its probe: b / t(1) near 0.3."""
    _, stack = compute_bound
    with grpc.insecure_channel(stack["verifier"]) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=30
        )
    assert not info.forward_cost.ragged  # the torch engines pad every row to the widest
    line = ReportedCost.from_proto(info.forward_cost).line(1)
    assert line.per_token_ms == pytest.approx(0.6, rel=0.5)
    assert line.step_share == pytest.approx(0.3, rel=0.5)


def test_compute_bound_poor_drafts_shrink_to_nothing(compute_bound):
    """Lookups rejected at 85% of positions: the fixed policy verifies whole matches every
    round; the adaptive default shrinks them to (almost) nothing. The draft model, right at
    25% of positions, is held at k = 0 for most rounds. Outputs equal the target alone's."""
    standins, stack = compute_bound
    ids = _prompt(standins)
    alone, model = _generate(stack, "model", ids, k=0), _generate(stack, "model", ids)
    ngram, hybrid = _generate(stack, "ngram", ids), _generate(stack, "hybrid", ids)
    fixed = _generate(stack, "fixed-ngram", ids)
    for got in (model, ngram, hybrid, fixed):
        assert list(got.tokens) == list(alone.tokens)
    assert [r.stats.k_policy for r in (model, ngram, hybrid)] == ["adaptive"] * 3
    assert fixed.stats.k_policy == "fixed"
    # The premise: lookups are mostly wrong, and the fixed policy drafts them whole.
    _, fixed_tokens, fixed_accepted = fixed.stats.by_source["ngram"]
    assert fixed_accepted / fixed_tokens < 0.3
    assert fixed.stats.draft_tokens / fixed.stats.rounds > 2
    # The adaptive policy verifies a small fraction of those tokens.
    assert ngram.stats.draft_tokens < fixed.stats.draft_tokens / 3, ngram.stats
    # The draft model is mostly off.
    assert model.stats.rounds_by_k[0] > model.stats.rounds / 2, model.stats
    assert model.stats.mean_k < 1.5
    # Hybrid: neither its lookups nor the model's drafts run long.
    assert hybrid.stats.mean_k < 2.0, hybrid.stats


def test_memory_bound_k_grows_to_the_bound(memory_bound):
    """A drafter right 97% of the time, drafts at a few hundredths of a step, verification
    nearly free (a 20 ms step, like a large target on a GPU):
    the adaptive policy drafts at (or next to) the request's bound, as the best fixed k
    would; lookups, right at 95% of positions past the first period, run long too."""
    standins, stack = memory_bound
    ids = _prompt(standins)
    alone, model = _generate(stack, "model", ids, k=0), _generate(stack, "model", ids)
    ngram = _generate(stack, "ngram", ids)
    assert list(model.tokens) == list(ngram.tokens) == list(alone.tokens)
    s = model.stats
    assert s.mean_k >= MAX_K - 1.5, s
    assert s.rounds_by_k[MAX_K] + s.rounds_by_k[MAX_K - 1] >= s.rounds / 2, s
    assert ngram.stats.draft_tokens / ngram.stats.rounds > 2, ngram.stats
