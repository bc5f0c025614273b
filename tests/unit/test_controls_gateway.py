"""The gateway's side of the length, stop and logits-processor controls: TextOutput's stop
token ids, ignore_eos and min_tokens; what the replicas are told (OutputControls); the HTTP
body's translation into the typed Request; the SDK's request."""

from __future__ import annotations

import pytest

from specdec.common.errors import InvalidRequest
from specdec.gateway.front.http import api
from specdec.gateway.front.response import Event
from specdec.gateway.front.turn import output_controls
from specdec.gateway.job import Job, ResolvedOutput, ResolvedSpeculation
from specdec.gateway.text import TextOutput
from specdec.sdk.client import build_generate_request
from specdec.v1 import common_pb2
from tests.unit.test_text import codec  # noqa: F401  (the fixture)

EOS = 2


def test_stop_token_id_ends_with_stop_and_drops_its_text(codec):  # noqa: F811
    ids = codec.encode("alpha beta gamma delta")
    c = TextOutput(codec, 100, frozenset({EOS}), stop_token_ids=frozenset({ids[2]}))
    text, tokens = c.push(ids)
    assert c.finish_reason == "stop"
    assert c.tokens == tokens == ids[:3]  # the stop token is kept, what follows is not
    assert text == codec.decode(ids[:2])  # its text is not


def test_ignore_eos_generates_through_eos(codec):  # noqa: F811
    ids = codec.encode("alpha beta")
    c = TextOutput(codec, 4, frozenset({EOS}), ignore_eos=True)
    _, tokens = c.push([ids[0], EOS, ids[1], EOS, ids[0]])
    assert c.finish_reason == "length" and tokens == [ids[0], EOS, ids[1], EOS]


def test_stop_strings_wait_for_min_tokens(codec):  # noqa: F811
    ids = codec.encode("ab STOP cd STOP ef")
    early = TextOutput(codec, 100, frozenset({EOS}), ("STOP",))
    early.push(ids)
    late = TextOutput(codec, 100, frozenset({EOS}), ("STOP",), min_tokens=len(ids) - 2)
    late.push(ids)
    assert early.finish_reason == late.finish_reason == "stop"
    assert early.text == "ab " and late.text == "ab STOP cd "


def _job(**output) -> Job:
    return Job(
        prompt=[1],
        sampling=common_pb2.SamplingParams(),
        output=ResolvedOutput(max_new_tokens=8, **output),
        speculation=ResolvedSpeculation(k=3),
    )


def test_output_controls_mask_eos_and_stop_ids_unless_ignored():
    eos = frozenset({EOS, 7})
    got = output_controls(_job(min_tokens=4, stop_token_ids=frozenset({9})), 12, eos)
    assert (got.output_start, got.min_tokens, list(got.min_tokens_ids)) == (12, 4, [2, 7, 9])
    got = output_controls(
        _job(min_tokens=4, stop_token_ids=frozenset({9}), ignore_eos=True), 12, eos
    )
    assert list(got.min_tokens_ids) == [9]
    got = output_controls(_job(stop_token_ids=frozenset({9})), 5, eos)  # no min_tokens
    assert (got.output_start, got.min_tokens, list(got.min_tokens_ids)) == (5, 0, [])


def test_http_body_translates_to_the_typed_fields():
    body = {
        "prompt": "x",
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.25,
        "logit_bias": {"5": 10, "17": -100.0},
        "ignore_eos": True,
        "min_tokens": 3,
        "stop_token_ids": [4, 9],
    }
    req, _ = api.completion_request(body, "m")
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1, 1.25)
    assert dict(s.logit_bias) == {5: 10.0, 17: -100.0}
    out = req.output
    assert out.ignore_eos and out.min_tokens == 3 and list(out.stop_token_ids) == [4, 9]
    chat, opts, _ = api.chat_request({"messages": [{"role": "user", "content": "x"}], **{
        k: v for k, v in body.items() if k != "prompt"
    }}, "m")  # fmt: skip
    assert chat.sampling == s and not opts.max_tokens_given
    assert chat.output.max_new_tokens == 3  # room for min_tokens until the context fixes it


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"repetition_penalty": -2}, "repetition_penalty must be > 0"),
        ({"logit_bias": {"1.5": 1}}, "key '1.5' is not a token id"),
        ({"logit_bias": {"3": True}}, "the bias of token 3 must be a number"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be a list of token ids"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ],
)
def test_http_body_refusals(extra, match):
    with pytest.raises(InvalidRequest, match=match):
        api.completion_request({"prompt": "x", **extra}, "m")


def test_sdk_request_carries_the_controls():
    req = build_generate_request(
        "x",
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[3],
        presence_penalty=0.1,
        frequency_penalty=0.2,
        repetition_penalty=1.5,
        logit_bias={4: -1.0},
    )
    assert req.ignore_eos and req.min_tokens == 2 and list(req.stop_token_ids) == [3]
    assert req.sampling.repetition_penalty == 1.5 and dict(req.sampling.logit_bias) == {4: -1.0}
    assert req.sampling.presence_penalty == pytest.approx(0.1)
    plain = build_generate_request("x")
    assert not plain.ignore_eos and plain.min_tokens == 0 and not plain.sampling.logit_bias


def test_stream_options_continuous_usage_stats():
    """vLLM's continuous_usage_stats (guidellm sends it): with include_usage, every chunk
    carries the usage so far; without include_usage it changes nothing, as in vLLM."""
    body = {"prompt": "x", "stream": True}
    _, opts = api.completion_request(
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "m"
    )
    assert opts.include_usage and opts.continuous_usage
    _, opts = api.completion_request(
        {**body, "stream_options": {"continuous_usage_stats": True}}, "m"
    )
    assert not opts.continuous_usage
    # Another key is ignored, as vLLM does; --strict-fields refuses it.
    _, opts = api.completion_request({**body, "stream_options": {"other": 1}}, "m")
    assert not opts.include_usage
    with pytest.raises(InvalidRequest, match=r"unsupported field\(s\): stream_options.other"):
        api.completion_request({**body, "stream_options": {"other": 1}}, "m", strict=True)
    r = api.Renderer(chat=True, model="m")
    first = r.chunks(Event("a", [5, 6], context_tokens=10), True, True)
    assert [c["usage"]["completion_tokens"] for c in first] == [2, 2]
    (later,) = r.chunks(Event("b", [7], context_tokens=10), True, True)
    assert later["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


@pytest.mark.parametrize("field", ["min_tokens", "ignore_eos"])
def test_structured_output_refuses_min_tokens_and_ignore_eos(field):
    """A complete grammar allows only EOS: min_tokens or ignore_eos beside structured_output
    would leave no token to draw, so the request is refused before any replica is called."""
    from specdec.gateway.job import Limits
    from specdec.gateway.names import KPolicy
    from specdec.sdk.request import Request

    limits = Limits(
        vocab_size=100,
        max_context=64,
        max_k=4,
        default_k=2,
        default_ssd=False,
        default_k_policy=KPolicy.FIXED,
        max_new_tokens=32,
        default_ttl=60,
        max_session_ttl=600,
    )
    req = Request.build("hi", max_new_tokens=8, structured_output={"regex": "a+"})
    Job.resolve(req, limits)  # alone: fine
    value = 2 if field == "min_tokens" else True
    req = Request.build("hi", max_new_tokens=8, structured_output={"regex": "a+"}, **{field: value})
    with pytest.raises(InvalidRequest, match=f"structured_output cannot be combined with {field}"):
        Job.resolve(req, limits)
