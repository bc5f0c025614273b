"""Validation of a GenerateRequest against the gateway's limits: proto in, `Job` out.

A `Job` carries the request as typed parts, each resolved once here: `Output` (length,
stops, grammar, prediction), `Speculation` (k, SSD, k policy, method, tree width: the
gateway's defaults where the request leaves them), `Session`, `Scoring` (the SDK's) and
the sampling (the model's generation_config where the request leaves a field unset).

Every check runs before anything is tokenized or sent to a replica, so a bad request costs
nothing and touches no session. The limits come from the replicas' Info (vocabulary,
context, largest k) and the gateway's own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.controls import MAX_STOP_TOKEN_IDS, check_sampling_controls
from specdec.common.errors import InvalidRequest
from specdec.common.params import (
    MAX_TOP_LOGPROBS,
    MAX_TREE_WIDTH,
    SamplingParams,
    sampling_from_proto,
)
from specdec.gateway.names import DraftMethod, KPolicy
from specdec.sdk.request import Sampling, Scoring
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

# gateway_pb2.SpeculationMethod value -> the method
METHODS = {method.proto: method for method in DraftMethod}


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
    default_k_policy: int  # gateway_pb2.KPolicy: FIXED or ADAPTIVE
    max_new_tokens: int
    default_ttl: int  # seconds
    max_session_ttl: int  # seconds
    default_method: gateway_pb2.SpeculationMethod = gateway_pb2.SPECULATION_METHOD_HYBRID
    default_tree_width: int = 1
    # What a request's unset sampling fields become: the target's generation_config
    # (ModelInfo.sampling_defaults); None: neutral (greedy).
    sampling_defaults: Sampling | None = None


@dataclass(frozen=True)
class Speculation:
    """How a request's drafts are made, resolved: the request's SpeculationParams, else
    the gateway's defaults (speed only, never the output)."""

    k: int  # the draft length; an upper bound under the adaptive policy
    ssd: bool = False
    k_policy: KPolicy = KPolicy.FIXED
    method: DraftMethod = DraftMethod.MODEL
    tree_width: int = 1  # candidate continuations per lookup round (1: chains)


@dataclass(frozen=True)
class Session:
    """Which conversation a request continues (id None: a one-off request)."""

    id: str | None = None
    reset: bool = False  # forget its history first
    ttl: int = 0  # seconds of idle time it lives
    expected_turns: int = 0  # turns the client saw complete (0: not checked)


@dataclass(frozen=True)
class Output:
    """What a request generates and where it ends."""

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


NO_SCORING = Scoring()  # no log-probabilities


@dataclass(frozen=True)
class Job:
    """A validated GenerateRequest: its prompt and its typed parts (the SDK's Request,
    specdec.sdk.request, with every default resolved)."""

    prompt: str | list[int]  # text (tokenized once the history is known) or token ids
    sampling: SamplingParams  # every field set: the request's, else the model's defaults
    output: Output
    speculation: Speculation
    session: Session = Session()
    scoring: Scoring = NO_SCORING  # logprobs, top_logprobs, prompt_logprobs
    tenant: str = ""  # who the request is for (gRPC metadata specdec-tenant, HTTP `user`)


def validate(req: gateway_pb2.GenerateRequest, limits: Limits) -> Job:
    """The request as a Job, or InvalidRequest naming the first problem."""
    which = req.WhichOneof("input")
    if which == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty")
        if len(req.prompt) > limits.max_context * MAX_CHARS_PER_TOKEN:
            raise ContextLengthExceeded(
                f"prompt of {len(req.prompt)} characters cannot fit the model's context "
                f"of {limits.max_context} tokens"
            )
        prompt: str | list[int] = req.prompt
    elif which == "prompt_token_ids":
        prompt = list(req.prompt_token_ids.ids)
        if not prompt:
            raise InvalidRequest("prompt is empty: prompt_token_ids has no ids")
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {limits.vocab_size})"
            )
    else:
        raise InvalidRequest("prompt is empty: set prompt or prompt_token_ids")
    if not 1 <= req.max_new_tokens <= limits.max_new_tokens:
        raise InvalidRequest(
            f"max_new_tokens must be in [1, {limits.max_new_tokens}], got {req.max_new_tokens}"
        )
    sampling = sampling_from_proto(
        req.sampling if req.HasField("sampling") else None, limits.sampling_defaults
    )
    check_sampling_controls(req.sampling, limits.vocab_size)
    if req.min_tokens > req.max_new_tokens:
        raise InvalidRequest(
            f"min_tokens must be at most max_new_tokens ({req.max_new_tokens}), "
            f"got {req.min_tokens}"
        )
    stop_ids = list(req.stop_token_ids)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_ids)}")
    bad = [t for t in stop_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {limits.vocab_size})"
        )
    stop = tuple(req.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(f"stop strings must have 1..{MAX_STOP_CHARS} characters")
    session = req.session
    if session.mode not in gateway_pb2.SessionMode.values():
        raise InvalidRequest(f"unknown session mode {session.mode}")
    if not session.id and (session.mode or session.ttl_seconds or session.expected_turns):
        raise InvalidRequest("session options given without a session id")
    if session.expected_turns and session.mode == gateway_pb2.SESSION_MODE_RESET:
        raise InvalidRequest(
            "session options: expected_turns cannot be used with SESSION_MODE_RESET (a "
            "reset session starts with no turns)"
        )
    if len(session.id) > MAX_SESSION_ID_CHARS:
        raise InvalidRequest(f"session id is longer than {MAX_SESSION_ID_CHARS} characters")
    if session.ttl_seconds > limits.max_session_ttl:
        raise InvalidRequest(
            f"session ttl_seconds must be at most {limits.max_session_ttl}, "
            f"got {session.ttl_seconds}"
        )
    spec = req.speculation
    k = spec.num_draft_tokens if spec.HasField("num_draft_tokens") else limits.default_k
    if not 0 <= k <= limits.max_k:
        raise InvalidRequest(f"num_draft_tokens must be in [0, {limits.max_k}], got {k}")
    ssd = spec.ssd if spec.HasField("ssd") else limits.default_ssd
    k_policy = spec.k_policy or limits.default_k_policy
    if not spec.k_policy and sampling.seed is not None and not sampling.greedy:
        # A seeded sampled output is reproducible for a given sequence of drafts: the
        # adaptive policy's depend on timings (specdec.gateway.round.policy), so it drafts fixed.
        k_policy = gateway_pb2.K_POLICY_FIXED
    if k_policy not in (gateway_pb2.K_POLICY_FIXED, gateway_pb2.K_POLICY_ADAPTIVE):
        raise InvalidRequest(
            f"speculation.k_policy must be K_POLICY_UNSPECIFIED, K_POLICY_FIXED or "
            f"K_POLICY_ADAPTIVE, got {spec.k_policy}"
        )
    if req.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}"
        )
    if req.top_logprobs and not (req.logprobs or req.prompt_logprobs):
        raise InvalidRequest("top_logprobs needs logprobs or prompt_logprobs")
    if req.prompt_logprobs and session.id:
        raise InvalidRequest(
            "prompt_logprobs cannot be used with a session id: the prompt is scored whole, "
            "in a request of its own"
        )
    n = req.n or 1
    if n > MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {n}")
    if n > 1 and session.id:
        raise InvalidRequest(
            "n > 1 cannot be used with a session id: a session continues one conversation"
        )
    if req.HasField("structured_output") and (req.min_tokens or req.ignore_eos):
        # A complete grammar allows only EOS: min_tokens would mask every token, and
        # ignore_eos would ask for tokens after the grammar has ended.
        which = "min_tokens" if req.min_tokens else "ignore_eos"
        raise InvalidRequest(
            f"structured_output cannot be combined with {which}: the grammar decides where "
            "the output ends"
        )
    method = spec.method or limits.default_method
    if method not in METHODS:
        raise InvalidRequest(
            "speculation.method must be SPECULATION_METHOD_UNSPECIFIED, _MODEL, _NGRAM, "
            f"_SUFFIX or _HYBRID, got {spec.method}"
        )
    width = spec.tree_width if spec.HasField("tree_width") else limits.default_tree_width
    why = tree_width(width)
    if why is not None:
        raise InvalidRequest(f"speculation.tree_width {why}, got {width}")
    return Job(
        prompt=prompt,
        sampling=sampling,
        output=Output(
            max_new_tokens=req.max_new_tokens,
            stop=stop,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            n=n,
            structured=req.structured_output if req.HasField("structured_output") else None,
            prediction=_prediction(req, limits),
            record=req.record if req.HasField("record") else True,
        ),
        speculation=Speculation(
            k=k,
            ssd=ssd and k > 0,
            k_policy=KPolicy.of(k_policy),
            method=DraftMethod.of(method),
            tree_width=width,
        ),
        session=Session(
            id=session.id or None,
            reset=session.mode == gateway_pb2.SESSION_MODE_RESET,
            ttl=session.ttl_seconds or limits.default_ttl,
            expected_turns=session.expected_turns,
        ),
        scoring=Scoring(
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            prompt_logprobs=req.prompt_logprobs,
        ),
    )


def _prediction(req: gateway_pb2.GenerateRequest, limits: Limits) -> str | list[int] | None:
    """GenerateRequest.prediction as text or ids, checked like the prompt."""
    if not req.HasField("prediction"):
        return None
    which = req.prediction.WhichOneof("content")
    if which == "text":
        text = req.prediction.text
        if len(text) > limits.max_context * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"prediction.text of {len(text)} characters cannot fit the model's context "
                f"of {limits.max_context} tokens"
            )
        return text or None
    if which == "token_ids":
        ids = list(req.prediction.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prediction.token_ids holds {bad[0]}, outside the vocabulary "
                f"[0, {limits.vocab_size})"
            )
        if len(ids) > limits.max_context:
            raise InvalidRequest(
                f"prediction.token_ids has {len(ids)} ids, more than the model's context "
                f"of {limits.max_context}"
            )
        return ids or None
    raise InvalidRequest("prediction is set but empty: set prediction.text or prediction.token_ids")
