"""The HTTP bodies' declared schema: Sampling's fields are body fields by the same name,
integer ranges are the proto fields', and a refusal names its field's path."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.gateway.front.http import api, schema
from specdec.gateway.front.http.errors import FieldError
from specdec.sdk.names import DraftMethod, KPolicy
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2, gateway_pb2


def test_every_sampling_field_is_a_body_field():
    for body in (schema.CompletionBody, schema.ChatBody):
        assert {f.name for f in dataclasses.fields(Sampling)} <= set(body.model_fields)


@pytest.mark.parametrize(
    "field, message, proto_field",
    [
        ("max_tokens", gateway_pb2.GenerateRequest, "max_new_tokens"),
        ("top_k", common_pb2.SamplingParams, "top_k"),
        ("seed", common_pb2.SamplingParams, "seed"),
        ("k", gateway_pb2.SpeculationParams, "num_draft_tokens"),
        ("tree_width", gateway_pb2.SpeculationParams, "tree_width"),
        ("min_tokens", gateway_pb2.GenerateRequest, "min_tokens"),
    ],
)
def test_integer_ranges_are_the_protos(field, message, proto_field):
    low, high = schema.proto_range(message, proto_field)
    parsed = schema.parse(schema.CompletionBody, {"prompt": "x", field: high})
    assert getattr(parsed, field) == high
    api.completion_request({"prompt": "x", field: high}, "m")  # the wire holds it
    for bad in (low - 1, high + 1):
        with pytest.raises(FieldError) as e:
            schema.parse(schema.CompletionBody, {"prompt": "x", field: bad})
        assert e.value.param == field
        assert e.value.details.startswith(f"{field}: {bad} is out of range")


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": "x", "top_k": 1.5}, "top_k", "top_k must be an integer"),
        ({"prompt": "x", "temperature": True}, "temperature", "temperature must be a number"),
        ({"prompt": "x", "method": "magic"}, "method", "method must be one of model, ngram"),
        ({"prompt": "x", "user": 5}, "user", "user must be a string"),
        ({"prompt": [1, 1 << 70]}, "prompt", "prompt token ids must fit in int64"),
        ({"prompt": "x", "stop_token_ids": [1 << 70]}, "stop_token_ids", "must fit in int64"),
        ({"prompt": "x", "prediction": {"type": "content", "content": 3}}, "prediction", None),
        ({"prompt": "x", "guided_json": 3}, "guided_json", "guided_json must be a JSON schema"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
        (
            {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
            "guided_regex",
            "give one of guided_regex, guided_choice, not several",
        ),
    ],
)
def test_refusals_name_the_field(body, param, message):
    with pytest.raises(FieldError) as e:
        api.completion_request(body, "m")
    assert e.value.param == param
    assert message is None or message in e.value.details, e.value.details


def test_a_chat_parses_into_the_typed_parts():
    req, opts, messages = api.chat_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "k_policy": " Adaptive ",
            "method": "suffix",
            "session_id": "s",
            "session_reset": True,
            "guided_choice": ["yes", "no"],
            "prediction": {"type": "content", "content": [{"type": "text", "text": "yes"}]},
            "min_tokens": 3,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        "m",
    )
    assert messages == [{"role": "user", "content": "hi"}]
    out = req.output
    assert req.prompt is None and out.max_new_tokens == 3 and out.min_tokens == 3
    assert req.speculation.k_policy is KPolicy.ADAPTIVE
    assert req.speculation.method is DraftMethod.SUFFIX
    assert req.session.session_id == "s" and req.session.reset_session
    assert out.structured_output == {"choice": ["yes", "no"]}
    assert list(out.grammar.choice.choices) == ["yes", "no"]
    assert out.prediction == "yes" and req.scoring.logprobs and not req.scoring.top_logprobs
    assert opts.stream and opts.include_usage and opts.continuous_usage
    assert not opts.max_tokens_given and opts.prompt_field == "messages"
