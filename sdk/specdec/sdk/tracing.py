"""Trace context for the gateway, when the application uses OpenTelemetry.

If ``opentelemetry-api`` is importable, every call sends the caller's current trace
context as W3C ``traceparent`` (and ``tracestate`` / ``baggage``) gRPC metadata through
the globally configured propagator, so the gateway's spans join the application's trace.
If it is not installed, or no span is active, nothing is sent: the SDK itself depends on
grpcio and protobuf only. The gateway answers with its trace id in
``Generation.trace_id`` and in the trailing metadata ``specdec-trace-id``.
"""

from __future__ import annotations

from typing import Any

_propagate: Any = None  # the opentelemetry.propagate module; False when not installed


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The caller's trace context as gRPC metadata, or None (nothing to send)."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate as module
        except ImportError:
            _propagate = False
        else:
            _propagate = module
    if _propagate is False:
        return None
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return tuple(carrier.items()) or None
