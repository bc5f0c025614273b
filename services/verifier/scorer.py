"""The verifier's domain logic: one target forward over new tokens + draft, then the rule.

`verify` is a model-thread job (specdec.common.batching): its forward is batched with the
forwards of other sessions' Verify calls waiting at the same time."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.common.batching import ForwardRequest
from specdec.common.host import to_host
from specdec.common.masks import apply_masks
from specdec.common.runtime import ModelRuntime, Prefix
from specdec.common.sampling import (
    SamplingParams,
    greedy_verdict,
    make_generator,
    rejection_sample,
    warp,
)

# Salt of the verifier's random stream (the drafter uses "draft").
VERIFY_SALT = "verify"


@dataclass
class Verdict:
    accepted: int  # 0..k
    next_token: int  # recovered (accepted < k) or bonus (accepted == k)
    bonus: bool
    cached_length: int
    forward_ms: float


def verify(
    runtime: ModelRuntime,
    session_id: str,
    prefix: Prefix,
    new_tokens: Sequence[int],
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    grammar_masks: torch.Tensor | None = None,
) -> Generator[ForwardRequest, torch.Tensor, Verdict]:
    """Score draft_tokens [k] (sampled from draft_probs [k, vocab]) after prefix + new_tokens.

    grammar_masks [k+1, vocab] bool (structured output): the tokens allowed at each verified
    position; the target's other logits are -inf before the rule. None: no grammar.

    A job for the model thread (`ModelRuntime.run`). The cache ends holding prefix +
    new_tokens + accepted drafts.
    """
    with runtime.guarded(session_id):
        return (
            yield from _verify(
                runtime,
                session_id,
                prefix,
                new_tokens,
                draft_tokens,
                draft_probs,
                params,
                grammar_masks,
            )
        )


def _verify(
    runtime, session_id, prefix, new_tokens, draft_tokens, draft_probs, params, grammar_masks
):
    started = time.perf_counter()
    k = len(draft_tokens)
    session = runtime.store.acquire(session_id, prefix.length, prefix.hash, len(new_tokens) + k)
    target_logits = yield from runtime.forward_steps(
        session, [*new_tokens, *draft_tokens], keep=k + 1
    )  # [k+1, vocab]
    target_logits = apply_masks(target_logits, grammar_masks)
    if params.greedy:
        # The target's choices [k+1], copied once; the rule on the host: accept while the
        # draft token is the target's, then the target's token.
        (choices,) = to_host(target_logits.argmax(dim=-1))  # the Verify's one copy
        n, token = greedy_verdict(draft_tokens, choices.tolist())
    else:
        drafts = torch.tensor([list(draft_tokens)], dtype=torch.long)  # [1, k]
        target_probs = warp(target_logits, params)[None]  # [1, k+1, vocab]
        position = prefix.length + len(new_tokens)  # index of d_1 in the sequence
        gen = make_generator(params.seed, VERIFY_SALT, position, runtime.device)
        accepted, next_token = rejection_sample(
            drafts, draft_probs[None].to(runtime.device), target_probs, gen, False
        )
        (verdict,) = to_host(torch.cat([accepted, next_token]))  # the Verify's one copy
        n, token = verdict.tolist()
    runtime.store.truncate(session, len(session.tokens) - (k - n))  # roll back rejected drafts
    return Verdict(
        accepted=n,
        next_token=token,
        bonus=n == k,
        cached_length=len(session.tokens),
        forward_ms=(time.perf_counter() - started) * 1e3,
    )
