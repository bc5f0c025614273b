"""The drafter's domain logic: propose k tokens and the distributions they came from."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.runtime import ModelRuntime, Prefix
from specdec.common.sampling import EncodedProbs, SamplingParams, make_generator, round_trip, warp

# Salt of the drafter's random stream (the verifier uses "verify").
DRAFT_SALT = "draft"


@dataclass
class Draft:
    tokens: list[int]  # [k]
    probs: list[EncodedProbs]  # [k], empty when greedy
    cached_length: int
    forward_ms: float


def propose(
    runtime: ModelRuntime,
    session_id: str,
    prefix: Prefix,
    new_tokens: Sequence[int],
    k: int,
    params: SamplingParams,
) -> Draft:
    """Draft k tokens after prefix + new_tokens (runs on the model thread).

    The cache ends holding prefix + new_tokens + d_1..d_{k-1}: d_k is only fed if it is
    accepted, in the next request's new tokens.
    """
    with runtime.guarded(session_id):
        return _propose(runtime, session_id, prefix, new_tokens, k, params)


def _propose(runtime, session_id, prefix, new_tokens, k, params) -> Draft:
    started = time.perf_counter()
    session, logits = runtime.extend(session_id, prefix, new_tokens, len(new_tokens) + k - 1)
    last = logits[-1]  # [vocab]
    position = prefix.length + len(new_tokens)  # index of d_1 in the sequence
    shared_gen = (
        None
        if params.greedy or params.seed is not None
        else make_generator(None, DRAFT_SALT, 0, runtime.device)
    )
    tokens: list[int] = []
    encoded: list[EncodedProbs] = []
    for i in range(k):
        if params.greedy:
            token = int(last.argmax())
        else:
            enc, probs = round_trip(warp(last, params))  # sample from what travels
            gen = shared_gen or make_generator(
                params.seed, DRAFT_SALT, position + i, runtime.device
            )
            token = int(torch.multinomial(probs, 1, generator=gen))
            encoded.append(enc)
        tokens.append(token)
        if i < k - 1:
            last = runtime.forward(session, [token])[-1]
    return Draft(
        tokens=tokens,
        probs=encoded,
        cached_length=len(session.tokens),
        forward_ms=(time.perf_counter() - started) * 1e3,
    )
