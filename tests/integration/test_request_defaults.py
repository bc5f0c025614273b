"""Sampling defaults decided once (real processes): a request's unset sampling fields take
the target's generation_config, the same over the SDK, gRPC and HTTP, while a client from
before the fields were optional (temperature 0 sent as nothing) still decodes greedily.
And min_p, applied by the drafter and the verifier alike. The drafter is the target itself
(same weights): drafts the verifier's rule would not draw show as rejections."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import grpc
import pytest

from specdec.sdk import Client, InvalidArgument
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
def stack(sampling_target):
    port = free_port()
    flags = ("--http-port", str(port), "--served-model-name", "tiny")
    with small_stack(sampling_target, sampling_target, gateway_flags=flags) as s:
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
    assert unset.tokens == explicit.tokens
    # The model's sampling, not greedy: this seed draws another continuation.
    greedy = reference(tokenizer(prompt).input_ids, N)
    assert list(explicit.tokens) != greedy
    body = {"prompt": prompt, "max_tokens": N, "seed": 11, "k": k}
    assert completion(stack, body)["choices"][0]["text"] == explicit.text


def completion(stack, body: dict) -> dict:
    """POST /v1/completions; the answer's JSON (an error's too)."""
    req = urllib.request.Request(
        stack["http"] + "/v1/completions",
        data=json.dumps({"model": "tiny", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}


def test_explicit_temperature_zero_is_greedy(client, reference, tokenizer):
    ids = tokenizer(PROMPTS[2]).input_ids
    got = client.generate(PROMPTS[2], max_new_tokens=N, temperature=0.0, k=3)
    assert list(got.tokens) == reference(ids, N)


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


@pytest.mark.parametrize("api", ["sdk", "http"])
def test_min_p_one_samples_the_argmax_on_both_replicas(client, stack, reference, tokenizer, api):
    """min_p 1 keeps only the most likely token: sampling at temperature 1 must give the
    greedy output (the verifier applies it), and every draft of the drafter (the same
    model) must be accepted (the drafter applies it too)."""
    ids = tokenizer(PROMPTS[3]).input_ids
    options = {"temperature": 1.0, "min_p": 1.0, "seed": 5, "k": 3}
    speculation = {"method": "model", "k_policy": "fixed"}
    if api == "sdk":
        got = client.generate(PROMPTS[3], max_new_tokens=N, **options, **speculation)
        tokens, accepted = list(got.tokens), got.stats.acceptance_rate
    else:
        body = {"prompt": PROMPTS[3], "max_tokens": N, **options, **speculation}
        answer = completion(stack, body)
        tokens = tokenizer(PROMPTS[3] + answer["choices"][0]["text"]).input_ids[len(ids) :]
        accepted = answer["specdec"]["stats"]["acceptance_rate"]
    assert tokens == reference(ids, N)
    assert accepted == 1.0


def test_min_p_out_of_range_is_refused_naming_it(client, stack):
    with pytest.raises(InvalidArgument, match=r"min_p must be in \[0, 1\], got 1.5"):
        client.generate("x", max_new_tokens=2, min_p=1.5)
    answer = completion(stack, {"prompt": "x", "max_tokens": 2, "min_p": -0.5})
    assert answer["status"] == 400 and answer["error"]["param"] == "min_p"
    assert "min_p" in client.server_info().supported_request_fields
