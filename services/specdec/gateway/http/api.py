"""OpenAI request bodies to GenerateRequest, and gateway events to OpenAI responses.

A thin translation: JSON types and OpenAI's field names are checked here; every range
(max_tokens, temperature, top_p, top_k, k, stop strings, session id, context) is checked
by specdec.gateway.request.validate, the same code the gRPC API runs.

Speculation settings are extension fields of the body, as vLLM accepts extra fields:
`k` (draft length; 0 = no speculation), `ssd` (bool), `k_policy` ("fixed" or "adaptive":
`k` is then an upper bound per round), `method` ("model", "ngram", "suffix" or
"hybrid": where drafts come from), `tree_width` (candidate continuations a round may
verify as one token tree), `session_id`, `session_reset`
(bool: forget the session's history first), `record` (false: the gateway's recording,
--record, skips this request) and `timeout` (seconds for the whole generation; past it
the answer is 504). Structured output: OpenAI's `response_format` (`json_object`,
`json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice` become
GenerateRequest.structured_output. Responses carry the
speculation statistics, timings, the token ids and, for a session, what happened to it
under the extension key `specdec`.

OpenAI's `prediction` ({"type": "content", "content": text or a list of text parts}) is
a source of drafts (GenerateRequest.prediction); usage reports
`completion_tokens_details.accepted_prediction_tokens` and `rejected_prediction_tokens`.
`user` names the tenant of the suffix cache under --suffix-cache-scope tenant.

Fields the gateway does not know are ignored and logged at debug level, as vLLM and SGLang
ignore them (benchmark tools and SDKs send extras); under --strict-fields they are refused.
OpenAI fields the gateway cannot honour (`tools`, `best_of > 1`, ...) are refused unless
they carry their neutral value. A bad value raises FieldError naming its body field
(`param` of the error body).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from specdec.common.errors import InvalidRequest
from specdec.gateway.http.errors import FieldError, ModelNotFound
from specdec.gateway.http.logprobs import LogprobsRenderer
from specdec.gateway.lookup import parse_method
from specdec.gateway.policy import parse_policy
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

EXTENSION = "specdec"

# OpenAI's default for /v1/completions when max_tokens is absent.
DEFAULT_COMPLETION_TOKENS = 16

FINISH_REASON = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_STOP: "stop",
}

COMMON_FIELDS = {
    "model",
    "max_tokens",
    # temperature, top_p, top_k, seed, the penalties, logit_bias: specdec.sdk.request.Sampling
    *(f.name for f in dataclasses.fields(Sampling)),
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    # vLLM's extensions
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    # specdec's extensions
    "prediction",
    # extensions
    "k",
    "method",
    "tree_width",
    "ssd",
    "k_policy",
    "session_id",
    "session_reset",
    "timeout",
    # structured output (vLLM's names for the extensions)
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "record",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# OpenAI fields that are accepted only with their neutral value (anything else is refused,
# never ignored).
NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "store": (None, False),
    "metadata": (None, {}),
}


@dataclass
class Options:
    """What the HTTP layer itself acts on (the rest travels in the GenerateRequest)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    # carries the usage so far.
    continuous_usage: bool = False
    timeout: float | None = None
    session_id: str | None = None
    max_tokens_given: bool = False
    echo: bool = False  # completions: the prompt's text (and scores) before the completion
    user: str = ""  # OpenAI's end-user id: the suffix cache's tenant
    # The body field a request that cannot fit is about (errors.ErrorContext.prompt), and
    # the gRPC names of the shared validation's messages -> this body's fields.
    prompt_field: str = "prompt"
    fields: dict[str, str] = field(default_factory=dict)


# The gRPC names the shared validation's messages start with (errors.leading_field) -> the
# body field each comes from; `_fields` adjusts them to one request.
VALIDATION_FIELDS = {
    "prompt": "prompt",
    "prompt_token_ids": "prompt",
    "max_new_tokens": "max_tokens",
    **{f.name: f.name for f in dataclasses.fields(Sampling)},  # body names = Sampling's
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "stop strings": "stop",
    "session id": "session_id",
    "session options": "session_reset",
    "num_draft_tokens": "k",
    "top_logprobs": "top_logprobs",
    "prompt_logprobs": "echo",
    "n": "n",
    "prediction": "prediction",
    "structured_output": "response_format",
}
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _fields(body: dict, chat: bool) -> dict[str, str]:
    fields = dict(VALIDATION_FIELDS)
    if chat:
        fields["prompt"] = fields["prompt_token_ids"] = "messages"
        if body.get("max_completion_tokens") is not None:
            fields["max_new_tokens"] = "max_completion_tokens"
        elif body.get("max_tokens") is None:
            fields["max_new_tokens"] = "min_tokens"  # the request's only length field
    else:
        fields["top_logprobs"] = "logprobs"
    structured = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    if structured:
        fields["structured_output"] = structured[0]
    return fields


def _unknown(names: list[str], strict: bool, where: str = "") -> None:
    """Fields the gateway does not know: refused (400 naming the first) under
    --strict-fields, else ignored (as vLLM and SGLang ignore them) and logged."""
    if not names:
        return
    names = sorted(where + name for name in names)
    if strict:
        raise FieldError(names[0], f"unsupported field(s): {', '.join(names)}")
    log.debug("unknown request fields ignored", extra={"fields": names})


def _check_fields(body: dict, allowed: set[str], strict: bool) -> None:
    unknown = []
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise FieldError(name, f"{name}={value!r} is not supported")
            continue
        unknown.append(name)
    _unknown(unknown, strict)


def _number(body: dict, name: str, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise FieldError(name, f"{name} must be {'an integer' if integer else 'a number'}")
    return value


def _bool(body: dict, name: str, where: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(where + name, f"{where}{name} must be true or false")
    return value


def _set(msg, attr: str, value, name: str) -> None:
    """Set a proto field, refusing values its type cannot hold (naming the body field)."""
    try:
        setattr(msg, attr, value)
    except (ValueError, TypeError) as e:
        raise FieldError(name, f"{name}: {value!r} is out of range ({e})") from None


def _choice(body: dict, name: str, parse, choices: str) -> int | None:
    """An enum given by name (`parse` raises ValueError naming the choices), or None."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise FieldError(name, f"{name} must be {choices}")
    try:
        return parse(value)
    except ValueError as e:
        raise FieldError(name, f"{name} {e}") from None


def check_model(body: dict, served: str, aliases: Collection[str] = ()) -> str:
    """The served name, when the body's `model` is it or one of its aliases (or absent)."""
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise FieldError("model", "model must be a string")
    if model != served and model not in aliases:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {served!r}")
    return served


def _common(
    body: dict,
    req: gateway_pb2.GenerateRequest,
    served: str,
    aliases: Collection[str],
    strict: bool,
) -> Options:
    opts = Options(model=check_model(body, served, aliases))
    n = _number(body, "n", integer=True)
    if n is not None:
        if n < 1:
            raise FieldError("n", f"n must be at least 1, got {n}")
        _set(req, "n", n, "n")  # the upper bound is validated as gRPC's
    for name in ("max_tokens", "max_completion_tokens"):
        value = _number(body, name, integer=True)
        if value is not None:
            _set(req, "max_new_tokens", value, name)
            opts.max_tokens_given = True
    sampling = _sampling(body)
    _controls(body, req)
    req.sampling.CopyFrom(sampling)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise FieldError("stop", "stop must be a string or a list of strings")
        req.stop.extend(stop)
    opts.stream = bool(_bool(body, "stream"))
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise FieldError("stream_options", "stream_options must be an object")
        known = {"include_usage", "continuous_usage_stats"}
        _unknown([k for k in stream_options if k not in known], strict, "stream_options.")
        if not opts.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        opts.include_usage = bool(_bool(stream_options, "include_usage", "stream_options."))
        continuous = bool(_bool(stream_options, "continuous_usage_stats", "stream_options."))
        opts.continuous_usage = opts.include_usage and continuous  # as vLLM
    k = _number(body, "k", integer=True)
    if k is not None:
        _set(req.speculation, "num_draft_tokens", k, "k")
    ssd = _bool(body, "ssd")
    if ssd is not None:
        req.speculation.ssd = ssd
    k_policy = _choice(body, "k_policy", parse_policy, '"fixed" or "adaptive"')
    if k_policy is not None:
        req.speculation.k_policy = k_policy
    method = _choice(body, "method", parse_method, '"model", "ngram", "suffix" or "hybrid"')
    if method is not None:
        req.speculation.method = method
    tree_width = _number(body, "tree_width", integer=True)
    if tree_width is not None:
        _set(req.speculation, "tree_width", tree_width, "tree_width")
    _prediction(body.get("prediction"), req)
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise FieldError("user", "user must be a string")
        opts.user = user
    session_id = body.get("session_id")
    if session_id is not None:
        if not isinstance(session_id, str) or not session_id:
            raise FieldError("session_id", "session_id must be a non-empty string")
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
            raise FieldError("timeout", f"timeout must be > 0 seconds, got {timeout}")
        opts.timeout = float(timeout)
    _structured(body, req)
    return opts


# Body values a Sampling field reads differently (vLLM's spellings, proto3's unset zeros).
_SAMPLING_VALUES = {
    "top_k": lambda v: 0 if v == -1 else v,  # vLLM: -1 = off
}
# Values the wire would read as unset: refused here, naming the field.
_SAMPLING_REFUSED = {
    "top_p": (lambda v: v == 0, "sampling: top_p must be in (0, 1], got 0"),
    "repetition_penalty": (lambda v: not v > 0, "repetition_penalty must be > 0, got {}"),
}


def _sampling(body: dict) -> common_pb2.SamplingParams:
    """The body's sampling fields, one per field of specdec.sdk.request.Sampling by the
    same name (their ranges: request.validate); unset ones take the model's
    generation_config (SamplingParams.model_defaults)."""
    sampling = common_pb2.SamplingParams(model_defaults=True)
    for f in dataclasses.fields(Sampling):
        if f.name == "logit_bias":
            _logit_bias(body, sampling)
            continue
        value = _number(body, f.name, integer=str(f.type).startswith("int"))
        if value is None:
            continue
        refused = _SAMPLING_REFUSED.get(f.name)
        if refused is not None and refused[0](value):
            raise FieldError(f.name, refused[1].format(value))
        _set(sampling, f.name, _SAMPLING_VALUES.get(f.name, lambda v: v)(value), f.name)
    return sampling


def _logit_bias(body: dict, sampling: common_pb2.SamplingParams) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise FieldError("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise FieldError(
                "logit_bias", f"logit_bias: key {key!r} is not a token id (an integer)"
            ) from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FieldError("logit_bias", f"logit_bias: the bias of token {key} must be a number")
        try:
            sampling.logit_bias[token] = value
        except (ValueError, TypeError) as e:
            raise FieldError(
                "logit_bias", f"logit_bias: token id {key} is out of range ({e})"
            ) from None


def _controls(body: dict, req: gateway_pb2.GenerateRequest) -> None:
    """The length and stop fields (their ranges: request.validate)."""
    ignore_eos = _bool(body, "ignore_eos")
    if ignore_eos is not None:
        req.ignore_eos = ignore_eos
    min_tokens = _number(body, "min_tokens", integer=True)
    if min_tokens is not None:
        _set(req, "min_tokens", min_tokens, "min_tokens")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise FieldError(
                "stop_token_ids", "stop_token_ids must be a list of token ids (integers)"
            )
        try:
            req.stop_token_ids.extend(stop_ids)
        except ValueError:
            raise FieldError("stop_token_ids", "stop_token_ids must fit in int64") from None


def _structured(body: dict, req: gateway_pb2.GenerateRequest) -> None:
    """response_format / guided_json / guided_regex / guided_choice -> structured_output
    (at most one of them; the grammar itself is checked by the gateway)."""
    given = [n for n in ("guided_json", "guided_regex", "guided_choice") if body.get(n) is not None]
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise FieldError("response_format", 'response_format must be an object with a "type"')
        if fmt["type"] != "text":
            given.append("response_format")
    if len(given) > 1:
        raise FieldError(given[0], f"give one of {', '.join(given)}, not several")
    if not given:
        return
    out = req.structured_output
    name = given[0]
    value = body[name]
    if name == "response_format":
        kind = value["type"]
        if kind == "json_object":
            out.json_object.SetInParent()
            return
        if kind != "json_schema":
            raise FieldError(
                "response_format",
                f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
            )
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise FieldError(
                "response_format",
                'response_format json_schema must be an object holding the "schema" object',
            )
        out.json_schema = json.dumps(spec.get("schema", {}))
    elif name == "guided_json":
        if isinstance(value, str):
            out.json_schema = value
        elif isinstance(value, dict):
            out.json_schema = json.dumps(value)
        else:
            raise FieldError(
                "guided_json", "guided_json must be a JSON schema (an object or its text)"
            )
    elif name == "guided_regex":
        if not isinstance(value, str):
            raise FieldError("guided_regex", "guided_regex must be a string")
        out.regex = value
    else:
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise FieldError("guided_choice", "guided_choice must be a list of strings")
        out.choice.choices.extend(value)
        out.choice.SetInParent()


def _prediction(prediction: Any, req: gateway_pb2.GenerateRequest) -> None:
    """OpenAI's `prediction` -> GenerateRequest.prediction (content as text, or as a list
    of text parts joined)."""
    if prediction is None:
        return
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise FieldError("prediction", 'prediction must be {"type": "content", "content": ...}')
    if set(prediction) - {"type", "content"}:
        raise FieldError("prediction", "prediction may only hold type and content")
    content = prediction.get("content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise FieldError(
                    "prediction", f"prediction.content[{i}]: only text parts are supported"
                )
            if not isinstance(part.get("text"), str):
                raise FieldError("prediction", f"prediction.content[{i}].text must be a string")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise FieldError(
            "prediction", "prediction.content must be a string or a list of text parts"
        )
    if content:
        req.prediction.text = content


def completion_request(
    body: Any, served: str, aliases: Collection[str] = (), strict: bool = False
) -> tuple[gateway_pb2.GenerateRequest, Options]:
    """POST /v1/completions body -> (GenerateRequest, Options). `aliases`: other names
    `model` may give; `strict`: unknown fields are refused (--strict-fields)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS, strict)
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
            raise FieldError("prompt", "prompt token ids must fit in int32") from None
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise FieldError("prompt", "one prompt per request: batches of prompts are not supported")
    else:
        raise FieldError("prompt", "prompt must be a string or a list of token ids")
    opts = _common(body, req, served, aliases, strict)
    opts.fields = _fields(body, chat=False)
    logprobs = _number(body, "logprobs", integer=True)  # alternatives per token (legacy)
    if logprobs is not None:
        if logprobs < 0:
            raise FieldError("logprobs", f"logprobs must be >= 0, got {logprobs}")
        req.logprobs = True
        _set(req, "top_logprobs", logprobs, "logprobs")
    opts.echo = bool(_bool(body, "echo"))
    req.prompt_logprobs = opts.echo and logprobs is not None
    return req, opts


def chat_request(
    body: Any, served: str, aliases: Collection[str] = (), strict: bool = False
) -> tuple[gateway_pb2.GenerateRequest, Options, list[dict]]:
    """POST /v1/chat/completions body -> (GenerateRequest without its prompt, Options,
    messages). The caller renders the messages into `prompt`. Without max_tokens a chat
    may use what is left of the context, up to the gateway's --max-new-tokens: ChatTurn
    sets it once the prompt's length is known (the request carries 1 for validation)."""
    from specdec.gateway.http.chat import messages_from_json

    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS, strict)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise FieldError(
            "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        )
    req = gateway_pb2.GenerateRequest(max_new_tokens=1)
    opts = _common(body, req, served, aliases, strict)
    opts.prompt_field, opts.fields = "messages", _fields(body, chat=True)
    if not opts.max_tokens_given:  # ChatTurn sets it from the context; min_tokens must fit
        req.max_new_tokens = max(1, req.min_tokens)
    req.logprobs = bool(_bool(body, "logprobs"))
    top = _number(body, "top_logprobs", integer=True)
    if top is not None:
        if not req.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if top < 0:
            raise FieldError("top_logprobs", f"top_logprobs must be >= 0, got {top}")
        _set(req, "top_logprobs", top, "top_logprobs")
    return req, opts, messages_from_json(body.get("messages"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def proto_dict(msg) -> dict[str, Any]:
    """A proto message's fields as plain JSON values (defaults included)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            out[f.name] = [proto_dict(v) for v in value] if f.is_repeated else proto_dict(value)
        else:
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
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    }


@dataclass
class Renderer:
    """Builds one request's OpenAI objects (unary body, stream chunks)."""

    chat: bool
    model: str
    session: dict[str, Any] | None = None  # filled by the route once the turn has run
    trace_id: str = ""  # the request's trace (tracing on)
    completion_tokens: int = 0  # tokens rendered so far (continuous usage)
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    scores: LogprobsRenderer | None = None  # the served tokenizer, for logprobs
    echo: str | None = None  # completions with echo: the prompt's text
    prompt_scores: bool = False  # echo with logprobs: the prompt's rows first
    _started: set[int] = field(default_factory=set)  # choices whose stream has begun
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: text offset
    _prompt: Any = None  # echo in a stream: the prompt's scores (choice 0's first event)

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

    def _logprobs(self, table, prompt=None, offset: int = 0) -> tuple[dict[str, Any] | None, int]:
        """A choice's (or a delta's) OpenAI logprobs, None when not asked; the text offset
        after it (completions)."""
        if self.scores is None or table is None:
            return None, offset
        if self.chat:
            return self.scores.chat(table), offset
        return self.scores.completion([t for t in (prompt, table) if t is not None], offset)

    def _choice(self, index: int, text: str, finish: int, table, prompt) -> dict[str, Any]:
        logprobs, _ = self._logprobs(table, prompt)
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": FINISH_REASON.get(finish),
            }
        text = text if self.echo is None else self.echo + text
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": FINISH_REASON.get(finish),
        }

    def body(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        prompt = final.prompt_logprobs if self.prompt_scores else None
        choices = [
            self._choice(c.index, c.text, c.finish_reason, c.logprobs, prompt)
            for c in final.choices
        ] or [self._choice(0, final.text, final.finish_reason, final.logprobs, prompt)]
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
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
        self, event, include_usage: bool, continuous_usage: bool = False
    ) -> list[dict[str, Any]]:
        """The stream chunks for one event (specdec.gateway.response.Event): the delta of its
        choice, then at a choice's end a chunk with its finish reason and, on the last
        event, the statistics and the usage chunk if asked. continuous_usage: every chunk
        carries the usage so far (prompt_tokens: the event's context_tokens, a session's
        history included), as vLLM's continuous_usage_stats."""
        out = []
        index, tokens, final = event.index, list(event.tokens), event.final
        self.completion_tokens += len(tokens)
        usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
        if continuous_usage:
            usage_field["usage"] = {
                "prompt_tokens": event.context_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": event.context_tokens + self.completion_tokens,
            }
        if self.chat and index not in self._started:
            self._started.add(index)
            out.append(
                self._chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage_field,
                )
            )
        if event.prompt_logprobs is not None:
            self._prompt = event.prompt_logprobs
        if self.echo is not None and index not in self._started:  # echo: the prompt first
            self._started.add(index)
            table = self._prompt if self.prompt_scores else None
            logprobs, self._offsets[index] = self._logprobs(table, None, 0)
            choice = {"index": index, "text": self.echo, "logprobs": logprobs}
            out.append(self._chunk([{**choice, "finish_reason": None}], **usage_field))
        if event.text or tokens:
            logprobs, self._offsets[index] = self._logprobs(
                event.logprobs, None, self._offsets.get(index, 0)
            )
            choice = (
                {
                    "index": index,
                    "delta": {"content": event.text},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                if self.chat
                else {
                    "index": index,
                    "text": event.text,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
            out.append(self._chunk([choice], **usage_field, **{EXTENSION: {"token_ids": tokens}}))
        ended = event.choice if event.choice is not None else final
        if ended is not None:
            finish = FINISH_REASON.get(ended.finish_reason)
            choice = (
                {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
                if self.chat
                else {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
            )
            ext = {EXTENSION: self.extension(final, [])} if final is not None else {}
            out.append(self._chunk([choice], **usage_field, **ext))
        if final is not None and include_usage:
            out.append(self._chunk([], usage=usage(final)))
        return out
