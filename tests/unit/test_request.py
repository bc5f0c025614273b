"""The request's typed parts (specdec.sdk.request): one declaration each, one conversion
to and from protobuf, and the rule for unset sampling fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from transformers import GenerationConfig

from specdec.common.errors import InvalidRequest
from specdec.common.params import SamplingParams, sampling_from_proto
from specdec.replica.loading import generation_sampling
from specdec.sdk import AsyncClient, Client
from specdec.sdk.client import build_generate_request
from specdec.sdk.request import PARTS, Request, Sampling, request_parameters
from specdec.v1 import common_pb2

MODEL = Sampling(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.05)


def test_every_part_field_is_an_sdk_keyword_once():
    names = [p.name for p in request_parameters()]
    assert len(names) == len(set(names))
    for part in PARTS:
        for field in (f.name for f in dataclasses.fields(part)):
            assert field in names, (part, field)
    for method in (Client.generate, AsyncClient.stream, build_generate_request):
        assert "temperature" in inspect.signature(method).parameters


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="temprature"):
        build_generate_request("x", temprature=0.5)


def test_round_trip_through_the_proto():
    sampling = Sampling(temperature=0.5, top_k=3, seed=9, logit_bias={4: 1.5})
    assert Sampling.from_proto(sampling.to_proto()) == sampling
    request = Request.build("hi", k=2, method="ngram", session_id="s", logprobs=True)
    msg = request.to_proto()
    assert msg.speculation.num_draft_tokens == 2 and msg.session.id == "s" and msg.logprobs


def test_unset_fields_take_the_models_then_neutral():
    got = sampling_from_proto(Sampling(top_k=3).to_proto(), MODEL)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (
        pytest.approx(0.7),
        pytest.approx(0.9),
        3,
        pytest.approx(1.05),
    )
    assert sampling_from_proto(None, MODEL).temperature == pytest.approx(0.7)
    plain = sampling_from_proto(Sampling().to_proto())  # no model defaults: neutral
    assert plain == SamplingParams() and plain.greedy


def test_a_message_without_model_defaults_reads_absent_as_neutral():
    """A client from before `optional` sends temperature 0 as nothing: greedy, whatever
    the model's defaults; top_p and repetition_penalty 0 read as unset."""
    legacy = common_pb2.SamplingParams(top_p=0.0, top_k=0)
    got = sampling_from_proto(legacy, MODEL)
    assert got.greedy and got.top_p == 1.0 and got.top_k == 0 and got.repetition_penalty == 1.0


def test_out_of_range_is_invalid_request_naming_the_field():
    with pytest.raises(InvalidRequest, match="sampling: temperature must be a finite"):
        sampling_from_proto(common_pb2.SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (GenerationConfig(), SamplingParams()),
        (GenerationConfig(do_sample=False, temperature=0.3), SamplingParams()),
        (
            GenerationConfig(do_sample=False, repetition_penalty=1.1),
            SamplingParams(repetition_penalty=1.1),
        ),
        (
            GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20),
            SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
        ),
        (None, SamplingParams()),
    ],
)
def test_generation_config_as_generate_reads_it(config, expected):
    got = generation_sampling(config)
    assert SamplingParams(**got.__dict__) == expected
