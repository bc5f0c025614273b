"""Prometheus metrics and trace spans of a model replica (drafter or verifier).

Every name is ``specdec_<role>_...`` and follows vLLM's where one exists
(``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
``spec_decode_*``). What is measured and where:

- `observed_rpc` (a decorator on the servicer's methods): requests in flight, requests by
  method and status code, and the SERVER span of the call under the caller's trace
  context (``traceparent`` in the gRPC metadata);
- `ReplicaObserver.run` (every job sent to the model thread): the queue in front of the
  model thread (depth and time waited), cache misses, the cache gauges after each job
  (sessions, tokens, the bound, usage), and the job's cache figures on the server span;
- `ReplicaObserver.forward` (around every model forward): latency, tokens fed and batch
  size (rows) by kind (``prefill``: a forward into an empty cache; ``verify``;
  ``draft_step``; ``speculate``), sessions per forward (batching across sessions,
  specdec.replica.batching), and a child span per forward (in the context of the batch's
  oldest job; the others count the forward through `ReplicaObserver.member`);
- `note_cache`, `note_rollback`, `note_eviction` (called by the cache store): whether a
  job reused the session's cache, how many cached tokens it rolled back, evictions.

Torch-free. The model-thread side relies on ModelRuntime running each job inside a copy
of the caller's context (contextvars), which `ReplicaObserver.run` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from opentelemetry.trace import SpanKind
from prometheus_client import Counter, Gauge, Histogram

from specdec.common import telemetry
from specdec.common.errors import CacheMiss, SpecdecError

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

    from specdec.replica.batching import ModelJob, Scheduler
    from specdec.replica.config import ReplicaConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
Metric = TypeVar("Metric", bound="MetricWrapperBase")

# Forward kinds: a forward into an empty cache is a prefill, else the RPC's own kind.
FORWARD_KINDS = {"Verify": "verify", "Draft": "draft_step", "Speculate": "speculate"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SESSION_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class CachedSessions(Protocol):
    """What the metrics read of a replica's session store (specdec.replica.engine)."""

    @property
    def max_cached_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    def __len__(self) -> int: ...


class Runtime(Protocol):
    """What the metrics read of a replica's engine (specdec.replica.engine.Engine)."""

    @property
    def config(self) -> ReplicaConfig: ...

    @property
    def store(self) -> CachedSessions | None: ...


class ReplicaMetrics:
    """The Prometheus metrics of one role; one instance per role and process."""

    _by_role: dict[str, ReplicaMetrics] = {}

    @classmethod
    def for_role(cls, role: str) -> ReplicaMetrics:
        if role not in cls._by_role:
            cls._by_role[role] = cls(role)
        return cls._by_role[role]

    def child(self, metric: Metric, *labels: str) -> Metric:
        """metric.labels(*labels), kept: a label lookup costs more than the count."""
        key = (id(metric), labels)
        found: Metric | None = self._children.get(key)  # a child of `metric` (the key's id)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def __init__(self, role: str):
        p = f"specdec_{role}_"
        self.role = role
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.running = Gauge(p + "num_requests_running", "Requests being served (in flight)")
        self.waiting = Gauge(
            p + "num_requests_waiting", "Jobs queued for the model thread (queue depth)"
        )
        self.queue_seconds = Histogram(
            p + "request_queue_time_seconds",
            "Time a job waited for the model thread",
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(p + "requests", "Requests answered", ["method", "code"])
        self.data_connections = Gauge(
            p + "data_plane_connections",
            "Open data-plane connections (gateways sending the round's calls without gRPC)",
        )
        self.data_calls = Counter(
            p + "data_plane_calls",
            "Calls received on the data plane (also counted in requests by method and code)",
            ["method"],
        )
        self.forward_seconds = Histogram(
            p + "model_forward_seconds", "Model forward latency", ["kind"], buckets=LATENCY_BUCKETS
        )
        self.forward_tokens = Histogram(
            p + "model_forward_tokens",
            "Tokens fed per forward (all rows)",
            ["kind"],
            buckets=TOKEN_BUCKETS,
        )
        self.forward_batch = Histogram(
            p + "model_forward_batch_size", "Rows per forward", ["kind"], buckets=BATCH_BUCKETS
        )
        self.forward_sessions = Histogram(
            p + "model_forward_sessions",
            "Sessions per model forward (batching across sessions; 1: unbatched)",
            buckets=SESSION_BUCKETS,
        )
        self.cached_sessions = Gauge(p + "cached_sessions", "Sessions with a KV cache here")
        self.cached_tokens = Gauge(p + "cached_tokens", "Tokens held in KV caches")
        self.max_cached_tokens = Gauge(
            p + "max_cached_tokens", "Bound on cached tokens (--max-cached-tokens)"
        )
        self.kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Cached tokens / --max-cached-tokens (0 to 1)"
        )
        self.evictions = Counter(p + "cache_evictions", "Sessions evicted (least recently used)")
        self.evicted_tokens = Counter(p + "cache_evicted_tokens", "Cached tokens evicted")
        self.cache_misses = Counter(
            p + "cache_misses", "Requests whose prefix was not cached (the caller resends)"
        )
        self.rollback_tokens = Counter(
            p + "cache_rollback_tokens", "Cached tokens rolled back (rejected or stale drafts)"
        )
        # The children of the per-forward histograms, by kind: a forward observes three of
        # them, and a label lookup each time would cost more than the observation.
        self.by_kind = {
            kind: tuple(
                m.labels(kind=kind)
                for m in (self.forward_seconds, self.forward_tokens, self.forward_batch)
            )
            for kind in (*FORWARD_KINDS.values(), "prefill", "other")
        }
        if role == "drafter":
            self.ssd_prepared = Counter(
                p + "ssd_branches_prepared", "SSD next-round drafts prepared by Speculate"
            )
            self.ssd_served = Counter(
                p + "ssd_branches_served", "Drafts answered from a prepared SSD branch"
            )
            self.head_feature_bytes = Counter(
                p + "head_feature_bytes",
                "A head drafter: bytes of the target's features received with Drafts",
            )
            self.head_feature_positions = Counter(
                p + "head_feature_positions",
                "A head drafter: positions fed, by the feature they were fed with (target: "
                "the verifier's; own: the head's prediction, a draft step; missing: zeros, "
                "the target's never arrived)",
                ["source"],
            )
        if role == "verifier":
            self.num_drafts = Counter(
                p + "spec_decode_num_drafts", "Verifications of a non-empty draft"
            )
            self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Tokens verified")
            self.num_accepted_tokens = Counter(
                p + "spec_decode_num_accepted_tokens", "Draft tokens accepted"
            )
            self.feature_bytes = Counter(
                p + "feature_bytes",
                "Bytes of the target's features sent with verdicts (VerifyRequest.features, "
                "for head drafters)",
            )


@dataclass
class JobReport:
    """What one job on the model thread did (set through the cache store's notes)."""

    operation: str
    metrics: ReplicaMetrics
    cache: str = "none"  # hit (prefix reused) | fresh (empty prefix) | miss
    prefix_tokens: int = 0
    rollback_tokens: int = 0
    forwards: int = 0
    tokens_fed: int = 0
    max_batch: int = 0


_OPERATION: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_op", default="")
_JOB: contextvars.ContextVar[JobReport | None] = contextvars.ContextVar("specdec_job", default=None)


def note_cache(prefix_tokens: int) -> None:
    """The store found (or, for prefix 0, made) the session's cache for this job."""
    job = _JOB.get()
    if job is not None:
        job.cache = "hit" if prefix_tokens else "fresh"
        job.prefix_tokens = prefix_tokens


def note_rollback(tokens: int) -> None:
    """The store dropped `tokens` cached tokens from the end of a session."""
    job = _JOB.get()
    if job is not None and tokens > 0:
        job.rollback_tokens += tokens
        job.metrics.rollback_tokens.inc(tokens)


def note_fork(tokens: int) -> None:
    """The store copied `tokens` of another session's cache into this job's (n > 1)."""
    if _JOB.get() is not None:
        telemetry.event("forked session cache", specdec__forked_tokens=tokens)


def note_eviction(tokens: int) -> None:
    job = _JOB.get()
    if job is not None:
        job.metrics.evictions.inc()
        job.metrics.evicted_tokens.inc(tokens)
        telemetry.event("evicted session cache", specdec__evicted_tokens=tokens)


class ReplicaObserver:
    """Instrumentation of one ModelRuntime (see the module docstring)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.metrics = ReplicaMetrics.for_role(runtime.config.role)
        self.metrics.max_cached_tokens.set(runtime.config.max_cached_tokens)

    async def run(
        self,
        scheduler: Scheduler,
        fn: Callable[..., Any],
        *args: Any,
        on_done: Callable[[Future[Any] | None], object] | None = None,
        key: str | None = None,
    ) -> Any:
        """fn(*args) on the model thread (a specdec.replica.batching.Scheduler), in a copy of
        the caller's context, counted in the queue until the thread picks it up. fn may be
        a job (a generator of forward requests). key: the session (one job at a time each).
        on_done(future) runs once the job has ended or was cancelled before it started (also
        when it could not be submitted)."""
        future = self.submit(scheduler, fn, *args, on_done=on_done, key=key)
        return await asyncio.wrap_future(future)  # fn's result (a job's: its return value)

    def submit(
        self,
        scheduler: Scheduler,
        fn: Callable[..., T],
        *args: Any,
        on_done: Callable[[Future[Any] | None], object] | None = None,
        key: str | None = None,
    ) -> Future[Any]:
        """`run` without waiting: the job's concurrent.futures.Future (any thread; the data
        plane submits from the model thread itself)."""
        m = self.metrics
        context = contextvars.copy_context()
        queued = time.perf_counter()
        started = False

        def job() -> ModelJob:
            nonlocal started
            started = True
            waited = time.perf_counter() - queued
            m.waiting.dec()
            m.queue_seconds.observe(waited)
            return self._job(fn, args, waited)

        m.waiting.inc()
        try:
            future = scheduler.submit(job, key=key, context=context)
        except BaseException:
            m.waiting.dec()
            if on_done is not None:
                on_done(None)
            raise
        # A job cancelled before it started (its caller gave up) leaves the queue too.
        future.add_done_callback(lambda _: None if started else m.waiting.dec())
        if on_done is not None:
            future.add_done_callback(on_done)
        return future

    def _job(self, fn: Callable[..., T], args: tuple[Any, ...], waited: float) -> ModelJob:
        """The job as a generator: its forward requests pass through (model thread, in the
        caller's context)."""
        m = self.metrics
        job = JobReport(_OPERATION.get(), m)
        _JOB.set(job)
        try:
            result = fn(*args)
            if inspect.isgenerator(result):
                result = yield from result
            return result
        except CacheMiss:
            job.cache = "miss"
            m.cache_misses.inc()
            raise
        finally:
            self._refresh_cache_gauges()
            if telemetry.enabled():
                telemetry.annotate(
                    specdec__queue_wait_ms=round(waited * 1e3, 3),
                    specdec__cache__result=job.cache,
                    specdec__cache__prefix_tokens=job.prefix_tokens,
                    specdec__cache__rollback_tokens=job.rollback_tokens,
                    specdec__forwards=job.forwards,
                    specdec__tokens_fed=job.tokens_fed,
                )

    def _refresh_cache_gauges(self) -> None:
        store = self.runtime.store
        if store is None:
            return
        m = self.metrics
        tokens = store.cached_tokens
        m.cached_tokens.set(tokens)
        m.cached_sessions.set(len(store))
        m.kv_usage.set(tokens / store.max_cached_tokens)

    @contextmanager
    def forward(
        self, tokens: int, batch: int = 1, fresh: bool = False, sessions: int = 1
    ) -> Iterator[None]:
        """Around one model forward of `tokens` tokens over `batch` rows of `sessions`
        sessions (model thread)."""
        job = _JOB.get()
        kind = "prefill" if fresh else FORWARD_KINDS.get(job.operation if job else "", "other")
        started = time.perf_counter()
        span = None
        if telemetry.enabled():
            attributes: dict[str, Any] = {
                "specdec.forward.kind": kind,
                "specdec.forward.tokens": tokens,
                "specdec.forward.batch_size": batch,
                "specdec.forward.sessions": sessions,
            }
            if job is not None:
                attributes["specdec.cache.result"] = job.cache
                attributes["specdec.cache.rollback_tokens"] = job.rollback_tokens
            span = telemetry.tracer.start_span(
                f"forward {kind}", kind=SpanKind.INTERNAL, attributes=attributes
            )
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            if span is not None:
                span.end()
            m = self.metrics
            latency, fed, rows = m.by_kind[kind]
            latency.observe(seconds)
            fed.observe(tokens)
            rows.observe(batch)
            m.forward_sessions.observe(sessions)
            if job is not None:
                job.forwards += 1
                job.tokens_fed += tokens
                job.max_batch = max(job.max_batch, batch)

    def member(self, tokens: int, batch: int) -> None:
        """This job fed `tokens` tokens into a batched forward of `batch` sessions that
        another job's context observed (model thread)."""
        job = _JOB.get()
        if job is not None:
            job.forwards += 1
            job.tokens_fed += tokens
            job.max_batch = max(job.max_batch, batch)

    # -- role-specific counts (event loop) --------------------------------------------------

    def ssd_prepared(self, branches: int) -> None:
        self.metrics.ssd_prepared.inc(branches)

    def ssd_served(self) -> None:
        self.metrics.ssd_served.inc()

    def features_sent(self, data_bytes: int) -> None:
        self.metrics.feature_bytes.inc(data_bytes)

    def features_received(self, data_bytes: int) -> None:
        self.metrics.head_feature_bytes.inc(data_bytes)

    def head_fed(self, target: int, own: int, missing: int) -> None:
        """A head drafter fed positions with the target's features, its own, or zeros
        (model thread)."""
        m = self.metrics
        for source, count in (("target", target), ("own", own), ("missing", missing)):
            if count:
                m.child(m.head_feature_positions, source).inc(count)

    def verified(self, draft_tokens: int, accepted: int) -> None:
        m = self.metrics
        m.num_drafts.inc(draft_tokens > 0)
        m.num_draft_tokens.inc(draft_tokens)
        m.num_accepted_tokens.inc(accepted)


def _request_attributes(runtime: Runtime, request: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {"gen_ai.request.model": runtime.config.model}
    if getattr(request, "session_id", ""):
        attributes["specdec.session_id"] = request.session_id
    if request.HasField("prefix") if hasattr(request, "prefix") else False:
        attributes["specdec.prefix_tokens"] = request.prefix.length
    if hasattr(request, "new_tokens"):
        attributes["specdec.new_tokens"] = len(request.new_tokens)
    if hasattr(request, "num_draft_tokens"):
        attributes["specdec.k"] = request.num_draft_tokens
    elif hasattr(request, "draft_tokens"):
        attributes["specdec.k"] = len(request.draft_tokens)
    return attributes


class CallRecord:
    """One call served by a replica: counted in ``num_requests_running`` while it lasts,
    traced as a SERVER span under the caller's trace context (``traceparent`` in `carrier`:
    a grpc servicer context or a mapping), then counted in ``requests{method,code}`` by
    `finish`. The operation's name is set in the current context for the forwards' kinds
    (create and finish it in the same contextvars context). observed_rpc (gRPC) and the
    data plane (specdec.replica.dataplane) both record their calls with it."""

    def __init__(
        self,
        runtime: Runtime,
        service: str,
        method: str,
        request: Any,  # the call's request message, whichever RPC's
        carrier: telemetry.Invoked | Mapping[str, object],
    ):
        self.method = method
        self.metrics = ReplicaMetrics.for_role(runtime.config.role)
        self._operation = _OPERATION.set(method)
        self.metrics.running.inc()
        attributes = _request_attributes(runtime, request) if telemetry.enabled() else None
        self._span = telemetry.server_span(service, method, carrier, attributes)
        self.span = self._span.__enter__()

    def finish(self, code: grpc.StatusCode, message: str = "") -> None:
        try:
            telemetry.set_grpc_status(self.span, code, message)
            self._span.__exit__(None, None, None)
        finally:
            self.metrics.running.dec()
            self.metrics.child(self.metrics.requests, self.method, code.name).inc()
            _OPERATION.reset(self._operation)


class Observed(Protocol):
    """What observed_rpc reads of the servicer it decorates a method of."""

    @property
    def runtime(self) -> Runtime: ...


ServicerT = TypeVar("ServicerT", bound=Observed)
RpcMethod = Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], Awaitable[ResponseT]]


def observed_rpc(
    service: str,
) -> Callable[
    [RpcMethod[ServicerT, RequestT, ResponseT]],
    Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], Coroutine[Any, Any, ResponseT]],
]:
    """Count a replica servicer method and trace it as a SERVER span (outermost decorator,
    above serving.rpc_errors, whose aborts it reads the status code of): a CallRecord."""

    def decorate(
        method: RpcMethod[ServicerT, RequestT, ResponseT],
    ) -> Callable[[ServicerT, RequestT, grpc.aio.ServicerContext], Coroutine[Any, Any, ResponseT]]:
        name = method.__name__

        @functools.wraps(method)
        async def wrapper(
            self: ServicerT, request: RequestT, context: grpc.aio.ServicerContext
        ) -> ResponseT:
            record = CallRecord(self.runtime, service, name, request, context)
            code, message = grpc.StatusCode.UNKNOWN, ""
            try:
                response = await method(self, request, context)
            except grpc.aio.AbortError:
                code, message = context.code() or grpc.StatusCode.UNKNOWN, context.details() or ""
                raise
            except asyncio.CancelledError:
                code, message = grpc.StatusCode.CANCELLED, "cancelled by the caller"
                raise
            except SpecdecError as e:
                code, message = e.code, e.details
                raise
            else:
                code = grpc.StatusCode.OK
                return response
            finally:
                record.finish(code, message)

        return wrapper

    return decorate


def start_metrics_server(port: int, host: str = "") -> None:
    """Serve Prometheus text on http://host:port/metrics (a daemon thread)."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host or "0.0.0.0")
    except OSError as e:
        raise OSError(f"--metrics-port {port}: cannot listen: {e}") from None
    log.info("metrics listening", extra={"metrics_port": port})
