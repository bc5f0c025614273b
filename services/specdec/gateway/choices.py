"""One completion's loop state (`ChoiceRun`), and n > 1: n completions of one prompt that
share its prefill (`run_choices`).

n > 1. Choice 0 runs its first round alone: that Draft and Verify prefill the prompt on a
drafter and a verifier. Every other choice then starts on those same replicas, in a
replica session of its own, with its first Draft and Verify naming choice 0's session in
`fork_from`: the replica copies that cache's first len(prompt) - 1 tokens (the prompt but
its last token, which the call feeds to get the logits it needs) instead of computing them
again (specdec.replica.kvstore.CacheStore.fork). A fork named in the request rather than a
Fork RPC: the copy happens on the model thread inside the call that needs it, with the
same prefix check as any call, so a fork source that was evicted or failed over is an
ordinary cache miss (the caller resends the whole prompt) and costs no extra round trip.
From there each choice is an independent request on its own cache: its own rounds, k
policy and SSD, so each is exact. With a seed s, choice i samples with seed s + i
(mod 2^64): choice i is what a single request with that seed returns. Usage counts the
prompt once and the tokens of every choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specdec.common.params import SamplingParams
from specdec.gateway.caller import Placement
from specdec.gateway.logprobs import LogprobsTrack
from specdec.gateway.loop import Speculator
from specdec.gateway.response import Event, build_response, record_metrics
from specdec.gateway.sessions import replica_session_id
from specdec.gateway.text import Completion
from specdec.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from specdec.gateway.grammar import Grammar
    from specdec.gateway.lookup.hybrid import RequestLookup
    from specdec.gateway.request import Job

SEED_SPACE = 1 << 64


class Completions(Protocol):
    """What n > 1 choices need from the gateway that runs them (Gateway, in
    specdec.gateway.turn, which composes this module: the seam keeps the import one-way)."""

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
    ) -> ChoiceRun: ...

    async def request_lookup(self, job: Job, ctx: list[int]) -> RequestLookup: ...

    def rounds(
        self, job: Job, ctx: list[int], run: ChoiceRun, started: float
    ) -> AsyncIterator[Event]: ...

    def release_later(self, replica_session: str, *placements: Placement) -> None: ...


@dataclass
class ChoiceRun:
    """The loop state of one completion: its rounds, its text and its scores."""

    index: int
    spec: Speculator
    completion: Completion
    track: LogprobsTrack | None = None
    prompt_logprobs: common_pb2.TokenLogprobs | None = None
    first_at: float | None = None  # perf_counter() of its first token
    last_at: float = 0.0
    held: tuple[str, list[int]] = ("", [])  # the last round's delta, sent with the end
    context_tokens: int = 0  # history + prompt: a stream's running usage counts from it
    outcomes: list | None = None  # the rounds' Outcomes, when the turn is recorded
    # The output's scores for the recording (--record-top-logprobs), when it is recorded
    record_track: LogprobsTrack | None = None
    _prompt_sent: bool = field(default=False, repr=False)

    def delta(self, tokens: list[int]) -> dict[str, Any]:
        """An Event's fields beside its text and tokens: the choice, the tokens' scores
        and, on the first event, the prompt's."""
        out: dict[str, Any] = {"index": self.index, "context_tokens": self.context_tokens}
        if self.track is not None:
            out["logprobs"] = self.track.delta(self.completion.emitted_tokens)
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
            self.completion,
            self.spec.stats,
            started,
            self.first_at,
        )
        if self.track is not None:
            response.logprobs.CopyFrom(self.track.rows(0, len(self.completion.tokens)))
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


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the request's, with seed s + index when it has a seed s."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % SEED_SPACE)


async def run_choices(
    gateway: Completions,
    job: Job,
    ctx: list[int],
    prompt_ids: list[int],
    started: float,
    deadline: float | None,
    grammar: Grammar | None = None,
) -> AsyncIterator[Any]:
    """The events of n > 1 completions of ctx (a one-off request): each choice's deltas
    as they come, tagged with its index; a choice's last event carries its GenerateChoice,
    and the last of all also the GenerateResponse (see the module docstring)."""
    parent = replica_session_id(None)
    drafter, verifier = Placement(), Placement()
    lookup = await gateway.request_lookup(job, ctx)
    runs = [
        gateway.choice_run(
            job, parent, drafter, verifier, deadline, len(ctx), grammar=grammar, lookup=lookup
        )
    ]
    sessions = [(parent, drafter, verifier)]
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(run: ChoiceRun, rounds: AsyncIterator[Any], first: Any = None) -> None:
        try:
            if first is not None:
                queue.put_nowait((run, first, None))
            async for event in rounds:
                queue.put_nowait((run, event, None))
            queue.put_nowait((run, None, None))
        except Exception as e:  # the request fails with it (the others are cancelled)
            queue.put_nowait((run, None, e))

    try:
        # Choice 0's first round prefills the prompt on a drafter and a verifier.
        rounds = gateway.rounds(job, list(ctx), runs[0], started)
        first = await anext(rounds, None)
        if first is None:
            queue.put_nowait((runs[0], None, None))
        else:
            tasks.append(asyncio.ensure_future(pump(runs[0], rounds, first)))
        for i in range(1, job.n):
            session = f"{parent}/{i}"
            # Both caches hold the prompt now; each choice forks them (at len(ctx) - 1).
            d = Placement(drafter.replica, len(ctx)) if drafter.replica else Placement()
            v = Placement(verifier.replica, len(ctx))
            run = gateway.choice_run(
                job,
                session,
                d,
                v,
                deadline,
                len(ctx),
                i,
                choice_sampling(job.sampling, i),
                grammar=grammar,
                lookup=await gateway.request_lookup(job, ctx),
            )
            run.spec.fork_from["verifier"] = parent
            if d.replica is not None:
                run.spec.fork_from["drafter"] = parent
            runs.append(run)
            sessions.append((session, d, v))
            rounds = gateway.rounds(job, list(ctx), run, started)
            tasks.append(asyncio.ensure_future(pump(run, rounds)))
        ended: dict[int, gateway_pb2.GenerateChoice] = {}
        while len(ended) < job.n:
            run, event, error = await queue.get()
            if error is not None:
                raise error
            if event is not None:
                yield event
                continue
            response = run.response(job, prompt_ids, 0, started)
            ended[run.index] = run.choice(response)
            final = None
            if len(ended) == job.n:
                final = runs[0].response(job, prompt_ids, 0, started)
                final.usage.completion_tokens = sum(len(r.completion.tokens) for r in runs)
                final.choices.extend(ended[i] for i in range(job.n))
            yield Event(*run.held, final, choice=ended[run.index], **run.delta(run.held[1]))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for run in runs:
            record_metrics(job, run.spec.stats, run.completion)
        for session, d, v in sessions:
            gateway.release_later(session, d, v)
