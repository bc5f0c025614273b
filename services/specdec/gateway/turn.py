"""One turn of a request: the session's history, the speculation loop, the session write.

`Gateway` is the request-level logic, independent of gRPC plumbing (the servicer in
specdec.gateway.server translates; an HTTP front can call the same `run`). A turn:

1. validates the request (specdec.gateway.request) and, for a session, takes its turn
   lock (one turn at a time per session, across gateways);
2. reads the session's record (history, which replicas cache it and how much);
3. tokenizes the prompt after the history and checks it fits the context;
4. runs speculation rounds (specdec.gateway.loop) until the completion finishes, yielding
   what may be streamed after each round;
5. writes the session's new history and placement, then yields the final response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specdec.common.errors import InvalidRequest, SpecdecError
from specdec.common.params import SamplingParams
from specdec.gateway import metrics
from specdec.gateway.caller import Placement, ReplicaCaller
from specdec.gateway.canary import version_rule
from specdec.gateway.choices import ChoiceRun, run_choices
from specdec.gateway.config import GatewayConfig
from specdec.gateway.dataplane import DataPlaneSettings
from specdec.gateway.grammar import Grammar, Grammars
from specdec.gateway.logprobs import LogprobsTrack, narrowed
from specdec.gateway.lookup import method_name
from specdec.gateway.lookup.hybrid import LookupSettings, RequestLookup
from specdec.gateway.lookup.suffix import SuffixCache, SuffixParams
from specdec.gateway.loop import Speculator
from specdec.gateway.policy import SourcePriors, make_policy
from specdec.gateway.recorder import Recorder, recording_row
from specdec.gateway.replicas import Fleet
from specdec.gateway.request import ContextLengthExceeded, Job, Limits, validate
from specdec.gateway.response import Event, record_metrics
from specdec.gateway.sessions import (
    SessionIndex,
    SessionRecord,
    TurnLease,
    TurnLocks,
    replica_session_id,
)
from specdec.gateway.text import Completion, TextCodec
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

TURN_LOCK_SECONDS = 60.0
# How long a turn waits for its session's previous turn to end before ABORTED: covers a
# cancelled turn that is still cleaning up (milliseconds), not a turn that is running.
TURN_LOCK_WAIT_SECONDS = 1.0


# Builds a turn's prompt ids from the session's record, inside the turn lock: returns the
# record to continue (None: start the session afresh), the prompt ids and, when the request
# left max_new_tokens to it, the max_new_tokens that fits (the HTTP chat API,
# specdec.gateway.http.chat).
Prompter = Callable[
    [SessionRecord | None], Awaitable[tuple[SessionRecord | None, list[int], int | None]]
]


class Aborted(SpecdecError):
    code = grpc.StatusCode.ABORTED


def _ms(seconds: float) -> float:
    return seconds * 1e3


def output_controls(
    job: Job, output_start: int, eos_token_ids: frozenset[int]
) -> common_pb2.OutputControls:
    """What the replicas' logits processors need besides the sampling: where this turn's
    output starts in the session's sequence, and the ids min_tokens masks (the model's EOS
    unless ignore_eos, and the stop token ids)."""
    masked = set(job.stop_token_ids) | (set() if job.ignore_eos else set(eos_token_ids))
    return common_pb2.OutputControls(
        output_start=output_start,
        min_tokens=job.min_tokens,
        min_tokens_ids=sorted(masked) if job.min_tokens else [],
    )


def data_plane_settings(config: GatewayConfig) -> DataPlaneSettings | None:
    """How the gateway reaches the replicas' data ports: the replicas' TLS settings
    (--replica-ca, --replica-cert/--replica-key, --replica-server-name); None under
    --replica-transport grpc."""
    if config.replica_transport != "dataplane":
        return None
    tls = config.replica_tls
    return DataPlaneSettings(
        tls=tls.ssl_context() if tls is not None else None,
        server_name=tls.server_name if tls is not None else "",
        keepalive_interval=config.data_keepalive,
        keepalive_timeout=config.data_keepalive_timeout,
    )


def drafter_version(placement: Placement) -> str:
    """The model version of the drafter a placement ends on ("" when none)."""
    replica = placement.replica
    return replica.info.model_version if replica is not None and replica.info else ""


class Gateway:
    """Turns against the replica fleet and the session index."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.fleet = Fleet(
            config.drafters,
            config.verifiers,
            dns_interval=config.dns_interval,
            credentials=config.replica_tls.credentials() if config.replica_tls else None,
            server_name=config.replica_tls.server_name if config.replica_tls else "",
            data_plane=data_plane_settings(config),
        )
        self.sessions = SessionIndex(config.redis_url, default_ttl=config.session_ttl)
        self.turns = TurnLocks(self.sessions)
        self.recorder: Recorder | None = None
        if config.record_dir:
            self.recorder = Recorder(
                config.record_dir, config.record_max_bytes, config.record_max_files
            )
        self.codec: TextCodec | None = None
        self.limits: Limits | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammars: Grammars | None = None  # structured output (specdec.gateway.grammar)
        self.grammars_error = "the gateway is still connecting to its replicas"
        # Each draft source's acceptance over the requests served: where a new request's
        # adaptive policy starts from (specdec.gateway.policy).
        self.source_priors = SourcePriors()
        self._background: set[asyncio.Task] = set()
        self.lookup_settings = LookupSettings(
            prompt_lookup_min=config.prompt_lookup_min,
            prompt_lookup_max=config.prompt_lookup_max,
            suffix=SuffixParams(
                depth=config.suffix_depth,
                max_match=min(SuffixParams.max_match, config.suffix_depth - 1),
            ),
        )
        # The cache of recent outputs for suffix drafts (this gateway replica's own).
        self.suffix_cache = (
            SuffixCache(config.suffix_cache_tokens, self.lookup_settings.suffix)
            if config.suffix_cache_scope != "off" and config.suffix_cache_tokens > 0
            else None
        )

    async def start(self) -> None:
        """Wait for the replicas, take their tokenizer and limits, start the probe."""
        info = await self.fleet.connect(self.config.startup_timeout)
        self.codec = TextCodec.from_info(info)
        replicas = self.fleet.all
        max_k = min(r.info.max_draft_tokens for r in replicas)
        default_k = min(self.config.default_k, max_k)
        if default_k < self.config.default_k:
            log.warning(
                "--default-k is above what the replicas accept; using their maximum",
                extra={"default_k": self.config.default_k, "max_k": max_k},
            )
        self.limits = Limits(
            vocab_size=info.vocab_size,
            max_context=min(r.info.max_context for r in replicas),
            max_k=max_k,
            default_k=default_k,
            default_ssd=self.config.ssd,
            default_k_policy=self.config.k_policy,
            max_new_tokens=self.config.max_new_tokens,
            default_ttl=self.config.session_ttl,
            max_session_ttl=self.config.max_session_ttl,
            default_method=self.config.method,
            default_tree_width=self.config.tree_width,
            sampling_defaults=(
                Sampling.from_proto(info.sampling_defaults)
                if info.HasField("sampling_defaults")
                else None
            ),
        )
        self.eos_token_ids = frozenset(info.eos_token_ids)
        try:
            self.grammars = await asyncio.to_thread(
                Grammars,
                zlib.decompress(info.tokenizer_json_zlib).decode(),
                info.vocab_size,
                self.eos_token_ids,
            )
        except Exception as e:  # a tokenizer the engine cannot read: the rest still serves
            self.grammars_error = f"the grammar engine cannot use this tokenizer: {e}"
            log.warning("structured output unavailable", extra={"why": self.grammars_error})
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
                "vocab_size": self.limits.vocab_size,
                "max_context": self.limits.max_context,
                "max_k": self.limits.max_k,
            },
        )

    async def close(self) -> None:
        await self.fleet.close()
        await self.sessions.close()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)

    async def run(
        self,
        req: gateway_pb2.GenerateRequest,
        *,
        prompter: Prompter | None = None,
        deadline: float | None = None,
        tenant: str = "",
    ) -> AsyncIterator[Event]:
        """Validate and run one request; errors are SpecdecError with their status.

        tenant: who the request is for; keys the suffix cache under --suffix-cache-scope
        tenant (the gRPC metadata specdec-tenant, the HTTP API's `user` field).

        prompter: when given, replaces the tokenization of the prompt (see Prompter).
        deadline: the client's deadline (time.monotonic()), if it set one; it bounds every
        replica call of the request instead of --rpc-timeout.
        """
        metrics.IN_FLIGHT.inc()
        try:
            job = dataclasses.replace(validate(req, self.limits), tenant=tenant)
            grammar = None
            if job.structured is not None:  # before any replica is called
                if self.grammars is None:
                    raise InvalidRequest(
                        f"structured_output is not available on this server: {self.grammars_error}"
                    )
                grammar = await asyncio.to_thread(self.grammars.compile, job.structured)
            async for event in self._run(job, prompter, deadline, grammar):
                yield event
        except SpecdecError as e:
            metrics.REQUEST_ERRORS.labels(code=e.code.name).inc()
            raise
        finally:
            metrics.IN_FLIGHT.dec()

    async def _run(
        self,
        job: Job,
        prompter: Prompter | None,
        deadline: float | None,
        grammar: Grammar | None,
    ) -> AsyncIterator[Event]:
        if not job.session_id:
            async for event in self._turn(job, None, prompter, deadline, grammar):
                yield event
            return
        lease = await self.turns.lock(job.session_id, TURN_LOCK_SECONDS, TURN_LOCK_WAIT_SECONDS)
        if lease is None:
            raise Aborted(
                f"session {job.session_id!r} has a turn in progress; send a session's turns "
                "one after another"
            )
        try:
            async for event in self._turn(job, lease, prompter, deadline, grammar):
                yield event
        finally:
            await self.turns.unlock(lease)

    async def _turn(
        self,
        job: Job,
        lease: TurnLease | None,
        prompter: Prompter | None = None,
        deadline: float | None = None,
        grammar: Grammar | None = None,
    ) -> AsyncIterator[Event]:
        started = time.perf_counter()
        record = None
        if job.session_id and not job.reset:
            record = await self.sessions.get(job.session_id)
        history = record.tokens if record else []
        if prompter is not None:
            record, prompt_ids, max_new_tokens = await prompter(record)
            history = record.tokens if record else []
            if max_new_tokens is not None:
                job = dataclasses.replace(job, max_new_tokens=max_new_tokens)
                if job.min_tokens > max_new_tokens:
                    raise InvalidRequest(
                        f"min_tokens {job.min_tokens} exceeds the {max_new_tokens} tokens "
                        "left for the completion"
                    )
        elif isinstance(job.prompt, str):
            # A new conversation gets the tokenizer's special tokens (BOS), as
            # `tokenizer(prompt)` would; a continuation appends the text alone.
            prompt_ids = await asyncio.to_thread(self.codec.encode, job.prompt, not history)
            if not prompt_ids:
                raise InvalidRequest("prompt is empty after tokenization")
        else:
            prompt_ids = job.prompt
        ctx = [*history, *prompt_ids]
        max_context = self.limits.max_context
        if len(ctx) + job.max_new_tokens > max_context:
            raise ContextLengthExceeded(
                f"the model's context is {max_context} tokens; this request needs "
                f"{len(ctx) + job.max_new_tokens} ({len(history)} history + "
                f"{len(prompt_ids)} prompt + {job.max_new_tokens} max_new_tokens)"
            )
        metrics.PROMPT_TOKENS.inc(len(prompt_ids))
        replica_session = replica_session_id(job.session_id)
        # --drafter-canary: which drafter version a new placement takes (a pure function
        # of the session's replica id: the same for every turn of a session).
        rule = version_rule(self.config.drafter_canary, replica_session)
        drafter, verifier = Placement(rule=rule), Placement()
        if record:
            drafter = Placement(
                self.fleet.drafters.by_address(record.drafter), record.drafter_cached, rule
            )
            verifier = Placement(
                self.fleet.verifiers.by_address(record.verifier), record.verifier_cached
            )
        if job.n > 1:  # n completions of one prompt, its prefill shared (no session)
            async for event in run_choices(self, job, ctx, prompt_ids, started, deadline, grammar):
                yield event
            return
        recording = self.recorder is not None and job.record
        run = self.choice_run(
            job,
            replica_session,
            drafter,
            verifier,
            deadline,
            len(ctx),
            grammar=grammar,
            lookup=await self.request_lookup(job, ctx),
            record_top=self.config.record_top_logprobs if recording else 0,
        )
        if recording:
            run.outcomes = []  # the rounds' outcomes, kept for the recording
        try:
            async for event in self.rounds(job, ctx, run, started, lease):
                yield event
            response = run.response(job, prompt_ids, len(history), started)
            response.stats.drafter_version = drafter_version(drafter)
            completion = run.completion
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
                    fence=lease.fence if lease else None,
                )
            if recording:  # a finished turn, its session saved
                response.stats.recorded = self.recorder.submit(
                    recording_row(
                        prompt_ids=[*history, *prompt_ids],
                        history_tokens=len(history),
                        output_ids=completion.tokens,
                        rounds=run.outcomes,
                        drafter_version=response.stats.drafter_version,
                        target_model=verifier.replica.info.model_id if verifier.replica else "",
                        sampling=job.sampling,
                        finish_reason=completion.finish_reason,
                        scores=(
                            run.record_track.rows(0, len(completion.tokens))
                            if run.record_track is not None
                            else None
                        ),
                    )
                )
            yield Event(*run.held, response, **run.delta(run.held[1]))
        finally:
            record_metrics(job, run.spec.stats, run.completion, drafter_version(drafter))
            if not job.session_id:
                self.release_later(replica_session, drafter, verifier)

    def choice_run(
        self,
        job: Job,
        replica_session: str,
        drafter: Placement,
        verifier: Placement,
        deadline: float | None,
        context_tokens: int,
        index: int = 0,
        sampling: SamplingParams | None = None,
        grammar: Grammar | None = None,
        lookup: RequestLookup | None = None,
        record_top: int = 0,
    ) -> ChoiceRun:
        """The loop state of one completion (choice `index`) on the given placements, after
        context_tokens of history and prompt."""
        spec = Speculator(
            ReplicaCaller(self.fleet, self.config.rpc_timeout, deadline),
            replica_session,
            sampling or job.sampling,
            drafter,
            verifier,
            make_policy(job.k_policy, job.ssd, self.config.ssd_fan_out, self.source_priors),
            ssd=job.ssd,
            max_context=self.limits.max_context,
            # A recorded turn with --record-top-logprobs M scores its output too: one Verify
            # asks for the most either reader needs, each keeps its own (`narrowed`).
            logprobs=job.logprobs or record_top > 0,
            top_logprobs=max(job.top_logprobs, record_top),
            prompt_logprobs=job.prompt_logprobs and index == 0,
            output=output_controls(job, context_tokens, self.eos_token_ids),
            # Structured output: this completion's own grammar state (a matcher per choice).
            constraint=self.grammars.matcher(grammar) if grammar is not None else None,
            lookup=lookup,
            lookup_max_k=self.limits.max_k,
            tree_width=job.tree_width,
        )
        completion = Completion(
            self.codec,
            job.max_new_tokens,
            self.eos_token_ids,
            job.stop,
            ignore_eos=job.ignore_eos,
            min_tokens=job.min_tokens,
            stop_token_ids=job.stop_token_ids,
        )
        track = LogprobsTrack(job.top_logprobs) if job.logprobs else None
        run = ChoiceRun(index, spec, completion, track, context_tokens=context_tokens)
        if record_top:  # the output's scores, kept for the recording
            run.record_track = LogprobsTrack(record_top)
        return run

    async def rounds(
        self,
        job: Job,
        ctx: list[int],
        run: ChoiceRun,
        started: float,
        lease: TurnLease | None = None,
    ) -> AsyncIterator[Event]:
        """Speculation rounds after ctx (extended in place) until the completion finishes,
        yielding each round's delta; what the last round leaves is in run.held."""
        completion = run.completion
        reported_first = False
        while completion.finish_reason is None:
            remaining = job.max_new_tokens - len(completion.tokens)
            outcome = await run.spec.round(ctx, min(job.k, remaining - 1), remaining)
            if run.outcomes is not None:
                run.outcomes.append(outcome)
            new = outcome.tokens
            if run.spec.constraint is not None:
                run.spec.constraint.advance(new)
            ctx.extend(new)
            if run.track is not None:
                run.track.add(outcome.logprobs)
            if run.record_track is not None:
                run.record_track.add(outcome.logprobs)
            if outcome.prompt_logprobs is not None:
                run.prompt_logprobs = narrowed(outcome.prompt_logprobs, job.top_logprobs)
            text, tokens = completion.push(new)
            now = time.perf_counter()
            if run.first_at is None:
                run.first_at = now
                if run.index == 0:
                    metrics.TTFT.observe(now - started)
            elif tokens and run.index == 0:
                for _ in tokens:
                    metrics.ITL.observe((now - run.last_at) / len(tokens))
            run.last_at = now
            if lease is not None and lease.lost:
                raise Aborted(
                    f"session {job.session_id!r}: this turn lost its lock (another "
                    "gateway may have taken the session); stopped without saving it"
                )
            if completion.finish_reason is None and (text or tokens):
                ttft = None if reported_first else _ms(run.first_at - started)
                reported_first = True
                yield Event(text, tokens, time_to_first_token_ms=ttft, **run.delta(tokens))
            elif completion.finish_reason is not None:
                run.held = (text, tokens)
        if run.spec.lookup is not None:  # the output joins the suffix cache
            run.spec.lookup.finish(completion.tokens)

    async def request_lookup(self, job: Job, ctx: list[int]) -> RequestLookup:
        """A completion's lookup proposer (its method, its prediction, the suffix cache),
        following ctx (the history and prompt)."""
        prediction = job.prediction
        if isinstance(prediction, str):
            prediction = await asyncio.to_thread(self.codec.encode, prediction, False)
        key = job.tenant if self.config.suffix_cache_scope == "tenant" else ""
        lookup = RequestLookup(
            method_name(job.method),
            self.lookup_settings,
            output_from=len(ctx),
            prediction=prediction or (),
            cache=self.suffix_cache,
            cache_key=key,
            # A seeded sampled request stays reproducible: no drafts from other outputs.
            draft_from_cache=job.sampling.seed is None,
            width=job.tree_width,
        )
        if lookup.active and job.k > 0:  # index the prompt (4k tokens: tens of ms) off the loop
            await asyncio.to_thread(lookup.follow, ctx)
        return lookup

    def release_later(self, replica_session: str, *placements: Placement) -> None:
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
