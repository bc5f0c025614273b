"""OpenTelemetry tracing for every service, configured from the standard OTEL_* variables.

`setup_tracing(service)` reads, once at start-up:

- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``: where spans go.
  Without one nothing is set up: no tracer provider, no span processor, no exporter
  thread; every span helper here is then a no-op that costs a flag check.
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc``
  (default) or ``http/protobuf`` (``/v1/traces`` is appended to the generic endpoint, as
  the specification says).
- ``OTEL_SERVICE_NAME`` (else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
  ``specdec-<service>``) and ``OTEL_RESOURCE_ATTRIBUTES``.
- ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` (default
  ``parentbased_always_on``; the ratio samplers take their ratio from the argument).
- ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn tracing off.

A malformed value stops start-up with a ConfigError naming the variable. Spans are
batched (``OTEL_BSP_*`` tune the batch processor) and flushed by `Tracing.shutdown`, which
every service calls after its graceful stop on SIGTERM.

Trace context crosses processes as W3C ``traceparent`` in gRPC metadata:
`outgoing_metadata()` on the calling side, `incoming_context(context)` on the serving side.
Torch-free: the gateway uses it too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from specdec.common.settings import ConfigError

if TYPE_CHECKING:
    import grpc
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
TRACER_NAME = "specdec"

# True once setup_tracing installed a provider in this process. Span helpers check it
# first, so a service without an endpoint does no tracing work at all.
_enabled = False
tracer = trace.get_tracer(TRACER_NAME)


def enabled() -> bool:
    return _enabled


def _env(env: Mapping[str, str], *names: str) -> tuple[str, str] | tuple[None, None]:
    """The first of `names` set to a non-empty value, as (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None, None


def _resource_attributes(raw: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES 'k=v,k2=v2' (values percent-encoded) -> dict."""
    from urllib.parse import unquote

    attributes: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"OTEL_RESOURCE_ATTRIBUTES: {item!r} is not key=value")
        attributes[key.strip()] = unquote(value.strip())
    return attributes


@dataclass(frozen=True)
class TracingConfig:
    """What setup_tracing will do, read from the environment (see the module docstring)."""

    endpoint: str | None  # None: tracing off
    protocol: str = "grpc"
    service_name: str = "specdec"
    resource: tuple[tuple[str, str], ...] = ()
    sampler: str = "parentbased_always_on"
    sampler_arg: float | None = None

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        resource = _resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        service_name = (
            env.get("OTEL_SERVICE_NAME", "").strip()
            or resource.get("service.name")
            or f"specdec-{service}"
        )
        resource["service.name"] = service_name
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
        if sampler not in SAMPLERS:
            raise ConfigError(f"OTEL_TRACES_SAMPLER: {sampler!r} is not one of {SAMPLERS}")
        sampler_arg = None
        if sampler.endswith("traceidratio"):
            raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip() or "1.0"
            try:
                sampler_arg = float(raw)
            except ValueError:
                raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: cannot read {raw!r}") from None
            if not 0.0 <= sampler_arg <= 1.0:
                raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG: must be in [0, 1] (got {raw!r})")
        protocol_var, protocol = _env(
            env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"
        )
        protocol = protocol or "grpc"
        if protocol not in PROTOCOLS:
            raise ConfigError(f"{protocol_var}: {protocol!r} is not one of {PROTOCOLS}")
        endpoint_var, endpoint = _env(
            env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        if endpoint is not None:
            if "://" not in endpoint:
                raise ConfigError(
                    f"{endpoint_var}: {endpoint!r} is not a URL (http://HOST:PORT or https://...)"
                )
            if protocol == "http/protobuf" and endpoint_var == "OTEL_EXPORTER_OTLP_ENDPOINT":
                endpoint = endpoint.rstrip("/") + "/v1/traces"
        exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
        if exporter not in ("otlp", "none"):
            raise ConfigError(f"OTEL_TRACES_EXPORTER: only 'otlp' or 'none' (got {exporter!r})")
        disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower()
        if disabled not in ("", "true", "false"):
            raise ConfigError(f"OTEL_SDK_DISABLED: expected true or false (got {disabled!r})")
        if exporter == "none" or disabled == "true":
            endpoint = None
        return cls(
            endpoint=endpoint,
            protocol=protocol,
            service_name=service_name,
            resource=tuple(sorted(resource.items())),
            sampler=sampler,
            sampler_arg=sampler_arg,
        )

    def make_sampler(self) -> Sampler:
        from opentelemetry.sdk.trace import sampling

        ratio = self.sampler_arg if self.sampler_arg is not None else 1.0
        root = {
            "always_on": sampling.ALWAYS_ON,
            "always_off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(ratio),
        }
        if self.sampler.startswith("parentbased_"):
            return sampling.ParentBased(root[self.sampler.removeprefix("parentbased_")])
        return root[self.sampler]


class Tracing:
    """The tracer provider of this process; `shutdown` flushes and stops the exporter."""

    def __init__(self, config: TracingConfig, provider: TracerProvider):
        self.config = config
        self.provider = provider

    def shutdown(self) -> None:
        global _enabled
        _enabled = False
        self.provider.shutdown()  # flushes the batch processor, stops its thread
        log.info("tracing stopped")


def setup_tracing(service: str, env: Mapping[str, str] | None = None) -> Tracing | None:
    """Start tracing from the OTEL_* variables; None (and nothing started) without an
    endpoint. Raises ConfigError on a malformed variable."""
    global _enabled
    config = TracingConfig.from_env(service, env)
    if not config.enabled:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    assert config.endpoint is not None  # enabled: an endpoint is set
    exporter: SpanExporter
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(
            endpoint=config.endpoint, insecure=config.endpoint.startswith("http://")
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        exporter = HttpSpanExporter(endpoint=config.endpoint)
    provider = TracerProvider(
        resource=Resource.create(dict(config.resource)),
        sampler=config.make_sampler(),
        shutdown_on_exit=False,  # Tracing.shutdown does it, after the graceful stop
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info(
        "tracing on",
        extra={
            "otlp_endpoint": config.endpoint,
            "otlp_protocol": config.protocol,
            "service_name": config.service_name,
            "sampler": config.sampler,
            "sampler_arg": config.sampler_arg,
        },
    )
    return Tracing(config, provider)


# -- propagation ------------------------------------------------------------------------


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC metadata (``traceparent``), None when off."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def traceparent() -> str | None:
    """The current trace context as a W3C ``traceparent`` value (sampled or not: a callee's
    parent-based sampler follows it), None when tracing is off or there is no context."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


class Invoked(Protocol):
    """What incoming_context reads of a grpc servicer context."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...


def incoming_context(source: Invoked | Mapping[str, object]) -> otel_context.Context | None:
    """The caller's trace context from a grpc servicer context's metadata, or from a
    mapping of (lower-case) HTTP headers; None when it carries no ``traceparent``."""
    if isinstance(source, Mapping):
        carrier = {str(k).lower(): v for k, v in source.items() if isinstance(v, str)}
    else:
        metadata = source.invocation_metadata() or ()
        carrier = {key: value for key, value in metadata if isinstance(value, str)}
    if "traceparent" not in carrier:
        return None
    return propagate.extract(carrier)


# -- spans ------------------------------------------------------------------------------


def rpc_attributes(service: str, method: str) -> dict[str, Any]:
    """OpenTelemetry's rpc.* semantic conventions for a gRPC call."""
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


@contextmanager
def server_span(
    service: str,
    method: str,
    servicer_context: Invoked | Mapping[str, object],
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span | None]:
    """A SERVER span `<service>/<method>` under the caller's context (a grpc servicer
    context, or a mapping of HTTP headers); None when off."""
    if not _enabled:
        yield None
        return
    with tracer.start_as_current_span(
        f"{service}/{method}",
        context=incoming_context(servicer_context),
        kind=SpanKind.SERVER,
        attributes={**rpc_attributes(service, method), **(attributes or {})},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def current_span() -> Span | None:
    """The current span if tracing is on and it records, else None."""
    if not _enabled:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (dots in names written as '__')."""
    span = current_span()
    if span is not None:
        span.set_attributes({k.replace("__", "."): v for k, v in attributes.items()})


def event(name: str, **attributes: Any) -> None:
    """Add an event to the current span."""
    span = current_span()
    if span is not None:
        span.add_event(name, {k.replace("__", "."): v for k, v in attributes.items()})


def set_grpc_status(span: Span | None, code: grpc.StatusCode, message: str = "") -> None:
    """Record a gRPC status code (grpc.StatusCode) on a span; errors set the span's status.

    For a SERVER span only server-side failures are errors (as the conventions say), but
    marking every non-OK answer makes failed requests easy to find in Jaeger."""
    if span is None:
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code.value[0] != 0:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"[:500]))


def trace_id_hex(span: Span | None) -> str:
    """The span's trace id as 32 hex digits ('' when off or not sampled)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return ""
    return trace.format_trace_id(ctx.trace_id)
