"""The request's typed parts (specdec.sdk.request): one declaration each, one conversion
to and from protobuf (Request.from_proto mirrors to_proto, every field), and the rule for
unset sampling fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from transformers import GenerationConfig

from specdec.common.errors import InvalidRequest
from specdec.common.params import SamplingParams
from specdec.replica.loading import generation_sampling
from specdec.sdk import AsyncClient, Client
from specdec.sdk.client import build_generate_request
from specdec.sdk.names import DraftMethod, KPolicy
from specdec.sdk.request import (
    PARTS,
    Output,
    Request,
    Sampling,
    Scoring,
    Session,
    Speculation,
    request_parameters,
)
from specdec.v1 import common_pb2, gateway_pb2

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


# Every field of every part set to a value other than its default (a new field fails
# test_the_round_trip_covers_every_field until it is added here).
EVERY_FIELD = Request(
    prompt="hello",
    sampling=Sampling(
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        min_p=0.125,
        seed=11,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        logit_bias={3: -2.0, 9: 4.5},
    ),
    speculation=Speculation(
        k=3, ssd=True, k_policy=KPolicy.ADAPTIVE, method=DraftMethod.SUFFIX, tree_width=4
    ),
    session=Session(
        session_id="s1", reset_session=True, session_ttl_seconds=90, session_expected_turns=0
    ),
    output=Output(
        max_new_tokens=17,
        stop=("\n\n", "END"),
        stop_token_ids=(5, 6),
        ignore_eos=True,
        min_tokens=2,
        n=3,
        structured_output=gateway_pb2.StructuredOutput(regex="[a-z]+"),
        prediction=(1, 2, 3),
        record=False,
    ),
    scoring=Scoring(logprobs=True, top_logprobs=4, prompt_logprobs=True),
)


def test_the_round_trip_covers_every_field():
    """Request.from_proto is the mirror of to_proto: every field of every part comes back."""
    for part in PARTS:
        name = part.__name__.lower()
        for f in dataclasses.fields(part):
            given, default = getattr(getattr(EVERY_FIELD, name), f.name), f.default
            # session_expected_turns cannot be given with reset_session: checked below
            if f.name != "session_expected_turns":
                assert given != default, f"set {name}.{f.name} in EVERY_FIELD"
    assert Request.from_proto(EVERY_FIELD.to_proto()) == EVERY_FIELD
    continued = dataclasses.replace(
        EVERY_FIELD,
        prompt=None,
        token_ids=(4, 5, 6),
        session=Session(session_id="s2", session_ttl_seconds=5, session_expected_turns=2),
        output=dataclasses.replace(EVERY_FIELD.output, prediction="text", record=True),
    )
    assert Request.from_proto(continued.to_proto()) == continued
    assert Request.from_proto(Request(prompt="x").to_proto()) == Request(prompt="x")
    # Names given as strings (the SDK's keywords) are the enum's members.
    assert Request.build("x", method="ngram", k_policy="fixed").speculation == Speculation(
        method=DraftMethod.NGRAM, k_policy=KPolicy.FIXED
    )


@pytest.mark.parametrize(
    ("build", "field", "match"),
    [
        (lambda m: setattr(m.speculation, "method", 9), "method", "speculation.method must be"),
        (lambda m: setattr(m.speculation, "k_policy", 7), "k_policy", "K_POLICY_ADAPTIVE, got 7"),
        (lambda m: setattr(m.session, "mode", 7), "reset_session", "unknown session mode 7"),
        (lambda m: setattr(m.session, "mode", 1), "reset_session", "without a session id"),
        (lambda m: m.prediction.SetInParent(), "prediction", "prediction is set but empty"),
    ],
)
def test_what_no_request_can_hold_is_refused_naming_its_field(build, field, match):
    msg = gateway_pb2.GenerateRequest(prompt="x", max_new_tokens=4)
    build(msg)
    with pytest.raises(InvalidRequest, match=match) as e:
        Request.from_proto(msg)
    assert e.value.field == field


def test_a_bad_name_is_refused_naming_its_field():
    with pytest.raises(InvalidRequest, match="method must be one of model, ngram") as e:
        Speculation(method="fast")
    assert e.value.field == "method"
    with pytest.raises(InvalidRequest, match="top_p must be in") as e:
        SamplingParams(top_p=2.0)
    assert e.value.field == "top_p"


def test_unset_fields_take_the_models_then_neutral():
    got = SamplingParams.from_proto(Sampling(top_k=3).to_proto(), MODEL)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (
        pytest.approx(0.7),
        pytest.approx(0.9),
        3,
        pytest.approx(1.05),
    )
    assert SamplingParams.from_proto(None, MODEL).temperature == pytest.approx(0.7)
    plain = SamplingParams.from_proto(Sampling().to_proto())  # no model defaults: neutral
    assert plain == SamplingParams() and plain.greedy


def test_a_message_without_model_defaults_reads_absent_as_neutral():
    """A client from before `optional` sends temperature 0 as nothing: greedy, whatever
    the model's defaults; top_p and repetition_penalty 0 read as unset."""
    legacy = common_pb2.SamplingParams(top_p=0.0, top_k=0)
    got = SamplingParams.from_proto(legacy, MODEL)
    assert got.greedy and got.top_p == 1.0 and got.top_k == 0 and got.repetition_penalty == 1.0


def test_out_of_range_is_invalid_request_naming_the_field():
    with pytest.raises(InvalidRequest, match="sampling: temperature must be a finite"):
        SamplingParams.from_proto(common_pb2.SamplingParams(temperature=-1.0))
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
