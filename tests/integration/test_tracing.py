"""Traces through real processes, exported over OTLP/gRPC to a real receiver on loopback.

The receiver (specdec.tools.otlpsink) is an in-process `TraceService` server built from
opentelemetry-proto: the same OTLP endpoint Jaeger or a collector offers (no Jaeger binary
installs here). Drafter, verifiers and gateway export to it as they would in production.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import format_span_id, format_trace_id

from specdec.gateway.sessions import replica_session_id
from specdec.sdk import Client
from specdec.tools.otlpsink import OtlpReceiver, ReceivedSpan, render_tree
from specdec.tools.redisproc import RedisProcess
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import _get_record, gateway, replica

pytestmark = pytest.mark.integration

GATEWAY = "specdec.v1.GatewayService"
REPLICA_SERVICES = {"specdec.v1.DrafterService", "specdec.v1.VerifierService"}


def otel_env(receiver: OtlpReceiver, delay_ms: int = 100) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms),
    }


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(test_models, receiver):
    """Redis, a drafter, two verifiers and a gateway, all exporting to the receiver."""
    env = otel_env(receiver)
    procs = []
    with RedisProcess() as redis:
        try:
            d = replica("drafter", test_models.draft_noisy, env=env)
            v1 = replica("verifier", test_models.target, env=env)
            v2 = replica("verifier", test_models.target, env=env)
            procs += [d, v1, v2]
            for p in procs:
                p.wait_healthy()
            g = gateway([d], [v1, v2], redis.url, env=env)
            procs.append(g)
            g.wait_healthy()
            yield {"drafter": d, "verifiers": [v1, v2], "gateway": g, "redis": redis}
        finally:
            for p in procs:
                p.stop()


def app_tracer(receiver: OtlpReceiver):
    """The test's own 'application' tracer (a local provider, not the global one)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "test-app"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True))
    )
    return provider, provider.get_tracer("test-app")


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


def complete(trace_id: str, rounds: int, lost: str = ""):
    """The trace has the gateway's request span, `rounds` round spans, and a replica
    SERVER span under every gateway CLIENT call that was answered (OK or cache miss),
    except calls to `lost` (HOST:PORT of a replica killed before it could export)."""

    def done(all_spans: list[ReceivedSpan]) -> bool:
        spans = [s for s in all_spans if s.trace_id == trace_id]
        if not any(
            s.kind == "SERVER" and s.attributes.get("rpc.service") == GATEWAY for s in spans
        ):
            return False
        if sum(s.name == "speculation round" for s in spans) != rounds:
            return False
        answered = {
            s.span_id
            for s in spans
            if s.kind == "CLIENT"
            and s.attributes.get("rpc.service") in REPLICA_SERVICES
            and s.attributes.get("rpc.grpc.status_code") in (0, 9)  # OK, FAILED_PRECONDITION
            and f"{s.attributes['server.address']}:{s.attributes['server.port']}" != lost
        }
        served = {
            s.parent_id for s in spans if s.kind == "SERVER" and s.service != "specdec-gateway"
        }
        return answered <= served

    return done


def check_trace(spans: list[ReceivedSpan], gen, *, app_span_id: str | None = None) -> dict:
    """The structure every traced request must have; returns the spans by role."""
    ids = by_id(spans)
    assert {s.trace_id for s in spans} == {gen.trace_id}
    (request,) = [s for s in spans if s.kind == "SERVER" and s.service == "specdec-gateway"]
    if app_span_id is not None:
        assert request.parent_id == app_span_id
    rounds = [s for s in spans if s.name == "speculation round"]
    assert len(rounds) == gen.stats.rounds
    assert all(r.parent_id == request.span_id for r in rounds)
    clients = [
        s
        for s in spans
        if s.kind == "CLIENT" and s.attributes.get("rpc.service") in REPLICA_SERVICES
    ]
    assert clients and all(ids[c.parent_id].name == "speculation round" for c in clients)
    servers = [s for s in spans if s.kind == "SERVER" and s.service != "specdec-gateway"]
    assert servers
    for server in servers:  # every replica span hangs under the gateway call that made it
        parent = ids[server.parent_id]
        assert parent.kind == "CLIENT" and parent.service == "specdec-gateway"
        assert parent.attributes["rpc.method"] == server.attributes["rpc.method"]
        assert parent.attributes["rpc.service"] == server.attributes["rpc.service"]
        assert server.attributes["rpc.system"] == "grpc"
        assert server.attributes["gen_ai.request.model"]
        if server.attributes.get("rpc.grpc.status_code") == 1:
            # CANCELLED: a Speculate still running at its verdict, which the gateway
            # cancels; one cancelled before the model thread took it did no cache work.
            assert server.attributes["rpc.method"] == "Speculate"
            continue
        assert server.attributes["specdec.cache.result"] in ("hit", "fresh", "miss")
        forwards = [s for s in spans if s.parent_id == server.span_id]
        if server.attributes["specdec.cache.result"] == "miss":
            assert not forwards and server.status == 2
        elif not (server.attributes["rpc.method"] == "Draft" and not forwards):  # SSD hit
            assert forwards, server.name
        for f in forwards:
            assert f.name.startswith("forward ")
            assert f.attributes["specdec.forward.tokens"] >= 1
            assert f.attributes["specdec.forward.batch_size"] >= 1
            assert "specdec.cache.rollback_tokens" in f.attributes
    a = request.attributes
    assert a["rpc.system"] == "grpc" and a["rpc.service"] == GATEWAY
    assert a["gen_ai.usage.input_tokens"] == gen.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == gen.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [gen.finish_reason]
    assert a["gen_ai.request.model"]
    assert a["specdec.k"] == gen.stats.num_draft_tokens
    assert a["specdec.ssd"] is gen.stats.ssd
    assert a["specdec.rounds"] == gen.stats.rounds
    assert a["specdec.acceptance_rate"] == pytest.approx(gen.stats.acceptance_rate)
    assert a["specdec.ssd_hit_rate"] == pytest.approx(gen.stats.ssd_hit_rate)
    assert a["specdec.cache_misses"] == gen.stats.cache_misses
    for r in rounds:
        ra = r.attributes
        assert {
            "specdec.round.k",
            "specdec.round.accepted",
            "specdec.round.drafter_wait_ms",
        } <= set(ra)
        assert ra["specdec.round.next_token_kind"] in ("bonus", "recovered")
        # off: no Speculate (SSD off, or too close to the end for another draft);
        # late: still running at the verdict, decided by the next round's Draft;
        # paused: the adaptive policy held SSD back (its Speculates kept arriving late,
        # as on a loaded machine).
        assert ra["specdec.round.ssd"] in (
            ("hit", "miss", "late", "off", "paused") if gen.stats.ssd else ("off",)
        )
    assert sum(r.attributes["specdec.round.accepted"] for r in rounds) == gen.stats.accepted_tokens
    # Each round's span carries the k it drafted (the policy's choice under k_policy
    # adaptive): together, the response's rounds_by_k.
    by_k = Counter(r.attributes["specdec.round.k"] for r in rounds)
    assert [by_k[k] for k in range(len(gen.stats.rounds_by_k))] == list(gen.stats.rounds_by_k)
    assert by_k.total() == sum(gen.stats.rounds_by_k)
    ssd = Counter(r.attributes["specdec.round.ssd"] for r in rounds)
    resolved = Counter(
        r.attributes["specdec.round.ssd_late_outcome"]
        for r in rounds
        if "specdec.round.ssd_late_outcome" in r.attributes
    )
    assert ssd["hit"] + resolved["hit"] == gen.stats.ssd_hits
    assert ssd["miss"] + resolved["miss"] == gen.stats.ssd_misses
    assert resolved.total() <= ssd["late"] <= resolved.total() + 1  # the last may stay open
    if gen.stats.ssd:
        assert ssd["hit"] + ssd["miss"] + ssd["late"] > 0
    assert sum(r.attributes["specdec.round.cache_misses"] for r in rounds) == gen.stats.cache_misses
    return {"request": request, "rounds": rounds, "clients": clients, "servers": servers}


def test_one_trace_across_app_gateway_drafter_verifier(traced, receiver, tokenizer, reference):
    provider, tracer = app_tracer(receiver)
    ids = tokenizer(PROMPTS[0]).input_ids
    with (
        Client(traced["gateway"].address, timeout=120) as client,
        tracer.start_as_current_span("application request") as app,
    ):
        gen = client.generate(token_ids=ids, max_new_tokens=32, k=4, ssd=True)
    provider.shutdown()
    assert list(gen.tokens) == reference(ids, 32)
    context = app.get_span_context()
    assert gen.trace_id == format_trace_id(context.trace_id)  # the caller's trace, continued
    spans = [
        s
        for s in receiver.wait_for(complete(gen.trace_id, gen.stats.rounds))
        if s.trace_id == gen.trace_id
    ]
    assert {s.service for s in spans} == {
        "test-app",
        "specdec-gateway",
        "specdec-drafter",
        "specdec-verifier",
    }
    parts = check_trace(
        [s for s in spans if s.service != "test-app"],
        gen,
        app_span_id=format_span_id(context.span_id),
    )
    methods = Counter(s.attributes["rpc.method"] for s in parts["servers"])
    calls = Counter(s.attributes["rpc.method"] for s in parts["clients"])
    assert methods["Verify"] == calls["Verify"] == gen.stats.rounds  # no miss, no failover
    # One Speculate per SSD round. Each is settled as a hit or a miss, at its verdict or,
    # when it was still running then (and cancelled), by the next round's Draft: only the
    # last round's can stay open. A cancelled one may never reach the drafter.
    ssd_rounds = sum(r.attributes["specdec.round.ssd"] != "off" for r in parts["rounds"])
    settled = gen.stats.ssd_hits + gen.stats.ssd_misses
    assert calls["Speculate"] == ssd_rounds and settled <= ssd_rounds <= settled + 1
    assert methods["Speculate"] <= calls["Speculate"]
    assert gen.stats.ssd_hits > 0
    forwards = [s for s in spans if s.name.startswith("forward ")]
    kinds = Counter(s.attributes["specdec.forward.kind"] for s in forwards)
    assert kinds["prefill"] >= 2 and kinds["verify"] > 0 and kinds["speculate"] > 0
    assert any(
        s.attributes["specdec.forward.kind"] == "speculate"
        and s.attributes["specdec.forward.batch_size"] > 1
        for s in forwards
    )
    print(render_tree(spans, ("specdec.round.accepted", "specdec.forward.tokens")))


def test_trace_id_without_caller_context_and_in_stream(traced, receiver, tokenizer):
    ids = tokenizer(PROMPTS[1]).input_ids
    with Client(traced["gateway"].address, timeout=120) as client:
        unary = client.generate(token_ids=ids, max_new_tokens=16, k=2)
        chunks = list(client.stream(token_ids=ids, max_new_tokens=16, k=2))
        # k per round chosen by the policy: the round spans say which (check_trace)
        adaptive = client.generate(token_ids=ids, max_new_tokens=16, k=4, k_policy="adaptive")
    final = chunks[-1].final
    assert len(unary.trace_id) == 32 and len(final.trace_id) == 32
    assert unary.trace_id != final.trace_id
    for gen in (unary, final, adaptive):
        spans = receiver.wait_for(complete(gen.trace_id, gen.stats.rounds))
        trace = [s for s in spans if s.trace_id == gen.trace_id]
        parts = check_trace(trace, gen)
        assert parts["request"].parent_id == ""  # a root span: no caller context
    stream_request = [s for s in receiver.spans(final.trace_id) if s.kind == "SERVER"]
    assert any(s.name == f"{GATEWAY}/GenerateStream" for s in stream_request)


def test_trace_id_in_trailing_metadata(traced, tokenizer):
    from specdec.sdk.client import build_generate_request
    from specdec.v1 import gateway_pb2_grpc

    request = build_generate_request(PROMPTS[2], max_new_tokens=8, k=2)
    with grpc.insecure_channel(traced["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        response, call = stub.Generate.with_call(request, timeout=120)
    trailing = dict(call.trailing_metadata())
    assert trailing["specdec-trace-id"] == response.trace_id and len(response.trace_id) == 32


def test_cache_miss_in_the_trace(traced, receiver, tokenizer, reference):
    """Turn 2 of a session after both replicas dropped its caches: the first Draft and
    Verify answer `cache miss`, the gateway resends the whole context. The trace shows the
    failed attempts, the replicas' miss, the resends, and the Redis reads and writes."""
    p1, p2 = tokenizer(PROMPTS[3]).input_ids, tokenizer(PROMPTS[4]).input_ids
    with Client(traced["gateway"].address, timeout=120) as client:
        t1 = client.generate(token_ids=p1, max_new_tokens=12, k=4, session_id="traced-miss")
        record = asyncio.run(_get_record(traced["redis"].url, "traced-miss"))
        for address, stub_type in (
            (record.verifier, verifier_pb2_grpc.VerifierServiceStub),
            (record.drafter, drafter_pb2_grpc.DrafterServiceStub),
        ):
            with grpc.insecure_channel(address) as channel:
                released = stub_type(channel).Release(
                    common_pb2.ReleaseRequest(session_id=replica_session_id("traced-miss")),
                    timeout=30,
                )
                assert released.released
        t2 = client.generate(token_ids=p2, max_new_tokens=12, k=4, session_id="traced-miss")
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], 12)
    assert t2.stats.cache_misses == 2  # one per side
    spans = receiver.wait_for(complete(t2.trace_id, t2.stats.rounds))
    trace = [s for s in spans if s.trace_id == t2.trace_id]
    parts = check_trace(trace, t2)
    missed = [c for c in parts["clients"] if c.attributes.get("specdec.cache_miss")]
    assert {c.attributes["rpc.method"] for c in missed} == {"Draft", "Verify"}
    assert all(
        c.attributes["rpc.grpc.status_code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        for c in missed
    )
    misses = [s for s in parts["servers"] if s.attributes["specdec.cache.result"] == "miss"]
    assert len(misses) == 2
    first_round = min(parts["rounds"], key=lambda r: r.start_ns)
    assert [e for e, _ in first_round.events].count("cache miss") == 2
    redis_ops = {
        s.attributes.get("db.operation.name") for s in trace if s.name.startswith("redis ")
    }
    assert {"get", "lock", "put", "unlock"} <= redis_ops
    assert all(
        s.attributes["db.system.name"] == "redis" and s.parent_id == parts["request"].span_id
        for s in trace
        if s.name.startswith("redis ")
    )


def test_failover_mid_generation_in_the_trace(traced, receiver, tokenizer, reference):
    """The verifier holding a session is killed while its turn streams; the gateway moves
    the turn to the other verifier. The trace shows the failed Verify (UNAVAILABLE), a
    failover event on its round, and the resend to the survivor; output stays exact."""
    p1, p2 = tokenizer(PROMPTS[5]).input_ids, tokenizer(PROMPTS[0]).input_ids
    v1, v2 = traced["verifiers"]
    n = 400
    with Client(traced["gateway"].address, timeout=300) as client:
        t1 = client.generate(token_ids=p1, max_new_tokens=8, k=1, session_id="traced-failover")
        record = asyncio.run(_get_record(traced["redis"].url, "traced-failover"))
        holder = {v1.address: v1, v2.address: v2}[record.verifier]
        chunks = []
        for chunk in client.stream(
            token_ids=p2, max_new_tokens=n, k=1, session_id="traced-failover"
        ):
            if not chunks:
                holder.kill()  # mid-generation: the first tokens are out, hundreds to go
            chunks.append(chunk)
    final = chunks[-1].final
    history = [*p1, *t1.tokens, *p2]
    assert list(final.tokens) == reference(history, n)
    assert len(chunks) > 10  # it was still generating when the verifier died
    spans = receiver.wait_for(complete(final.trace_id, final.stats.rounds, holder.address))
    trace = [s for s in spans if s.trace_id == final.trace_id]
    parts = check_trace(trace, final)
    failed = [
        c
        for c in parts["clients"]
        if c.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    ]
    assert failed and all(c.attributes["rpc.method"] == "Verify" for c in failed)
    port = int(holder.address.split(":")[1])
    assert all(c.attributes["server.port"] == port for c in failed)
    events = [(e, a) for r in parts["rounds"] for e, a in r.events if e == "failover"]
    assert len(events) == 1 and events[0][1]["specdec.replica"] == holder.address
    survivor = v2 if holder is v1 else v1
    after = [
        c
        for c in parts["clients"]
        if c.attributes["rpc.method"] == "Verify" and c.start_ns > failed[-1].start_ns
    ]
    assert after and all(
        c.attributes["server.port"] == int(survivor.address.split(":")[1]) for c in after
    )
    # The survivor prefilled the whole context once, then verified round after round.
    survivor_forwards = Counter(
        s.attributes["specdec.forward.kind"]
        for s in trace
        if s.name.startswith("forward ")
        and s.service == "specdec-verifier"
        and by_id(trace)[s.parent_id].parent_id in {c.span_id for c in after}
    )
    assert survivor_forwards["prefill"] == 1 and survivor_forwards["verify"] == len(after) - 1


def test_spans_are_flushed_on_sigterm(test_models, receiver):
    """A verifier with a one-minute export delay: its span can only arrive through the
    flush of its graceful stop (SIGTERM)."""
    v = replica("verifier", test_models.target, env=otel_env(receiver, delay_ms=60_000))
    try:
        v.wait_healthy()
        from specdec.common.prefix import prefix_hash
        from specdec.v1 import verifier_pb2

        with grpc.insecure_channel(v.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            stub.Verify(
                verifier_pb2.VerifyRequest(
                    session_id="flush",
                    prefix=common_pb2.CachedPrefix(length=0, hash=prefix_hash([])),
                    new_tokens=[5, 6, 7],
                ),
                timeout=60,
            )
        assert v.stop() == 0
        spans = receiver.wait_for(
            lambda all_spans: any(
                s.attributes.get("specdec.session_id") == "flush" for s in all_spans
            ),
            timeout=10,
        )
        (server,) = [s for s in spans if s.attributes.get("specdec.session_id") == "flush"]
        assert server.parent_id == "" and server.attributes["rpc.method"] == "Verify"
    finally:
        v.stop()


def test_up_passes_otlp_settings_to_every_child(test_models, receiver, tokenizer, monkeypatch):
    """`specdec up --otlp-endpoint URL`: every child exports under its own service name."""
    import argparse

    from specdec.tools.stack import LocalStack, add_up_parser

    monkeypatch.delenv("REDIS_URL", raising=False)
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["up", "--dtype", "float32", "--draft-model", str(test_models.draft_noisy), "--target-model",
         str(test_models.target), "--port", "0", "--draft-threads", "1", "--target-threads",
         "1", "--otlp-endpoint", receiver.endpoint, "--ssd"]
    )  # fmt: skip
    lines: list[str] = []
    with LocalStack(args, announce=lines.append) as stack:
        with Client(stack.gateway.address, timeout=120) as client:
            gen = client.generate(PROMPTS[1], max_new_tokens=12, k=2, session_id="up")
        spans = receiver.wait_for(complete(gen.trace_id, gen.stats.rounds))
    trace = [s for s in spans if s.trace_id == gen.trace_id]
    check_trace(trace, gen)
    assert {s.service for s in trace} == {"specdec-gateway", "specdec-drafter", "specdec-verifier"}
    assert {"get", "lock", "put", "unlock"} <= {
        s.attributes.get("db.operation.name") for s in trace if s.name.startswith("redis ")
    }  # the stack's own Redis
    assert f"traces    {receiver.endpoint} (grpc)" in lines
