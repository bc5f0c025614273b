"""An OTLP/gRPC trace receiver in this process: a real `TraceService` endpoint on loopback.

Built from opentelemetry-proto's generated service, so exporters talk to it exactly as to
Jaeger's or a collector's OTLP port. It keeps every span it receives, flattened with its
service name, and renders a trace as a text tree. Used by the tracing tests and by
`specdec bench --tracing` (the traced mode exports here), and handy to look at a trace
without Jaeger.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # '' for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver):
        self.sink = sink

    def Export(self, request, context):
        self.sink._add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as r:` listens on 127.0.0.1 (r.endpoint: http://127.0.0.1:PORT)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.host = host
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.exports = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            kind=KINDS.get(s.kind, str(s.kind)),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            status=s.status.code,
                            status_message=s.status.message,
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                        )
                    )
        with self._lock:
            self._spans.extend(received)
            self.exports += 1

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            spans = list(self._spans)
        return [s for s in spans if trace_id is None or s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 60.0
    ) -> list[ReceivedSpan]:
        """Poll until done(all spans) holds; returns the spans (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans not complete after {timeout}s ({len(spans)} received)")
            time.sleep(0.1)


def render_tree(spans: list[ReceivedSpan], attributes: tuple[str, ...] = ()) -> str:
    """One trace as an indented text tree, children by start time, with durations."""
    by_parent: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        parent = s.parent_id if s.parent_id in ids else ""
        by_parent.setdefault(parent, []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda s: s.start_ns):
            extra = [f"{k}={s.attributes[k]}" for k in attributes if k in s.attributes]
            if s.status == 2:
                extra.append(f"ERROR {s.status_message}")
            label = f"{'  ' * depth}{s.name} [{s.service}]"
            lines.append(f"{label:<64} {s.duration_ms:9.2f} ms  {' '.join(extra)}".rstrip())
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
