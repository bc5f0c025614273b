"""One turn of a request: the session's history, the completion, the session write.

`Gateway` is the request-level logic, independent of gRPC plumbing (the servicer in
specdec.gateway.front.server translates; an HTTP front can call the same `run`): the core it
runs on (`GatewayCore`, specdec.gateway.service: start-up, limits, the fleet and the
session index) and the session turn. A turn:

1. resolves the typed request (the SDK's Request, from either door) into a Job
   (specdec.gateway.job) and, for a session, takes its turn lock (one turn at a time per
   session, across gateways);
2. reads the session's record (history, which replicas cache it and how much);
3. tokenizes the prompt after the history and checks it fits the context;
4. runs its completion (specdec.gateway.front.completion; n > 1: specdec.gateway.front.choices)
   until it finishes, yielding what may be streamed after each round;
5. writes the session's new history and placement, then yields the final response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from specdec.common.errors import InvalidRequest, SpecdecError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.fleet.canary import version_rule
from specdec.gateway.fleet.placement import Placement
from specdec.gateway.front.choices import run_choices
from specdec.gateway.front.completion import Aborted as Aborted
from specdec.gateway.front.completion import Completion, Completions
from specdec.gateway.front.completion import output_controls as output_controls
from specdec.gateway.front.response import Event, record_metrics
from specdec.gateway.job import ContextLengthExceeded, Job
from specdec.gateway.observe import metrics
from specdec.gateway.observe.recorder import recording_row
from specdec.gateway.round.grammar import Grammar
from specdec.gateway.service import GatewayCore
from specdec.gateway.service import data_plane_settings as data_plane_settings
from specdec.gateway.sessions import (
    Holder,
    LockLost,
    SessionLost,
    SessionRecord,
    TurnLease,
    replica_session_id,
)
from specdec.sdk.request import Request

# How long a turn waits for its session's previous turn to end before ABORTED: covers a
# cancelled turn that is still cleaning up (milliseconds), not a turn that is running. A
# turn whose lock belongs to a gateway that stopped answering waits for its lease to lapse
# (--turn-lease) instead.
TURN_LOCK_WAIT_SECONDS = 1.0


# Builds a turn's prompt ids from the session's record, inside the turn lock: returns the
# record to continue (None: start the session afresh), the prompt ids and, when the request
# left max_new_tokens to it, the max_new_tokens that fits (the HTTP chat API,
# specdec.gateway.front.http.chat).
Prompter = Callable[
    [SessionRecord | None], Awaitable[tuple[SessionRecord | None, list[int], int | None]]
]


def _check_turns(job: Job, record: SessionRecord | None) -> None:
    """SessionLost when the session holds fewer turns than the request expects: its history
    was lost, and continuing would answer as if the conversation had never happened."""
    held = record.turns if record else 0
    if held >= job.session.expected_turns:
        return
    metrics.SESSIONS_LOST.inc()
    raise SessionLost(
        f"session {job.session.id!r} holds {held} turns, the request expected "
        f"{job.session.expected_turns}: its history was lost (the session store restarted "
        "without it, or a gateway that wrote it while the store was unreachable has not "
        "written it back, and this gateway has no copy); start it again with "
        "SESSION_MODE_RESET and the whole conversation"
    )


def drafter_version(placement: Placement) -> str:
    """The model version of the drafter a placement ends on ("" when none)."""
    replica = placement.replica
    return replica.info.model_version if replica is not None and replica.info else ""


class Gateway(GatewayCore):
    """Session turns on the gateway's core: each request's completions, its session's
    history."""

    def __init__(self, config: GatewayConfig):
        super().__init__(config)
        self.completions = Completions(self)

    async def run(
        self,
        request: Request,
        *,
        prompter: Prompter | None = None,
        deadline: float | None = None,
        tenant: str = "",
    ) -> AsyncGenerator[Event, None]:
        """Resolve and run one request; errors are SpecdecError with their status (a bad
        request: InvalidRequest naming its field).

        tenant: who the request is for; keys the suffix cache under --suffix-cache-scope
        tenant (the gRPC metadata specdec-tenant, the HTTP API's `user` field).

        prompter: when given, replaces the tokenization of the prompt (see Prompter).
        deadline: the client's deadline (time.monotonic()), if it set one; it bounds every
        replica call of the request instead of --rpc-timeout.
        """
        metrics.IN_FLIGHT.inc()
        try:
            assert self.limits is not None, "the service has started"
            job = Job.resolve(request, self.limits, tenant)
            grammar = await self._grammar(job)  # before any replica is called
            async for event in self._run(job, prompter, deadline, grammar):
                yield event
        except SpecdecError as e:
            metrics.REQUEST_ERRORS.labels(code=e.code.name).inc()
            raise
        finally:
            metrics.IN_FLIGHT.dec()

    async def _grammar(self, job: Job) -> Grammar | None:
        """The request's compiled grammar (None: it has none); InvalidRequest naming
        structured_output when it cannot be compiled, or this server has no engine."""
        if job.output.structured is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(
                f"structured_output is not available on this server: {self.grammars_error}",
                field="structured_output",
            )
        try:
            return await asyncio.to_thread(self.grammars.compile, job.output.structured)
        except InvalidRequest as e:
            raise e.about("structured_output") from None

    async def _run(
        self,
        job: Job,
        prompter: Prompter | None,
        deadline: float | None,
        grammar: Grammar | None,
    ) -> AsyncIterator[Event]:
        if not job.session.id:
            async for event in self._turn(job, None, prompter, deadline, grammar):
                yield event
            return
        lease = await self.turns.acquire(
            job.session.id, self.config.turn_lease, TURN_LOCK_WAIT_SECONDS
        )
        if isinstance(lease, Holder):
            raise lease.error(job.session.id)
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
        if job.session.id and not job.session.reset:
            record = await self.sessions.get(job.session.id)
            _check_turns(job, record)
        job, record, prompt_ids = await self._prompt(job, record, prompter)
        history = record.tokens if record else []
        ctx = [*history, *prompt_ids]
        metrics.PROMPT_TOKENS.inc(len(prompt_ids))
        replica_session = replica_session_id(job.session.id)
        drafter, verifier = self._placements(record, replica_session)
        if job.output.n > 1:  # n completions of one prompt, its prefill shared (no session)
            async for event in run_choices(
                self.completions, job, ctx, prompt_ids, started, deadline, grammar
            ):
                yield event
            return
        recording = self.recorder is not None and job.output.record
        run = self.completions.new(
            job,
            replica_session,
            drafter,
            verifier,
            deadline,
            len(ctx),
            grammar=grammar,
            lookup=await self.completions.lookup(job, ctx),
            record_top=self.config.record_top_logprobs if recording else 0,
        )
        if recording:
            run.outcomes = []  # the rounds' outcomes, kept for the recording
        try:
            async for event in run.rounds(job, ctx, started, lease):
                yield event
            response = run.response(job, prompt_ids, len(history), started)
            response.stats.drafter_version = drafter_version(drafter)
            if job.session.id:
                response.usage.session_turns = await self._save(
                    job.session.id, job, lease, record, [*history, *prompt_ids], run
                )
            if recording:  # a finished turn, its session saved
                response.stats.recorded = self._record(
                    job, history, prompt_ids, run, response.stats.drafter_version
                )
            yield Event(*run.held, response, **run.delta(run.held[1]))
        finally:
            record_metrics(job, run.spec.stats, run.output, drafter_version(drafter))
            if not job.session.id:
                self.release_later(replica_session, drafter, verifier)

    async def _prompt(
        self, job: Job, record: SessionRecord | None, prompter: Prompter | None
    ) -> tuple[Job, SessionRecord | None, list[int]]:
        """The turn's prompt ids after the session's history (the record to continue, and
        the job with the max_new_tokens a prompter left to fit); ContextLengthExceeded
        when history, prompt and max_new_tokens do not fit the context."""
        history = record.tokens if record else []
        if prompter is not None:
            record, prompt_ids, max_new_tokens = await prompter(record)
            history = record.tokens if record else []
            if max_new_tokens is not None:
                output = dataclasses.replace(job.output, max_new_tokens=max_new_tokens)
                job = dataclasses.replace(job, output=output)
                if output.min_tokens > max_new_tokens:
                    raise InvalidRequest(
                        f"min_tokens {output.min_tokens} exceeds the {max_new_tokens} tokens "
                        "left for the completion",
                        field="min_tokens",
                    )
        elif isinstance(job.prompt, str):
            # A new conversation gets the tokenizer's special tokens (BOS), as
            # `tokenizer(prompt)` would; a continuation appends the text alone.
            assert self.codec is not None, "the service has started"
            prompt_ids = await asyncio.to_thread(self.codec.encode, job.prompt, not history)
            if not prompt_ids:
                raise InvalidRequest("prompt is empty after tokenization", field="prompt")
        else:
            prompt_ids = job.prompt
        needs = len(history) + len(prompt_ids) + job.output.max_new_tokens
        assert self.limits is not None, "the service has started"
        max_context = self.limits.max_context
        if needs > max_context:
            raise ContextLengthExceeded(
                f"the model's context is {max_context} tokens; this request needs "
                f"{needs} ({len(history)} history + {len(prompt_ids)} prompt + "
                f"{job.output.max_new_tokens} max_new_tokens)"
            )
        return job, record, prompt_ids

    def _placements(
        self, record: SessionRecord | None, replica_session: str
    ) -> tuple[Placement, Placement]:
        """The turn's drafter and verifier placements: where the session's record left its
        caches, else none yet. --drafter-canary: which drafter version a new placement
        takes (a pure function of the session's replica id: the same for every turn)."""
        rule = version_rule(self.config.drafter_canary, replica_session)
        if record is None:
            return Placement(rule=rule), Placement()
        return (
            Placement(self.fleet.drafters.by_address(record.drafter), record.drafter_cached, rule),
            Placement(self.fleet.verifiers.by_address(record.verifier), record.verifier_cached),
        )

    async def _save(
        self,
        session_id: str,
        job: Job,
        lease: TurnLease | None,
        record: SessionRecord | None,
        context: list[int],
        run: Completion,
    ) -> int:
        """Write the session's new history (context and the output) and placements, fenced
        by the turn's lease; the session's turns after it. LockLost when the lease lapsed
        and another turn took the session."""
        tokens = [*context, *run.output.tokens]
        drafter, verifier = run.spec.drafter, run.spec.verifier
        turns = (record.turns if record else 0) + 1
        try:
            await self.sessions.put(
                SessionRecord(
                    session_id=session_id,
                    tokens=tokens,
                    drafter=drafter.address,
                    verifier=verifier.address,
                    drafter_cached=min(drafter.cached, len(tokens)),
                    verifier_cached=min(verifier.cached, len(tokens)),
                    turns=turns,
                ),
                ttl_seconds=job.session.ttl,
                fence=lease.fence if lease else None,
            )
        except LockLost:
            if lease is not None:
                self.turns.lost(lease)
            raise
        return turns

    def _record(
        self,
        job: Job,
        history: list[int],
        prompt_ids: list[int],
        run: Completion,
        drafter_version: str,
    ) -> bool:
        """Submit a finished turn to the recorder (--record); whether it was kept."""
        output, verifier = run.output, run.spec.verifier
        recorder, rounds, finish = self.recorder, run.outcomes, output.finish_reason
        assert recorder is not None and rounds is not None, "a turn kept for the recorder"
        assert finish is not None, "a finished turn"
        return recorder.submit(
            recording_row(
                prompt_ids=[*history, *prompt_ids],
                history_tokens=len(history),
                output_ids=output.tokens,
                rounds=rounds,
                drafter_version=drafter_version,
                target_model=verifier.replica.admitted_info.model_id if verifier.replica else "",
                sampling=job.sampling,
                finish_reason=finish,
                scores=(
                    run.record_track.rows(0, len(output.tokens))
                    if run.record_track is not None
                    else None
                ),
            )
        )
