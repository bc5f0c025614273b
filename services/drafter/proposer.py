"""The drafter's domain logic: propose k tokens and the distributions they came from.

`propose` is a model-thread job (specdec.replica.batching): each of its k forwards is batched
with the forwards of other sessions drafting at the same time (lock-step)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.common.controls import Controls
from specdec.drafter.sampler import sampler_for
from specdec.drafter.speculate import BranchStore, DraftRows, take_prepared
from specdec.replica.batching import ForwardRequest
from specdec.replica.engine import Engine, arguments
from specdec.replica.host import to_host
from specdec.replica.processors import TokenCounts
from specdec.replica.runtime import Prefix
from specdec.replica.sampling import EncodedProbs, SamplingParams, encoded_rows


@dataclass
class Draft:
    tokens: list[int]  # [k]
    probs: list[EncodedProbs]  # [k], empty when greedy
    cached_length: int
    forward_ms: float
    prepared: bool = False  # served from a Speculate branch, no forward


@dataclass(frozen=True)
class DraftCall:
    """A validated Draft: the arguments of `propose`."""

    runtime: Engine
    branches: BranchStore
    session_id: str
    prefix: Prefix
    new_tokens: list[int]
    k: int
    params: SamplingParams
    controls: Controls | None
    fork_from: str

    def job(self) -> Generator[ForwardRequest, torch.Tensor, Draft]:
        return propose(**arguments(self))


def propose(
    runtime: Engine,
    branches: BranchStore,
    session_id: str,
    prefix: Prefix,
    new_tokens: Sequence[int],
    k: int,
    params: SamplingParams,
    controls: Controls | None = None,
    fork_from: str = "",
) -> Generator[ForwardRequest, torch.Tensor, Draft]:
    """Draft k tokens after prefix + new_tokens (a job for the model thread,
    `Engine.run`), each step under the request's logits processors (controls).

    If Speculate prepared a draft for exactly this sequence it is returned without a
    forward and the cache stays at the prefix. Otherwise the cache ends holding
    prefix + new_tokens + d_1..d_{k-1}: d_k is only fed if it is accepted, in the next
    request's new tokens (or by the Speculate that follows, which then reuses the logits
    kept here instead of feeding d_1..d_{k-1} again). fork_from: start the session as a
    copy of that session's cache (CacheStore.acquire).
    """
    with runtime.guarded(session_id):
        return (
            yield from _propose(
                runtime, branches, session_id, prefix, new_tokens, k, params, controls, fork_from
            )
        )


def _propose(runtime, branches, session_id, prefix, new_tokens, k, params, controls, fork_from):
    started = time.perf_counter()
    branches.pop_rows(session_id)
    session = runtime.store.acquire(
        session_id, prefix.length, prefix.hash, len(new_tokens) + k - 1, fork_from=fork_from
    )
    hit = take_prepared(branches, session_id, session, new_tokens, k, params, controls)
    if hit is not None:
        tokens, probs = hit
        return Draft(tokens, probs, len(session.tokens), _ms(started), prepared=True)
    last = (yield from runtime.forward_steps(session, new_tokens, keep=1))[-1:]  # [1, vocab]
    position = prefix.length + len(new_tokens)  # index of d_1 in the sequence
    counts = None
    if controls is not None:  # the sequence's statistics, then each drawn token's
        counts = TokenCounts(controls, session.tokens, [()], last.shape[-1], last.device)
    sampler = sampler_for(params, runtime, counts)
    drawn: list[torch.Tensor] = []  # [1] each: the draft, on the device
    proposals: list[torch.Tensor] = []  # [1, vocab] each, under sampling
    rows: list[torch.Tensor] = []  # [1, vocab] logits each token was drawn from
    for i in range(k):
        rows.append(last)
        token, proposal = sampler.draw(last, [position + i])
        drawn.append(token)
        if proposal is not None:
            proposals.append(proposal)
        if i < k - 1:  # the device token is the next input: no copy to the host
            last = (yield from runtime.forward_steps(session, token))[-1:]
    host = to_host(torch.cat(drawn), *sampler.payload(proposals))  # the Draft's one copy
    tokens = host[0].tolist()
    runtime.store.fill(session, tokens[: k - 1])  # the device tokens it fed
    encoded = encoded_rows(host[1:]) if proposals else []
    n = len(session.tokens)
    branches.put_rows(
        session_id,
        DraftRows(position, n, session.chain.hash(session.tokens, n), torch.cat(rows)),
    )
    return Draft(tokens, encoded, len(session.tokens), _ms(started))


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3
