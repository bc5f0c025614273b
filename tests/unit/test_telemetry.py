"""Tracing set-up from the OTEL_* variables: off without an endpoint (nothing created),
exporting over OTLP/gRPC and OTLP/HTTP to real receivers on loopback when on."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.common.settings import ConfigError
from specdec.common.telemetry import TracingConfig
from specdec.tools.otlpsink import OtlpReceiver


def test_no_endpoint_means_off():
    cfg = TracingConfig.from_env("drafter", {})
    assert not cfg.enabled and cfg.service_name == "specdec-drafter"
    assert cfg.sampler == "parentbased_always_on"


def test_settings_are_read():
    cfg = TracingConfig.from_env(
        "gateway",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318/",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_RESOURCE_ATTRIBUTES": "service.namespace=prod,k8s.pod.name=gw%2D1",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        },
    )
    assert cfg.enabled and cfg.endpoint == "http://jaeger:4318/v1/traces"
    assert cfg.protocol == "http/protobuf" and cfg.sampler_arg == 0.25
    assert dict(cfg.resource) == {
        "service.namespace": "prod",
        "k8s.pod.name": "gw-1",
        "service.name": "specdec-gateway",
    }
    # The signal-specific endpoint is used as given; OTEL_SERVICE_NAME wins.
    cfg = TracingConfig.from_env(
        "gateway",
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:1",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "gw",
            "OTEL_RESOURCE_ATTRIBUTES": "service.name=other",
        },
    )
    assert cfg.endpoint == "http://c:4318/custom" and cfg.service_name == "gw"
    sampler = TracingConfig.from_env("x", {"OTEL_TRACES_SAMPLER": "traceidratio"}).make_sampler()
    assert "TraceIdRatioBased" in type(sampler).__name__


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_disabled_by_the_standard_switches(env):
    assert not TracingConfig.from_env(
        "x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", **env}
    ).enabled


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"}, "SAMPLER_ARG"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_SDK_DISABLED": "maybe"}, "OTEL_SDK_DISABLED"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ],
)
def test_bad_values_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        TracingConfig.from_env("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", **env})


PROBE = """
import json, os, sys, threading
from opentelemetry import trace
from specdec.common import telemetry
tracing = telemetry.setup_tracing("probe")
with telemetry.tracer.start_as_current_span("probe span") as span:
    metadata = telemetry.outgoing_metadata()
state = {
    "tracing": tracing is not None,
    "enabled": telemetry.enabled(),
    "provider": type(trace.get_tracer_provider()).__name__,
    "sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
    "exporter_threads": [t.name for t in threading.enumerate() if "Otel" in t.name or "Batch" in t.name],
    "metadata": dict(metadata or ()),
    "trace_id": telemetry.trace_id_hex(span),
}
if tracing:
    tracing.shutdown()
print(json.dumps(state))
"""


def _probe(env: dict[str, str]) -> dict:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tracing_off_creates_no_processor_and_no_exporter():
    state = _probe({})
    assert state["tracing"] is False and state["enabled"] is False
    assert state["provider"] == "ProxyTracerProvider"  # the API's placeholder, no SDK
    assert state["sdk_imported"] is False  # no span processor or exporter class even loaded
    assert state["exporter_threads"] == []
    assert state["metadata"] == {} and state["trace_id"] == ""


def test_tracing_on_exports_over_otlp_grpc():
    """The control for the test above: the same probe with an endpoint does create the
    provider, its batch processor thread, sends traceparent, and the span arrives."""
    with OtlpReceiver() as receiver:
        state = _probe({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        assert state["tracing"] and state["provider"] == "TracerProvider"
        assert state["sdk_imported"] and state["exporter_threads"]
        assert state["metadata"]["traceparent"].split("-")[1] == state["trace_id"]
        (span,) = receiver.spans(state["trace_id"])  # flushed by shutdown, not by a timer
    assert span.name == "probe span" and span.service == "specdec-probe"


def test_sampler_always_off_gives_no_trace_id():
    with OtlpReceiver() as receiver:
        state = _probe(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_SAMPLER": "always_off"}
        )
        assert state["tracing"] and state["trace_id"] == ""
        assert receiver.spans() == []


def test_tracing_on_exports_over_otlp_http():
    """OTLP/HTTP (http/protobuf) to a real HTTP server on loopback that decodes the
    ExportTraceServiceRequest it is sent, as a collector's port 4318 does."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    received: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            received.append((self.path, self.headers["Content-Type"], request))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        state = _probe(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            }
        )
    finally:
        server.shutdown()
    assert state["tracing"]
    ((path, content_type, request),) = received
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["probe span"]
    assert spans[0].trace_id.hex() == state["trace_id"]


class _RecordingGateway:
    """A stand-in GatewayService on loopback that records the metadata it is sent and
    answers with a fixed trace id (the SDK's side of propagation, without the stack)."""

    def __init__(self):
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):
        from specdec.v1 import gateway_pb2

        self.metadata.append(dict(context.invocation_metadata()))
        return gateway_pb2.GenerateResponse(
            text="x", token_ids=[1], finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            trace_id="ab" * 16,
        )  # fmt: skip


def test_sdk_forwards_the_callers_trace_context():
    from concurrent import futures

    import grpc
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import format_span_id, format_trace_id

    from specdec.sdk import Client
    from specdec.v1 import gateway_pb2_grpc

    servicer = _RecordingGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = gateway_pb2_grpc.GatewayServiceServicer()
    handler.Generate = servicer.Generate
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(handler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracer = TracerProvider().get_tracer("app")  # a local provider: the global stays unset
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            outside = client.generate("hi")
            with tracer.start_as_current_span("app") as span:
                inside = client.generate("hi")
    finally:
        server.stop(0)
    assert "traceparent" not in servicer.metadata[0]  # no active span: nothing sent
    ctx = span.get_span_context()
    version, trace_id, parent_id, flags = servicer.metadata[1]["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert trace_id == format_trace_id(ctx.trace_id) and parent_id == format_span_id(ctx.span_id)
    assert outside.trace_id == inside.trace_id == "ab" * 16


def test_incoming_context_from_grpc_metadata_or_http_headers():
    from opentelemetry import trace

    from specdec.common.telemetry import incoming_context

    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    class Servicer:
        def invocation_metadata(self):
            return (("traceparent", header), ("bin-bin", b"\x00"))

    for source in (Servicer(), {"Traceparent": header, "Content-Type": "application/json"}):
        span = trace.get_current_span(incoming_context(source)).get_span_context()
        assert trace.format_trace_id(span.trace_id) == "0af7651916cd43dd8448eb211c80319c"
        assert trace.format_span_id(span.span_id) == "b7ad6b7169203331"
    assert incoming_context({"content-type": "application/json"}) is None


def test_served_model_with_no_verifier_or_no_info_yet():
    from types import SimpleNamespace

    from specdec.gateway.observe.tracing import served_model

    def fleet(*infos):
        replicas = [SimpleNamespace(info=i) for i in infos]
        return SimpleNamespace(verifiers=SimpleNamespace(replicas=replicas))

    assert served_model(fleet()) == ""  # discovery lists no verifier right now
    assert served_model(fleet(None)) == ""  # not connected yet
    assert served_model(fleet(None, SimpleNamespace(model_id="target"))) == "target"
