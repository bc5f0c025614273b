"""Generated and malformed requests against the gateway, the drafter and the verifier,
through real processes on loopback (issue 11): no crash, no UNKNOWN or INTERNAL status,
every service SERVING afterwards.

Requests come from a seeded generator (reproducible: SPECDEC_FUZZ_SEED), in three kinds:
random bytes, valid requests with bytes flipped, and well-formed requests with values drawn
across and beyond their ranges. The loop is bounded in count (SPECDEC_FUZZ_N, default
10,000) and in time (SPECDEC_FUZZ_SECONDS, default 900); the count reached is asserted.
"""

from __future__ import annotations

import collections
import os
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

N = int(os.environ.get("SPECDEC_FUZZ_N", "10000"))
SECONDS = float(os.environ.get("SPECDEC_FUZZ_SECONDS", "900"))
SEED = int(os.environ.get("SPECDEC_FUZZ_SEED", "11"))
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def stack(test_models):
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy, "--max-cached-tokens", "4096")
        v = replica("verifier", test_models.target, "--max-cached-tokens", "4096")
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        g = gateway([d], [v], None, "--max-new-tokens", "8")
        procs.append(g)
        g.wait_healthy()
        yield {"drafter": d, "verifier": v, "gateway": g, "vocab": test_models.vocab_size}
    finally:
        for p in procs:
            p.stop()


class Gen:
    """Draws requests; values reach past every documented range on purpose."""

    def __init__(self, rng: random.Random, vocab: int):
        self.r = rng
        self.vocab = vocab

    def token(self) -> int:
        r = self.r.random()
        if r < 0.9:
            return self.r.randrange(self.vocab)
        return self.r.choice([-1, self.vocab, 2**31 - 1, 2**40, -(2**40), 2**63 - 1])

    def tokens(self, most: int = 40) -> list[int]:
        return [self.token() for _ in range(self.r.choice([0, 1, 2, 5, most]))]

    def small(self, hi: int) -> int:
        return self.r.choice([0, 1, 2, 3, hi, hi + 1, self.r.randrange(hi + 2)])

    def sampling(self) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams(
            temperature=self.r.choice([0.0, 0.0, 0.7, 1.0, -1.0, float("nan"), float("inf")]),
            top_p=self.r.choice([0.0, 0.9, 1.0, 1.5, -0.1]),
            top_k=self.r.choice([0, 0, 5, -3, 10**6]),
        )
        if self.r.random() < 0.5:
            msg.seed = self.r.randrange(2**64)
        return msg

    def prefix(self) -> common_pb2.CachedPrefix:
        return common_pb2.CachedPrefix(
            length=self.r.choice([0, 0, 1, 5, 4096, 2**32 - 1]), hash=self.r.randrange(2**64)
        )

    def dist(self) -> common_pb2.DraftDistribution:
        if self.r.random() < 0.5:
            n = self.r.choice([0, 1, 3])
            ids = [self.token() for _ in range(n)]
            probs = [self.r.choice([1.0 / max(n, 1), -1.0, float("nan"), 2.0]) for _ in range(n)]
            return common_pb2.DraftDistribution(
                sparse=common_pb2.SparseProbs(token_ids=ids, probs=probs)
            )
        size = self.r.choice([0, 1, 2 * self.vocab, 2 * self.vocab - 1])
        return common_pb2.DraftDistribution(
            dense=common_pb2.DenseProbs(
                format=self.r.choice([0, 1, 2, 7]), data=self.r.randbytes(size)
            )
        )

    def session(self) -> str:
        return self.r.choice(["", "s/a", "s/b", "x" * 300, "s/\u00e9\u0000"])

    # -- one request per method ---------------------------------------------------------

    def generate(self):
        msg = gateway_pb2.GenerateRequest(max_new_tokens=self.small(8), sampling=self.sampling())
        if self.r.random() < 0.5:
            msg.prompt = self.r.choice(
                ["", "def f(x):", "\u00e9\u00e8" * 5, "a" * 40, "\udcff"[:0]]
            )
        elif self.r.random() < 0.9:
            msg.prompt_token_ids.ids.extend(self.tokens())
        msg.stop.extend(self.r.choice([[], ["\n"], [""], ["x" * 300], ["a"] * 20]))
        if self.r.random() < 0.4:
            msg.session.id = self.session()
            msg.session.mode = self.r.choice([0, 1, 5])
            msg.session.ttl_seconds = self.r.choice([0, 10, 2**31])
        if self.r.random() < 0.7:
            msg.speculation.num_draft_tokens = self.small(16)
            msg.speculation.ssd = self.r.random() < 0.5
        return msg

    def draft(self):
        return drafter_pb2.DraftRequest(
            session_id=self.session(),
            prefix=self.prefix(),
            new_tokens=self.tokens(),
            num_draft_tokens=self.small(16),
            sampling=self.sampling(),
        )

    def speculate(self):
        msg = drafter_pb2.SpeculateRequest(
            session_id=self.session(),
            prefix=self.prefix(),
            new_tokens=self.tokens(),
            draft_length=self.small(16),
            num_draft_tokens=self.small(16),
            sampling=self.sampling(),
            fan_out=self.small(64),
        )
        if self.r.random() < 0.5:
            msg.acceptance_rate = self.r.choice([0.0, 0.5, 1.0, 1.5, float("nan")])
        return msg

    def verify(self):
        k = self.small(16)
        msg = verifier_pb2.VerifyRequest(
            session_id=self.session(),
            prefix=self.prefix(),
            new_tokens=self.tokens(),
            draft_tokens=[self.token() for _ in range(k)],
            sampling=self.sampling(),
        )
        if self.r.random() < 0.5:
            msg.draft_probs.extend(self.dist() for _ in range(self.r.choice([k, 0, 1])))
        return msg

    def info(self):
        return common_pb2.InfoRequest(include_tokenizer=self.r.random() < 0.1)

    def release(self):
        return common_pb2.ReleaseRequest(session_id=self.session())

    def server_info(self):
        return gateway_pb2.GetServerInfoRequest()


METHODS = [
    ("gateway", "/specdec.v1.GatewayService/Generate", "generate", 6),
    ("gateway", "/specdec.v1.GatewayService/GenerateStream", "generate", 3),
    ("gateway", "/specdec.v1.GatewayService/GetServerInfo", "server_info", 1),
    ("drafter", "/specdec.v1.DrafterService/Draft", "draft", 4),
    ("drafter", "/specdec.v1.DrafterService/Speculate", "speculate", 4),
    ("drafter", "/specdec.v1.DrafterService/Info", "info", 1),
    ("drafter", "/specdec.v1.DrafterService/Release", "release", 1),
    ("verifier", "/specdec.v1.VerifierService/Verify", "verify", 5),
    ("verifier", "/specdec.v1.VerifierService/Info", "info", 1),
    ("verifier", "/specdec.v1.VerifierService/Release", "release", 1),
    ("gateway", "/grpc.health.v1.Health/Check", "info", 1),  # any bytes: a wrong message
]


def payload(gen: Gen, rng: random.Random, maker: str) -> bytes:
    kind = rng.random()
    if kind < 0.2:
        return rng.randbytes(rng.choice([0, 1, 3, 16, 64]))
    raw = bytearray(getattr(gen, maker)().SerializeToString())
    if kind < 0.45 and raw:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


def test_fuzz_the_three_services(stack):
    rng = random.Random(SEED)
    gen = Gen(rng, stack["vocab"])
    channels = {role: grpc.insecure_channel(stack[role].address) for role in ("gateway", "drafter", "verifier")}  # fmt: skip
    weights = [w for *_, w in METHODS]
    codes: collections.Counter = collections.Counter()
    bad: list[tuple[str, str, str]] = []
    started = time.monotonic()
    sent = 0
    try:
        while sent < N and time.monotonic() - started < SECONDS:
            role, method, maker, _ = rng.choices(METHODS, weights)[0]
            data = payload(gen, rng, maker)
            channel = channels[role]
            try:
                if method.endswith("GenerateStream"):
                    list(channel.unary_stream(method)(data, timeout=30))
                else:
                    channel.unary_unary(method)(data, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                if code in FORBIDDEN or code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    bad.append((method, code.name, (e.details() or "")[:200]))
            codes[code.name] += 1
            sent += 1
    finally:
        for channel in channels.values():
            channel.close()
    print(f"fuzz: {sent} requests in {time.monotonic() - started:.0f}s: {dict(codes)}")
    assert not bad, bad[:10]
    assert sent >= N, f"only {sent} of {N} requests in {SECONDS:.0f}s"
    for role in ("gateway", "drafter", "verifier"):
        proc = stack[role]
        assert proc.alive(), proc.tail()
        with grpc.insecure_channel(proc.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
