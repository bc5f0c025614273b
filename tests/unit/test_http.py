"""The HTTP API's pieces without processes: chat templates against transformers' own
rendering, chat-session continuation, the OpenAI body translation and the error table."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.common.errors import CapacityExceeded, InvalidRequest
from specdec.gateway.http import api
from specdec.gateway.http.chat import ChatTemplate, ChatTurn, messages_from_json
from specdec.gateway.http.errors import BodyTooLarge, ModelNotFound, error_body, http_status
from specdec.gateway.loop import Unavailable
from specdec.gateway.sessions import SessionRecord
from specdec.gateway.text import TextCodec
from specdec.gateway.turn import Aborted
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
    for bad, match in [
        ([], "non-empty"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content is required"),
        ([{"role": "user", "content": 3}], "string or a list"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text"),
        ([{"role": "assistant", "content": None, "tool_calls": [{}]}], "tool calls"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            messages_from_json(bad)


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
            "session_id": "abc",
            "timeout": 1.5,
            "echo": False,
            "logprobs": None,
        },
        SERVED,
    )
    assert req.prompt == "def f():" and req.max_new_tokens == 7
    assert req.sampling.temperature == 0 and req.sampling.top_p == 0.5
    assert req.sampling.top_k == 0 and req.sampling.seed == 3
    assert list(req.stop) == ["\n"] and req.session.id == "abc"
    assert req.speculation.num_draft_tokens == 2 and req.speculation.ssd
    assert req.speculation.k_policy == gateway_pb2.K_POLICY_ADAPTIVE
    assert opts.stream and opts.include_usage and opts.timeout == 1.5 and opts.session_id == "abc"
    assert not req.logprobs and not req.prompt_logprobs and not opts.echo and req.n == 1
    req, opts = api.completion_request({"prompt": "x", "logprobs": 0, "n": 3}, SERVED)
    assert req.logprobs and req.top_logprobs == 0 and not req.prompt_logprobs and req.n == 3
    req, opts = api.completion_request({"prompt": [[5, 6]], "logprobs": 2, "echo": True}, SERVED)
    assert req.prompt_logprobs and req.top_logprobs == 2 and opts.echo
    req, opts = api.completion_request({"prompt": [1, 2, 3]}, SERVED)
    assert list(req.prompt_token_ids.ids) == [1, 2, 3]
    assert req.max_new_tokens == api.DEFAULT_COMPLETION_TOKENS
    assert req.sampling.temperature == api.DEFAULT_TEMPERATURE
    assert not req.speculation.HasField("num_draft_tokens") and not opts.stream
    assert req.speculation.k_policy == gateway_pb2.K_POLICY_UNSPECIFIED  # the gateway's default


@pytest.mark.parametrize(
    "body, match",
    [
        ([], "JSON object"),
        ({"prompt": "x", "n": 0}, "n must be at least 1"),
        ({"prompt": "x", "best_of": 3}, "best_of=3 is not supported"),
        ({"prompt": "x", "logprobs": -1}, "logprobs must be >= 0"),
        ({"prompt": "x", "logprobs": True}, "logprobs must be an integer"),
        ({"prompt": "x", "logprobs": 1 << 40}, "logprobs.*out of range"),
        ({"prompt": "x", "echo": 1}, "echo must be true or false"),
        ({"prompt": "x", "top_logprobs": 2}, "unsupported field.*top_logprobs"),
        ({"prompt": "x", "frobnicate": 1}, "unsupported field"),
        ({"prompt": ["a", "b"]}, "batches"),
        ({"prompt": 5}, "prompt must be"),
        ({"prompt": "x", "max_tokens": "9"}, "max_tokens must be an integer"),
        ({"prompt": "x", "max_tokens": 1 << 40}, "max_tokens.*out of range"),
        ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": -1}, "seed.*out of range"),
        ({"prompt": "x", "stop": [1]}, "stop must be"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with stream"),
        ({"prompt": "x", "ssd": "yes"}, "ssd must be true or false"),
        ({"prompt": "x", "k_policy": "auto"}, "k_policy must be one of fixed, adaptive"),
        ({"prompt": "x", "k_policy": 2}, 'k_policy must be "fixed" or "adaptive"'),
        ({"prompt": "x", "session_id": ""}, "session_id"),
        ({"prompt": "x", "timeout": 0}, "timeout"),
    ],
)
def test_completion_request_refusals(body, match):
    with pytest.raises(InvalidRequest, match=match):
        api.completion_request(body, SERVED)


def test_unknown_model_and_chat_fields():
    with pytest.raises(ModelNotFound, match="'gpt-4' does not exist"):
        api.completion_request({"model": "gpt-4", "prompt": "x"}, SERVED)
    hi = [{"role": "user", "content": "hi"}]
    req, opts, messages = api.chat_request({"messages": hi, "max_completion_tokens": 5}, SERVED)
    assert req.max_new_tokens == 5 and opts.max_tokens_given and messages == hi
    _, opts, _ = api.chat_request({"messages": hi}, SERVED)
    assert not opts.max_tokens_given
    with pytest.raises(InvalidRequest, match="not both"):
        api.chat_request({"messages": hi, "max_tokens": 1, "max_completion_tokens": 1}, SERVED)
    req, _, _ = api.chat_request({"messages": hi, "logprobs": True, "top_logprobs": 4}, SERVED)
    assert req.logprobs and req.top_logprobs == 4 and not req.prompt_logprobs
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs: true"):
        api.chat_request({"messages": hi, "top_logprobs": 4}, SERVED)
    with pytest.raises(InvalidRequest, match=r"unsupported field.*echo"):
        api.chat_request({"messages": hi, "echo": True}, SERVED)
    with pytest.raises(InvalidRequest, match="tools"):
        api.chat_request({"messages": hi, "tools": [{"type": "function"}]}, SERVED)


def test_chat_without_max_tokens_fills_the_context(test_models, tokenizer):
    codec = _codec(test_models)
    rendered = _template(tokenizer).render([{"role": "user", "content": "Hello"}])
    n = len(codec.encode(rendered))
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=64, max_new_tokens=40)
    assert asyncio.run(turn(None))[2] == min(40, 64 - n)
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=64, max_new_tokens=4)
    assert asyncio.run(turn(None))[2] == 4
    turn = ChatTurn(codec, rendered, None, fill_context=True, max_context=n, max_new_tokens=4)
    with pytest.raises(InvalidRequest, match="fills the model's context"):
        asyncio.run(turn(None))


def test_error_table_and_shape():
    cases = [
        (InvalidRequest("bad"), 400, "invalid_request_error", "invalid_argument"),
        (ModelNotFound("no"), 404, "not_found_error", "model_not_found"),
        (BodyTooLarge("big"), 413, "invalid_request_error", "invalid_argument"),
        (Aborted("busy"), 409, "conflict_error", "aborted"),
        (CapacityExceeded("full"), 429, "rate_limit_error", "resource_exhausted"),
        (Unavailable("down"), 503, "service_unavailable_error", "unavailable"),
        (RuntimeError("bug"), 500, "server_error", "internal"),
    ]
    for err, status, kind, code in cases:
        assert http_status(err) == status
        body = error_body(err)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (body["error"]["type"], body["error"]["code"]) == (kind, code)
    assert http_status(_with_code(grpc.StatusCode.DEADLINE_EXCEEDED)) == 504
    assert http_status(_with_code(grpc.StatusCode.UNAUTHENTICATED)) == 401


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
    assert req.session.id == "s" and req.session.mode == gateway_pb2.SESSION_MODE_RESET
    req, _ = api.completion_request({"prompt": "x", "session_id": "s"}, SERVED)
    assert req.session.mode == gateway_pb2.SESSION_MODE_CONTINUE
    with pytest.raises(InvalidRequest, match="session_reset must be true or false"):
        api.completion_request({"prompt": "x", "session_reset": "yes"}, SERVED)


def test_loadtest_backend_reads_openai_errors():
    from specdec.sdk.errors import InvalidArgument, ResourceExhausted, SpecdecError
    from specdec.sdk.loadtest.openai_api import base_url, error_from

    assert base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("https://h/v1/") == "https://h/v1"
    e = error_from(400, error_body(InvalidRequest("bad k")))
    assert isinstance(e, InvalidArgument) and e.details == "bad k"
    e = error_from(429, error_body(CapacityExceeded("full")))
    assert isinstance(e, ResourceExhausted)
    e = error_from(409, {"error": {"message": "busy", "code": "aborted"}})
    assert e.code == grpc.StatusCode.ABORTED and type(e) is SpecdecError
    e = error_from(504, "<html>gateway timeout</html>")  # a proxy's page: by status
    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED and "HTTP 504" in e.details


def test_record_extension():
    req, _ = api.completion_request({"prompt": "x", "record": False}, SERVED)
    assert req.HasField("record") and req.record is False
    req, _ = api.completion_request({"prompt": "x"}, SERVED)
    assert not req.HasField("record")  # the gateway's default: recorded when it records
    with pytest.raises(InvalidRequest, match="record must be true or false"):
        api.completion_request({"prompt": "x", "record": "no"}, SERVED)
