"""Drafter and verifier as real processes on loopback, driven over gRPC from the test."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from specdec.common.prefix import prefix_hash
from specdec.tools.launcher import ServiceProcess
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS, start_up_error

pytestmark = pytest.mark.integration

MAX_DRAFT = 8


def start(role: str, model, *flags: str) -> ServiceProcess:
    return ServiceProcess.specdec(
        role, "serve", role, "--model", str(model), "--port", "0", "--host", "127.0.0.1", *flags
    ).start()


@pytest.fixture(scope="module")
def services(test_models):
    drafter = start("drafter", test_models.draft_noisy, "--max-draft-tokens", str(MAX_DRAFT))
    verifier = start("verifier", test_models.target, "--max-draft-tokens", str(MAX_DRAFT))
    try:
        drafter.wait_healthy()
        verifier.wait_healthy()
        yield drafter, verifier
    finally:
        drafter.stop()
        verifier.stop()


@pytest.fixture(scope="module")
def stubs(services):
    drafter, verifier = services
    dch, vch = grpc.insecure_channel(drafter.address), grpc.insecure_channel(verifier.address)
    yield drafter_pb2_grpc.DrafterServiceStub(dch), verifier_pb2_grpc.VerifierServiceStub(vch)
    dch.close()
    vch.close()


def prefix(tokens: list[int], length: int) -> common_pb2.CachedPrefix:
    return common_pb2.CachedPrefix(length=length, hash=prefix_hash(tokens[:length]))


class Loop:
    """The speculation loop of DESIGN §2, driven by hand (the gateway's job, later)."""

    def __init__(self, drafter, verifier, session: str, sampling=None):
        self.drafter, self.verifier, self.session = drafter, verifier, session
        self.sampling = sampling or common_pb2.SamplingParams()
        self.drafter_cached = 0
        self.verifier_cached = 0
        self.rounds = self.accepted = self.bonus = self.recovered = 0

    def round(self, ctx: list[int], k: int) -> list[int]:
        draft_tokens, draft_probs = [], []
        if k:
            n = min(self.drafter_cached, len(ctx) - 1)
            d = self.drafter.Draft(
                drafter_pb2.DraftRequest(
                    session_id=self.session,
                    prefix=prefix(ctx, n),
                    new_tokens=ctx[n:],
                    num_draft_tokens=k,
                    sampling=self.sampling,
                ),
                timeout=30,
            )
            self.drafter_cached = d.cached_length
            draft_tokens, draft_probs = list(d.draft_tokens), list(d.draft_probs)
        n = min(self.verifier_cached, len(ctx) - 1)
        v = self.verifier.Verify(
            verifier_pb2.VerifyRequest(
                session_id=self.session,
                prefix=prefix(ctx, n),
                new_tokens=ctx[n:],
                draft_tokens=draft_tokens,
                draft_probs=draft_probs,
                sampling=self.sampling,
            ),
            timeout=30,
        )
        assert v.cached_length == len(ctx) + v.accepted_count
        self.verifier_cached = v.cached_length
        self.rounds += 1
        self.accepted += v.accepted_count
        if v.next_token_kind == verifier_pb2.NEXT_TOKEN_KIND_BONUS:
            assert v.accepted_count == k
            self.bonus += 1
        else:
            assert v.accepted_count < k
            self.recovered += 1
        # The drafter cached d_1..d_{k-1}; only the accepted ones stay valid.
        self.drafter_cached = min(self.drafter_cached, len(ctx) + v.accepted_count)
        return [*draft_tokens[: v.accepted_count], v.next_token]

    def generate(self, prompt: list[int], max_new: int, k: int, eos: int) -> list[int]:
        ctx, out = list(prompt), []
        while len(out) < max_new:
            new = self.round(ctx, k)
            ctx += new
            out += new
            if eos in out:
                return out[: out.index(eos) + 1]
        return out[:max_new]


def test_health_and_reflection(services):
    for proc, service in zip(
        services, ("specdec.v1.DrafterService", "specdec.v1.VerifierService"), strict=True
    ):
        with grpc.insecure_channel(proc.address) as ch:
            for name in ("", service):
                status = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=name), timeout=5
                )
                assert status.status == health_pb2.HealthCheckResponse.SERVING
            names = ProtoReflectionDescriptorDatabase(ch).get_services()
            assert service in names
            assert "grpc.health.v1.Health" in names


def test_info(stubs, test_models):
    drafter, verifier = stubs
    d = drafter.Info(common_pb2.InfoRequest(include_tokenizer=True), timeout=10)
    v = verifier.Info(common_pb2.InfoRequest(), timeout=10)
    assert d.role == common_pb2.ROLE_DRAFTER and v.role == common_pb2.ROLE_VERIFIER
    assert d.vocab_size == v.vocab_size == test_models.vocab_size
    assert d.tokenizer_fingerprint == v.tokenizer_fingerprint
    assert len(d.tokenizer_fingerprint) == 64
    assert d.tokenizer_json_zlib and not v.tokenizer_json_zlib
    assert v.max_context == 512 and v.max_draft_tokens == MAX_DRAFT
    assert test_models.eos_token_id in v.eos_token_ids
    assert v.dtype == "float32" and v.device == "cpu"


@pytest.mark.parametrize("k", [4, 0])
def test_greedy_loop_equals_generate(stubs, tokenizer, reference, test_models, k):
    drafter, verifier = stubs
    total_rounds = total_tokens = 0
    loops = []
    for i, text in enumerate(PROMPTS[:5]):
        ids = tokenizer(text).input_ids
        loop = Loop(drafter, verifier, f"greedy-k{k}-{i}")
        got = loop.generate(ids, 40, k, test_models.eos_token_id)
        assert got == reference(ids, 40), f"prompt {text!r}"
        total_rounds += loop.rounds
        total_tokens += len(got)
        loops.append(loop)
    if k == 0:
        assert total_rounds == total_tokens  # one target step per token
    else:
        # The walk visited every path: accepted drafts, rejections (recovered) and bonus.
        assert sum(lp.accepted for lp in loops) > 0
        assert sum(lp.recovered for lp in loops) > 0
        assert sum(lp.bonus for lp in loops) > 0
        assert total_rounds < total_tokens


def test_seeded_sampling_is_reproducible(stubs, tokenizer, test_models):
    drafter, verifier = stubs
    ids = tokenizer(PROMPTS[1]).input_ids
    sampling = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    runs = [
        Loop(drafter, verifier, f"seeded-{i}", sampling).generate(ids, 24, 4, -1) for i in range(2)
    ]
    assert runs[0] == runs[1]
    other = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert Loop(drafter, verifier, "seeded-x", other).generate(ids, 24, 4, -1) != runs[0]


def test_dense_draft_distribution(stubs, tokenizer, test_models):
    """Without top-k/top-p the draft distribution travels dense (fp16) and verifies."""
    drafter, _verifier = stubs
    ids = tokenizer(PROMPTS[0]).input_ids
    d = drafter.Draft(
        drafter_pb2.DraftRequest(
            session_id="dense",
            prefix=prefix(ids, 0),
            new_tokens=ids,
            num_draft_tokens=3,
            sampling=common_pb2.SamplingParams(temperature=1.0, seed=5),
        ),
        timeout=30,
    )
    assert [p.WhichOneof("probs") for p in d.draft_probs] == ["dense"] * 3
    assert len(d.draft_probs[0].dense.data) == 2 * test_models.vocab_size
    sparse = drafter.Draft(
        drafter_pb2.DraftRequest(
            session_id="sparse",
            prefix=prefix(ids, 0),
            new_tokens=ids,
            num_draft_tokens=3,
            sampling=common_pb2.SamplingParams(temperature=1.0, top_k=5, seed=5),
        ),
        timeout=30,
    )
    assert [p.WhichOneof("probs") for p in sparse.draft_probs] == ["sparse"] * 3
    assert all(len(p.sparse.token_ids) <= 5 for p in sparse.draft_probs)
    for p in sparse.draft_probs:
        assert math.isclose(sum(p.sparse.probs), 1.0, rel_tol=1e-5)


def test_cache_miss_then_full_resend(stubs, tokenizer):
    drafter, verifier = stubs
    ids = tokenizer(PROMPTS[2]).input_ids
    req = dict(session_id="miss", new_tokens=ids[5:], sampling=common_pb2.SamplingParams())
    # Unknown session with a non-empty prefix.
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(verifier_pb2.VerifyRequest(prefix=prefix(ids, 5), **req), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("cache miss")
    with pytest.raises(grpc.RpcError) as err:
        drafter.Draft(
            drafter_pb2.DraftRequest(prefix=prefix(ids, 5), num_draft_tokens=2, **req), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Full resend works, then a prefix with the right length but other tokens misses.
    full = verifier.Verify(
        verifier_pb2.VerifyRequest(session_id="miss", prefix=prefix(ids, 0), new_tokens=ids),
        timeout=10,
    )
    assert full.cached_length == len(ids)
    wrong = [*ids[:-2], (ids[-2] + 1) % 300]
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(
            verifier_pb2.VerifyRequest(
                session_id="miss", prefix=prefix(wrong, len(wrong)), new_tokens=[ids[-1]]
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "different tokens" in err.value.details()
    # Longer than what is cached: miss, not a silent wrong answer.
    longer = [*ids, full.next_token, 7]
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(
            verifier_pb2.VerifyRequest(
                session_id="miss", prefix=prefix(longer, len(longer)), new_tokens=[3]
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_rollback_keeps_only_accepted(stubs, tokenizer, reference):
    """A rejected draft is rolled back: the next round continues from the cache, exactly."""
    _drafter, verifier = stubs
    ids = tokenizer(PROMPTS[3]).input_ids
    ref = reference(ids, 12)
    bad_draft = [(ref[0] + 1) % 300, ref[1], ref[2]]  # first token wrong: all rejected
    v = verifier.Verify(
        verifier_pb2.VerifyRequest(
            session_id="rollback", prefix=prefix(ids, 0), new_tokens=ids, draft_tokens=bad_draft
        ),
        timeout=10,
    )
    assert v.accepted_count == 0 and v.next_token == ref[0]
    assert v.next_token_kind == verifier_pb2.NEXT_TOKEN_KIND_RECOVERED
    assert v.cached_length == len(ids)
    ctx = [*ids, v.next_token]
    # Continue from the cache: the right draft is fully accepted, bonus follows.
    v2 = verifier.Verify(
        verifier_pb2.VerifyRequest(
            session_id="rollback",
            prefix=prefix(ctx, len(ids)),
            new_tokens=ctx[len(ids) :],
            draft_tokens=ref[1:4],
        ),
        timeout=10,
    )
    assert v2.accepted_count == 3 and v2.next_token == ref[4]
    assert v2.next_token_kind == verifier_pb2.NEXT_TOKEN_KIND_BONUS
    assert v2.cached_length == len(ids) + 4


def test_release(stubs, tokenizer):
    _drafter, verifier = stubs
    ids = tokenizer(PROMPTS[0]).input_ids
    verifier.Verify(
        verifier_pb2.VerifyRequest(session_id="rel", prefix=prefix(ids, 0), new_tokens=ids),
        timeout=10,
    )
    assert verifier.Release(common_pb2.ReleaseRequest(session_id="rel"), timeout=5).released
    assert not verifier.Release(common_pb2.ReleaseRequest(session_id="rel"), timeout=5).released
    with pytest.raises(grpc.RpcError) as err:
        verifier.Verify(
            verifier_pb2.VerifyRequest(session_id="rel", prefix=prefix(ids, 3), new_tokens=ids[3:]),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _dense(values: list[float]) -> common_pb2.DraftDistribution:
    import numpy as np

    return common_pb2.DraftDistribution(
        dense=common_pb2.DenseProbs(
            format=common_pb2.PROB_FORMAT_FLOAT16, data=np.asarray(values, np.float16).tobytes()
        )
    )


def _sparse(ids: list[int], probs: list[float]) -> common_pb2.DraftDistribution:
    return common_pb2.DraftDistribution(sparse=common_pb2.SparseProbs(token_ids=ids, probs=probs))


def bad_requests(ids: list[int], vocab: int):
    """(name, rpc, request, expected status, message fragment)."""
    sampled = common_pb2.SamplingParams(temperature=1.0)
    uniform = [1.0 / vocab] * vocab
    nan = [float("nan")] * vocab
    v = verifier_pb2.VerifyRequest
    d = drafter_pb2.DraftRequest
    s = drafter_pb2.SpeculateRequest
    p0 = prefix(ids, 0)
    inv = grpc.StatusCode.INVALID_ARGUMENT
    return [
        (
            "oov new token",
            "draft",
            d(session_id="b", prefix=p0, new_tokens=[*ids, vocab], num_draft_tokens=2),
            inv,
            "outside the vocabulary",
        ),
        (
            "negative token",
            "verify",
            v(session_id="b", prefix=p0, new_tokens=[-1]),
            inv,
            "outside the vocabulary",
        ),
        (
            "oov draft token",
            "verify",
            v(session_id="b", prefix=p0, new_tokens=ids, draft_tokens=[vocab + 5]),
            inv,
            "draft_tokens",
        ),
        ("empty input", "verify", v(session_id="b", prefix=p0, new_tokens=[]), inv, "empty"),
        (
            "empty input draft",
            "draft",
            d(session_id="b", prefix=p0, new_tokens=[], num_draft_tokens=1),
            inv,
            "empty",
        ),
        ("empty session", "verify", v(session_id="", prefix=p0, new_tokens=ids), inv, "session_id"),
        (
            "k too large",
            "draft",
            d(session_id="b", prefix=p0, new_tokens=ids, num_draft_tokens=MAX_DRAFT + 1),
            inv,
            "num_draft_tokens",
        ),
        (
            "k zero draft",
            "draft",
            d(session_id="b", prefix=p0, new_tokens=ids, num_draft_tokens=0),
            inv,
            "num_draft_tokens",
        ),
        (
            "draft too long",
            "verify",
            v(session_id="b", prefix=p0, new_tokens=ids, draft_tokens=[1] * (MAX_DRAFT + 1)),
            inv,
            "max_draft_tokens",
        ),
        (
            "beyond context",
            "verify",
            v(session_id="b", prefix=p0, new_tokens=[5] * 510, draft_tokens=[1, 2, 3]),
            inv,
            "context",
        ),
        (
            "beyond context draft",
            "draft",
            d(session_id="b", prefix=p0, new_tokens=[5] * 510, num_draft_tokens=4),
            inv,
            "context",
        ),
        (
            "missing draft probs",
            "verify",
            v(session_id="b", prefix=p0, new_tokens=ids, draft_tokens=[1, 2], sampling=sampled),
            inv,
            "draft_probs",
        ),
        (
            "dense wrong length",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_dense([0.5, 0.5])],
                sampling=sampled,
            ),
            inv,
            "entries",
        ),
        (
            "dense nan",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_dense(nan)],
                sampling=sampled,
            ),
            inv,
            "non-finite",
        ),
        (
            "dense mass",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_dense([3 * x for x in uniform])],
                sampling=sampled,
            ),
            inv,
            "sums to",
        ),
        (
            "sparse oov",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_sparse([1, vocab], [0.5, 0.5])],
                sampling=sampled,
            ),
            inv,
            "outside",
        ),
        (
            "sparse lengths",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_sparse([1, 2], [1.0])],
                sampling=sampled,
            ),
            inv,
            "ids but",
        ),
        (
            "sparse negative",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[_sparse([1, 2], [1.5, -0.5])],
                sampling=sampled,
            ),
            inv,
            "negative",
        ),
        (
            "dense no data",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[
                    common_pb2.DraftDistribution(
                        dense=common_pb2.DenseProbs(format=common_pb2.PROB_FORMAT_FLOAT16)
                    )
                ],
                sampling=sampled,
            ),
            inv,
            "no data",
        ),
        (
            "empty distribution",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_tokens=[1],
                draft_probs=[common_pb2.DraftDistribution()],
                sampling=sampled,
            ),
            inv,
            "empty",
        ),
        (
            "temperature",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                sampling=common_pb2.SamplingParams(temperature=-1),
            ),
            inv,
            "temperature",
        ),
        (
            "top_p",
            "draft",
            d(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                num_draft_tokens=1,
                sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5),
            ),
            inv,
            "top_p",
        ),
        (
            "top_k",
            "draft",
            d(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                num_draft_tokens=1,
                sampling=common_pb2.SamplingParams(temperature=1, top_k=-3),
            ),
            inv,
            "top_k",
        ),
        (
            "speculate draft_length zero",
            "speculate",
            s(session_id="b", prefix=p0, new_tokens=ids, draft_length=0, num_draft_tokens=2),
            inv,
            "draft_length",
        ),
        (
            "speculate without the token before the draft",
            "speculate",
            s(session_id="b", prefix=p0, new_tokens=[5, 6], draft_length=2, num_draft_tokens=2),
            inv,
            "at least 3 tokens",
        ),
        (
            "speculate next k zero",
            "speculate",
            s(session_id="b", prefix=p0, new_tokens=ids, draft_length=1, num_draft_tokens=0),
            inv,
            "num_draft_tokens",
        ),
        (
            "speculate fan-out too large",
            "speculate",
            s(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_length=1,
                num_draft_tokens=2,
                fan_out=65,
            ),
            inv,
            "fan_out",
        ),
        (
            "speculate acceptance rate nan",
            "speculate",
            s(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                draft_length=1,
                num_draft_tokens=2,
                acceptance_rate=float("nan"),
            ),
            inv,
            "acceptance_rate",
        ),
        (
            "speculate oov",
            "speculate",
            s(
                session_id="b",
                prefix=p0,
                new_tokens=[*ids, vocab],
                draft_length=1,
                num_draft_tokens=2,
            ),
            inv,
            "outside the vocabulary",
        ),
        (
            "speculate beyond context",
            "speculate",
            s(
                session_id="b",
                prefix=p0,
                new_tokens=[5] * 505,
                draft_length=2,
                num_draft_tokens=8,
            ),
            inv,
            "context",
        ),
        (
            "nan temperature",
            "verify",
            v(
                session_id="b",
                prefix=p0,
                new_tokens=ids,
                sampling=common_pb2.SamplingParams(temperature=float("nan")),
            ),
            inv,
            "temperature",
        ),
    ]


def test_bad_input_is_rejected_and_harms_nothing(
    stubs, services, tokenizer, test_models, reference
):
    drafter, verifier = stubs
    ids = tokenizer(PROMPTS[4]).input_ids
    # A healthy session in flight before the bad requests...
    loop = Loop(drafter, verifier, "bystander")
    ctx = list(ids)
    for _ in range(3):
        ctx += loop.round(ctx, 4)
    for name, rpc, request, code, fragment in bad_requests(ids, test_models.vocab_size):
        call = {"draft": drafter.Draft, "verify": verifier.Verify, "speculate": drafter.Speculate}[
            rpc
        ]
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == code, f"{name}: {err.value.code()} {err.value.details()}"
        assert fragment in err.value.details(), f"{name}: {err.value.details()!r}"
    assert all(proc.alive() for proc in services)
    # ... continues from its caches (no miss) and stays exact.
    while len(ctx) - len(ids) < 30:
        ctx += loop.round(ctx, 4)
    got = ctx[len(ids) : len(ids) + 30]
    assert got == reference(ids, 30)[: len(got)]


def test_eviction_and_capacity(test_models, tokenizer):
    """A 64-token bound: a second session evicts the first (LRU); oversize is refused."""
    proc = start("verifier", test_models.target, "--max-cached-tokens", "64").wait_healthy()
    try:
        with grpc.insecure_channel(proc.address) as ch:
            verifier = verifier_pb2_grpc.VerifierServiceStub(ch)
            a = list(range(10, 50))  # 40 tokens
            b = list(range(60, 90))  # 30 tokens
            verifier.Verify(
                verifier_pb2.VerifyRequest(session_id="a", prefix=prefix(a, 0), new_tokens=a),
                timeout=10,
            )
            verifier.Verify(
                verifier_pb2.VerifyRequest(session_id="b", prefix=prefix(b, 0), new_tokens=b),
                timeout=10,
            )
            info = verifier.Info(common_pb2.InfoRequest(), timeout=5)
            assert info.cached_tokens <= 64 and info.cached_sessions == 1
            with pytest.raises(grpc.RpcError) as err:  # a was evicted
                verifier.Verify(
                    verifier_pb2.VerifyRequest(
                        session_id="a", prefix=prefix(a, 40), new_tokens=[5]
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # b is still there and continues from its cache.
            r = verifier.Verify(
                verifier_pb2.VerifyRequest(session_id="b", prefix=prefix(b, 30), new_tokens=[5]),
                timeout=10,
            )
            assert r.cached_length == 31
            with pytest.raises(grpc.RpcError) as err:
                verifier.Verify(
                    verifier_pb2.VerifyRequest(
                        session_id="c", prefix=prefix([], 0), new_tokens=list(range(1, 70))
                    ),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max-cached-tokens" in err.value.details()
    finally:
        assert proc.stop() == 0  # graceful shutdown on SIGTERM exits cleanly


def test_speculate_prepares_drafts_that_a_matching_draft_takes(stubs, tokenizer):
    """Speculate after a sampled draft: a Draft for one branch's outcome gets that branch
    (tokens and distributions) without a forward; any other Draft drafts afresh."""
    drafter, _ = stubs
    sampled = common_pb2.SamplingParams(temperature=1.0, top_k=5, seed=3)
    ids = tokenizer(PROMPTS[1]).input_ids
    d = drafter.Draft(
        drafter_pb2.DraftRequest(
            session_id="ssd",
            prefix=prefix(ids, 0),
            new_tokens=ids,
            num_draft_tokens=3,
            sampling=sampled,
        ),
        timeout=30,
    )
    draft = list(d.draft_tokens)
    assert not d.prepared and d.cached_length == len(ids) + 2
    n = len(ids) - 1  # the request carries the token before the draft and the draft
    seq = [*ids, *draft]
    spec = drafter.Speculate(
        drafter_pb2.SpeculateRequest(
            session_id="ssd",
            prefix=prefix(seq, n),
            new_tokens=seq[n:],
            draft_length=3,
            num_draft_tokens=2,
            sampling=sampled,
            fan_out=5,
        ),
        timeout=30,
    )
    assert spec.cached_length == len(seq)
    keys = [(b.accepted_count, b.next_token) for b in spec.branches]
    assert len(keys) == 5 and len(set(keys)) == 5
    for a, t in keys:
        assert 0 <= a <= 3 and (a == 3 or t != draft[a])  # a rejected token is not retried
    assert all(len(b.draft_tokens) == 2 for b in spec.branches)
    branch = spec.branches[-1]
    a, t = branch.accepted_count, branch.next_token
    ctx = [*ids, *draft[:a], t]
    after = drafter_pb2.DraftRequest(
        session_id="ssd",
        prefix=prefix(ctx, len(ids) + a),
        new_tokens=[t],
        num_draft_tokens=2,
        sampling=sampled,
    )
    hit = drafter.Draft(after, timeout=30)
    assert hit.prepared and list(hit.draft_tokens) == list(branch.draft_tokens)
    assert len(hit.draft_probs) == 2 and hit.cached_length == len(ids) + a
    # The branches were for one round only: the same request again drafts with a forward.
    again = drafter.Draft(after, timeout=30)
    assert not again.prepared and again.cached_length == len(ctx) + 1


def test_replicas_write_json_lines_only(services, stubs, tokenizer):
    """Every line either service wrote, stdout and stderr together, from start-up (weight
    loading) through forwards, is one JSON object: transformers' progress bars and
    warnings go through the logger, not straight to stderr."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    Loop(*stubs, session="json-lines").generate(ids, 6, 3, eos=-1)
    for proc in services:
        lines = [line for line in proc.lines if line.strip()]
        assert any('"listening"' in line for line in lines), "start-up lines are kept"
        for line in lines:
            try:
                assert isinstance(json.loads(line), dict), line
            except json.JSONDecodeError:
                pytest.fail(f"{proc.name} wrote a line that is not JSON: {line!r}")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device / SPECDEC_DEVICE: must be cpu, cuda or cuda:N (got 'tpu')"),
        ("cuda:0", "--device / SPECDEC_DEVICE: CUDA is not available on this machine"),
    ],
)
def test_a_device_the_machine_lacks_fails_start_up(test_models, device, message):
    """The spelling is checked with the rest of the config; whether the machine has the
    device, by the replica before it loads anything (so the shared config stays
    torch-free). Either way the verifier exits 2 with the setting named."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    stderr = start_up_error("verifier", test_models.target, "--device", device)
    assert f"configuration error: {message}" in stderr
