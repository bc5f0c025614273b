"""A generation request as typed objects, defined once and torch-free.

A request is a :class:`Request` of five parts: :class:`Sampling` (how tokens are drawn),
:class:`Speculation` (how drafts are made: speed only, never the output), :class:`Output`
(how long, where it stops, its grammar), :class:`Session` (which conversation it
continues) and :class:`Scoring` (log-probabilities). Each part converts to and from its
protobuf message in one function each way; nothing else reads or writes those fields.

The SDK's keyword arguments (``Client.generate(..., temperature=0.7, k=4)``) are the
parts' fields, flat: :func:`request_parameters` builds the methods' signatures from them,
and :meth:`Request.build` sorts keywords back into parts. Adding an option is adding a
field to its part, to the proto, and to the code that uses it.

Unset (None) sampling fields take the target model's ``generation_config`` at the gateway
(:meth:`Sampling.resolve`); docs/features/sampling.md states the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from specdec.v1 import common_pb2, gateway_pb2

__all__ = [
    "GREEDY_BELOW",
    "K_POLICIES",
    "MAX_TOP_K",
    "METHODS",
    "Output",
    "Request",
    "Sampling",
    "Scoring",
    "Session",
    "Speculation",
    "request_parameters",
]

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): logits / 1e-40 overflows to
# inf, and such a distribution is a one-hot argmax to every digit fp32 can hold anyway.
GREEDY_BELOW = 1e-5
# Largest accepted top_k; larger values behave like 0 (no filter) and are most likely a
# client bug, so they are refused rather than silently clamped.
MAX_TOP_K = 1 << 20
#: ``k_policy`` values: how the gateway picks each round's draft length.
K_POLICIES = {"fixed": gateway_pb2.K_POLICY_FIXED, "adaptive": gateway_pb2.K_POLICY_ADAPTIVE}
#: ``method`` values: where drafts come from.
METHODS = {
    "model": gateway_pb2.SPECULATION_METHOD_MODEL,
    "ngram": gateway_pb2.SPECULATION_METHOD_NGRAM,
    "suffix": gateway_pb2.SPECULATION_METHOD_SUFFIX,
    "hybrid": gateway_pb2.SPECULATION_METHOD_HYBRID,
}


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn (the drafter and the verifier apply it alike).

    ``temperature``: 0 (anything below ``GREEDY_BELOW``) is greedy. ``top_p`` in (0, 1];
    ``top_k``: 0 is off; ``min_p`` in [0, 1]: 0 is off. None (unset) takes the model's
    generation_config at the gateway (:meth:`resolve`). ``seed``: None draws fresh
    entropy. The penalties and ``logit_bias`` (token id -> bias) are OpenAI's and
    transformers' logits processors.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None

    #: Fields that the model's generation_config may set, with their neutral values
    #: (what an unset field is when the model sets none: greedy, no filter, no penalty).
    MODEL_FIELDS: ClassVar[Mapping[str, float | int]] = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }

    @property
    def greedy(self) -> bool:
        return (self.temperature or 0.0) < GREEDY_BELOW

    def resolve(self, defaults: Sampling | None = None) -> Sampling:
        """Every unset field set: from ``defaults`` (the model's), else neutral."""
        values: dict[str, Any] = {}
        for name, neutral in self.MODEL_FIELDS.items():
            value = getattr(self, name)
            if value is None and defaults is not None:
                value = getattr(defaults, name)
            values[name] = neutral if value is None else value
        return dataclasses.replace(self, **values)

    def check(self) -> None:
        """ValueError naming the first field out of range (unset fields pass)."""
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if p is not None and not (math.isfinite(p) and 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise ValueError(f"top_k must be an integer, got {k!r}")
        if self.min_p is not None and not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if k is not None and not 0 <= k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {k}")
        if seed is not None and not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")

    def to_proto(self) -> common_pb2.SamplingParams:
        """The message (unset fields stay unset; model_defaults marks that they may be)."""
        values = {name: getattr(self, name) for name in _names(Sampling)}
        values["logit_bias"] = dict(self.logit_bias or {})
        return common_pb2.SamplingParams(**values, model_defaults=True)

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams | None) -> Sampling:
        """The message's sampling: None (no message) leaves every field unset.

        A message without ``model_defaults`` comes from a client that could not leave a
        field unset (proto3 sends 0 as nothing): its absent MODEL_FIELDS are neutral, so
        an explicit temperature 0 stays greedy. A 0 top_p or repetition_penalty reads as
        unset (neither can be 0).
        """
        if msg is None:
            return cls()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            name, field = f.name, msg.DESCRIPTOR.fields_by_name[f.name]
            if name == "logit_bias":
                values[name] = dict(msg.logit_bias) or None
            elif not field.has_presence or _given(msg, name):
                values[name] = getattr(msg, name)
            elif name in cls.MODEL_FIELDS and not msg.model_defaults:
                values[name] = cls.MODEL_FIELDS[name]
            else:
                values[name] = None
        return cls(**values)


# Fields whose 0 cannot be meant (a client from before `optional` sent 0 for "unset").
_ZERO_IS_UNSET = ("top_p", "repetition_penalty")


def _given(msg: common_pb2.SamplingParams, name: str) -> bool:
    return msg.HasField(name) and (bool(getattr(msg, name)) or name not in _ZERO_IS_UNSET)


@dataclass(frozen=True)
class Speculation:
    """How drafts are made; every choice gives the same output (speed only).

    ``k``: draft length (an upper bound under ``k_policy="adaptive"``); ``ssd``:
    speculative speculative decoding; ``k_policy``: ``"fixed"`` or ``"adaptive"``;
    ``method``: ``"model"``, ``"ngram"``, ``"suffix"`` or ``"hybrid"``; ``tree_width``:
    candidate continuations a lookup round verifies together (1..8). None: the server's
    default.
    """

    k: int | None = None
    ssd: bool | None = None
    k_policy: str | None = None
    method: str | None = None
    tree_width: int | None = None

    def to_proto(self) -> gateway_pb2.SpeculationParams | None:
        """The message, or None when every field is the server's default."""
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.k_policy is not None and self.k_policy not in K_POLICIES:
            raise ValueError(
                f"k_policy must be one of {', '.join(K_POLICIES)}, got {self.k_policy!r}"
            )
        if self == Speculation():
            return None
        return gateway_pb2.SpeculationParams(
            num_draft_tokens=self.k,
            ssd=self.ssd,
            k_policy=K_POLICIES.get(self.k_policy or "", gateway_pb2.K_POLICY_UNSPECIFIED),
            method=METHODS.get(self.method or "", gateway_pb2.SPECULATION_METHOD_UNSPECIFIED),
            tree_width=self.tree_width,
        )


@dataclass(frozen=True)
class Session:
    """Which conversation a request continues: none (``session_id`` None: a one-off
    request), or a session's history, forgotten first with ``reset_session``;
    ``session_ttl_seconds``: its idle time to live (0: the server's default);
    ``session_expected_turns``: the session's turns this client saw complete
    (``usage.session_turns`` of its last response; 0: not checked): a session that holds
    fewer lost its history and the server refuses the turn (FAILED_PRECONDITION) instead of
    continuing it as a new one."""

    session_id: str | None = None
    reset_session: bool = False
    session_ttl_seconds: int = 0
    session_expected_turns: int = 0

    def to_proto(self) -> gateway_pb2.SessionOptions | None:
        if not self.session_id:
            if self.reset_session or self.session_ttl_seconds or self.session_expected_turns:
                raise ValueError(
                    "reset_session, session_ttl_seconds and session_expected_turns need a "
                    "session_id"
                )
            return None
        return gateway_pb2.SessionOptions(
            id=self.session_id,
            mode=(
                gateway_pb2.SESSION_MODE_RESET
                if self.reset_session
                else gateway_pb2.SESSION_MODE_CONTINUE
            ),
            ttl_seconds=self.session_ttl_seconds,
            expected_turns=self.session_expected_turns,
        )


@dataclass(frozen=True)
class Output:
    """What is generated: at most ``max_new_tokens``, ending at a ``stop`` string, one of
    ``stop_token_ids`` or EOS (unless ``ignore_eos``), not before ``min_tokens``; ``n``
    independent completions; ``structured_output``: a grammar (a ``StructuredOutput`` or
    a dict of one key: ``{"json_schema": <schema dict or JSON text>}``, ``{"regex":
    "..."}``, ``{"choice": ["a", "b"]}``, ``{"grammar": "<Lark grammar>"}`` or
    ``{"json_object": True}``); ``prediction``:
    text or token ids the output is expected to repeat (OpenAI's Predicted Outputs, a
    source of drafts); ``record=False`` refuses the gateway's recording (``--record``)."""

    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None
    prediction: str | Sequence[int] | None = None
    record: bool | None = None

    def fill(self, request: gateway_pb2.GenerateRequest) -> None:
        """Write this part's fields into ``request``."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one stop string
        request.max_new_tokens = self.max_new_tokens
        request.stop.extend(stop)
        request.stop_token_ids.extend(self.stop_token_ids)
        request.ignore_eos, request.min_tokens, request.n = (
            self.ignore_eos,
            self.min_tokens,
            self.n,
        )
        if self.structured_output is not None:
            request.structured_output.CopyFrom(_structured_output(self.structured_output))
        if isinstance(self.prediction, str):
            if self.prediction:
                request.prediction.text = self.prediction
        elif self.prediction is not None:
            if isinstance(self.prediction, bytes):
                raise TypeError("prediction must be a str or a sequence of ints")
            request.prediction.token_ids.ids.extend(self.prediction)
        if self.record is not None:
            request.record = self.record


@dataclass(frozen=True)
class Scoring:
    """Log-probabilities under the target: of each generated token (``logprobs``), with
    ``top_logprobs`` alternatives (0..20), and of the prompt (``prompt_logprobs``, not
    with a session)."""

    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False

    def fill(self, request: gateway_pb2.GenerateRequest) -> None:
        request.logprobs, request.top_logprobs = self.logprobs, self.top_logprobs
        request.prompt_logprobs = self.prompt_logprobs


_Part = Sampling | Speculation | Session | Output | Scoring
# The parts in the order their fields appear in the SDK's signatures.
PARTS: tuple[type[_Part], ...] = (Output, Sampling, Session, Speculation, Scoring)


@dataclass(frozen=True)
class Request:
    """One generation: exactly one of ``prompt`` (text) / ``token_ids``, and its parts."""

    prompt: str | None = None
    token_ids: Sequence[int] | None = None
    sampling: Sampling = Sampling()
    speculation: Speculation = Speculation()
    session: Session = Session()
    output: Output = Output()
    scoring: Scoring = Scoring()

    @classmethod
    def build(
        cls, prompt: str | None = None, *, token_ids: Sequence[int] | None = None, **options: Any
    ) -> Request:
        """The request of the SDK's flat keyword arguments (TypeError for unknown ones)."""
        parts: dict[type[_Part], dict[str, Any]] = {part: {} for part in PARTS}
        owner = _owners()
        for name, value in options.items():
            if name not in owner:
                raise TypeError(f"unexpected keyword argument {name!r}")
            parts[owner[name]][name] = value
        return cls(
            prompt=prompt,
            token_ids=token_ids,
            sampling=Sampling(**parts[Sampling]),
            speculation=Speculation(**parts[Speculation]),
            session=Session(**parts[Session]),
            output=Output(**parts[Output]),
            scoring=Scoring(**parts[Scoring]),
        )

    def to_proto(self) -> gateway_pb2.GenerateRequest:
        """The ``GenerateRequest`` (``ValueError`` / ``TypeError`` for what cannot be sent)."""
        if (self.prompt is None) == (self.token_ids is None):
            raise ValueError("give exactly one of prompt or token_ids")
        request = gateway_pb2.GenerateRequest()
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise TypeError(f"prompt must be a str, not {type(self.prompt).__name__}")
            request.prompt = self.prompt
        else:
            if isinstance(self.token_ids, (str, bytes)):
                raise TypeError("token_ids must be a sequence of ints")
            request.prompt_token_ids.ids.extend(self.token_ids or ())
        request.sampling.CopyFrom(self.sampling.to_proto())
        session = self.session.to_proto()
        if session is not None:
            request.session.CopyFrom(session)
        speculation = self.speculation.to_proto()
        if speculation is not None:
            request.speculation.CopyFrom(speculation)
        self.output.fill(request)
        self.scoring.fill(request)
        return request


@functools.cache
def _owners() -> dict[str, type[_Part]]:
    return {f.name: part for part in PARTS for f in dataclasses.fields(part)}


@functools.cache
def _names(part: type[_Part]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(part))


def request_parameters() -> list[inspect.Parameter]:
    """The SDK's request arguments: ``prompt``, then keyword-only ``token_ids`` and every
    part's fields with their defaults (the signature of ``build_generate_request``)."""
    params = [
        inspect.Parameter(
            "prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="str | None"
        ),
        inspect.Parameter(
            "token_ids",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation="Sequence[int] | None",
        ),
    ]
    for part in PARTS:
        for f in dataclasses.fields(part):
            params.append(
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
                )
            )
    return params


F = TypeVar("F", bound=Callable[..., Any])


def takes_request_options(fn: F) -> F:
    """Give ``fn(self?, prompt=None, **options, timeout=...)`` the request's parameters as
    its signature (help(), IDEs and ``inspect`` show every option; ``Request.build``
    checks them)."""
    own = list(inspect.signature(fn).parameters.values())
    head = [p for p in own if p.name == "self"]
    tail = [p for p in own if p.name == "timeout"]
    signature = inspect.signature(fn).replace(parameters=[*head, *request_parameters(), *tail])
    setattr(fn, "__signature__", signature)  # noqa: B010 (mypy: functions have no such attribute)
    return fn


def _structured_output(
    spec: dict[str, Any] | gateway_pb2.StructuredOutput,
) -> gateway_pb2.StructuredOutput:
    if isinstance(spec, gateway_pb2.StructuredOutput):
        return spec
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(
            "structured_output must be a StructuredOutput or a dict of one key: json_schema, "
            "regex, choice, grammar or json_object"
        )
    ((kind, value),) = spec.items()
    if kind == "json_schema":
        text = value if isinstance(value, str) else json.dumps(value)
        return gateway_pb2.StructuredOutput(json_schema=text)
    if kind == "regex":
        return gateway_pb2.StructuredOutput(regex=value)
    if kind == "grammar":
        return gateway_pb2.StructuredOutput(grammar=value)
    if kind == "choice":
        return gateway_pb2.StructuredOutput(
            choice=gateway_pb2.StructuredChoice(choices=list(value))
        )
    if kind == "json_object" and value:
        return gateway_pb2.StructuredOutput(json_object=gateway_pb2.StructuredJsonObject())
    raise ValueError(f"structured_output: unknown kind {kind!r}")
