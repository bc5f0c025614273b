"""The gateway's spans: the request, its rounds, every Redis operation.

One trace per request (under the caller's context when its metadata carries
``traceparent``):

    specdec.v1.GatewayService/Generate          SERVER  tokens, k, SSD, finish reason, rates
      redis get / lock / put ...                CLIENT  db.* (session reads and writes)
      speculation round                         INTERNAL k, accepted, next-token kind, SSD hit
        specdec.v1.DrafterService/Draft         CLIENT  rpc.*, server.address; traceparent sent
        specdec.v1.DrafterService/Speculate     CLIENT
        specdec.v1.VerifierService/Verify       CLIENT  (a cache miss or a failover shows as a
                                                         failed attempt, then the resend)

A replica call's CLIENT span is opened by the caller that sends it
(specdec.gateway.fleet.caller.traced_call), which knows the transport; the replicas' SERVER
spans (specdec.replica.metrics.observed_rpc) hang under it. With tracing off (no OTLP endpoint) every helper here is a flag check; the round
latency histogram is recorded either way.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec.common import telemetry
from specdec.common.errors import SpecdecError
from specdec.gateway.observe import metrics
from specdec.gateway.outcome import Outcome
from specdec.sdk.request import Request
from specdec.v1 import gateway_pb2

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
TRACE_ID_METADATA = "specdec-trace-id"
FINISH_NAMES = {v: k for k, v in gateway_pb2.FinishReason.items()}


def served_model(fleet: Any) -> str:
    """The target model's id (a verifier's Info); '' while no verifier has answered Info
    (before start-up, or while discovery lists none)."""
    return next((r.info.model_id for r in fleet.verifiers.replicas if r.info is not None), "")


def _request_attributes(request: Request, model: str) -> dict[str, Any]:
    sampling = request.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.max_tokens": request.output.max_new_tokens,
    }
    # As the request asked; unset (the model's generation_config) is left out.
    if sampling.temperature is not None:
        attributes["gen_ai.request.temperature"] = sampling.temperature
    if model:
        attributes["gen_ai.request.model"] = model
    if sampling.top_p:
        attributes["gen_ai.request.top_p"] = sampling.top_p
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if request.session.session_id:
        attributes["gen_ai.conversation.id"] = request.session.session_id
    return attributes


@contextmanager
def request_span(method: str, context: Any, request: Request, model: str = "") -> Iterator[Any]:
    """The SERVER span of a Generate / GenerateStream call; None when tracing is off.

    `context` is the grpc servicer context, or for another front (HTTP) a mapping of its
    request headers (``traceparent``). An error leaving the block sets the span's status
    and rpc.grpc.status_code. Every round and replica call of the turn hangs under it."""
    attributes = _request_attributes(request, model) if telemetry.enabled() else None
    with telemetry.server_span(GATEWAY_SERVICE, method, context, attributes) as span:
        try:
            yield span
        except SpecdecError as e:
            telemetry.set_grpc_status(span, e.code, e.details)
            raise
        except BaseException as e:
            if span is not None and not isinstance(e, GeneratorExit):
                span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"[:500]))
            raise


def finish(span: Any, final: gateway_pb2.GenerateResponse, context: Any) -> str:
    """Put the request's figures on its span, its trace id in the final response and in
    the trailing metadata; returns the trace id ('' when not traced)."""
    trace_id = telemetry.trace_id_hex(span)
    if span is None:
        return trace_id
    s, u = final.stats, final.usage
    speculated = s.ssd_hits + s.ssd_misses
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "gen_ai.usage.output_tokens": u.completion_tokens,
            "gen_ai.response.finish_reasons": [
                FINISH_NAMES.get(final.finish_reason, "").removeprefix("FINISH_REASON_").lower()
            ],
            "specdec.history_tokens": u.history_tokens,
            "specdec.k": s.num_draft_tokens,
            "specdec.ssd": s.ssd,
            "specdec.rounds": s.rounds,
            "specdec.draft_tokens": s.draft_tokens,
            "specdec.accepted_tokens": s.accepted_tokens,
            "specdec.acceptance_rate": s.acceptance_rate,
            "specdec.mean_accepted_length": s.mean_accepted_length,
            "specdec.ssd_hits": s.ssd_hits,
            "specdec.ssd_misses": s.ssd_misses,
            "specdec.ssd_hit_rate": s.ssd_hits / speculated if speculated else 0.0,
            "specdec.ssd_late": s.ssd_late,
            "specdec.cache_misses": s.cache_misses,
            "specdec.time_to_first_token_ms": final.timings.time_to_first_token_ms,
        }
    )
    telemetry.set_grpc_status(span, grpc.StatusCode.OK)
    if trace_id:
        final.trace_id = trace_id
        if hasattr(context, "set_trailing_metadata"):  # gRPC (an HTTP front sets a header)
            context.set_trailing_metadata(((TRACE_ID_METADATA, trace_id),))
    return trace_id


@contextmanager
def round_span(index: int) -> Iterator[Any]:
    """The INTERNAL span of one speculation round (the index-th of its request), under
    which its replica calls hang; None when tracing is off. `round_done` puts the round's
    outcome on it."""
    if not telemetry.enabled():
        yield None
        return
    with telemetry.tracer.start_as_current_span(
        "speculation round", attributes={"specdec.round.index": index}
    ) as span:
        yield span


def round_done(span: Any, outcome: Outcome) -> None:
    """A round's outcome: the round latency histogram, and its span's attributes."""
    metrics.ROUND_SECONDS.observe(outcome.seconds)
    if outcome.gain is not None:  # the adaptive policy priced the round
        metrics.POLICY_ROUNDS_BY_LOAD.labels(rows=outcome.load_level, k=str(outcome.k)).inc()
        metrics.POLICY_GAIN.labels(rows=outcome.load_level).observe(outcome.gain)
        metrics.POLICY_SATURATION.observe(outcome.saturation)
    if span is None:
        return
    attributes = {
        "specdec.round.k": outcome.k,  # the policy's choice, 0 when no drafter could draft
        "specdec.round.draft_source": outcome.source,
        "specdec.round.accepted": outcome.accepted,
        # The verifier's rule: all k accepted -> a bonus token, else a recovered one.
        "specdec.round.next_token_kind": "bonus" if outcome.accepted == outcome.k else "recovered",
        # off | paused | hit | miss | late (decided by the next round's Draft)
        "specdec.round.ssd": outcome.ssd,
        "specdec.round.drafter_wait_ms": round(outcome.draft_seconds * 1e3, 3),
        "specdec.round.cache_misses": outcome.resends,
    }
    if outcome.gain is not None:
        attributes["specdec.round.load_level"] = outcome.load_level
        attributes["specdec.round.saturation"] = round(outcome.saturation, 3)
        attributes["specdec.round.speculation_gain"] = round(outcome.gain, 3)
    if outcome.late_outcome is not None:  # the previous round's late Speculate
        attributes["specdec.round.ssd_late_outcome"] = outcome.late_outcome
    span.set_attributes(attributes)


def note_cache_miss(role: str, address: str) -> None:
    telemetry.event("cache miss", specdec__role=role, specdec__replica=address)


def note_moved(role: str, previous: str | None, address: str) -> None:
    telemetry.event(
        "session moved", specdec__role=role, specdec__from=previous or "", specdec__replica=address
    )


def note_failover(role: str, address: str, why: str) -> None:
    telemetry.event("failover", specdec__role=role, specdec__replica=address, specdec__why=why)


_Op = TypeVar("_Op", bound=Callable[..., Awaitable[Any]])  # a SessionIndex / TurnLocks method


def redis_op(operation: str) -> Callable[[_Op], _Op]:
    """A CLIENT span `redis <operation>` around a SessionIndex / TurnLocks method (only
    when Redis is configured); `redis_failed` marks it when the store fails."""

    def decorate(fn: _Op) -> _Op:
        @functools.wraps(fn)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            index = getattr(self, "index", self)
            redis = getattr(index, "redis", None)
            if not telemetry.enabled() or redis is None:
                return await fn(self, *args, **kwargs)
            kw = redis.connection_pool.connection_kwargs
            attributes: dict[str, str | int] = {
                "db.system.name": "redis",
                "db.system": "redis",
                "db.operation.name": operation,
            }
            if kw.get("host"):
                attributes["server.address"] = str(kw["host"])
                attributes["server.port"] = int(kw.get("port") or 6379)
            with telemetry.tracer.start_as_current_span(
                f"redis {operation}", kind=SpanKind.CLIENT, attributes=attributes
            ):
                return await fn(self, *args, **kwargs)

        return cast(_Op, wrapper)  # functools.wraps keeps fn's signature

    return decorate


def redis_failed(error: BaseException) -> None:
    """The store failed inside a redis span (the caller falls back to its local copy)."""
    span = telemetry.current_span()
    if span is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
