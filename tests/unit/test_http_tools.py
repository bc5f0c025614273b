"""Tools on /v1/chat/completions (specdec.gateway.front.http.tools): reading tool calls from the
output, unary and streamed; tool_choice; the grammar that forces calls; the chat template
shown the tools as transformers shows them."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from specdec.common.errors import InvalidRequest
from specdec.gateway.front.http import api
from specdec.gateway.front.http.chat import ChatTemplate
from specdec.gateway.front.http.errors import FieldError
from specdec.gateway.front.http.tools import ToolCallReader, read, tool_choice
from specdec.gateway.round.grammar import grammar_text
from specdec.v1 import gateway_pb2

SERVED = "tiny"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def _call(name: str, arguments: str) -> dict:
    return {"name": name, "arguments": arguments}


# (output text, content, [(name, arguments JSON)])
CASES = [
    ("plain text, no call", "plain text, no call", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [_call("get_weather", '{"city": "Paris"}')],
    ),
    (  # two calls, the newlines around them are not content
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n',
        None,
        [_call("now", "{}"), _call("get_weather", '{"city": "Tokyo"}')],
    ),
    (  # text before a call is content; compact JSON and no arguments
        'Let me look.\n<tool_call>{"name":"now"}</tool_call>',
        "Let me look.",
        [_call("now", "{}")],
    ),
    (  # arguments given as JSON text
        '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        None,
        [_call("now", '{"tz": "UTC"}')],
    ),
    (  # malformed JSON stays content, as written
        '<tool_call>\n{"name": "now", "arguments": {</tool_call>',
        '<tool_call>\n{"name": "now", "arguments": {</tool_call>',
        [],
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>["now"]</tool_call>', '<tool_call>["now"]</tool_call>', []),
    (  # a block cut by max_tokens stays content
        'ok <tool_call>\n{"name": "now", "argu',
        'ok <tool_call>\n{"name": "now", "argu',
        [],
    ),
    (  # a malformed block beside a good one: the good one is a call, the other content
        '<tool_call>{x}</tool_call>\n<tool_call>{"name": "now"}</tool_call>',
        "<tool_call>{x}</tool_call>",
        [_call("now", "{}")],
    ),
    ("a < b and <tool", "a < b and <tool", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_tool_calls_are_read_from_the_output(text, content, calls):
    got_content, got_calls = read(text)
    assert got_content == content
    assert [c["function"] for c in got_calls] == calls
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_a_stream_reads_what_a_unary_answer_reads(text, content, calls):
    """Cut anywhere, the streamed deltas carry the unary answer's content and calls, each
    call whole in one delta with its index."""
    for seed in range(40):
        rnd = random.Random(seed)
        reader, deltas, i = ToolCallReader(), [], 0
        while i < len(text):
            j = i + rnd.randint(1, 5)
            deltas += reader.feed(text[i:j])
            i = j
        deltas += reader.finish()
        streamed = "".join(d["content"] for d in deltas if "content" in d)
        assert streamed == (content or "")
        called = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in called] == list(range(len(calls)))
        assert [c["function"] for c in called] == calls


def test_tool_choice():
    tools = [WEATHER, NOW]
    assert tool_choice(None, None, None) is None
    assert tool_choice([], "auto", None) is None  # what agent frameworks send
    assert tool_choice(tools, "none", None) is None  # no tool is in play
    auto = tool_choice(tools, None, None)
    assert auto is not None and auto.mode == "auto" and not auto.forced and auto.parallel
    named = tool_choice(tools, {"type": "function", "function": {"name": "now"}}, False)
    assert named is not None and named.forced and named.name == "now" and not named.parallel
    for tools_, choice, match in [
        (None, "required", 'tool_choice "required" needs tools'),
        (tools, {"type": "function", "function": {"name": "nope"}}, "'nope', not in tools"),
    ]:
        with pytest.raises(FieldError, match=match) as e:
            tool_choice(tools_, choice, None)
        assert e.value.param == "tool_choice"


def test_chat_request_fields():
    _, opts, _ = api.chat_request({"messages": HI, "tools": [WEATHER]}, SERVED)
    assert opts.tools is not None and opts.tools.mode == "auto"
    req, opts, _ = api.chat_request(
        {"messages": HI, "tools": [WEATHER], "tool_choice": "required"}, SERVED
    )
    assert req.output.grammar.WhichOneof("kind") == "grammar"
    assert req.output.grammar.grammar == opts.tools.grammar()
    req, opts, _ = api.chat_request({"messages": HI, "tool_choice": "auto"}, SERVED)
    assert opts.tools is None and req.output.structured_output is None
    for body, match, param in [
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice must be", "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "given twice", "tools[1].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, '"type": "function"', "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "JSON schema",
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "forces the output to be tool calls",
            "tool_choice",
        ),
        ({"parallel_tool_calls": "yes"}, "true or false", "parallel_tool_calls"),
    ]:
        with pytest.raises(FieldError, match=match) as e:
            api.chat_request({"messages": HI, **body}, SERVED)
        assert e.value.param == param


def _matcher(tokenizer, grammar: str) -> llguidance.LLMatcher:
    tok = llguidance.LLTokenizer(
        tokenizer.backend_tokenizer.to_str(), n_vocab=len(tokenizer), eos_token=[2]
    )
    return llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar))


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "accepted"),
    [
        ("required", True, '{"name":"get_weather","arguments":{"city":"Paris"}}', True),
        ("required", True, '{"name":"now","arguments":{}}', True),
        ("required", True, '{"name":"get_weather","arguments":{"city":"Rome"}}', False),
        ("required", True, '{"name":"other","arguments":{}}', False),
        ("now", True, '{"name":"get_weather","arguments":{"city":"Paris"}}', False),
        ("now", True, '{"name":"now","arguments":{}}', True),
    ],
)
def test_the_forcing_grammar(tokenizer, choice, parallel, text, accepted):
    """tool_choice "required" or a named function: a grammar whose language is tool-call
    blocks with a declared name and arguments of its schema, nothing else."""
    spec = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    forced = tool_choice([WEATHER, NOW], spec, parallel)
    assert forced is not None
    block = f"<tool_call>\n{text}\n</tool_call>"
    for output, ok in [(block, accepted), (block + "\n" + block, accepted), ("hi " + block, False)]:
        matcher = _matcher(tokenizer, forced.grammar())
        ids = tokenizer.encode(output, add_special_tokens=False)
        n = matcher.validate_tokens(ids)
        if ok:
            assert n == len(ids) and matcher.consume_tokens(ids), output
            assert matcher.is_accepting(), output
        else:
            assert n < len(ids) or not (matcher.consume_tokens(ids) and matcher.is_accepting())
    single = tool_choice([WEATHER, NOW], "required", False)
    matcher = _matcher(tokenizer, single.grammar())
    two = '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'
    ids = tokenizer.encode(two + "\n" + two, add_special_tokens=False)
    assert matcher.validate_tokens(ids) < len(ids)  # parallel_tool_calls false: one call


def test_the_template_is_shown_the_tools_as_transformers_shows_them(tokenizer):
    """The gateway's Jinja rendering with tools and with earlier calls and results equals
    transformers' apply_chat_template(tools=...) on the test template, which takes tools."""
    template = ChatTemplate(
        tokenizer.chat_template, {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    )
    assert template.takes_tools
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [WEATHER],
    }
    _, opts, messages = api.chat_request(body, SERVED)
    ours = template.render(messages, True, opts.tools.tools)
    reference = [dict(m) for m in body["messages"]]
    reference[1] = {
        "role": "assistant",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    theirs = tokenizer.apply_chat_template(
        reference, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert json.dumps(WEATHER) in ours and '"arguments": {"city": "Paris"}' in ours


def test_a_template_without_tools_refuses_them():
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    assert not plain.takes_tools
    assert plain.render(HI) == "hi"
    with pytest.raises(FieldError, match="does not take tools") as e:
        plain.render(HI, True, [WEATHER])
    assert e.value.param == "tools"


def test_an_empty_grammar_is_refused():
    with pytest.raises(InvalidRequest, match=r"structured_output\.grammar is empty"):
        grammar_text(gateway_pb2.StructuredOutput(grammar=" "))
    kind, text = grammar_text(gateway_pb2.StructuredOutput(grammar='start: "a" | "b"'))
    assert kind == "grammar" and "start" in text
