"""Sampling defaults decided once (real processes): a request's unset sampling fields take
the target's generation_config, the same over the SDK, gRPC and HTTP, while a client from
before the fields were optional (temperature 0 sent as nothing) still decodes greedily."""

from __future__ import annotations

import json
import shutil
import urllib.request

import grpc
import pytest

from specdec.sdk import Client
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack
from tests.integration.test_http import free_port

pytestmark = pytest.mark.integration

N = 16
MODEL_SAMPLING = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}


@pytest.fixture(scope="module")
def sampling_target(test_models, tmp_path_factory):
    """The tiny target, whose generation_config asks for sampling (do_sample)."""
    path = tmp_path_factory.mktemp("sampling") / "target"
    shutil.copytree(test_models.target, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, **MODEL_SAMPLING)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def stack(test_models, sampling_target):
    port = free_port()
    flags = ("--http-port", str(port), "--served-model-name", "tiny")
    with small_stack(test_models.draft_noisy, sampling_target, gateway_flags=flags) as s:
        yield {**s, "http": f"http://127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack["gateway"].address, timeout=300) as c:
        yield c


def test_server_info_reports_the_models_sampling(client):
    got = client.server_info().sampling_defaults
    assert got is not None
    assert got.temperature == pytest.approx(0.7) and got.top_k == 5
    assert got.top_p == pytest.approx(0.9) and got.repetition_penalty == 1.0


@pytest.mark.parametrize("k", [0, 3])
def test_unset_sampling_is_the_models_over_sdk_and_http(client, stack, reference, tokenizer, k):
    prompt = PROMPTS[1]
    explicit = client.generate(prompt, max_new_tokens=N, k=k, seed=11, **MODEL_SAMPLING)
    unset = client.generate(prompt, max_new_tokens=N, k=k, seed=11)
    assert unset.token_ids == explicit.token_ids
    # The model's sampling, not greedy: this seed draws another continuation.
    greedy = reference(tokenizer(prompt).input_ids, N)
    assert explicit.token_ids != greedy
    body = {"model": "tiny", "prompt": prompt, "max_tokens": N, "seed": 11, "k": k}
    req = urllib.request.Request(
        stack["http"] + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    assert text == explicit.text


def test_explicit_temperature_zero_is_greedy(client, reference, tokenizer):
    ids = tokenizer(PROMPTS[2]).input_ids
    got = client.generate(PROMPTS[2], max_new_tokens=N, temperature=0.0, k=3)
    assert got.token_ids == reference(ids, N)


def test_an_old_client_sending_temperature_zero_stays_greedy(stack, reference, tokenizer):
    """Before `optional`, temperature 0 went on the wire as nothing, in a sampling message
    without model_defaults: that still reads as greedy."""
    ids = tokenizer(PROMPTS[2]).input_ids
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[2],
        max_new_tokens=N,
        sampling=common_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0),
    )
    assert not request.sampling.HasField("temperature") and not request.sampling.model_defaults
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        response = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=300)
    assert list(response.token_ids) == reference(ids, N)
