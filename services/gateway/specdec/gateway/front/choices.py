"""n > 1: n completions of one prompt that share its prefill (`run_choices`), each a
`Completion` (specdec.gateway.front.completion).

 Choice 0 runs its first round alone: that Draft and Verify prefill the prompt on a
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

from specdec.common.params import SamplingParams
from specdec.gateway.fleet.placement import Placement
from specdec.gateway.front.completion import Completion, Completions
from specdec.gateway.front.response import Event, record_metrics
from specdec.gateway.job import Job
from specdec.gateway.names import Role
from specdec.gateway.round.grammar import Grammar
from specdec.gateway.sessions import replica_session_id
from specdec.v1 import gateway_pb2

SEED_SPACE = 1 << 64


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the request's, with seed s + index when it has a seed s."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % SEED_SPACE)


# Each choice's events on their way to the response: (its completion, an event, None)
# per delta, (its completion, None, None) at its end, (its completion, None, the error).
Queue = asyncio.Queue[tuple[Completion, Event | None, Exception | None]]


async def run_choices(
    completions: Completions,
    job: Job,
    ctx: list[int],
    prompt_ids: list[int],
    started: float,
    deadline: float | None,
    grammar: Grammar | None = None,
) -> AsyncIterator[Event]:
    """The events of n > 1 completions of ctx (a one-off request): each choice's deltas
    as they come, tagged with its index; a choice's last event carries its GenerateChoice,
    and the last of all also the GenerateResponse (see the module docstring)."""
    parent = replica_session_id(None)
    drafter, verifier = Placement(), Placement()
    lookup = await completions.lookup(job, ctx)
    runs = [
        completions.new(
            job, parent, drafter, verifier, deadline, len(ctx), grammar=grammar, lookup=lookup
        )
    ]
    sessions = [(parent, drafter, verifier)]
    queue: Queue = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []
    try:
        # Choice 0's first round prefills the prompt on a drafter and a verifier.
        rounds = runs[0].rounds(job, list(ctx), started)
        first = await anext(rounds, None)
        if first is None:
            queue.put_nowait((runs[0], None, None))
        else:
            tasks.append(asyncio.ensure_future(_pump(queue, runs[0], rounds, first)))
        for i in range(1, job.output.n):
            run, placed = await _fork(completions, job, ctx, sessions[0], i, deadline, grammar)
            runs.append(run)
            sessions.append(placed)
            rounds = run.rounds(job, list(ctx), started)
            tasks.append(asyncio.ensure_future(_pump(queue, run, rounds)))
        ended: dict[int, gateway_pb2.GenerateChoice] = {}
        while len(ended) < job.output.n:
            run, event, error = await queue.get()
            if error is not None:
                raise error
            yield event if event is not None else _ended(run, runs, ended, job, prompt_ids, started)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for run in runs:
            record_metrics(job, run.spec.stats, run.output)
        for session, d, v in sessions:
            completions.service.release_later(session, d, v)


async def _pump(
    queue: Queue, run: Completion, rounds: AsyncIterator[Event], first: Event | None = None
) -> None:
    """A choice's events into the queue, then its end (or its error: the request fails
    with it, the others are cancelled)."""
    try:
        if first is not None:
            queue.put_nowait((run, first, None))
        async for event in rounds:
            queue.put_nowait((run, event, None))
        queue.put_nowait((run, None, None))
    except Exception as e:
        queue.put_nowait((run, None, e))


async def _fork(
    completions: Completions,
    job: Job,
    ctx: list[int],
    parent: tuple[str, Placement, Placement],
    index: int,
    deadline: float | None,
    grammar: Grammar | None,
) -> tuple[Completion, tuple[str, Placement, Placement]]:
    """Choice `index` (> 0) in a replica session of its own, on the replicas where choice
    0 (`parent`: its replica session and placements) prefilled the prompt: both caches
    hold it now, and its first Draft and Verify fork them (at len(ctx) - 1). Returns
    the choice's completion and its replica session and placements."""
    parent_session, drafter, verifier = parent
    session = f"{parent_session}/{index}"
    d = Placement(drafter.replica, len(ctx)) if drafter.replica else Placement()
    v = Placement(verifier.replica, len(ctx))
    run = completions.new(
        job,
        session,
        d,
        v,
        deadline,
        len(ctx),
        index,
        choice_sampling(job.sampling, index),
        grammar=grammar,
        lookup=await completions.lookup(job, ctx),
    )
    run.spec.fork_from[Role.VERIFIER] = parent_session
    if d.replica is not None:
        run.spec.fork_from[Role.DRAFTER] = parent_session
    return run, (session, d, v)


def _ended(
    run: Completion,
    runs: list[Completion],
    ended: dict[int, gateway_pb2.GenerateChoice],
    job: Job,
    prompt_ids: list[int],
    started: float,
) -> Event:
    """A choice's last event: its held delta and its GenerateChoice (kept in `ended`);
    once every choice has ended, the GenerateResponse too (usage: the prompt once, the
    tokens of every choice)."""
    response = run.response(job, prompt_ids, 0, started)
    ended[run.index] = run.choice(response)
    final = None
    if len(ended) == job.output.n:
        final = runs[0].response(job, prompt_ids, 0, started)
        final.usage.completion_tokens = sum(len(r.output.tokens) for r in runs)
        final.choices.extend(ended[i] for i in range(job.output.n))
    text, tokens = run.held
    return Event(text, tokens, final, choice=ended[run.index], **run.delta(tokens))
