"""A request resolved against the gateway's limits: the SDK's typed `Request` in, a `Job` out.

Both doors hand the same `Request` (specdec.sdk.request) to `Job.resolve`: the gRPC
servicer converts its GenerateRequest once (`Request.from_proto`), the HTTP API builds the
Request from its body. A `Job` carries the request as typed parts, each resolved (and
checked) by its own `resolve` from the SDK's part of the same name: `ResolvedOutput`
(length, stops, grammar, prediction), `ResolvedSpeculation` (k, SSD, k policy, method,
tree width: the gateway's defaults where the request leaves them), `ResolvedSession`, the
scoring (the SDK's `Scoring`) and the sampling (the model's generation_config where the
request leaves a field unset).

Every check runs before anything is tokenized or sent to a replica, so a bad request costs
nothing and touches no session. A refusal is InvalidRequest with its `field`: the
Request's name of the field it is about (the HTTP API answers with the body's name of
it). The limits come from the replicas' Info (vocabulary, context, largest k) and the
gateway's own configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.common.controls import MAX_STOP_TOKEN_IDS, check_sampling_controls
from specdec.common.errors import InvalidRequest
from specdec.common.params import (
    MAX_TOP_LOGPROBS,
    MAX_TREE_WIDTH,
    SamplingParams,
)
from specdec.gateway.names import DraftMethod, KPolicy
from specdec.sdk import request
from specdec.sdk.request import Request, Sampling, Scoring
from specdec.v1 import gateway_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SESSION_ID_CHARS = 256
# A prompt longer than this many characters per context token cannot fit: refused before
# it is tokenized, so one huge prompt cannot hold the event loop.
MAX_CHARS_PER_TOKEN = 64
# Completions per request (alternatives per scored token: MAX_TOP_LOGPROBS, which the
# verifier enforces too).
MAX_CHOICES = 16

# The default lease of a session's turn lock (specdec.gateway.sessions.turns): renewed every
# quarter, so it survives three missed renewals (a Redis blip, a loaded event loop), and
# lapses this long after its holder's death.
TURN_LEASE_SECONDS = 4.0


def tree_width(value: int) -> str | None:
    """Why a tree width is invalid (None: it is valid)."""
    if 1 <= value <= MAX_TREE_WIDTH:
        return None
    return f"must be in [1, {MAX_TREE_WIDTH}]"


class ContextLengthExceeded(InvalidRequest):
    """A request whose history, prompt and max_new_tokens cannot fit the model's context:
    INVALID_ARGUMENT on gRPC like any bad request; the HTTP API answers OpenAI's
    400 `context_length_exceeded` (specdec.gateway.front.http.errors)."""


@dataclass(frozen=True)
class Limits:
    """What a request may ask for, known once the replicas have answered Info."""

    vocab_size: int
    max_context: int  # tokens: history + prompt + max_new_tokens
    max_k: int  # the replicas' largest draft length
    default_k: int
    default_ssd: bool
    default_k_policy: KPolicy
    max_new_tokens: int
    default_ttl: int  # seconds
    max_session_ttl: int  # seconds
    default_method: DraftMethod = DraftMethod.HYBRID
    default_tree_width: int = 1
    # What a request's unset sampling fields become: the target's generation_config
    # (ModelInfo.sampling_defaults); None: neutral (greedy).
    sampling_defaults: Sampling | None = None


@dataclass(frozen=True)
class ResolvedSpeculation:
    """How a request's drafts are made, resolved: the request's Speculation, else the
    gateway's defaults (speed only, never the output)."""

    k: int  # the draft length; an upper bound under the adaptive policy
    ssd: bool = False
    k_policy: KPolicy = KPolicy.FIXED
    method: DraftMethod = DraftMethod.MODEL
    tree_width: int = 1  # candidate continuations per lookup round (1: chains)

    @classmethod
    def resolve(
        cls, asked: request.Speculation, limits: Limits, *, seeded: bool
    ) -> ResolvedSpeculation:
        """The request's choices, the gateway's defaults where it leaves them (`seeded`: the
        request samples with a seed)."""
        k = limits.default_k if asked.k is None else asked.k
        if not 0 <= k <= limits.max_k:
            raise InvalidRequest(
                f"num_draft_tokens must be in [0, {limits.max_k}], got {k}", field="k"
            )
        k_policy = asked.k_policy or limits.default_k_policy
        if asked.k_policy is None and seeded:
            # A seeded sampled output is reproducible for a given sequence of drafts: the
            # adaptive policy's depend on timings (specdec.gateway.round.policy), so it
            # drafts fixed.
            k_policy = KPolicy.FIXED
        width = limits.default_tree_width if asked.tree_width is None else asked.tree_width
        why = tree_width(width)
        if why is not None:
            raise InvalidRequest(f"speculation.tree_width {why}, got {width}", field="tree_width")
        ssd = limits.default_ssd if asked.ssd is None else asked.ssd
        return cls(
            k=k,
            ssd=ssd and k > 0,
            k_policy=k_policy,
            method=asked.method or limits.default_method,
            tree_width=width,
        )


@dataclass(frozen=True)
class ResolvedSession:
    """Which conversation a request continues, resolved: the request's Session with the
    gateway's default ttl (id None: a one-off request)."""

    id: str | None = None
    reset: bool = False  # forget its history first
    ttl: int = 0  # seconds of idle time it lives
    expected_turns: int = 0  # turns the client saw complete (0: not checked)

    @classmethod
    def resolve(cls, asked: request.Session, limits: Limits) -> ResolvedSession:
        """The session the request names, its ttl the gateway's default where unset."""
        asked.check()
        if len(asked.session_id or "") > MAX_SESSION_ID_CHARS:
            raise InvalidRequest(
                f"session id is longer than {MAX_SESSION_ID_CHARS} characters",
                field="session_id",
            )
        if asked.session_ttl_seconds > limits.max_session_ttl:
            raise InvalidRequest(
                f"session ttl_seconds must be at most {limits.max_session_ttl}, "
                f"got {asked.session_ttl_seconds}",
                field="session_ttl_seconds",
            )
        return cls(
            id=asked.session_id or None,
            reset=asked.reset_session,
            ttl=asked.session_ttl_seconds or limits.default_ttl,
            expected_turns=asked.session_expected_turns,
        )


@dataclass(frozen=True)
class ResolvedOutput:
    """What a request generates and where it ends, resolved: the request's Output,
    checked against the limits."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # independent completions (specdec.gateway.front.choices)
    # The grammar the output follows (compiled by specdec.gateway.round.grammar); None: none.
    structured: gateway_pb2.StructuredOutput | None = None
    # GenerateRequest.prediction: text (tokenized by the turn), ids, or None
    prediction: str | list[int] | None = None
    record: bool = True  # False: the request refused recording (GenerateRequest.record)

    @classmethod
    def resolve(cls, asked: request.Output, limits: Limits) -> ResolvedOutput:
        """The request's output, checked against the limits."""
        max_new = asked.max_new_tokens
        if not 1 <= max_new <= limits.max_new_tokens:
            raise InvalidRequest(
                f"max_new_tokens must be in [1, {limits.max_new_tokens}], got {max_new}",
                field="max_new_tokens",
            )
        if asked.min_tokens > max_new:
            raise InvalidRequest(
                f"min_tokens must be at most max_new_tokens ({max_new}), got {asked.min_tokens}",
                field="min_tokens",
            )
        stop_ids = list(asked.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_ids)}",
                field="stop_token_ids",
            )
        _check_ids(stop_ids, limits, "stop_token_ids")
        stop = tuple(asked.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", field="stop"
            )
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequest(
                f"stop strings must have 1..{MAX_STOP_CHARS} characters", field="stop"
            )
        if not 1 <= asked.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {asked.n}", field="n")
        structured = asked.grammar
        if structured is not None and (asked.min_tokens or asked.ignore_eos):
            # A complete grammar allows only EOS: min_tokens would mask every token, and
            # ignore_eos would ask for tokens after the grammar has ended.
            which = "min_tokens" if asked.min_tokens else "ignore_eos"
            raise InvalidRequest(
                f"structured_output cannot be combined with {which}: the grammar decides "
                "where the output ends",
                field="structured_output",
            )
        return cls(
            max_new_tokens=max_new,
            stop=stop,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=asked.ignore_eos,
            min_tokens=asked.min_tokens,
            n=asked.n,
            structured=structured,
            prediction=_prediction(asked.prediction, limits),
            record=asked.record is not False,
        )


NO_SCORING = Scoring()  # no log-probabilities


@dataclass(frozen=True)
class Job:
    """A resolved request: its prompt and its typed parts (the SDK's Request,
    specdec.sdk.request, checked, with every default resolved)."""

    prompt: str | list[int]  # text (tokenized once the history is known) or token ids
    sampling: SamplingParams  # every field set: the request's, else the model's defaults
    output: ResolvedOutput
    speculation: ResolvedSpeculation
    session: ResolvedSession = ResolvedSession()
    scoring: Scoring = NO_SCORING  # logprobs, top_logprobs, prompt_logprobs
    tenant: str = ""  # who the request is for (gRPC metadata specdec-tenant, HTTP `user`)

    @classmethod
    def resolve(cls, asked: Request, limits: Limits, tenant: str = "") -> Job:
        """The request as a Job, or InvalidRequest naming the first problem (its field)."""
        prompt = _prompt(asked, limits)
        output = ResolvedOutput.resolve(asked.output, limits)
        sampling = asked.sampling.resolve(limits.sampling_defaults, SamplingParams)
        check_sampling_controls(sampling.processors, limits.vocab_size)
        session = ResolvedSession.resolve(asked.session, limits)
        scoring = _scoring(asked.scoring)
        if scoring.prompt_logprobs and session.id:
            raise InvalidRequest(
                "prompt_logprobs cannot be used with a session id: the prompt is scored "
                "whole, in a request of its own",
                field="prompt_logprobs",
            )
        if output.n > 1 and session.id:
            raise InvalidRequest(
                "n > 1 cannot be used with a session id: a session continues one conversation",
                field="n",
            )
        return cls(
            prompt=prompt,
            sampling=sampling,
            output=output,
            speculation=ResolvedSpeculation.resolve(
                asked.speculation, limits, seeded=sampling.seed is not None and not sampling.greedy
            ),
            session=session,
            scoring=scoring,
            tenant=tenant,
        )


def _check_ids(ids: Sequence[int], limits: Limits, field: str, what: str = "") -> None:
    """InvalidRequest naming `field` when an id of `what` (the field itself unless
    given) lies outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"{what or field} holds {bad[0]}, outside the vocabulary [0, {limits.vocab_size})",
            field=field,
        )


def _prompt(asked: Request, limits: Limits) -> str | list[int]:
    """The request's prompt: text, or token ids inside the vocabulary."""
    if asked.prompt is not None and asked.token_ids is not None:
        raise InvalidRequest("give exactly one of prompt or token_ids", field="prompt")
    if asked.prompt is not None:
        if not asked.prompt:
            raise InvalidRequest("prompt is empty", field="prompt")
        if len(asked.prompt) > limits.max_context * MAX_CHARS_PER_TOKEN:
            raise ContextLengthExceeded(
                f"prompt of {len(asked.prompt)} characters cannot fit the model's context "
                f"of {limits.max_context} tokens",
                field="prompt",
            )
        return asked.prompt
    if asked.token_ids is None:
        raise InvalidRequest("prompt is empty: set prompt or prompt_token_ids", field="prompt")
    ids = list(asked.token_ids)
    if not ids:
        raise InvalidRequest("prompt is empty: prompt_token_ids has no ids", field="token_ids")
    _check_ids(ids, limits, "token_ids", "prompt_token_ids")
    return ids


def _scoring(asked: Scoring) -> Scoring:
    """The request's log-probabilities, checked."""
    if not 0 <= asked.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {asked.top_logprobs}",
            field="top_logprobs",
        )
    if asked.top_logprobs and not (asked.logprobs or asked.prompt_logprobs):
        raise InvalidRequest("top_logprobs needs logprobs or prompt_logprobs", field="top_logprobs")
    return asked


def _prediction(prediction: str | Sequence[int] | None, limits: Limits) -> str | list[int] | None:
    """The request's prediction as text or ids (None: none), checked like the prompt."""
    if isinstance(prediction, str):
        if len(prediction) > limits.max_context * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"prediction.text of {len(prediction)} characters cannot fit the model's "
                f"context of {limits.max_context} tokens",
                field="prediction",
            )
        return prediction or None
    if prediction is None:
        return None
    ids = list(prediction)
    _check_ids(ids, limits, "prediction", "prediction.token_ids")
    if len(ids) > limits.max_context:
        raise InvalidRequest(
            f"prediction.token_ids has {len(ids)} ids, more than the model's context "
            f"of {limits.max_context}",
            field="prediction",
        )
    return ids or None
