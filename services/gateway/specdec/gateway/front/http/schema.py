"""The OpenAI-compatible request bodies, declared once (pydantic).

Each body field is declared here with its JSON type, the range its protobuf field can
hold (read from the descriptor) and the sentence that refuses a bad value; `parse` turns a
body into the model, and a refusal into a FieldError naming the field (`param`) the way
OpenAI's clients read it: "max_tokens must be an integer", "stream_options.include_usage
must be true or false", "messages[0].role must be one of ...". The ranges that depend on
the served model (max_tokens against the context, k against the drafters, ...) are not
here: the gateway checks them for gRPC and HTTP alike (specdec.gateway.job.Job.resolve).

specdec.gateway.front.http.api turns the parsed body into the SDK's typed Request
(specdec.sdk.request), which Gateway.run takes as it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Annotated, Any

from google.protobuf.descriptor import FieldDescriptor
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    create_model,
)
from pydantic_core import PydanticCustomError

from specdec.common.errors import InvalidRequest
from specdec.gateway.front.http.errors import FieldError
from specdec.sdk.request import K_POLICIES, METHODS, Sampling
from specdec.v1 import common_pb2, gateway_pb2
from specdec.v1.gateway_pb2 import GenerateRequest, SpeculationParams

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


def refuse(tail: str, at: str = "") -> PydanticCustomError:
    """A refusal of the value being validated: the message is the field's path, `at`
    (a deeper path: "[0].text") and `tail` (" must be ...", ": ... is out of range")."""
    return PydanticCustomError("refused", "{tail}", {"tail": tail, "at": at})


_RANGE = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
}


def proto_range(message: Any, field: str) -> tuple[int, int]:
    """The integers a protobuf field holds (a map field: its key's)."""
    f = message.DESCRIPTOR.fields_by_name[field]
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        f = f.message_type.fields_by_name["key"]
    return _RANGE[f.type]


def Range(message: Any, field: str, at_least: int | None = None) -> Any:
    """The range of the protobuf field `field` of `message`, from at least `at_least` (a
    floor of the API, which FLOORS words): a field's metadata, `Annotated[int, Strict(),
    Range(...)]` (an integer, never a bool)."""
    lo, hi = proto_range(message, field)
    return Field(ge=lo if at_least is None else at_least, le=hi)


def Int(message: Any, field: str, at_least: int | None = None) -> Any:
    """An integer (never a bool) in `Range(message, field, at_least)`, as a type built at
    run time (a field's annotation writes the Annotated form)."""
    return Annotated[int, Strict(), Range(message, field, at_least)]


Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
# An int or a float, never a bool (strict: JSON's true is no number).
Number = Annotated[float, Strict()]

# How a value of the wrong JSON type is refused (pydantic's error type -> the words after
# the field's path), and the fields that say more.
TYPE_WORDS = {
    "int_type": " must be an integer",
    "bool_type": " must be true or false",
    "float_type": " must be a number",
    "string_type": " must be a string",
}
FIELD_WORDS = {
    "k_policy": ' must be "fixed" or "adaptive"',
    "method": ' must be "model", "ngram", "suffix" or "hybrid"',
    "session_id": " must be a non-empty string",
}
# The API's own floors of integer fields (below them: "n must be at least 1, got 0").
FLOORS = {"n": "at least 1", "logprobs": ">= 0", "top_logprobs": ">= 0"}


def _positive(value: float) -> float:
    if not value > 0:
        raise refuse(f" must be > 0 seconds, got {value}")
    return value


def _turns(value: int) -> int:
    if not 0 <= value < 2**32:
        raise refuse(f" must be in 0..{2**32 - 1}, got {value}")
    return value


def _non_empty(value: str) -> str:
    if not value:
        raise refuse(" must be a non-empty string")
    return value


def _choice(names: Mapping[str, int]) -> AfterValidator:
    """One of `names` (case and spaces as the gateway's flags take them): a field's
    metadata, `Annotated[str, Strict(), _choice(names)]`."""

    def check(value: str) -> str:
        name = value.strip().lower()
        if name not in names:
            raise refuse(f" must be one of {', '.join(names)}, got {value!r}")
        return name

    return AfterValidator(check)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise refuse(" must be a string or a list of strings")
    return value


_STOP_ID_LOW, _STOP_ID_HIGH = proto_range(gateway_pb2.GenerateRequest, "stop_token_ids")


def _stop_token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise refuse(" must be a list of token ids (integers)")
    if not all(_STOP_ID_LOW <= t <= _STOP_ID_HIGH for t in value):
        raise refuse(" must fit in int64")
    return value


_BIAS_LOW, _BIAS_HIGH = proto_range(common_pb2.SamplingParams, "logit_bias")


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise refuse(" must be an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise refuse(f": key {key!r} is not a token id (an integer)") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise refuse(f": the bias of token {key} must be a number")
        if not _BIAS_LOW <= token <= _BIAS_HIGH:
            raise refuse(f": token id {key} is out of range")
        out[token] = bias
    return out


def _prediction(value: Any) -> str:
    """OpenAI's `prediction`: its content as text (a list of text parts joined)."""
    if not isinstance(value, dict) or value.get("type") != "content":
        raise refuse(' must be {"type": "content", "content": ...}')
    if set(value) - {"type", "content"}:
        raise refuse(" may only hold type and content")
    content = value.get("content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise refuse(f".content[{i}]: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise refuse(f".content[{i}].text must be a string")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise refuse(".content must be a string or a list of text parts")
    return content


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as a structured_output spec (None: plain text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise refuse(' must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise refuse(f' type must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise refuse(' json_schema must be an object holding the "schema" object')
    return {"json_schema": spec.get("schema", {})}


def _guided_json(value: Any) -> dict[str, Any]:
    if not isinstance(value, str | dict):
        raise refuse(" must be a JSON schema (an object or its text)")
    return {"json_schema": value}


def _guided_choice(value: Any) -> dict[str, Any]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise refuse(" must be a list of strings")
    return {"choice": value}


def _neutral(*allowed: Any) -> AfterValidator:
    """An OpenAI field the gateway cannot honour: accepted with a neutral value only (a
    field's metadata, `Annotated[Any, _neutral(...)]`)."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise refuse(f"={value!r} is not supported")
        return value

    return AfterValidator(check)


def _object(value: Any) -> Any:
    if not isinstance(value, dict):
        raise refuse(" must be an object")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: Bool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: Bool | None = None


def _not_zero(value: float) -> float:
    if value == 0:  # the wire would read 0 as unset
        raise refuse(f" must be in (0, 1], got {value}")
    return value


def _above_zero(value: float) -> float:
    if not value > 0:  # the wire would read 0 as unset
        raise refuse(f" must be > 0, got {value}")
    return value


# The body's types of Sampling's fields that are not plain numbers, or that the wire
# cannot hold as given.
_SAMPLING_TYPES: dict[str, Any] = {
    "top_p": Annotated[float, Strict(), AfterValidator(_not_zero)],
    "repetition_penalty": Annotated[float, Strict(), AfterValidator(_above_zero)],
    "logit_bias": Annotated[dict[int, float], BeforeValidator(_logit_bias)],
}


def _sampling_type(f: dataclasses.Field[Any]) -> Any:
    if f.name in _SAMPLING_TYPES:
        return _SAMPLING_TYPES[f.name]
    if str(f.type).startswith("int"):
        return Int(common_pb2.SamplingParams, f.name)
    return Number


# The sampling fields: one per field of specdec.sdk.request.Sampling, by the same name (a
# new sampling option is a body field without a change here).
_SAMPLING_FIELDS: dict[str, Any] = {
    f.name: (_sampling_type(f) | None, None) for f in dataclasses.fields(Sampling)
}
SamplingFields: type[BaseModel] = create_model(
    "SamplingFields", __config__=ConfigDict(extra="allow"), **_SAMPLING_FIELDS
)


class Body(SamplingFields):  # type: ignore[misc,valid-type]
    """The fields /v1/completions and /v1/chat/completions share (and SamplingFields).
    Unknown fields are kept (`model_extra`) for the caller to ignore or refuse
    (--strict-fields)."""

    model: Str | None = None
    max_tokens: Annotated[int, Strict(), Range(GenerateRequest, "max_new_tokens")] | None = None
    n: Annotated[int, Strict(), Range(GenerateRequest, "n", at_least=1)] | None = None
    stop: Annotated[list[str], BeforeValidator(_stop)] | None = None
    stream: Bool | None = None
    stream_options: Annotated[StreamOptions, BeforeValidator(_object)] | None = None
    user: Str | None = None
    # vLLM's extensions
    ignore_eos: Bool | None = None
    min_tokens: Annotated[int, Strict(), Range(GenerateRequest, "min_tokens")] | None = None
    stop_token_ids: Annotated[list[int], BeforeValidator(_stop_token_ids)] | None = None
    # specdec's extensions
    prediction: Annotated[str, BeforeValidator(_prediction)] | None = None
    k: Annotated[int, Strict(), Range(SpeculationParams, "num_draft_tokens")] | None = None
    method: Annotated[str, Strict(), _choice(METHODS)] | None = None
    tree_width: Annotated[int, Strict(), Range(SpeculationParams, "tree_width")] | None = None
    ssd: Bool | None = None
    k_policy: Annotated[str, Strict(), _choice(K_POLICIES)] | None = None
    session_id: Annotated[str, Strict(), AfterValidator(_non_empty)] | None = None
    session_reset: Bool | None = None
    session_expected_turns: Annotated[int, Strict(), AfterValidator(_turns)] | None = None
    timeout: Annotated[float, Strict(), AfterValidator(_positive)] | None = None
    record: Bool | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* (one of them)
    response_format: Annotated[dict[str, Any] | None, BeforeValidator(_response_format)] | None = (
        None
    )
    guided_json: Annotated[dict[str, Any], BeforeValidator(_guided_json)] | None = None
    guided_regex: Str | None = None
    guided_grammar: Str | None = None  # llguidance's Lark dialect
    guided_choice: Annotated[dict[str, Any], BeforeValidator(_guided_choice)] | None = None
    # OpenAI's fields that the gateway cannot honour, accepted with their neutral value
    best_of: Annotated[Any, _neutral(None, 1)] = None
    suffix: Annotated[Any, _neutral(None, "")] = None
    functions: Annotated[Any, _neutral(None, [])] = None
    function_call: Annotated[Any, _neutral(None, "none")] = None
    store: Annotated[Any, _neutral(None, False)] = None
    metadata: Annotated[Any, _neutral(None, {})] = None


_TOKEN_LOW, _TOKEN_HIGH = proto_range(gateway_pb2.TokenIds, "ids")


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        if not all(_TOKEN_LOW <= t <= _TOKEN_HIGH for t in value):
            raise refuse(" token ids must fit in int64")
        return value
    if isinstance(value, list) and len(value) > 1:
        raise refuse(": one request, one prompt (batches of prompts are not supported)")
    raise refuse(" must be a string or a list of token ids")


class CompletionBody(Body):
    """POST /v1/completions."""

    prompt: Annotated[str | list[int], BeforeValidator(_prompt)] | None = None
    # alternatives per token (the legacy API's logprobs)
    logprobs: Annotated[int, Strict(), Range(GenerateRequest, "top_logprobs")] | None = None
    echo: Bool | None = None


def _content(value: Any) -> str | None:
    """A message's content: a string, or text parts joined (as vLLM does for
    string-content templates)."""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise refuse(": only text parts are supported", at=f"[{j}]")
            if not isinstance(part.get("text"), str):
                raise refuse(" must be a string", at=f"[{j}].text")
            texts.append(part["text"])
        return "\n".join(texts)
    if value is not None and not isinstance(value, str):
        raise refuse(" must be a string or a list of parts")
    return value


def _json_object(value: Any, at: str) -> dict[str, Any]:
    """A function's arguments: a JSON object or its text (OpenAI sends text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise refuse(" must be a JSON object (or its text)", at=at) from None
    if not isinstance(value, dict):
        raise refuse(" must be a JSON object (or its text)", at=at)
    return value


def _function(item: Any, at: str, default_type: str | None) -> tuple[dict[str, Any], str]:
    """A tool's or a tool call's `function` object and its name; `type` must be
    "function" (`default_type`: its value when absent)."""
    if not isinstance(item, dict) or item.get("type", default_type) != "function":
        raise refuse(' must be {"type": "function", "function": {...}}', at=at)
    function = item.get("function")
    if not isinstance(function, dict):
        raise refuse(" must be an object", at=f"{at}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise refuse(" must be a non-empty string", at=f"{at}.function.name")
    return function, name


def _tool_calls(value: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as chat templates read them: each
    {"id", "type": "function", "function": {"name", "arguments"}} with its arguments as an
    object (OpenAI sends their JSON text; Qwen2.5's template, like vLLM and transformers,
    reads an object)."""
    if not isinstance(value, list):
        raise refuse(" must be a list of tool calls")
    out = []
    for j, call in enumerate(value):
        function, name = _function(call, f"[{j}]", "function")
        arguments = _json_object(function.get("arguments", {}), f"[{j}].function.arguments")
        if "id" in call and not isinstance(call["id"], str):
            raise refuse(" must be a string", at=f"[{j}].id")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if "id" in call:
            entry["id"] = call["id"]
        out.append(entry)
    return out


class Message(BaseModel):
    """One chat message, as a chat template reads it."""

    role: str  # one of ROLES (_message)
    content: Annotated[str | None, BeforeValidator(_content)] = None
    name: Str | None = None
    tool_call_id: Str | None = None
    reasoning_content: Str | None = None
    tool_calls: Annotated[list[dict[str, Any]], BeforeValidator(_tool_calls)] | None = None
    function_call: Any = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the dict a chat template expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("name", "tool_call_id", "reasoning_content", "tool_calls"):
            if key in self.model_fields_set:
                out[key] = getattr(self, key)
        return out


def _message(value: Any) -> Any:
    _object(value)
    role = value.get("role")
    if role not in ROLES:
        raise refuse(f" must be one of {', '.join(ROLES)}", at=".role")
    if value.get("function_call"):
        raise refuse(
            ": the legacy function_call is not supported; send tool_calls", at=".function_call"
        )
    if value.get("tool_calls") is not None and role != "assistant":
        raise refuse(" are an assistant message's only", at=".tool_calls")
    if value.get("content") is None and role != "assistant":
        raise refuse(" is required", at=".content")
    return value


def _messages(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise refuse(" must be a non-empty list")
    return value


# A chat's messages: required (absent or null is refused like an empty list).
MessageList = Annotated[
    list[Annotated[Message, BeforeValidator(_message)]], BeforeValidator(_messages)
]


class Messages(BaseModel):
    """A chat's messages alone (specdec.gateway.front.http.chat.messages_from_json)."""

    messages: MessageList = Field(None, validate_default=True)


def _tools(value: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools`: function tools, each with a unique non-empty name and, if given, a
    JSON schema object as its parameters (specdec.gateway.front.http.tools)."""
    if not isinstance(value, list):
        raise refuse(" must be a list of tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        function, name = _function(tool, f"[{i}]", None)
        if name in names:
            raise refuse(f": the name {name!r} is given twice", at=f"[{i}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise refuse(" must be a JSON schema (an object)", at=f"[{i}].function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise refuse(" must be a string", at=f"[{i}].function.description")
    return value


TOOL_CHOICES = ("none", "auto", "required")


def _tool_choice(value: Any) -> str | dict[str, Any]:
    """ "none", "auto", "required" or {"type": "function", "function": {"name": ...}}."""
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        return value
    raise refuse(
        ' must be "none", "auto", "required" or {"type": "function", "function": '
        f'{{"name": ...}}}}, got {value!r}'
    )


class ChatBody(Body):
    """POST /v1/chat/completions."""

    messages: MessageList = Field(None, validate_default=True)
    tools: Annotated[list[dict[str, Any]], BeforeValidator(_tools)] | None = None
    tool_choice: Annotated[str | dict[str, Any], BeforeValidator(_tool_choice)] | None = None
    parallel_tool_calls: Bool | None = None
    max_completion_tokens: (
        Annotated[int, Strict(), Range(GenerateRequest, "max_new_tokens")] | None
    ) = None
    logprobs: Bool | None = None
    top_logprobs: Annotated[int, Strict(), Range(GenerateRequest, "top_logprobs")] | None = None


# Each body's field names (unknown ones are the caller's to ignore or refuse).
FIELDS: dict[type[BaseModel], frozenset[str]] = {
    model: frozenset(model.model_fields) for model in (CompletionBody, ChatBody)
}


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(model: type[BaseModel], body: Any, strict: bool | None = None) -> Any:
    """The body as `model`, or FieldError naming the first bad field (its path in the
    body: "stream_options.include_usage", "messages[0].role"). With `strict` set (a
    request body: --strict-fields), fields the gateway does not know are refused (400
    naming the first) when it is true, else ignored (as vLLM and SGLang ignore them) and
    logged; they are looked at before anything else."""
    if strict is not None:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        known = FIELDS[model]
        _unknown([name for name in body if name not in known], strict)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        ctx = first.get("ctx") or {}
        path = _path(first["loc"]) + ctx.get("at", "")
        raise FieldError(path, path + _words(first, path)) from None
    options = getattr(parsed, "stream_options", None)
    if strict is not None and options is not None:
        _unknown(list(options.model_extra or ()), strict, "stream_options.")
    return parsed


def _unknown(names: list[str], strict: bool, where: str = "") -> None:
    if not names:
        return
    names = sorted(where + name for name in names)
    if strict:
        raise FieldError(names[0], f"unsupported field(s): {', '.join(names)}")
    log.debug("unknown request fields ignored", extra={"fields": names})


def _words(error: Any, path: str) -> str:
    """What follows the field's path in the message refusing it."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error["input"]
    if kind == "refused":
        return str(ctx["tail"])
    if kind in TYPE_WORDS:
        return FIELD_WORDS.get(path, TYPE_WORDS[kind])
    if kind == "greater_than_equal" and path in FLOORS:
        return f" must be {FLOORS[path]}, got {value}"
    if kind == "greater_than_equal":
        return f": {value!r} is out of range (it must be >= {ctx['ge']})"
    if kind == "less_than_equal":
        return f": {value!r} is out of range (it must be <= {ctx['le']})"
    return f": {error['msg']}"
