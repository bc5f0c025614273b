"""One completion of a request: its speculation loop, its text and its scores.

A `Completion` is the unit a turn runs once (n = 1, specdec.gateway.front.turn) and
specdec.gateway.front.choices composes n times: its `Speculator` (specdec.gateway.round.loop) on a
drafter and a verifier placement, the output it has produced (specdec.gateway.text), and
its log-probabilities. `rounds` runs speculation rounds until the output finishes, yielding
each round's delta as an `Event`. `Completions` builds them on the gateway's core
(`GatewayCore`, specdec.gateway.service): its fleet, limits, grammar engine, acceptance priors and suffix
cache, each completion with its own lookup proposer (`lookup`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.common.errors import SpecdecError
from specdec.common.params import SamplingParams
from specdec.gateway.fleet.caller import ReplicaCaller
from specdec.gateway.fleet.placement import Placement
from specdec.gateway.front.logprobs import LogprobsTrack, narrowed
from specdec.gateway.front.response import Event, build_response
from specdec.gateway.job import Job
from specdec.gateway.names import KPolicy
from specdec.gateway.observe import metrics
from specdec.gateway.outcome import Outcome
from specdec.gateway.round.calls import RoundCalls
from specdec.gateway.round.grammar import Grammar
from specdec.gateway.round.lookup.hybrid import RequestLookup
from specdec.gateway.round.loop import Speculator
from specdec.gateway.round.policy import make_policy
from specdec.gateway.service import GatewayCore
from specdec.gateway.sessions import TurnLease
from specdec.gateway.text import TextOutput
from specdec.sdk.request import Scoring
from specdec.v1 import common_pb2, gateway_pb2


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
    out = job.output
    masked = set(out.stop_token_ids) | (set() if out.ignore_eos else set(eos_token_ids))
    return common_pb2.OutputControls(
        output_start=output_start,
        min_tokens=out.min_tokens,
        min_tokens_ids=sorted(masked) if out.min_tokens else [],
    )


@dataclass
class Completion:
    """The loop state of one completion: its rounds, its output and its scores."""

    index: int
    spec: Speculator
    output: TextOutput
    track: LogprobsTrack | None = None
    prompt_logprobs: common_pb2.TokenLogprobs | None = None
    first_at: float | None = None  # perf_counter() of its first token
    last_at: float = 0.0
    held: tuple[str, list[int]] = ("", [])  # the last round's delta, sent with the end
    context_tokens: int = 0  # history + prompt: a stream's running usage counts from it
    outcomes: list[Outcome] | None = None  # the rounds' Outcomes, when the turn is recorded
    # The output's scores for the recording (--record-top-logprobs), when it is recorded
    record_track: LogprobsTrack | None = None
    _prompt_sent: bool = field(default=False, repr=False)

    def delta(self, tokens: list[int]) -> dict[str, Any]:
        """An Event's fields beside its text and tokens: the choice, the tokens' scores
        and, on the first event, the prompt's."""
        out: dict[str, Any] = {"index": self.index, "context_tokens": self.context_tokens}
        if self.track is not None:
            out["logprobs"] = self.track.delta(self.output.emitted_tokens)
        if self.prompt_logprobs is not None and not self._prompt_sent:
            out["prompt_logprobs"] = self.prompt_logprobs
            self._prompt_sent = True
        return out

    def response(
        self, job: Job, prompt_ids: list[int], history_tokens: int, started: float
    ) -> gateway_pb2.GenerateResponse:
        """This completion as a GenerateResponse (scores included when asked)."""
        response = build_response(
            job,
            prompt_ids,
            history_tokens,
            self.output,
            self.spec.stats,
            started,
            self.first_at,
        )
        if self.track is not None:
            response.logprobs.CopyFrom(self.track.rows(0, len(self.output.tokens)))
        if self.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(self.prompt_logprobs)
        return response

    def choice(self, response: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateChoice:
        choice = gateway_pb2.GenerateChoice(
            index=self.index,
            text=response.text,
            token_ids=response.token_ids,
            finish_reason=response.finish_reason,
            stats=response.stats,
        )
        if response.HasField("logprobs"):
            choice.logprobs.CopyFrom(response.logprobs)
        return choice

    async def rounds(
        self,
        job: Job,
        ctx: list[int],
        started: float,
        lease: TurnLease | None = None,
    ) -> AsyncIterator[Event]:
        """Speculation rounds after ctx (extended in place) until the output finishes,
        yielding each round's delta; what the last round leaves is in `held`."""
        output, spec = self.output, self.spec
        max_new_tokens, k = job.output.max_new_tokens, job.speculation.k
        reported_first = False
        try:
            while output.finish_reason is None:
                remaining = max_new_tokens - len(output.tokens)
                outcome = await spec.round(ctx, min(k, remaining - 1), remaining)
                if self.outcomes is not None:
                    self.outcomes.append(outcome)
                new = outcome.tokens
                if spec.constraint is not None:
                    spec.constraint.advance(new)
                ctx.extend(new)
                if self.track is not None:
                    self.track.add(outcome.logprobs)
                if self.record_track is not None:
                    self.record_track.add(outcome.logprobs)
                if outcome.prompt_logprobs is not None:
                    self.prompt_logprobs = narrowed(
                        outcome.prompt_logprobs, job.scoring.top_logprobs
                    )
                text, tokens = output.push(new)
                now = time.perf_counter()
                if self.first_at is None:
                    self.first_at = now
                    if self.index == 0:
                        metrics.TTFT.observe(now - started)
                elif tokens and self.index == 0:
                    for _ in tokens:
                        metrics.ITL.observe((now - self.last_at) / len(tokens))
                self.last_at = now
                if lease is not None and lease.lost:
                    raise Aborted(
                        f"session {job.session.id!r}: this turn lost its lock (another "
                        "gateway may have taken the session); stopped without saving it"
                    )
                if output.finish_reason is None and (text or tokens):
                    ttft = None if reported_first else _ms(self.first_at - started)
                    reported_first = True
                    yield Event(text, tokens, time_to_first_token_ms=ttft, **self.delta(tokens))
                elif output.finish_reason is not None:
                    self.held = (text, tokens)
        finally:
            spec.leave()  # a failed or cancelled request too
        await spec.idle()
        if spec.lookup is not None:  # the output joins the suffix cache
            spec.lookup.finish(output.tokens)


class Completions:
    """Builds a request's completions on the gateway's core."""

    def __init__(self, service: GatewayCore):
        self.service = service

    def new(
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
    ) -> Completion:
        """Completion `index` on the given placements, after context_tokens of history and
        prompt (sampling: the choice's, else the request's; record_top: the alternatives
        a recorded turn keeps per output token, --record-top-logprobs)."""
        service, scoring = self.service, job.scoring
        limits, config = service.limits, service.config
        assert limits is not None and service.codec is not None, "the service has started"
        params = sampling or job.sampling
        calls = RoundCalls(
            ReplicaCaller(service.fleet, config.rpc_timeout, deadline),
            replica_session,
            params.to_proto(),
            output_controls(job, context_tokens, service.eos_token_ids),
            drafter,
            verifier,
        )
        policy = make_policy(
            job.speculation.k_policy, job.speculation.ssd, config.ssd_fan_out, service.source_priors
        )
        spec = Speculator(
            calls,
            policy,
            greedy=params.greedy,
            processors=params.processors,
            speculation=job.speculation,
            # A recorded turn with --record-top-logprobs M scores its output too: one Verify
            # asks for the most either reader needs, each keeps its own (`narrowed`).
            scoring=Scoring(
                logprobs=scoring.logprobs or record_top > 0,
                top_logprobs=max(scoring.top_logprobs, record_top),
                prompt_logprobs=scoring.prompt_logprobs and index == 0,
            ),
            max_context=limits.max_context,
            lookup_max_k=limits.max_k,
            # Structured output: this completion's own grammar state (a matcher per choice).
            constraint=(
                service.grammars.matcher(grammar)
                if grammar is not None and service.grammars is not None
                else None
            ),
            lookup=lookup,
            guard=service.guard if policy.kind == KPolicy.ADAPTIVE else None,
        )
        out = job.output
        text = TextOutput(
            service.codec,
            out.max_new_tokens,
            service.eos_token_ids,
            out.stop,
            ignore_eos=out.ignore_eos,
            min_tokens=out.min_tokens,
            stop_token_ids=out.stop_token_ids,
        )
        track = LogprobsTrack(scoring.top_logprobs) if scoring.logprobs else None
        completion = Completion(index, spec, text, track, context_tokens=context_tokens)
        if record_top:  # the output's scores, kept for the recording
            completion.record_track = LogprobsTrack(record_top)
        return completion

    async def lookup(self, job: Job, ctx: list[int]) -> RequestLookup:
        """A completion's lookup proposer (its method, its prediction, the suffix cache),
        following ctx (the history and prompt)."""
        service = self.service
        prediction = job.output.prediction
        if isinstance(prediction, str):
            assert service.codec is not None, "the service has started"
            prediction = await asyncio.to_thread(service.codec.encode, prediction, False)
        key = job.tenant if service.config.suffix_cache_scope == "tenant" else ""
        lookup = RequestLookup(
            job.speculation.method,
            service.lookup_settings,
            output_from=len(ctx),
            prediction=prediction or (),
            cache=service.suffix_cache,
            cache_key=key,
            # A seeded sampled request stays reproducible: no drafts from other outputs.
            draft_from_cache=job.sampling.seed is None,
            width=job.speculation.tree_width,
        )
        if lookup.active and job.speculation.k > 0:  # index the prompt (4k tokens: tens of
            # ms) off the loop
            await asyncio.to_thread(lookup.follow, ctx)
        return lookup
