"""The verifier's domain logic: one target forward over new tokens + draft, then the rule.

A draft is a chain or a token tree (`draft_parents`): a tree's nodes are scored in one
forward under a tree mask (ModelRuntime._forward_tree), the rule walks it
(specdec.replica.sampling.tree_verdict), and only the accepted path's keys/values stay in
the cache (the store's `keep_path`: gathered to follow the new tokens, the rest rolled
back).

`verify` is a model-thread job (specdec.replica.batching): its forward is batched with the
forwards of other sessions' Verify calls waiting at the same time."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from specdec.common.controls import Controls
from specdec.replica.batching import ForwardRequest
from specdec.replica.engine import CachedSession, Engine, Prefix
from specdec.replica.features import FeatureAsk, FeatureSink, sent_rows
from specdec.replica.host import to_host
from specdec.replica.logprobs import LogprobRows, LogprobsAsk, emitted_tokens, token_logprobs
from specdec.replica.masks import apply_masks
from specdec.replica.processors import verify_logits
from specdec.replica.sampling import (
    SamplingParams,
    greedy_verdict,
    make_generator,
    rejection_sample,
    tree_verdict,
    warp,
)

# Salt of the verifier's random stream (the drafter uses "draft").
VERIFY_SALT = "verify"


@dataclass
class VerifyResult:
    accepted: int  # 0..k
    next_token: int  # recovered (accepted < k) or bonus (accepted == k)
    bonus: bool  # a tree: the accepted path ends at a leaf
    cached_length: int
    forward_ms: float
    # Asked for (LogprobsAsk): the emitted tokens' scores [accepted + 1 rows], and those of
    # new_tokens[1:] with ask.prompt; on the host.
    logprobs: LogprobRows | None = None
    prompt_logprobs: LogprobRows | None = None
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf
    # Asked for (VerifyCall.features): the target's features of the positions from
    # `features_start` on whose next token the verdict makes known [m, width], on the host
    # in the wire dtype (at most MAX_FEATURE_BYTES: the last rows).
    features: torch.Tensor | None = None
    features_start: int = 0


@dataclass(frozen=True)
class VerifyCall:
    """A validated Verify, what `verify` scores: draft_tokens [k] (sampled from
    draft_probs [k, vocab]) after prefix + new_tokens of the session, under params and the
    request's logits processors (controls; None: none).

    grammar_masks [k+1, vocab] bool (structured output): the tokens allowed at each
    verified position; the target's other logits are -inf before the rule. None: no
    grammar. logprobs: also score the emitted tokens (and the prompt)
    (specdec.replica.logprobs). fork_from: start the session as a copy of that session's
    cache (SessionStore.acquire). draft_parents [k]: the draft is a token tree
    (VerifyRequest.draft_parents); the servicer has refused controls, grammar masks and
    logprobs with one. features: also return the features (specdec.replica.features) of
    the new tokens and the accepted drafts (VerifyResult.features)."""

    runtime: Engine[Any]
    session_id: str
    prefix: Prefix
    new_tokens: Sequence[int]
    draft_tokens: Sequence[int]
    draft_probs: torch.Tensor | None  # [k, vocab]
    params: SamplingParams
    controls: Controls | None = None
    logprobs: LogprobsAsk | None = None
    fork_from: str = ""
    grammar_masks: torch.Tensor | None = None  # [k+1, vocab] bool
    draft_parents: Sequence[int] | None = None  # a token tree's parents [k]; None: a chain
    features: FeatureAsk | None = None  # also return the target's features (VerifyResult)

    def job(self) -> Generator[ForwardRequest, torch.Tensor, VerifyResult]:
        return verify(self)


def verify(call: VerifyCall) -> Generator[ForwardRequest, torch.Tensor, VerifyResult]:
    """Score the call's draft (see VerifyCall): a job for the model thread (`Engine.run`).
    The cache ends holding prefix + new_tokens + the accepted drafts (a tree: the accepted
    path)."""
    with call.runtime.guarded(call.session_id):
        return (yield from _verify(call))


def processed_target_logits(
    runtime: Engine[Any],
    session: CachedSession,
    new_tokens: Sequence[int],
    draft_tokens: Sequence[int],
    controls: Controls | None,
    grammar_masks: torch.Tensor | None = None,
    scored: int = 0,
    features: FeatureSink | None = None,
) -> Generator[ForwardRequest, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The target's processed logits [k+1, vocab] at the draft's k+1 positions (the model's
    forward over new_tokens + draft_tokens, then the request's processors with the prefix
    up to each position, specdec.replica.processors.verify_logits, then the grammar's masks,
    specdec.replica.masks.apply_masks): what the rule, greedy or sampled, and the emitted
    tokens' log-probabilities read. Also the raw logits of the
    `scored` prompt positions before them [scored, vocab] (echo scores the prompt as the
    model sees it, without processors). features: the fed tokens' features go there."""
    k = len(draft_tokens)
    logits = yield from runtime.forward_steps(
        session, [*new_tokens, *draft_tokens], keep=scored + k + 1, features=features
    )  # [scored + k+1, vocab]
    prompt_logits, logits = logits[:scored], logits[scored:]
    if controls is not None:
        before = session.tokens[: len(session.tokens) - k]  # the sequence before the draft
        logits = verify_logits(controls, before, draft_tokens, logits)
    return apply_masks(logits, grammar_masks), prompt_logits


def _verify(call: VerifyCall) -> Generator[ForwardRequest, torch.Tensor, VerifyResult]:
    started = time.perf_counter()
    runtime, prefix, params, ask = call.runtime, call.prefix, call.params, call.logprobs
    new_tokens, draft_tokens = call.new_tokens, call.draft_tokens
    k = len(draft_tokens)
    session = runtime.ready_store.acquire(
        call.session_id, prefix.length, prefix.hash, len(new_tokens) + k, fork_from=call.fork_from
    )
    if call.draft_parents:
        return (yield from _verify_tree(call, session))
    scored = len(new_tokens) - 1 if ask is not None and ask.prompt else 0  # prompt rows
    sink = FeatureSink(call.features.layers) if call.features is not None else None
    target_logits, prompt_logits = yield from processed_target_logits(
        runtime,
        session,
        new_tokens,
        draft_tokens,
        call.controls,
        call.grammar_masks,
        scored,
        sink,
    )  # [k+1, vocab], [scored, vocab]
    feats = _wire_features(call, sink)  # [new + k, width], copied with the verdict
    extra: list[torch.Tensor] = []  # the scores asked for, copied with the verdict
    if params.greedy:
        # The target's choices [k+1], copied once; the rule on the host: accept while the
        # draft token is the target's, then the target's token.
        choices = target_logits.argmax(dim=-1)
        if ask is not None:  # the emitted tokens are the target's choices, up to the verdict
            extra += _scores(runtime, ask, prompt_logits, new_tokens, target_logits, choices)
        choices, *extra = to_host(choices, *extra, *feats)  # the Verify's one copy
        n, token = greedy_verdict(draft_tokens, choices.tolist())
    else:
        assert call.draft_probs is not None  # sampling: the servicer checked
        drafts = torch.tensor([list(draft_tokens)], dtype=torch.long)  # [1, k]
        target_probs = warp(target_logits, params)[None]  # [1, k+1, vocab]
        position = prefix.length + len(new_tokens)  # index of d_1 in the sequence
        gen = make_generator(params.seed, VERIFY_SALT, position, runtime.device)
        accepted, next_token = rejection_sample(
            drafts, call.draft_probs[None].to(runtime.device), target_probs, gen, False
        )
        if ask is not None:
            emitted = emitted_tokens(drafts[0].to(runtime.device), accepted, next_token)
            extra += _scores(runtime, ask, prompt_logits, new_tokens, target_logits, emitted)
        verdict, *extra = to_host(torch.cat([accepted, next_token]), *extra, *feats)  # one copy
        n, token = verdict.tolist()
    runtime.ready_store.truncate(
        session, len(session.tokens) - (k - n)
    )  # roll back rejected drafts
    if feats:  # the positions whose next token is known: the new tokens, the accepted drafts
        *extra, rows = extra
        feats = [rows[: len(new_tokens) + n]]
    emitted_rows = prompt_rows = None
    if ask is not None:
        emitted_rows = LogprobRows(*extra[:3]).head(n + 1)
        prompt_rows = LogprobRows(*extra[3:]) if ask.prompt else None
    return VerifyResult(
        accepted=n,
        next_token=token,
        bonus=n == k,
        cached_length=len(session.tokens),
        forward_ms=(time.perf_counter() - started) * 1e3,
        logprobs=emitted_rows,
        prompt_logprobs=prompt_rows,
        **_features_sent(call, feats),
    )


def _verify_tree(
    call: VerifyCall, session: CachedSession
) -> Generator[ForwardRequest, torch.Tensor, VerifyResult]:
    """A token tree's verdict (`verify`): one forward under the tree mask, the rule on the
    host, the accepted path kept."""
    started = time.perf_counter()
    runtime, params, draft_tokens = call.runtime, call.params, call.draft_tokens
    assert call.draft_parents is not None
    k = len(draft_tokens)
    parents = list(call.draft_parents)
    sink = FeatureSink(call.features.layers) if call.features is not None else None
    logits = yield from runtime.forward_steps(
        session, [*call.new_tokens, *draft_tokens], keep=k + 1, tree=parents, features=sink
    )  # [k+1, vocab]: after the new tokens, then after each node
    feats = _wire_features(call, sink)  # [new + k, width]: the new tokens', then each node's
    if params.greedy:
        target, probs, gen = logits.argmax(dim=-1), None, None
        target, *feats = to_host(target, *feats)  # the Verify's one copy
        target = torch.nn.functional.one_hot(target, logits.shape[-1])
    else:
        # The rule steps node by node on the host: the rows and the proposals, copied once.
        assert call.draft_probs is not None  # sampling: the servicer checked
        target, probs, *feats = to_host(
            warp(logits, params), call.draft_probs.to(runtime.device), *feats
        )
        position = call.prefix.length + len(call.new_tokens)  # index of the first node
        gen = make_generator(params.seed, VERIFY_SALT, position)
    path, token = tree_verdict(draft_tokens, parents, target, probs, gen, params.greedy)
    runtime.ready_store.keep_path(session, len(session.tokens) - k, path)
    if feats:  # the new tokens', then the accepted path's nodes' (their order in the cache)
        h = len(call.new_tokens)
        feats = [torch.cat([feats[0][:h], feats[0][[h + i for i in path]]])]
    children = set(parents)
    return VerifyResult(
        accepted=len(path),
        next_token=token,
        bonus=bool(path) and path[-1] not in children,
        cached_length=len(session.tokens),
        forward_ms=(time.perf_counter() - started) * 1e3,
        path=path,
        **_features_sent(call, feats),
    )


def _wire_features(call: VerifyCall, sink: FeatureSink | None) -> list[torch.Tensor]:
    """The fed tokens' features in the wire dtype, still on the device ([] when not asked):
    copied to the host with the verdict, cut there once it is known."""
    if call.features is None or sink is None:
        return []
    return [sink.tensor().to(call.features.dtype)]


class _SentFeatures(TypedDict, total=False):
    """Verdict's feature fields, when asked for."""

    features: torch.Tensor  # [m, width]
    features_start: int


def _features_sent(call: VerifyCall, feats: list[torch.Tensor]) -> _SentFeatures:
    """VerifyResult.features and features_start from the known positions' rows on the host
    ({} when not asked): the last rows that fit MAX_FEATURE_BYTES."""
    if call.features is None:
        return {}
    rows = feats[0]
    kept = sent_rows(rows.shape[0], rows.shape[1], call.features.format)
    dropped = rows.shape[0] - kept
    return {"features": rows[dropped:], "features_start": call.prefix.length + dropped}


def _scores(
    runtime: Engine[Any],
    ask: LogprobsAsk,
    prompt_logits: torch.Tensor,  # [scored, vocab]
    new_tokens: Sequence[int],
    target_logits: torch.Tensor,  # [k+1, vocab]
    emitted: torch.Tensor,  # [k+1]
) -> list[torch.Tensor]:
    """The device tensors of the scores asked for: the emitted rows (k+1, cut on the host
    once the verdict is known), then the prompt's (new_tokens[1:])."""
    out = list(token_logprobs(target_logits, emitted, ask.top).tensors())
    if ask.prompt:
        following = torch.tensor(list(new_tokens[1:]), dtype=torch.long, device=runtime.device)
        out += token_logprobs(prompt_logits, following, ask.top).tensors()
    return out
