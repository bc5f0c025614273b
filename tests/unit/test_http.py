"""The HTTP API's pieces without processes: chat templates against transformers' own
rendering, chat-session continuation, the OpenAI body translation, the error table and
the answers of the app itself over a stand-in gateway (a 500 tells nothing of its cause)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from types import SimpleNamespace

import grpc
import pytest

from specdec.common.errors import (
    BUSY_PREFIX,
    CapacityExceeded,
    InvalidRequest,
    ReplicaBusy,
    SpecdecError,
)
from specdec.gateway.fleet.caller import UpstreamError
from specdec.gateway.fleet.transport import CallFailed
from specdec.gateway.front.http import api
from specdec.gateway.front.http.app import OpenAIServer, model_folder_name
from specdec.gateway.front.http.chat import ChatTemplate, ChatTurn, messages_from_json
from specdec.gateway.front.http.errors import (
    BodyTooLarge,
    ErrorContext,
    FieldError,
    ModelNotFound,
    answer,
    error_body,
    http_status,
)
from specdec.gateway.front.response import Event
from specdec.gateway.front.turn import Aborted
from specdec.gateway.job import ContextLengthExceeded, Job, Limits
from specdec.gateway.names import KPolicy
from specdec.gateway.sessions import Holder, SessionLost, SessionRecord
from specdec.gateway.text import TextCodec
from specdec.sdk.errors import Unavailable
from specdec.v1 import gateway_pb2

# A template in the style of Qwen2.5's: a default system message, namespace, loop
# controls, tojson, raise_exception and whitespace control.
RICH_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|system|>\\n' + messages[0]['content'] + eos_token + '\\n' }}
{%- set loop_messages = messages[1:] %}
{%- else %}
{{- '<|system|>\\nYou are helpful.' + eos_token + '\\n' }}
{%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(users=0) %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant') }}
    {%- endif %}
    {%- if message.name is defined %}{{ message.name | tojson }}{% endif %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? ü ∑ 日本"},
    ],
    [{"role": "user", "content": "  spaced  ", "name": 'bob "q"'}],
]


def _template(tokenizer, template: str | None = None) -> ChatTemplate:
    return ChatTemplate(template or tokenizer.chat_template, tokenizer.special_tokens_map)


@pytest.mark.parametrize("which", ["tiny", "rich"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_template_equals_transformers(tokenizer, which, chat):
    template = None if which == "tiny" else RICH_TEMPLATE
    messages = CHATS[chat]
    expected = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert _template(tokenizer, template).render(messages) == expected
    no_prompt = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=False
    )
    assert _template(tokenizer, template).render(messages, add_generation_prompt=False) == no_prompt


def test_template_errors_are_bad_requests(tokenizer):
    rich = _template(tokenizer, RICH_TEMPLATE)
    with pytest.raises(InvalidRequest, match="roles must be user or assistant"):
        rich.render([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidRequest, match="no chat template"):
        ChatTemplate("", {})
    with pytest.raises(InvalidRequest, match="does not compile"):
        ChatTemplate("{% for %}", {})
    with pytest.raises(InvalidRequest, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render(
            [{"role": "user", "content": "a"}]
        )


def test_messages_from_json():
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert messages_from_json(parts) == [{"role": "user", "content": "a\nb"}]
    for bad, match, param in [
        ([], "non-empty", "messages"),
        ([{"role": "robot", "content": "x"}], "role", "messages[0].role"),
        ([{"role": "user"}], "content is required", "messages[0].content"),
        ([{"role": "user", "content": 3}], "string or a list", "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "only text",
            "messages[0].content[0]",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{}]}],
            "must be an object",
            "messages[0].tool_calls[0].function",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            "JSON object",
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": []}],
            "assistant message's only",
            "messages[0].tool_calls",
        ),
        ([{"role": "tool"}], "content is required", "messages[0].content"),
    ]:
        with pytest.raises(FieldError, match=match) as e:
            messages_from_json(bad)
        assert error_body(e.value)["error"]["param"] == param


def chat_ids(tokenizer, messages) -> list[int]:
    """transformers' own tokenized chat prompt."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _codec(test_models) -> TextCodec:
    return TextCodec((test_models.tokenizer / "tokenizer.json").read_bytes())


def test_chat_turn_continues_or_restarts(test_models, tokenizer):
    codec = _codec(test_models)
    template = _template(tokenizer)
    first = [{"role": "user", "content": "Hello there"}]
    turn = ChatTurn(codec, template.render(first), "s")
    record, ids, max_new = asyncio.run(turn(None))
    assert record is None and not turn.continued and turn.restarted is None and max_new is None
    assert ids == chat_ids(tokenizer, first)
    # The model answered "General Kenobi" and stopped at EOS: the history holds the EOS.
    reply = tokenizer("General Kenobi", add_special_tokens=False).input_ids
    history = [*ids, *reply, test_models.eos_token_id]
    stored = SessionRecord(session_id="s", tokens=history, turns=1)
    second = [
        *first,
        {"role": "assistant", "content": "General Kenobi"},
        {"role": "user", "content": "You are a bold one"},
    ]
    rendered = template.render(second)
    turn = ChatTurn(codec, rendered, "s")
    record, new, _ = asyncio.run(turn(stored))
    assert record is stored and turn.continued and turn.history_tokens == len(history)
    assert tokenizer.decode(history + new, skip_special_tokens=False) == rendered
    # An edited earlier message: the session starts afresh from the whole chat.
    edited = [{"role": "user", "content": "Hi there"}, *second[1:]]
    turn = ChatTurn(codec, template.render(edited), "s")
    record, ids, _ = asyncio.run(turn(stored))
    assert record is None and not turn.continued
    assert "do not extend session 's'" in turn.restarted and "character" in turn.restarted
    assert ids == chat_ids(tokenizer, edited)


SERVED = "tiny"


def test_completion_request_translation():
    req, opts = api.completion_request(
        {
            "model": SERVED,
            "prompt": ["def f():"],
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "\n",
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "k": 2,
            "ssd": True,
            "k_policy": "adaptive",
            "tree_width": 3,
            "session_id": "abc",
            "timeout": 1.5,
            "echo": False,
            "logprobs": None,
        },
        SERVED,
    )
    assert req.prompt == "def f():" and req.output.max_new_tokens == 7
    assert req.sampling.temperature == 0 and req.sampling.top_p == 0.5
    assert req.sampling.top_k == 0 and req.sampling.seed == 3
    assert req.output.stop == ("\n",) and req.session.session_id == "abc"
    assert req.speculation.k == 2 and req.speculation.ssd
    assert req.speculation.k_policy is KPolicy.ADAPTIVE
    assert req.speculation.tree_width == 3
    assert opts.stream and opts.include_usage and opts.timeout == 1.5 and opts.session_id == "abc"
    scoring = req.scoring
    assert not scoring.logprobs and not scoring.prompt_logprobs and not opts.echo
    assert req.output.n == 1
    req, opts = api.completion_request({"prompt": "x", "logprobs": 0, "n": 3}, SERVED)
    scoring = req.scoring
    assert scoring.logprobs and scoring.top_logprobs == 0 and not scoring.prompt_logprobs
    assert req.output.n == 3
    req, opts = api.completion_request({"prompt": [[5, 6]], "logprobs": 2, "echo": True}, SERVED)
    assert req.scoring.prompt_logprobs and req.scoring.top_logprobs == 2 and opts.echo
    req, opts = api.completion_request({"prompt": [1, 2, 3]}, SERVED)
    assert list(req.token_ids) == [1, 2, 3] and req.prompt is None
    assert req.output.max_new_tokens == api.DEFAULT_COMPLETION_TOKENS
    # Unset: the model's generation_config at the gateway (as the SDK and gRPC).
    assert req.sampling.temperature is None
    assert req.speculation.k is None and not opts.stream
    assert req.speculation.k_policy is None  # the gateway's default


STREAM = {"stream": True}


@pytest.mark.parametrize(
    "body, match, param",
    [
        ([], "JSON object", None),
        ({"prompt": "x", "n": 0}, "n must be at least 1", "n"),
        ({"prompt": "x", "best_of": 3}, "best_of=3 is not supported", "best_of"),
        ({"prompt": "x", "logprobs": -1}, "logprobs must be >= 0", "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs must be an integer", "logprobs"),
        ({"prompt": "x", "logprobs": 1 << 40}, "logprobs.*out of range", "logprobs"),
        ({"prompt": "x", "echo": 1}, "echo must be true or false", "echo"),
        ({"prompt": "x", "top_logprobs": 2}, "unsupported field.*top_logprobs", "top_logprobs"),
        ({"prompt": "x", "zeta": 1, "alpha": 2}, r"unsupported field\(s\): alpha, zeta", "alpha"),
        ({"prompt": ["a", "b"]}, "batches", "prompt"),
        ({"prompt": 5}, "prompt must be", "prompt"),
        ({"prompt": "x", "max_tokens": "9"}, "max_tokens must be an integer", "max_tokens"),
        ({"prompt": "x", "max_tokens": 1 << 40}, "max_tokens.*out of range", "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature must be a number", "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "x", "seed": -1}, "seed.*out of range", "seed"),
        ({"prompt": "x", "stop": [1]}, "stop must be", "stop"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "only allowed with stream",
            "stream_options",
        ),
        (
            {"prompt": "x", **STREAM, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage must be true or false",
            "stream_options.include_usage",
        ),
        (
            {"prompt": "x", **STREAM, "stream_options": {"include_obfuscation": True}},
            "unsupported field",
            "stream_options.include_obfuscation",
        ),
        ({"prompt": "x", "ssd": "yes"}, "ssd must be true or false", "ssd"),
        (
            {"prompt": "x", "k_policy": "auto"},
            "k_policy must be one of fixed, adaptive",
            "k_policy",
        ),
        ({"prompt": "x", "k_policy": 2}, 'k_policy must be "fixed" or "adaptive"', "k_policy"),
        ({"prompt": "x", "session_id": ""}, "session_id", "session_id"),
        ({"prompt": "x", "timeout": 0}, "timeout", "timeout"),
        ({"prompt": "x", "guided_regex": 3}, "guided_regex", "guided_regex"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "logit_bias"),
        ({"prompt": "x", "model": 3}, "model must be a string", "model"),
    ],
)
def test_completion_request_refusals_name_the_field(body, match, param):
    """Every refusal of the translation names its body field in `param` (unknown fields
    are refused here because strict: --strict-fields)."""
    with pytest.raises(InvalidRequest, match=match) as e:
        api.completion_request(body, SERVED, strict=True)
    assert error_body(e.value)["error"]["param"] == param


def test_unknown_fields_are_ignored_and_logged(caplog):
    """Without --strict-fields an unknown field (top level or in stream_options) is
    ignored, as vLLM does, and logged at debug level by name; a known OpenAI field the
    gateway cannot honour is still refused unless neutral."""
    body = {
        "prompt": "x", "max_tokens": 3, "frobnicate": True, "echo": False, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="specdec.gateway.front.http.schema"):
        req, opts = api.completion_request(body, SERVED)
    assert req.prompt == "x" and req.output.max_new_tokens == 3 and opts.include_usage
    logged = [
        r.fields for r in caplog.records if r.getMessage() == "unknown request fields ignored"
    ]
    assert logged == [["frobnicate"], ["stream_options.include_obfuscation"]]
    hi = [{"role": "user", "content": "hi"}]
    _, _, messages = api.chat_request(
        {"messages": hi, "echo": True, "service_tier": "auto"}, SERVED
    )
    assert messages == hi
    with pytest.raises(FieldError, match="must be an object") as e:
        api.chat_request({"messages": hi, "tools": [{"type": "function"}]}, SERVED)
    assert e.value.param == "tools[0].function"
    assert api.chat_request({"messages": hi, "tools": []}, SERVED)[1].tools is None


LIMITS = Limits(
    vocab_size=100,
    max_context=64,
    max_k=8,
    default_k=4,
    default_ssd=False,
    default_k_policy=KPolicy.FIXED,
    max_new_tokens=32,
    default_ttl=60,
    max_session_ttl=3600,
)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "max_completion_tokens": 99}, "max_completion_tokens"),
        ({"messages": [], "min_tokens": 99}, "min_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"500": 1}}, "logit_bias"),
        ({"prompt": "x", "k": 99}, "k"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [500]}, "stop_token_ids"),
        ({"prompt": "x", "n": 2, "session_id": "s"}, "n"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": [500]}, "prompt"),
        ({"messages": [], "session_id": "s" * 300}, "session_id"),
        ({"prompt": "x", "session_reset": True}, "session_reset"),
        (
            {"prompt": "x", "session_id": "s", "session_reset": True, "session_expected_turns": 1},
            "session_reset",
        ),
        ({"prompt": "x", "logprobs": 25}, "logprobs"),
        ({"messages": [], "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "session_id": "s"}, "echo"),
        ({"prompt": "x", "guided_regex": "a", "min_tokens": 1}, "guided_regex"),
        ({"prompt": "x", "prediction": {"type": "content", "content": "y" * 5000}}, "prediction"),
    ],
)
def test_shared_validation_errors_name_the_body_field(body, param):
    """The gateway's own checks (the gRPC path's, Job.resolve) name the Request's field;
    the error body's `param` is the field of this request it comes from."""
    chat = "messages" in body
    if chat:
        req, opts, _ = api.chat_request(
            {**body, "messages": [{"role": "user", "content": "a"}]}, SERVED
        )
        req = dataclasses.replace(req, prompt="a")
    else:
        req, opts = api.completion_request(body, SERVED)
    with pytest.raises(InvalidRequest) as e:
        Job.resolve(req, LIMITS)
    context = ErrorContext(prompt=opts.prompt_field, fields=opts.fields)
    error = error_body(e.value, context)["error"]
    assert (error["param"], error["code"]) == (param, "invalid_argument"), error["message"]


class _Replica:
    """What UpstreamError names: a replica's role and address."""

    def __repr__(self) -> str:
        return "verifier@10.1.2.3:50052"


def test_a_prompt_that_cannot_fit_is_context_length_exceeded():
    """Over the context (the gateway's check) or a replica's KV cache bound (its
    RESOURCE_EXHAUSTED): 400 context_length_exceeded naming the prompt's field, never 429."""
    req, _ = api.completion_request({"prompt": "x" * (64 * 64 + 1)}, SERVED)
    with pytest.raises(ContextLengthExceeded) as e:
        Job.resolve(req, LIMITS)
    kv = UpstreamError(
        _Replica(),
        CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "session needs 340 cached tokens"),
    )
    for err, prompt in ((e.value, "prompt"), (kv, "messages"), (CapacityExceeded("x"), "prompt")):
        a = answer(err, ErrorContext(prompt=prompt))
        assert a.status == 400 and "Retry-After" not in a.headers
        assert a.body["error"] == {
            "message": a.body["error"]["message"],
            "type": "invalid_request_error",
            "param": prompt,
            "code": "context_length_exceeded",
        }
    message = answer(kv).body["error"]["message"]
    assert (
        message == "the request does not fit a replica's KV cache: session needs 340 cached tokens"
    )


def test_backpressure_is_429_with_retry_after():
    busy = UpstreamError(
        _Replica(),
        CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{BUSY_PREFIX}: 3 queued", "REASON_BUSY"),
    )
    for err in (busy, ReplicaBusy(f"{BUSY_PREFIX}: 3 queued")):
        a = answer(err)
        assert a.status == 429 and a.headers == {"Retry-After": "1"}
        assert a.body["error"]["type"] == "rate_limit_error"
        assert a.body["error"]["code"] == "resource_exhausted"
        assert a.body["error"]["message"] == f"{BUSY_PREFIX}: 3 queued"  # no replica address


def test_unknown_model_and_chat_fields():
    with pytest.raises(ModelNotFound, match="'gpt-4' does not exist"):
        api.completion_request({"model": "gpt-4", "prompt": "x"}, SERVED)
    hi = [{"role": "user", "content": "hi"}]
    req, opts, messages = api.chat_request({"messages": hi, "max_completion_tokens": 5}, SERVED)
    assert req.output.max_new_tokens == 5 and opts.max_tokens_given and messages == hi
    _, opts, _ = api.chat_request({"messages": hi}, SERVED)
    assert not opts.max_tokens_given
    with pytest.raises(InvalidRequest, match="not both"):
        api.chat_request({"messages": hi, "max_tokens": 1, "max_completion_tokens": 1}, SERVED)
    req, _, _ = api.chat_request({"messages": hi, "logprobs": True, "top_logprobs": 4}, SERVED)
    assert req.scoring.logprobs and req.scoring.top_logprobs == 4
    assert not req.scoring.prompt_logprobs
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs: true"):
        api.chat_request({"messages": hi, "top_logprobs": 4}, SERVED)
    with pytest.raises(InvalidRequest, match=r"unsupported field.*echo"):
        api.chat_request({"messages": hi, "echo": True}, SERVED, strict=True)
    with pytest.raises(InvalidRequest, match="tools"):
        api.chat_request({"messages": hi, "tools": [{"type": "function"}]}, SERVED)
    # The model's whole id is an alias of its served name (the default name before).
    _, opts, _ = api.chat_request({"messages": hi, "model": "/m/tiny"}, SERVED, ("/m/tiny",))
    assert opts.model == SERVED


def test_model_folder_name():
    assert model_folder_name("/tmp/tiny/target") == "target"
    assert model_folder_name("/models/qwen-coder/") == "qwen-coder"
    assert model_folder_name("/models/qwen#qwen-q8_0.gguf") == "qwen"
    assert model_folder_name("Qwen/Qwen2.5-0.5B") == "Qwen2.5-0.5B"
    assert model_folder_name("target") == "target"
    assert (
        model_folder_name("/cache/qwen2.5-coder-1.5b-instruct/model")
        == "qwen2.5-coder-1.5b-instruct"
    )
    hub = "/hf/hub/models--Qwen--Qwen2.5-Coder-1.5B/snapshots/2e1fd397ee46e1388853d2af2c993145b0f1098a"
    assert model_folder_name(hub) == "Qwen2.5-Coder-1.5B"
    assert model_folder_name("/") == "/"


def test_chat_without_max_tokens_fills_the_context(test_models, tokenizer):
    codec = _codec(test_models)
    rendered = _template(tokenizer).render([{"role": "user", "content": "Hello"}])
    n = len(codec.encode(rendered))
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=64, max_new_tokens=40)
    assert asyncio.run(turn(None))[2] == min(40, 64 - n)
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=64, max_new_tokens=4)
    assert asyncio.run(turn(None))[2] == 4
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=n, max_new_tokens=4)
    with pytest.raises(ContextLengthExceeded, match="fills the model's context"):
        asyncio.run(turn(None))


def test_error_table_and_shape():
    cases = [
        (InvalidRequest("bad"), 400, "invalid_request_error", "invalid_argument", None),
        (FieldError("top_k", "bad"), 400, "invalid_request_error", "invalid_argument", "top_k"),
        (ModelNotFound("no"), 404, "invalid_request_error", "model_not_found", "model"),
        (BodyTooLarge("big"), 413, "invalid_request_error", "invalid_argument", None),
        (Aborted("busy"), 409, "conflict_error", "aborted", None),
        (ReplicaBusy("full"), 429, "rate_limit_error", "resource_exhausted", None),
        (CapacityExceeded("kv"), 400, "invalid_request_error", "context_length_exceeded", None),
        (Unavailable("down"), 503, "service_unavailable_error", "unavailable", None),
        (RuntimeError("bug"), 500, "server_error", "internal", None),
        (_with_code(grpc.StatusCode.INTERNAL), 500, "server_error", "internal", None),
    ]
    for err, status, kind, code, param in cases:
        assert http_status(err) == status
        body = error_body(err)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (body["error"]["type"], body["error"]["code"]) == (kind, code)
        assert body["error"]["param"] == param
    assert http_status(_with_code(grpc.StatusCode.DEADLINE_EXCEEDED)) == 504
    assert http_status(_with_code(grpc.StatusCode.UNAUTHENTICATED)) == 401


def test_a_busy_session_says_when_to_retry():
    """A session whose lock is held is 409 with Retry-After: when the lease of a gateway
    that stopped answering lapses (rounded up), else 1 s; a lost history is 400."""
    stopped = Holder("gw-a", lease=4.0, lapses_in=1.2)
    assert stopped.stopped
    got = answer(stopped.error("s"))
    assert got.status == 409 and got.headers == {"Retry-After": "2"}
    assert "gw-a, which stopped answering" in got.body["error"]["message"]
    live = Holder("gw-a", lease=4.0, lapses_in=3.9)
    assert answer(live.error("s")).headers == {"Retry-After": "1"}
    assert answer(Aborted("busy")).headers == {}
    lost = answer(SessionLost("gone"))
    assert (lost.status, lost.body["error"]["code"]) == (400, "session_lost")


def _with_code(code):
    from specdec.common.errors import SpecdecError

    e = SpecdecError("x")
    e.code = code
    return e


def test_usage_counts_history_as_cached():
    final = gateway_pb2.GenerateResponse(
        usage=gateway_pb2.Usage(prompt_tokens=5, completion_tokens=7, history_tokens=30)
    )
    assert api.usage(final) == {
        "prompt_tokens": 35,
        "completion_tokens": 7,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 30},
        "completion_tokens_details": {
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def test_session_reset_extension():
    req, _ = api.completion_request(
        {"prompt": "x", "session_id": "s", "session_reset": True}, SERVED
    )
    assert req.session.session_id == "s" and req.session.reset_session
    req, _ = api.completion_request({"prompt": "x", "session_id": "s"}, SERVED)
    assert not req.session.reset_session
    with pytest.raises(InvalidRequest, match="session_reset must be true or false"):
        api.completion_request({"prompt": "x", "session_reset": "yes"}, SERVED)


def test_loadtest_backend_reads_openai_errors():
    from specdec.sdk.errors import InvalidArgument, ResourceExhausted, SpecdecError
    from specdec.sdk.loadtest.openai_api import base_url, error_from

    assert base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("https://h/v1/") == "https://h/v1"
    e = error_from(400, error_body(InvalidRequest("bad k")))
    assert isinstance(e, InvalidArgument) and e.details == "bad k"
    e = error_from(429, error_body(ReplicaBusy(f"{BUSY_PREFIX}: full")))
    assert isinstance(e, ResourceExhausted)
    e = error_from(400, error_body(CapacityExceeded("kv")))  # context_length_exceeded
    assert isinstance(e, InvalidArgument)
    e = error_from(409, {"error": {"message": "busy", "code": "aborted"}})
    assert e.code == grpc.StatusCode.ABORTED and type(e) is SpecdecError
    e = error_from(504, "<html>gateway timeout</html>")  # a proxy's page: by status
    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED and "HTTP 504" in e.details


def test_record_extension():
    req, _ = api.completion_request({"prompt": "x", "record": False}, SERVED)
    assert req.output.record is False
    req, _ = api.completion_request({"prompt": "x"}, SERVED)
    assert req.output.record is None  # the gateway's default: recorded when it records
    with pytest.raises(InvalidRequest, match="record must be true or false"):
        api.completion_request({"prompt": "x", "record": "no"}, SERVED)


class _Gateway:
    """What OpenAIServer reads of a Gateway, with `run` given by the test."""

    def __init__(self, run):
        self.limits = LIMITS
        self.codec = object()
        info = SimpleNamespace(model_id="/models/tiny-target", chat_template="")
        self.fleet = SimpleNamespace(
            verifiers=SimpleNamespace(replicas=[SimpleNamespace(info=info)])
        )
        self.run = run


def _client(run, **kw):
    from starlette.testclient import TestClient

    return TestClient(OpenAIServer(_Gateway(run), **kw).app())


SECRET = "token sk-live-123 in /srv/secret/state.py line 42"


def test_a_500_tells_nothing_of_its_cause(caplog):
    """An unexpected exception in a generation: 500 with a generic message naming the
    request's id; the exception itself is logged under that id, never sent."""

    async def broken(req, **kw):
        raise KeyError(SECRET)
        yield  # an async generator, as Gateway.run

    async def broken_later(req, **kw):
        yield Event("a", [1])
        raise KeyError(SECRET)

    with caplog.at_level(logging.ERROR, logger="specdec.gateway.front.http.errors"):
        r = _client(broken).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "internal", None)
    assert SECRET not in r.text and "KeyError" not in r.text
    (record,) = [x for x in caplog.records if x.getMessage().startswith("internal error")]
    assert record.request_id.startswith("cmpl-") and record.request_id in error["message"]
    assert SECRET in caplog.text  # the whole exception is in the log
    # After the stream has started the same body arrives as an event.
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="specdec.gateway.front.http.errors"):
        r = _client(broken_later).post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and SECRET not in r.text and "KeyError" not in r.text
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    (record,) = [x for x in caplog.records if x.getMessage().startswith("internal error")]
    assert events[-1]["error"]["code"] == "internal"
    assert record.request_id in events[-1]["error"]["message"]
    assert r.text.endswith("data: [DONE]\n\n")


async def _unused(req, **kw):
    raise AssertionError("not called")
    yield


def test_routing_errors():
    client = _client(_unused)
    r = client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "GET /v1/nothing: Not Found",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"


def test_responses_api_is_known_and_not_built():
    """POST /v1/responses: 501 in OpenAI's error shape, naming the endpoint to use, after
    the bearer token check like every route."""
    r = _client(_unused).post("/v1/responses", json={"model": "tiny-target", "input": "hi"})
    assert r.status_code == 501
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("not_implemented_error", "unimplemented")
    assert "/v1/responses" in error["message"] and "/v1/chat/completions" in error["message"]
    r = _client(_unused, tokens=frozenset({"t"})).post("/v1/responses", json={})
    assert r.status_code == 401


def test_strict_fields_reach_the_routes():
    r = _client(_unused).post("/v1/completions", json={"prompt": "x", "frobnicate": 1, "model": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"  # frobnicate ignored
    strict = _client(_unused, strict_fields=True)
    r = strict.post("/v1/completions", json={"prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


def test_the_default_model_name_is_the_folders():
    """No --served-model-name: the verifier's model folder names the model; its whole path
    is accepted too."""
    client = _client(_unused)
    r = client.post("/v1/completions", json={"prompt": "x", "model": "other"})
    assert "this server serves 'tiny-target'" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "model": "/models/tiny-target", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # past the model check
    named = _client(_unused, served_model_name="tiny")
    r = named.post("/v1/completions", json={"prompt": "x", "model": "/models/tiny-target"})
    assert r.status_code == 404  # a name given: no alias


def test_a_replica_deadline_within_the_request_timeout_answers_as_the_timeout():
    """The request's `timeout` bounds its replica calls too: whichever fires first, the
    answer is the same 504 (a replica's DEADLINE_EXCEEDED answered first under load)."""

    class Late(SpecdecError):
        code = grpc.StatusCode.DEADLINE_EXCEEDED

    async def deadline(req, **kw):
        raise Late("verifier@127.0.0.1:1: Deadline Exceeded")
        yield

    r = _client(deadline).post("/v1/completions", json={"prompt": "x", "timeout": 5})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout_error"
    assert (
        "did not finish within timeout=5.0s (tokens generated: 0)" in r.json()["error"]["message"]
    )
    # Without a request timeout, the replica's deadline is the answer.
    r = _client(deadline).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 504 and "verifier@127.0.0.1:1" in r.json()["error"]["message"]
