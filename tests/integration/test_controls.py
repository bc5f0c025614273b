"""Length, stop and logits-processor controls through the whole stack (real processes):
greedy output equals transformers' `generate()` on the fp32 tiny target with the same
processors (transformers' own where it has them, an independent presence / frequency
reference otherwise), plain (k = 0), speculative (k = 3) and with SSD, over gRPC and HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from transformers import LogitsProcessorList

from specdec.common.controls import Controls
from specdec.sdk import Client, InvalidArgument
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack
from tests.integration.test_http import free_port
from tests.unit.test_processors import reference_processors

pytestmark = pytest.mark.integration

N = 24
EOS = 2  # the tiny tokenizer's <|eos|>
# With this bias the tiny target's greedy continuation of PROMPTS[1] meets EOS after a few
# tokens (its EOS logit is exactly 0, the best ordinary token's about 19).
EOS_BIAS = 15.0
MODES = {"k0": {"k": 0}, "k3": {"k": 3, "ssd": False}, "ssd": {"k": 3, "ssd": True}}


@pytest.fixture(scope="module")
def stack(test_models):
    """One drafter (the noisy draft), one verifier (the target), one gateway with HTTP."""
    port = free_port()
    flags = ("--http-port", str(port), "--served-model-name", "tiny")
    with small_stack(test_models.draft_noisy, test_models.target, gateway_flags=flags) as s:
        yield {**s, "http": f"http://127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack["gateway"].address, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def hf(target_model):
    """hf(ids, n, controls, eos) -> target.generate(do_sample=False) with controls as
    transformers logits processors (the output starts after ids), stopping at the ids of
    eos (None: never)."""

    def generate(ids, n, controls: Controls, eos=(EOS,)) -> list[int]:
        t = torch.tensor([ids])
        processors: LogitsProcessorList = reference_processors(controls, len(ids))
        with torch.inference_mode():
            out = target_model.generate(
                t,
                attention_mask=torch.ones_like(t),
                do_sample=False,
                max_new_tokens=n,
                logits_processor=processors,
                eos_token_id=list(eos) if eos else None,
            )
        return out[0, len(ids) :].tolist()

    return generate


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


# name -> (SDK arguments, the same as Controls for the reference)
PROCESSORS = {
    "presence": ({"presence_penalty": 1.5}, Controls(presence_penalty=1.5)),
    "frequency": ({"frequency_penalty": 1.2}, Controls(frequency_penalty=1.2)),
    "negative-frequency": ({"frequency_penalty": -0.8}, Controls(frequency_penalty=-0.8)),
    "repetition": ({"repetition_penalty": 1.6}, Controls(repetition_penalty=1.6)),
    "logit_bias": (
        {"logit_bias": {45: 6.0, 317: -100.0, 73: 3.5}},
        Controls(logit_bias=((45, 6.0), (73, 3.5), (317, -100.0))),
    ),
    "all": (
        {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.4,
            "repetition_penalty": 1.2,
            "logit_bias": {EOS: 4.0, 91: 2.0},
        },
        Controls(
            presence_penalty=0.5,
            frequency_penalty=0.4,
            repetition_penalty=1.2,
            logit_bias=((EOS, 4.0), (91, 2.0)),
        ),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", PROCESSORS)
def test_processors_greedy_equal_generate(client, tokenizer, hf, name, mode):
    kwargs, controls = PROCESSORS[name]
    changed = False
    for text in PROMPTS[:2]:
        ids = ids_of(tokenizer, text)
        got = client.generate(token_ids=ids, max_new_tokens=N, **kwargs, **MODES[mode])
        expected = hf(ids, N, controls)
        assert list(got.tokens) == expected, f"{name} {mode} {text!r}"
        changed |= expected != hf(ids, N, Controls())
        if mode != "k0":
            assert got.stats.draft_tokens > 0
    assert changed, f"{name} does not change the tiny target's output: the test cannot fail"


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_masks_eos_until_then(client, tokenizer, hf, mode):
    ids = ids_of(tokenizer, PROMPTS[1])
    strong = 20.0  # EOS wins wherever it is allowed
    plain = hf(ids, N, Controls(logit_bias=((EOS, strong),)))
    assert plain == [EOS]  # without min_tokens EOS comes first
    got = client.generate(
        token_ids=ids, max_new_tokens=N, min_tokens=8, logit_bias={EOS: strong}, **MODES[mode]
    )
    expected = hf(
        ids, N, Controls(logit_bias=((EOS, strong),), min_tokens=8, min_tokens_ids=(EOS,))
    )
    assert list(got.tokens) == expected
    assert len(got.tokens) == 9 and got.tokens[-1] == EOS and got.finish_reason == "eos"


@pytest.mark.parametrize("mode", MODES)
def test_ignore_eos_generates_through_eos(client, tokenizer, hf, mode):
    ids = ids_of(tokenizer, PROMPTS[1])
    controls = Controls(logit_bias=((EOS, EOS_BIAS),))
    got = client.generate(
        token_ids=ids,
        max_new_tokens=N,
        ignore_eos=True,
        logit_bias={EOS: EOS_BIAS},
        **MODES[mode],
    )
    expected = hf(ids, N, controls, eos=None)
    assert list(got.tokens) == expected
    assert len(got.tokens) == N and got.finish_reason == "length"
    assert got.tokens.count(EOS) >= 2  # it went through EOS, more than once
    # With min_tokens too, EOS is not masked: ignore_eos takes it off the stop list.
    both = client.generate(
        token_ids=ids,
        max_new_tokens=N,
        ignore_eos=True,
        min_tokens=N,
        logit_bias={EOS: EOS_BIAS},
        **MODES[mode],
    )
    assert both.tokens == got.tokens


@pytest.mark.parametrize("mode", MODES)
def test_stop_token_ids_end_with_stop(client, tokenizer, hf, mode):
    ids = ids_of(tokenizer, PROMPTS[0])
    plain = hf(ids, N, Controls())
    stop_id = plain[6]
    first = plain.index(stop_id)
    got = client.generate(token_ids=ids, max_new_tokens=N, stop_token_ids=[stop_id], **MODES[mode])
    assert list(got.tokens) == hf(ids, N, Controls(), eos=(EOS, stop_id)) == plain[: first + 1]
    assert got.finish_reason == "stop"
    assert got.text == tokenizer.decode(plain[:first])  # the stop token's text is dropped
    # min_tokens past the stop token's first occurrence masks it there: generate() with
    # the same mask agrees.
    masked = client.generate(
        token_ids=ids,
        max_new_tokens=N,
        stop_token_ids=[stop_id],
        min_tokens=first + 2,
        **MODES[mode],
    )
    controls = Controls(min_tokens=first + 2, min_tokens_ids=(EOS, stop_id))
    expected = hf(ids, N, controls, eos=(EOS, stop_id))
    assert list(masked.tokens) == expected and stop_id not in masked.tokens[: first + 2]


def test_penalties_count_only_this_turns_output(client, tokenizer, hf):
    """A session's second turn: presence / frequency count its own output only (the
    history and prompt are not output), repetition the whole sequence."""
    p1, p2 = ids_of(tokenizer, PROMPTS[2]), ids_of(tokenizer, " and then")
    kwargs = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    controls = Controls(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    t1 = client.generate(token_ids=p1, max_new_tokens=12, k=3, session_id="ctl", **kwargs)
    assert list(t1.tokens) == hf(p1, 12, controls)
    t2 = client.generate(token_ids=p2, max_new_tokens=12, k=3, session_id="ctl", **kwargs)
    history = [*p1, *t1.tokens, *p2]
    assert list(t2.tokens) == hf(history, 12, controls)
    assert t2.stats.cache_misses == 0


def test_server_info_lists_the_controls(client):
    info = client.server_info()
    assert {"ignore_eos", "min_tokens", "stop_token_ids", "logit_bias"} <= set(
        info.supported_request_fields
    )
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty"} <= set(
        info.supported_request_fields
    )
    assert info.max_stop_token_ids == 256 and info.max_logit_bias == 300


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -9}, "frequency_penalty must be in [-2, 2], got -9"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0"),
        ({"logit_bias": {384: 1.0}}, "logit_bias token id 384 is outside the vocabulary"),
        ({"logit_bias": {3: 200.0}}, "logit_bias of token 3 must be in [-100, 100], got 200"),
        ({"min_tokens": 9}, "min_tokens must be at most max_new_tokens (8), got 9"),
        ({"stop_token_ids": [5, 384]}, "stop_token_ids holds 384, outside the vocabulary"),
        ({"stop_token_ids": list(range(257))}, "at most 256 stop_token_ids, got 257"),
    ],
)
def test_bad_controls_are_invalid_argument(client, kwargs, message):
    with pytest.raises(InvalidArgument) as e:
        client.generate(PROMPTS[0], max_new_tokens=8, **kwargs)
    assert message in str(e.value)


def test_replicas_refuse_bad_output_controls(stack):
    """The verifier checks what the gateway would never send, with the field's name."""
    with grpc.insecure_channel(stack["verifier"].address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        request = verifier_pb2.VerifyRequest(
            session_id="r/bad-output",
            new_tokens=[5, 6, 7],
            sampling=common_pb2.SamplingParams(presence_penalty=1.0),
            output=common_pb2.OutputControls(output_start=4),
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "output.output_start 4 lies beyond the sequence before the draft" in e.value.details()
        )
        request.output.output_start = 0
        request.sampling.logit_bias[999] = 1.0
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logit_bias token id 999 is outside the vocabulary" in e.value.details()


# --------------------------------------------------------------------------------------
# HTTP: a translation of the same fields
# --------------------------------------------------------------------------------------


def post(stack, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(
        stack["http"] + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(stack, path: str) -> dict:
    with urllib.request.urlopen(stack["http"] + path, timeout=60) as r:
        return json.loads(r.read())


def test_http_completion_fields_equal_grpc(stack, client, tokenizer, hf):
    ids = ids_of(tokenizer, PROMPTS[1])
    body = {
        "prompt": ids,
        "max_tokens": N,
        "temperature": 0,
        "k": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.2,
        "logit_bias": {str(EOS): EOS_BIAS, "91": 2.0},
        "min_tokens": 6,
        "ignore_eos": False,
    }
    status, out = post(stack, "/v1/completions", body)
    assert status == 200, out
    controls = Controls(
        presence_penalty=0.5,
        frequency_penalty=0.4,
        repetition_penalty=1.2,
        logit_bias=((EOS, EOS_BIAS), (91, 2.0)),
        min_tokens=6,
        min_tokens_ids=(EOS,),
    )
    expected = hf(ids, N, controls)
    assert out["specdec"]["token_ids"] == expected
    assert out["choices"][0]["finish_reason"] == ("stop" if expected[-1] == EOS else "length")
    # stop_token_ids and ignore_eos over HTTP.
    stop_id = expected[2]
    status, out = post(stack, "/v1/completions", {**body, "stop_token_ids": [stop_id]})
    assert status == 200, out
    # min_tokens masks the stop token too (vLLM): it cannot end the first 6 tokens.
    masked = Controls(**{**controls.__dict__, "min_tokens_ids": (EOS, stop_id)})
    assert out["specdec"]["token_ids"] == hf(ids, N, masked, eos=(EOS, stop_id))
    assert stop_id not in out["specdec"]["token_ids"][:6]
    status, out = post(
        stack, "/v1/completions", {**body, "stop_token_ids": [stop_id], "min_tokens": 0}
    )
    assert status == 200, out
    unmasked = Controls(**{**controls.__dict__, "min_tokens": 0, "min_tokens_ids": ()})
    stopped = hf(ids, N, unmasked, eos=(EOS, stop_id))
    assert out["specdec"]["token_ids"] == stopped and stopped[-1] == stop_id
    assert out["choices"][0]["finish_reason"] == "stop"
    status, out = post(stack, "/v1/completions", {**body, "ignore_eos": True, "min_tokens": 0})
    assert status == 200, out
    assert len(out["specdec"]["token_ids"]) == N


def test_http_chat_min_tokens_without_max_tokens(stack, tokenizer, hf):
    messages = [{"role": "user", "content": "Say something."}]
    body = {
        "messages": messages,
        "temperature": 0,
        "min_tokens": 5,
        "logit_bias": {str(EOS): 30.0},  # EOS wins as soon as it may
    }
    status, out = post(stack, "/v1/chat/completions", body)
    assert status == 200, out
    ids = out["specdec"]["token_ids"]
    assert len(ids) == 6 and ids[-1] == EOS and out["choices"][0]["finish_reason"] == "stop"


def test_models_list_the_supported_fields(stack):
    card = get(stack, "/v1/models")["data"][0]
    fields = set(card["specdec"]["supported_request_fields"])
    assert {"ignore_eos", "min_tokens", "stop_token_ids", "presence_penalty"} <= fields
    assert {"frequency_penalty", "repetition_penalty", "logit_bias"} <= fields


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3"),
        ({"presence_penalty": "high"}, "presence_penalty must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"logit_bias": {"x": 1}}, "logit_bias: key 'x' is not a token id"),
        ({"logit_bias": [1, 2]}, "logit_bias must be an object mapping token ids to numbers"),
        ({"logit_bias": {"5": "up"}}, "logit_bias: the bias of token 5 must be a number"),
        ({"logit_bias": {"500": 1}}, "logit_bias token id 500 is outside the vocabulary"),
        ({"min_tokens": -1}, "min_tokens: -1 is out of range"),
        ({"min_tokens": 9}, "min_tokens must be at most max_new_tokens (8), got 9"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        # Still not built: refused by name, never ignored.
        ({"best_of": 2}, "best_of=2 is not supported"),
    ],
)
def test_http_bad_controls_are_400(stack, extra, message):
    status, out = post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 8, **extra})
    assert status == 400, out
    assert message in out["error"]["message"]


@pytest.fixture(scope="module")
def same(test_models):
    """A stack whose drafter is the target itself."""
    with (
        small_stack(test_models.target, test_models.target) as s,
        Client(s["gateway"].address, timeout=300) as c,
    ):
        yield c


@pytest.mark.parametrize("ssd", [False, True])
def test_drafter_applies_the_same_processors(same, tokenizer, hf, ssd):
    """With the target as its drafter, a drafter that applies the request's processors
    exactly as the verifier does (plain drafts and SSD branches, each with its own tokens)
    has every draft token accepted; one that did not would be rejected wherever a
    processor changes the argmax.

    Whether a round's SSD branch is used is timing: a Speculate still running at its
    verdict is a hit only if the drafter had started it (tests/integration/test_ssd.py's
    hit path), and on a loaded machine every one of a request's rounds can miss that way.
    So with SSD the request runs again, each run checked in full, until one has used a
    prepared branch (at most five runs)."""
    kwargs, controls = PROCESSORS["all"]
    ids = ids_of(tokenizer, PROMPTS[0])
    controls = Controls(**{**controls.__dict__, "min_tokens": 4, "min_tokens_ids": (EOS, 5)})
    expected = hf(ids, N, controls, eos=(EOS, 5))
    runs = []
    while len(runs) < 5 and not (runs and (not ssd or runs[-1].ssd_hits > 0)):
        got = same.generate(
            token_ids=ids,
            max_new_tokens=N,
            k=3,
            ssd=ssd,
            min_tokens=4,
            stop_token_ids=[5],
            **kwargs,
        )
        assert list(got.tokens) == expected
        assert got.stats.draft_tokens > 0 and got.stats.acceptance_rate == 1.0, got.stats
        runs.append(got.stats)
    if ssd:
        assert runs[-1].ssd_hits > 0, runs


@pytest.mark.parametrize("ssd", [False, True])
def test_sampled_drafts_follow_the_processed_target(same, tokenizer, ssd):
    """Under sampling, a drafter that is the target draws from the target's own processed
    distribution (up to the fp16 rounding it travels in), so nearly every draft token is
    accepted; a seeded request repeats itself exactly."""
    kwargs = {  # strong enough that the raw and the processed distributions differ a lot
        "presence_penalty": 2.0,
        "frequency_penalty": 2.0,
        "repetition_penalty": 2.0,
        "logit_bias": {45: 8.0, 73: 8.0, 91: 8.0},
    }
    ids = ids_of(tokenizer, PROMPTS[3])
    runs = [
        same.generate(
            token_ids=ids, max_new_tokens=N, k=3, ssd=ssd, temperature=1.0, seed=11, **kwargs
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    stats = runs[0].stats
    assert stats.draft_tokens > 0 and stats.acceptance_rate > 0.9, stats
