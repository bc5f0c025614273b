"""OpenAI request bodies to GenerateRequest, and gateway events to OpenAI responses.

A thin translation: JSON types and OpenAI's field names are checked here; every range
(max_tokens, temperature, top_p, top_k, k, stop strings, session id, context) is checked
by specdec.gateway.request.validate, the same code the gRPC API runs.

Speculation settings are extension fields of the body, as vLLM accepts extra fields:
`k` (draft length; 0 = no speculation), `ssd` (bool), `k_policy` ("fixed" or "adaptive":
`k` is then an upper bound per round), `session_id`, `session_reset`
(bool: forget the session's history first), `record` (false: the gateway's recording,
--record, skips this request) and `timeout` (seconds for the whole generation; past it
the answer is 504). Responses carry the
speculation statistics, timings, the token ids and, for a session, what happened to it
under the extension key `specdec`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from specdec.common.errors import InvalidRequest
from specdec.gateway.http.errors import ModelNotFound
from specdec.gateway.policy import parse_policy
from specdec.v1 import common_pb2, gateway_pb2

EXTENSION = "specdec"

# OpenAI's default for /v1/completions when max_tokens is absent.
DEFAULT_COMPLETION_TOKENS = 16
# proto3 cannot tell top_p 0 from unset; OpenAI's default is 1.
DEFAULT_TEMPERATURE = 1.0

FINISH_REASON = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_STOP: "stop",
}

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    # extensions
    "k",
    "ssd",
    "k_policy",
    "session_id",
    "session_reset",
    "timeout",
    "record",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
# OpenAI fields that are accepted only with their neutral value (anything else is refused,
# never ignored).
NEUTRAL: dict[str, tuple] = {
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
}


@dataclass
class Options:
    """What the HTTP layer itself acts on (the rest travels in the GenerateRequest)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None
    session_id: str | None = None
    max_tokens_given: bool = False


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = []
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise InvalidRequest(f"{name}={value!r} is not supported")
            continue
        unknown.append(name)
    if unknown:
        raise InvalidRequest(f"unsupported field(s): {', '.join(sorted(unknown))}")


def _number(body: dict, name: str, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise InvalidRequest(f"{name} must be {'an integer' if integer else 'a number'}")
    return value


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false")
    return value


def _set(msg, attr: str, value, name: str) -> None:
    """Set a proto field, refusing values its type cannot hold (naming the body field)."""
    try:
        setattr(msg, attr, value)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"{name}: {value!r} is out of range ({e})") from None


def check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise InvalidRequest("model must be a string")
    if model != served:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {served!r}")
    return model


def _common(body: dict, req: gateway_pb2.GenerateRequest, served: str) -> Options:
    opts = Options(model=check_model(body, served))
    n = _number(body, "n", integer=True)
    if n is not None and n != 1:
        raise InvalidRequest(f"n must be 1, got {n}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _number(body, name, integer=True)
        if value is not None:
            _set(req, "max_new_tokens", value, name)
            opts.max_tokens_given = True
    sampling = common_pb2.SamplingParams()
    temperature = _number(body, "temperature")
    sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if top_p == 0:
            raise InvalidRequest("sampling: top_p must be in (0, 1], got 0")
        sampling.top_p = top_p
    top_k = _number(body, "top_k", integer=True)
    if top_k is not None:
        _set(sampling, "top_k", 0 if top_k == -1 else top_k, "top_k")  # vLLM: -1 = off
    seed = _number(body, "seed", integer=True)
    if seed is not None:
        _set(sampling, "seed", seed, "seed")
    req.sampling.CopyFrom(sampling)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop must be a string or a list of strings")
        req.stop.extend(stop)
    opts.stream = bool(_bool(body, "stream"))
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise InvalidRequest("stream_options may only hold include_usage")
        if not opts.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true")
        opts.include_usage = bool(_bool(stream_options, "include_usage"))
    k = _number(body, "k", integer=True)
    if k is not None:
        _set(req.speculation, "num_draft_tokens", k, "k")
    ssd = _bool(body, "ssd")
    if ssd is not None:
        req.speculation.ssd = ssd
    k_policy = body.get("k_policy")
    if k_policy is not None:
        if not isinstance(k_policy, str):
            raise InvalidRequest('k_policy must be "fixed" or "adaptive"')
        try:
            req.speculation.k_policy = parse_policy(k_policy)
        except ValueError as e:
            raise InvalidRequest(f"k_policy {e}") from None
    session_id = body.get("session_id")
    if session_id is not None:
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequest("session_id must be a non-empty string")
        req.session.id = session_id
        opts.session_id = session_id
    if _bool(body, "session_reset"):  # forget the session's history first (validated as gRPC)
        req.session.mode = gateway_pb2.SESSION_MODE_RESET
    record = _bool(body, "record")  # false: refuse the gateway's recording (--record)
    if record is not None:
        req.record = record
    timeout = _number(body, "timeout")
    if timeout is not None:
        if not timeout > 0:
            raise InvalidRequest(f"timeout must be > 0 seconds, got {timeout}")
        opts.timeout = float(timeout)
    return opts


def completion_request(body: Any, served: str) -> tuple[gateway_pb2.GenerateRequest, Options]:
    """POST /v1/completions body -> (GenerateRequest, Options)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    req = gateway_pb2.GenerateRequest(max_new_tokens=DEFAULT_COMPLETION_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        try:
            req.prompt_token_ids.ids.extend(prompt)
        except ValueError:
            raise InvalidRequest("prompt token ids must fit in int32") from None
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest("one prompt per request: batches of prompts are not supported")
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids")
    return req, _common(body, req, served)


def chat_request(body: Any, served: str) -> tuple[gateway_pb2.GenerateRequest, Options, list[dict]]:
    """POST /v1/chat/completions body -> (GenerateRequest without its prompt, Options,
    messages). The caller renders the messages into `prompt`. Without max_tokens a chat
    may use what is left of the context, up to the gateway's --max-new-tokens: ChatTurn
    sets it once the prompt's length is known (the request carries 1 for validation)."""
    from specdec.gateway.http.chat import messages_from_json

    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both")
    req = gateway_pb2.GenerateRequest(max_new_tokens=1)
    opts = _common(body, req, served)
    return req, opts, messages_from_json(body.get("messages"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def proto_dict(msg) -> dict[str, Any]:
    """A proto message's fields as plain JSON values (defaults included)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        out[f.name] = list(value) if f.is_repeated else value
    return out


def usage(final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """OpenAI's usage object. prompt_tokens counts the whole context the completion was
    conditioned on (a session's history included); cached_tokens is that history."""
    u = final.usage
    prompt = u.prompt_tokens + u.history_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": u.completion_tokens,
        "total_tokens": prompt + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.history_tokens},
    }


@dataclass
class Renderer:
    """Builds one request's OpenAI objects (unary body, stream chunks)."""

    chat: bool
    model: str
    session: dict[str, Any] | None = None  # filled by the route once the turn has run
    trace_id: str = ""  # the request's trace (tracing on)
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def extension(self, final: gateway_pb2.GenerateResponse, token_ids: list[int]) -> dict:
        ext: dict[str, Any] = {
            "token_ids": token_ids,
            "stats": proto_dict(final.stats),
            "timings": proto_dict(final.timings),
        }
        if self.session is not None:
            ext["session"] = self.session
        if self.trace_id:
            ext["trace_id"] = self.trace_id
        return ext

    def body(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        finish = FINISH_REASON.get(final.finish_reason)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": final.text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": finish}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(final),
            EXTENSION: self.extension(final, list(final.token_ids)),
        }

    def _chunk(self, choices: list[dict], **extra) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunks(
        self,
        text: str,
        tokens: Iterable[int],
        final: gateway_pb2.GenerateResponse | None,
        first: bool,
        include_usage: bool,
    ) -> list[dict[str, Any]]:
        """The stream chunks for one event: the delta, then on the last event a chunk
        with the finish reason and the statistics, and the usage chunk if asked."""
        out = []
        tokens = list(tokens)
        usage_field = {"usage": None} if include_usage else {}
        if self.chat and first:
            out.append(
                self._chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage_field,
                )
            )
        if text or tokens:
            delta = {"content": text} if self.chat else None
            choice = (
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                if self.chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            )
            out.append(self._chunk([choice], **usage_field, **{EXTENSION: {"token_ids": tokens}}))
        if final is not None:
            finish = FINISH_REASON.get(final.finish_reason)
            choice = (
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
                if self.chat
                else {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
            )
            out.append(
                self._chunk([choice], **usage_field, **{EXTENSION: self.extension(final, [])})
            )
            if include_usage:
                out.append(self._chunk([], usage=usage(final)))
        return out
