"""GatewayService: validates requests, runs the speculation loop, keeps sessions in Redis."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from specdec.common.errors import InvalidRequest, SpecdecError
from specdec.common.logs import setup_logging
from specdec.common.params import sampling_from_proto
from specdec.common.serving import rpc_errors, serve, stream_rpc_errors
from specdec.gateway import metrics
from specdec.gateway.config import GatewayConfig
from specdec.gateway.loop import Placement, Speculator
from specdec.gateway.replicas import Fleet
from specdec.gateway.sessions import SessionIndex, SessionRecord
from specdec.gateway.text import Completion, TextCodec
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SESSION_ID_CHARS = 256
# A prompt longer than this many characters per context token cannot fit: refused before
# it is tokenized, so one huge prompt cannot hold the event loop.
MAX_CHARS_PER_TOKEN = 64
TURN_LOCK_SECONDS = 60.0
FINISH = {
    "length": gateway_pb2.FINISH_REASON_LENGTH,
    "eos": gateway_pb2.FINISH_REASON_EOS,
    "stop": gateway_pb2.FINISH_REASON_STOP,
}


class Aborted(SpecdecError):
    code = grpc.StatusCode.ABORTED


@dataclass(frozen=True)
class Job:
    """A validated GenerateRequest."""

    prompt: str | list[int]  # text (tokenized in _run, once the history is known) or ids
    max_new_tokens: int
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...]
    session_id: str | None
    reset: bool
    ttl: int
    k: int
    ssd: bool


@dataclass
class Event:
    """What one step of a request produced: a delta, and the response when finished."""

    text: str
    tokens: list[int]
    final: gateway_pb2.GenerateResponse | None = None


class Gateway:
    """The request-level logic, independent of gRPC plumbing."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.fleet = Fleet(config.drafters, config.verifiers)
        self.sessions = SessionIndex(config.redis_url, default_ttl=config.session_ttl)
        self.codec: TextCodec | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        info = await self.fleet.connect(self.config.startup_timeout)
        self.codec = TextCodec.from_info(info)
        replicas = self.fleet.all
        self.vocab_size = info.vocab_size
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.max_context = min(r.info.max_context for r in replicas)
        self.max_k = min(r.info.max_draft_tokens for r in replicas)
        self.default_k = min(self.config.default_k, self.max_k)
        if self.default_k < self.config.default_k:
            log.warning(
                "--default-k is above what the replicas accept; using their maximum",
                extra={"default_k": self.config.default_k, "max_k": self.max_k},
            )
        self.fleet.start_probe()
        if self.config.redis_url and not await self.sessions.ping():
            log.warning(
                "redis unreachable at start; sessions stay in this process until it is back"
            )
        log.info(
            "gateway ready",
            extra={
                "drafters": list(self.config.drafters),
                "verifiers": list(self.config.verifiers),
                "vocab_size": self.vocab_size,
                "max_context": self.max_context,
                "max_k": self.max_k,
            },
        )

    async def close(self) -> None:
        await self.fleet.close()
        await self.sessions.close()

    # -- validation ---------------------------------------------------------------------

    def validate(self, req: gateway_pb2.GenerateRequest) -> Job:
        which = req.WhichOneof("input")
        if which == "prompt":
            if not req.prompt:
                raise InvalidRequest("prompt is empty")
            if len(req.prompt) > self.max_context * MAX_CHARS_PER_TOKEN:
                raise InvalidRequest(
                    f"prompt of {len(req.prompt)} characters cannot fit the model's context "
                    f"of {self.max_context} tokens"
                )
            prompt: str | list[int] = req.prompt
        elif which == "prompt_token_ids":
            prompt = list(req.prompt_token_ids.ids)
            if not prompt:
                raise InvalidRequest("prompt is empty: prompt_token_ids has no ids")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
                )
        else:
            raise InvalidRequest("prompt is empty: set prompt or prompt_token_ids")
        if not 1 <= req.max_new_tokens <= self.config.max_new_tokens:
            raise InvalidRequest(
                f"max_new_tokens must be in [1, {self.config.max_new_tokens}], got {req.max_new_tokens}"
            )
        sampling_from_proto(req.sampling)  # validates; the proto travels as it is
        stop = tuple(req.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequest(f"stop strings must have 1..{MAX_STOP_CHARS} characters")
        session = req.session
        if session.mode not in gateway_pb2.SessionMode.values():
            raise InvalidRequest(f"unknown session mode {session.mode}")
        if not session.id and (session.mode or session.ttl_seconds):
            raise InvalidRequest("session options given without a session id")
        if len(session.id) > MAX_SESSION_ID_CHARS:
            raise InvalidRequest(f"session id is longer than {MAX_SESSION_ID_CHARS} characters")
        if session.ttl_seconds > self.config.max_session_ttl:
            raise InvalidRequest(
                f"session ttl_seconds must be at most {self.config.max_session_ttl}, "
                f"got {session.ttl_seconds}"
            )
        spec = req.speculation
        k = spec.num_draft_tokens if spec.HasField("num_draft_tokens") else self.default_k
        if not 0 <= k <= self.max_k:
            raise InvalidRequest(f"num_draft_tokens must be in [0, {self.max_k}], got {k}")
        ssd = spec.ssd if spec.HasField("ssd") else self.config.ssd
        return Job(
            prompt=prompt,
            max_new_tokens=req.max_new_tokens,
            sampling=req.sampling,
            stop=stop,
            session_id=session.id or None,
            reset=session.mode == gateway_pb2.SESSION_MODE_RESET,
            ttl=session.ttl_seconds or self.config.session_ttl,
            k=k,
            ssd=ssd and k > 0,
        )

    # -- generation ---------------------------------------------------------------------

    async def run(self, req: gateway_pb2.GenerateRequest) -> AsyncIterator[Event]:
        metrics.IN_FLIGHT.inc()
        try:
            async for event in self._run(self.validate(req)):
                yield event
        except SpecdecError as e:
            metrics.REQUEST_ERRORS.labels(code=e.code.name).inc()
            raise
        finally:
            metrics.IN_FLIGHT.dec()

    async def _run(self, job: Job) -> AsyncIterator[Event]:
        if not job.session_id:
            async for event in self._turn(job, None):
                yield event
            return
        token = await self.sessions.lock_turn(job.session_id, TURN_LOCK_SECONDS)
        if token is None:
            raise Aborted(
                f"session {job.session_id!r} has a turn in progress; send a session's turns "
                "one after another"
            )
        try:
            async for event in self._turn(job, token):
                yield event
        finally:
            await self.sessions.unlock_turn(job.session_id, token)

    async def _turn(self, job: Job, lock: str | None) -> AsyncIterator[Event]:
        started = time.perf_counter()
        record = None
        if job.session_id and not job.reset:
            record = await self.sessions.get(job.session_id)
        history = record.tokens if record else []
        if isinstance(job.prompt, str):
            # A new conversation gets the tokenizer's special tokens (BOS), as
            # `tokenizer(prompt)` would; a continuation appends the text alone.
            prompt_ids = await asyncio.to_thread(self.codec.encode, job.prompt, not history)
            if not prompt_ids:
                raise InvalidRequest("prompt is empty after tokenization")
        else:
            prompt_ids = job.prompt
        ctx = [*history, *prompt_ids]
        if len(ctx) + job.max_new_tokens > self.max_context:
            raise InvalidRequest(
                f"the model's context is {self.max_context} tokens; this request needs "
                f"{len(ctx) + job.max_new_tokens} ({len(history)} history + "
                f"{len(prompt_ids)} prompt + {job.max_new_tokens} max_new_tokens)"
            )
        drafter, verifier = Placement(), Placement()
        if record:
            drafter = Placement(
                self.fleet.drafters.by_address(record.drafter), record.drafter_cached
            )
            verifier = Placement(
                self.fleet.verifiers.by_address(record.verifier), record.verifier_cached
            )
        replica_session = f"s/{job.session_id}" if job.session_id else f"r/{uuid.uuid4().hex}"
        spec = Speculator(
            self.fleet,
            replica_session,
            job.sampling,
            drafter,
            verifier,
            self.config.rpc_timeout,
            ssd=job.ssd,
            ssd_fan_out=self.config.ssd_fan_out,
        )
        completion = Completion(self.codec, job.max_new_tokens, self.eos_token_ids, job.stop)
        first_at = last_at = None
        lock_refreshed = started
        try:
            while completion.finish_reason is None:
                remaining = job.max_new_tokens - len(completion.tokens)
                new = await spec.round(ctx, min(job.k, remaining - 1), remaining)
                ctx.extend(new)
                text, tokens = completion.push(new)
                now = time.perf_counter()
                if first_at is None:
                    first_at = now
                    metrics.TTFT.observe(now - started)
                elif tokens:
                    for _ in tokens:
                        metrics.ITL.observe((now - last_at) / len(tokens))
                last_at = now
                if lock and now - lock_refreshed > TURN_LOCK_SECONDS / 3:
                    await self.sessions.refresh_turn(job.session_id, lock, TURN_LOCK_SECONDS)
                    lock_refreshed = now
                if completion.finish_reason is None and (text or tokens):
                    yield Event(text, tokens)
            response = self._response(job, prompt_ids, completion, spec, history, started, first_at)
            if job.session_id:
                final_tokens = [*history, *prompt_ids, *completion.tokens]
                await self.sessions.put(
                    SessionRecord(
                        session_id=job.session_id,
                        tokens=final_tokens,
                        drafter=drafter.address,
                        verifier=verifier.address,
                        drafter_cached=min(drafter.cached, len(final_tokens)),
                        verifier_cached=min(verifier.cached, len(final_tokens)),
                        turns=(record.turns if record else 0) + 1,
                    ),
                    ttl_seconds=job.ttl,
                )
            yield Event(text, tokens, response)
        finally:
            self._record_metrics(spec, completion)
            if not job.session_id:
                self._release_later(replica_session, drafter, verifier)

    def _response(self, job, prompt_ids, completion, spec, history, started, first_at):
        stats = spec.stats
        return gateway_pb2.GenerateResponse(
            text=completion.text,
            token_ids=completion.tokens,
            finish_reason=FINISH[completion.finish_reason],
            usage=gateway_pb2.Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion.tokens),
                history_tokens=len(history),
            ),
            timings=gateway_pb2.Timings(
                time_to_first_token_ms=((first_at or started) - started) * 1e3,
                total_ms=(time.perf_counter() - started) * 1e3,
            ),
            stats=gateway_pb2.SpeculationStats(
                rounds=stats.rounds,
                draft_tokens=stats.draft_tokens,
                accepted_tokens=stats.accepted_tokens,
                acceptance_rate=stats.acceptance_rate,
                mean_accepted_length=stats.mean_accepted_length,
                accepted_per_position=stats.accepted_per_position,
                num_draft_tokens=job.k,
                ssd=job.ssd,
                ssd_hits=stats.ssd_hits,
                ssd_misses=stats.ssd_misses,
                ssd_branches=stats.ssd_branches,
                ssd_hidden_ms=stats.ssd_hidden_ms,
                drafter_wait_ms=stats.drafter_wait_ms,
                ssd_bytes=stats.ssd_bytes,
                cache_misses=stats.cache_misses,
            ),
            session_id=job.session_id or "",
        )

    @staticmethod
    def _record_metrics(spec: Speculator, completion: Completion) -> None:
        s = spec.stats
        if completion.finish_reason:
            metrics.REQUESTS.labels(finish_reason=completion.finish_reason).inc()
        metrics.GENERATION_TOKENS.inc(len(completion.tokens))
        metrics.NUM_DRAFTS.inc(s.drafts)
        metrics.NUM_DRAFT_TOKENS.inc(s.draft_tokens)
        metrics.NUM_ACCEPTED_TOKENS.inc(s.accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            metrics.ACCEPTED_PER_POS.labels(position=str(pos)).inc(n)
        metrics.CACHE_MISSES.inc(s.cache_misses)
        metrics.SSD_HITS.inc(s.ssd_hits)
        metrics.SSD_MISSES.inc(s.ssd_misses)
        metrics.SSD_BRANCHES.inc(s.ssd_branches)
        metrics.SSD_HIDDEN.inc(s.ssd_hidden_ms / 1e3)
        metrics.SSD_BYTES.inc(s.ssd_bytes)
        metrics.DRAFTER_WAIT.inc(s.drafter_wait_ms / 1e3)

    def _release_later(self, replica_session: str, *placements: Placement) -> None:
        """Drop a one-off request's KV caches (best effort, off the response path)."""

        async def release() -> None:
            for p in placements:
                if p.replica is not None and p.replica.up:
                    try:
                        await p.replica.stub.Release(
                            common_pb2.ReleaseRequest(session_id=replica_session), timeout=5
                        )
                    except grpc.RpcError as e:
                        log.info("release failed", extra={"replica": p.address, "why": e.details()})

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    @rpc_errors
    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        # Drain the generator (never return from inside the loop): its cleanup (the
        # session's turn lock, metrics, cache release) must run before the answer leaves.
        final = None
        async for event in self.gateway.run(request):
            final = event.final or final
        if final is None:
            raise AssertionError("generation ended without a final response")
        return final

    @stream_rpc_errors
    async def GenerateStream(self, request, context):
        async for event in self.gateway.run(request):
            msg = gateway_pb2.GenerateStreamResponse(text=event.text, token_ids=event.tokens)
            if event.final is not None:
                f = event.final
                msg.finish_reason = f.finish_reason
                msg.usage.CopyFrom(f.usage)
                msg.timings.CopyFrom(f.timings)
                msg.stats.CopyFrom(f.stats)
                msg.session_id = f.session_id
            yield msg


def main(args: argparse.Namespace) -> None:
    config = GatewayConfig.from_args(args)
    setup_logging("gateway")

    async def run() -> None:
        gateway = Gateway(config)  # grpc.aio channels bind to the running loop

        async def ready() -> None:
            if config.metrics_port:
                from prometheus_client import start_http_server

                start_http_server(config.metrics_port)
            await gateway.start()

        try:
            await serve(
                service_name=SERVICE_NAME,
                add_servicers=lambda server: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
                    GatewayServicer(gateway), server
                ),
                reflect=[SERVICE_NAME],
                host=config.host,
                port=config.port,
                ready=ready,
                grace_seconds=config.grace_seconds,
            )
        finally:
            await gateway.close()

    asyncio.run(run())
