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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, overload

from specdec.sdk.errors import InvalidRequest
from specdec.sdk.names import DraftMethod, KPolicy, WireEnum
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
#: ``k_policy`` values: how the gateway picks each round's draft length (name -> proto).
K_POLICIES = {policy.value: policy.proto for policy in KPolicy}
#: ``method`` values: where drafts come from (name -> proto).
METHODS = {method.value: method.proto for method in DraftMethod}
S = TypeVar("S", bound="Sampling")


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

    @overload
    def resolve(self, defaults: Sampling | None = None) -> Sampling: ...
    @overload
    def resolve(self, defaults: Sampling | None, kind: type[S]) -> S: ...
    def resolve(
        self, defaults: Sampling | None = None, kind: type[Sampling] | None = None
    ) -> Sampling:
        """Every unset field set: from ``defaults`` (the model's), else neutral; as a
        ``kind`` (a subclass that checks itself, the servers' SamplingParams), else as
        this class."""
        values: dict[str, Any] = {name: getattr(self, name) for name in _names(Sampling)}
        for name, neutral in self.MODEL_FIELDS.items():
            if values[name] is None and defaults is not None:
                values[name] = getattr(defaults, name)
            if values[name] is None:
                values[name] = neutral
        return (kind or type(self))(**values)

    def to_proto(self) -> common_pb2.SamplingParams:
        """The message (unset fields stay unset; model_defaults marks that they may be)."""
        values = {name: getattr(self, name) for name in _names(Sampling)}
        values["logit_bias"] = dict(self.logit_bias or {})
        return common_pb2.SamplingParams(**values, model_defaults=True)

    @classmethod
    def from_proto(
        cls: type[S], msg: common_pb2.SamplingParams | None, defaults: Sampling | None = None
    ) -> S:
        """The message's sampling: None (no message) leaves every field unset; unset
        model fields take ``defaults`` where given (a server's: the model's own).

        A message without ``model_defaults`` comes from a client that could not leave a
        field unset (proto3 sends 0 as nothing): its absent MODEL_FIELDS are neutral, so
        an explicit temperature 0 stays greedy. A 0 top_p or repetition_penalty reads as
        unset (neither can be 0).
        """
        values: dict[str, Any] = {}
        for name in _names(Sampling):
            if msg is None:
                break
            if name == "logit_bias":
                values[name] = dict(msg.logit_bias) or None
                continue
            value = getattr(msg, name)
            if not msg.DESCRIPTOR.fields_by_name[name].has_presence or (
                msg.HasField(name) and (bool(value) or name not in _ZERO_IS_UNSET)
            ):
                values[name] = value
            elif name in cls.MODEL_FIELDS and not msg.model_defaults:
                values[name] = cls.MODEL_FIELDS[name]
            else:
                values[name] = None
        for name in cls.MODEL_FIELDS if defaults is not None else ():
            if values.get(name) is None:
                values[name] = getattr(defaults, name)
        return cls(**values)


# Fields whose 0 cannot be meant (a client from before `optional` sent 0 for "unset").
_ZERO_IS_UNSET = ("top_p", "repetition_penalty")


@dataclass(frozen=True)
class Speculation:
    """How drafts are made; every choice gives the same output (speed only).

    ``k``: draft length (an upper bound under ``k_policy="adaptive"``); ``ssd``:
    speculative speculative decoding; ``k_policy``: ``"fixed"`` or ``"adaptive"``
    (:class:`~specdec.sdk.names.KPolicy`); ``method``: ``"model"``, ``"ngram"``,
    ``"suffix"`` or ``"hybrid"`` (:class:`~specdec.sdk.names.DraftMethod`; a name becomes
    its member); ``tree_width``: candidate continuations a lookup round verifies together
    (1..8). None: the server's default.
    """

    k: int | None = None
    ssd: bool | None = None
    k_policy: KPolicy | None = None
    method: DraftMethod | None = None
    tree_width: int | None = None

    def __post_init__(self) -> None:
        for name, kind in (("k_policy", KPolicy), ("method", DraftMethod)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                object.__setattr__(self, name, _member(kind, value, name))

    def to_proto(self) -> gateway_pb2.SpeculationParams | None:
        """The message, or None when every field is the server's default."""
        if self == Speculation():
            return None
        return gateway_pb2.SpeculationParams(
            num_draft_tokens=self.k,
            ssd=self.ssd,
            k_policy=self.k_policy.proto if self.k_policy else gateway_pb2.K_POLICY_UNSPECIFIED,
            method=self.method.proto if self.method else gateway_pb2.SPECULATION_METHOD_UNSPECIFIED,
            tree_width=self.tree_width,
        )

    @classmethod
    def from_proto(cls, msg: gateway_pb2.SpeculationParams | None) -> Speculation:
        """The message's choices (None: every one the server's default); InvalidRequest
        for an enum value this version does not know."""
        if msg is None:
            return cls()
        return cls(
            k=msg.num_draft_tokens if msg.HasField("num_draft_tokens") else None,
            ssd=msg.ssd if msg.HasField("ssd") else None,
            k_policy=_of_proto(KPolicy, msg.k_policy, "k_policy"),
            method=_of_proto(DraftMethod, msg.method, "method"),
            tree_width=msg.tree_width if msg.HasField("tree_width") else None,
        )


E = TypeVar("E", bound=WireEnum)


def _member(kind: type[E], name: str, field: str) -> E:
    """The member a name gives (``"ngram"``), or InvalidRequest listing the names."""
    try:
        return kind(name)
    except ValueError:
        names = ", ".join(kind)
        raise InvalidRequest(f"{field} must be one of {names}, got {name!r}", field=field) from None


def _of_proto(kind: type[E], value: int, field: str) -> E | None:
    """The member of a proto value (None: UNSPECIFIED), or InvalidRequest listing the
    proto's names."""
    if value == 0:
        return None
    try:
        return kind.of(value)
    except KeyError:
        enum_type, _ = kind.wire()
        *names, last = enum_type.keys()
        raise InvalidRequest(
            f"speculation.{field} must be {', '.join(names)} or {last}, got {value}", field=field
        ) from None


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

    def check(self) -> None:
        """InvalidRequest for options that contradict each other (the ranges that depend
        on the server are the server's to check)."""
        if not self.session_id:
            given = [
                name
                for name in ("reset_session", "session_ttl_seconds", "session_expected_turns")
                if getattr(self, name)
            ]
            if given:
                raise _without_id(given[0])
        elif self.session_expected_turns and self.reset_session:
            raise InvalidRequest(
                "session options: expected_turns cannot be used with SESSION_MODE_RESET (a "
                "reset session starts with no turns)",
                field="reset_session",
            )

    def to_proto(self) -> gateway_pb2.SessionOptions | None:
        self.check()
        if not self.session_id:
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

    @classmethod
    def from_proto(cls, msg: gateway_pb2.SessionOptions | None) -> Session:
        """The message's session (None: a one-off request); InvalidRequest for a mode this
        version does not know, or a mode without a session id."""
        if msg is None:
            return cls()
        if msg.mode not in gateway_pb2.SessionMode.values():
            raise InvalidRequest(f"unknown session mode {msg.mode}", field="reset_session")
        if not msg.id and msg.mode:
            raise _without_id("reset_session")
        return cls(
            session_id=msg.id or None,
            reset_session=msg.mode == gateway_pb2.SESSION_MODE_RESET,
            session_ttl_seconds=msg.ttl_seconds,
            session_expected_turns=msg.expected_turns,
        )


def _without_id(field: str) -> InvalidRequest:
    return InvalidRequest("session options given without a session id", field=field)


@dataclass(frozen=True)
class Output:
    """What is generated: at most ``max_new_tokens``, ending at a ``stop`` string, one of
    ``stop_token_ids`` or EOS (unless ``ignore_eos``), not before ``min_tokens``; ``n``
    independent completions; ``structured_output``: a grammar (a ``StructuredOutput`` or
    a dict of one key: ``{"json_schema": <schema dict or JSON text>}``, ``{"regex":
    "..."}``, ``{"choice": ["a", "b"]}``, ``{"grammar": "<Lark grammar>"}`` or
    ``{"json_object": True}``); ``prediction``:
    text or token ids the output is expected to repeat (OpenAI's Predicted Outputs, a
    source of drafts); ``record=False`` refuses the gateway's recording (``--record``).
    ``stop`` (one string or several) and ``stop_token_ids`` are kept as tuples."""

    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    structured_output: dict[str, Any] | gateway_pb2.StructuredOutput | None = None
    prediction: str | Sequence[int] | None = None
    record: bool | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # one string
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.prediction, bytes):
            raise TypeError("prediction must be a str or a sequence of ints")

    @property
    def grammar(self) -> gateway_pb2.StructuredOutput | None:
        """``structured_output`` as its message (InvalidRequest for a malformed dict)."""
        spec = self.structured_output
        return None if spec is None else _structured_output(spec)

    def fill(self, request: gateway_pb2.GenerateRequest) -> None:
        """Write this part's fields into ``request``."""
        request.max_new_tokens = self.max_new_tokens
        request.stop.extend(self.stop)
        request.stop_token_ids.extend(self.stop_token_ids)
        request.ignore_eos, request.min_tokens, request.n = (
            self.ignore_eos,
            self.min_tokens,
            self.n,
        )
        grammar = self.grammar
        if grammar is not None:
            request.structured_output.CopyFrom(grammar)
        if isinstance(self.prediction, str):
            if self.prediction:
                request.prediction.text = self.prediction
        elif self.prediction is not None:
            request.prediction.token_ids.ids.extend(self.prediction)
        if self.record is not None:
            request.record = self.record

    @classmethod
    def from_proto(cls, msg: gateway_pb2.GenerateRequest) -> Output:
        """The part's fields of ``msg`` (its grammar as the message; n 0 reads as 1)."""
        return cls(
            max_new_tokens=msg.max_new_tokens,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens,
            n=msg.n or 1,
            structured_output=(
                _copy(msg.structured_output) if msg.HasField("structured_output") else None
            ),
            prediction=_prediction(msg),
            record=msg.record if msg.HasField("record") else None,
        )


def _copy(msg: gateway_pb2.StructuredOutput) -> gateway_pb2.StructuredOutput:
    out = gateway_pb2.StructuredOutput()
    out.CopyFrom(msg)
    return out


def _prediction(msg: gateway_pb2.GenerateRequest) -> str | tuple[int, ...] | None:
    """GenerateRequest.prediction as text or ids (None: none); InvalidRequest when the
    message is set but holds neither."""
    if not msg.HasField("prediction"):
        return None
    which = msg.prediction.WhichOneof("content")
    if which == "text":
        return msg.prediction.text
    if which == "token_ids":
        return tuple(msg.prediction.token_ids.ids)
    raise InvalidRequest(
        "prediction is set but empty: set prediction.text or prediction.token_ids",
        field="prediction",
    )


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

    @classmethod
    def from_proto(cls, msg: gateway_pb2.GenerateRequest) -> Scoring:
        return cls(
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            prompt_logprobs=msg.prompt_logprobs,
        )


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

    @classmethod
    def from_proto(cls, msg: gateway_pb2.GenerateRequest) -> Request:
        """The request a ``GenerateRequest`` carries: the mirror of :meth:`to_proto`
        (``Request.from_proto(r.to_proto()) == r``). Each part reads its own fields; what
        no Request can hold (an enum value this version does not know, session options
        without a session id, an empty prediction) is InvalidRequest naming its field."""
        which = msg.WhichOneof("input")
        return cls(
            prompt=msg.prompt if which == "prompt" else None,
            token_ids=tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
            sampling=Sampling.from_proto(msg.sampling if msg.HasField("sampling") else None),
            speculation=Speculation.from_proto(
                msg.speculation if msg.HasField("speculation") else None
            ),
            session=Session.from_proto(msg.session if msg.HasField("session") else None),
            output=Output.from_proto(msg),
            scoring=Scoring.from_proto(msg),
        )


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
        raise InvalidRequest(
            "structured_output must be a StructuredOutput or a dict of one key: json_schema, "
            "regex, choice, grammar or json_object",
            field="structured_output",
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
    raise InvalidRequest(f"structured_output: unknown kind {kind!r}", field="structured_output")
