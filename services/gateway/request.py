"""Validation of a GenerateRequest against the gateway's limits: proto in, `Job` out.

Every check runs before anything is tokenized or sent to a replica, so a bad request costs
nothing and touches no session. The limits come from the replicas' Info (vocabulary,
context, largest k) and the gateway's own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.errors import InvalidRequest
from specdec.common.params import sampling_from_proto
from specdec.v1 import common_pb2, gateway_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_SESSION_ID_CHARS = 256
# A prompt longer than this many characters per context token cannot fit: refused before
# it is tokenized, so one huge prompt cannot hold the event loop.
MAX_CHARS_PER_TOKEN = 64


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


@dataclass(frozen=True)
class Job:
    """A validated GenerateRequest."""

    prompt: str | list[int]  # text (tokenized once the history is known) or token ids
    max_new_tokens: int
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...]
    session_id: str | None
    reset: bool
    ttl: int
    k: int  # the draft length; an upper bound under the adaptive policy
    ssd: bool
    k_policy: int = gateway_pb2.K_POLICY_FIXED  # FIXED or ADAPTIVE, never UNSPECIFIED
    record: bool = True  # False: the request refused recording (GenerateRequest.record)


def validate(req: gateway_pb2.GenerateRequest, limits: Limits) -> Job:
    """The request as a Job, or InvalidRequest naming the first problem."""
    which = req.WhichOneof("input")
    if which == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty")
        if len(req.prompt) > limits.max_context * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
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
    sampling_from_proto(req.sampling)  # validates; the proto travels as it is
    stop = tuple(req.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(f"stop strings must have 1..{MAX_STOP_CHARS} characters")
    session = req.session
    if session.mode not in gateway_pb2.SessionMode.values():
        raise InvalidRequest(f"unknown session mode {session.mode}")
    if not session.id and (session.mode or session.ttl_seconds):
        raise InvalidRequest("session options given without a session id")
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
    if k_policy not in (gateway_pb2.K_POLICY_FIXED, gateway_pb2.K_POLICY_ADAPTIVE):
        raise InvalidRequest(
            f"speculation.k_policy must be K_POLICY_UNSPECIFIED, K_POLICY_FIXED or "
            f"K_POLICY_ADAPTIVE, got {spec.k_policy}"
        )
    return Job(
        prompt=prompt,
        max_new_tokens=req.max_new_tokens,
        sampling=req.sampling,
        stop=stop,
        session_id=session.id or None,
        reset=session.mode == gateway_pb2.SESSION_MODE_RESET,
        ttl=session.ttl_seconds or limits.default_ttl,
        k=k,
        ssd=ssd and k > 0,
        k_policy=k_policy,
        record=req.record if req.HasField("record") else True,
    )
