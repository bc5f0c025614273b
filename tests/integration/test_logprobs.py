"""logprobs, top_logprobs, echo and n > 1 through the whole stack (real processes, fp32
tiny models): every score equals log_softmax of the target's logits computed by
transformers directly, within 1e-4, with k = 0, k = 3 and SSD; n choices are each exact.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
import torch

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import replica
from tests.integration.test_http import free_port, post

pytestmark = pytest.mark.integration

N = 12
MODES = {"k0": {"k": 0}, "k3": {"k": 3}, "ssd": {"k": 3, "ssd": True}}
ATOL = 1e-4


@pytest.fixture(scope="module")
def stack(test_models):
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy)
        v = replica("verifier", test_models.target)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        port = free_port()
        g = ServiceProcess.specdec(
            "gateway", "serve", "gateway", "--port", "0", "--host", "127.0.0.1",
            "--drafter", d.address, "--verifier", v.address, "--http-port", str(port),
            "--served-model-name", "tiny", "--k-policy", "fixed",
        ).start()  # fmt: skip
        procs.append(g)
        g.wait_healthy()
        yield {"gateway": g, "http": f"http://127.0.0.1:{port}"}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def oai(stack):
    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="-", max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture(scope="module")
def scores(target_model):
    """scores(ids) -> log_softmax of the target's logits over ids [len(ids), vocab]."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target_model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run


def ext(obj) -> dict:
    return obj.model_extra["specdec"]


def post_stream(stack, body: dict) -> list[dict]:
    """A streamed POST /v1/completions: its JSON chunks."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        stack["http"] + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check_rows(ref: torch.Tensor, start: int, tokens: list[int], logprobs, tops=None) -> None:
    """ref[start + i - 1] scores tokens[i]: the token's value and its best alternatives."""
    for i, token in enumerate(tokens):
        row = ref[start + i - 1]
        assert logprobs[i] == pytest.approx(row[token].item(), abs=ATOL), i
        if tops is not None:
            best = row.topk(len(tops[i])).values.tolist()
            assert [lp for _, lp in tops[i]] == pytest.approx(best, abs=ATOL), i


@pytest.mark.parametrize("mode", MODES)
def test_chat_logprobs_greedy(oai, tokenizer, reference, scores, mode):
    messages = [{"role": "user", "content": "Count to five."}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    got = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, temperature=0, logprobs=True,
        top_logprobs=5, extra_body=MODES[mode],
    )  # fmt: skip
    tokens = ext(got)["token_ids"]
    assert tokens == reference(ids, N)
    content = got.choices[0].logprobs.content
    assert len(content) == len(tokens)
    ref = scores([*ids, *tokens])
    tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    check_rows(ref, len(ids), tokens, [c.logprob for c in content], tops)
    for c, token in zip(content, tokens, strict=True):
        assert c.token == tokenizer.decode([token]) and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 5
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)  # most likely first
        assert c.logprob == pytest.approx(values[0], abs=ATOL)  # greedy: the top token
    # Streamed: each delta carries its own tokens' scores, the same values.
    stream = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, temperature=0, logprobs=True,
        top_logprobs=5, stream=True, extra_body=MODES[mode],
    )  # fmt: skip
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]


@pytest.mark.parametrize("mode", MODES)
def test_completion_logprobs_sampled(oai, tokenizer, scores, mode):
    """Under sampling the scores are the target's before temperature: log_softmax of its
    raw logits at each sampled token, whatever the draft did."""
    ids = tokenizer(PROMPTS[0]).input_ids
    got = oai.completions.create(
        model="tiny", prompt=ids, max_tokens=N, temperature=0.8, top_p=0.9, seed=11,
        logprobs=3, extra_body=MODES[mode],
    )  # fmt: skip
    tokens = ext(got)["token_ids"]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    ref = scores([*ids, *tokens])
    check_rows(ref, len(ids), tokens, lp.token_logprobs)
    for i, (token, top) in enumerate(zip(tokens, lp.top_logprobs, strict=True)):
        best = ref[len(ids) + i - 1].topk(3)
        want = {
            tokenizer.decode([t]): v
            for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        }
        want.setdefault(tokenizer.decode([token]), lp.token_logprobs[i])  # the token itself too
        assert top.keys() == want.keys()
        assert list(top.values()) == pytest.approx(list(want.values()), abs=ATOL)
    assert lp.text_offset[0] == 0
    # The same seed, the same tokens (the scores change nothing).
    plain = oai.completions.create(
        model="tiny", prompt=ids, max_tokens=N, temperature=0.8, top_p=0.9, seed=11,
        extra_body=MODES[mode],
    )  # fmt: skip
    assert ext(plain)["token_ids"] == tokens and plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_lm_eval_asks(stack, tokenizer, scores):
    """What lm-eval's local-completions sends for a loglikelihood request: token ids in a
    batch of one, echo, logprobs 1, max_tokens 1, temperature 0."""
    ids = tokenizer(PROMPTS[3]).input_ids
    body = {
        "model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }  # fmt: skip
    status, got = post(stack, "/v1/completions", body, key=None)
    assert status == 200, got
    choice = got["choices"][0]
    lp = choice["logprobs"]
    generated = got["specdec"]["token_ids"]
    assert len(generated) == 1
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = scores([*ids, *generated])
    check_rows(ref, 1, [*ids[1:], *generated], lp["token_logprobs"][1:])
    for i, top in enumerate(lp["top_logprobs"][1:], start=1):
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=ATOL)
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True) + tokenizer.decode(
        generated, skip_special_tokens=True
    )
    # Streamed: the prompt's text and rows first, then the completion's.
    chunks = post_stream(stack, {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    rows = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for r in rows if r for t in r["token_logprobs"]] == lp["token_logprobs"]
    assert [t for r in rows if r for t in r["text_offset"]] == lp["text_offset"]
    # echo without logprobs: the prompt's text, no scores.
    status, plain = post(stack, "/v1/completions", {**body, "logprobs": None}, key=None)
    assert status == 200 and plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == choice["text"]


def test_grpc_stream_and_prompt_logprobs(stub, tokenizer, reference, scores):
    ids = tokenizer(PROMPTS[1]).input_ids
    req = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=ids), max_new_tokens=N, logprobs=True,
        top_logprobs=2, prompt_logprobs=True,
    )  # fmt: skip
    unary = stub.Generate(req, timeout=300)
    assert list(unary.token_ids) == reference(ids, N)
    assert list(unary.logprobs.token_ids) == list(unary.token_ids)
    ref = scores([*ids, *unary.token_ids])
    check_rows(ref, len(ids), list(unary.token_ids), list(unary.logprobs.logprobs))
    prompt = unary.prompt_logprobs
    assert list(prompt.token_ids) == ids and len(prompt.logprobs) == len(ids) - 1
    check_rows(ref, 1, ids[1:], list(prompt.logprobs))
    assert prompt.num_top == 2 and len(prompt.top_token_ids) == 2 * (len(ids) - 1)
    messages = list(stub.GenerateStream(req, timeout=300))
    assert [t for m in messages for t in m.logprobs.token_ids] == list(unary.token_ids)
    # Equal within float noise: under the hybrid default the stream's rounds may draft from
    # the cache the unary request filled, so its forwards cover other spans.
    streamed = [v for m in messages for v in m.logprobs.logprobs]
    assert streamed == pytest.approx(list(unary.logprobs.logprobs), abs=ATOL)
    assert [m.HasField("prompt_logprobs") for m in messages].count(True) == 1
    assert messages[0].prompt_logprobs == prompt


def test_bad_logprobs_requests_are_refused(stack, stub, tokenizer):
    status, body = post(
        stack, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        key=None,
    )  # fmt: skip
    assert status == 400 and "top_logprobs must be in [0, 20]" in body["error"]["message"]
    status, body = post(
        stack, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, key=None,
    )  # fmt: skip
    assert status == 400 and "top_logprobs needs logprobs" in body["error"]["message"]
    status, body = post(
        stack, "/v1/completions", {"prompt": "hi", "n": 2, "session_id": "s"}, key=None
    )
    assert status == 400 and "n > 1 cannot be used with a session id" in body["error"]["message"]
    status, body = post(stack, "/v1/completions", {"prompt": "hi", "n": 17}, key=None)
    assert status == 400 and "n must be in [1, 16]" in body["error"]["message"]
    ids = tokenizer(PROMPTS[1]).input_ids
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(
            gateway_pb2.GenerateRequest(
                prompt_token_ids=gateway_pb2.TokenIds(ids=ids), max_new_tokens=2,
                prompt_logprobs=True, session=gateway_pb2.SessionOptions(id="x"),
            ),
            timeout=60,
        )  # fmt: skip
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs cannot be used with a session id" in e.value.details()


@pytest.mark.parametrize("mode", MODES)
def test_n_greedy_choices_equal_generate(oai, tokenizer, reference, mode):
    ids = tokenizer(PROMPTS[2]).input_ids
    got = oai.completions.create(
        model="tiny", prompt=ids, max_tokens=N, temperature=0, n=4, logprobs=1,
        extra_body=MODES[mode],
    )  # fmt: skip
    expected = tokenizer.decode(reference(ids, N), skip_special_tokens=True)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [expected] * 4
    first = got.choices[0].logprobs.token_logprobs
    for c in got.choices[1:]:
        assert c.logprobs.token_logprobs == pytest.approx(first, abs=ATOL)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 4 * N


@pytest.mark.parametrize("mode", MODES)
def test_n_sampled_choices_are_the_derived_seeds(stub, tokenizer, mode):
    """Choice i of a request with seed s is what one request with seed s + i returns."""
    ids = tokenizer(PROMPTS[4]).input_ids
    opts = MODES[mode]
    spec = gateway_pb2.SpeculationParams(num_draft_tokens=opts["k"], ssd=opts.get("ssd", False))

    def request(seed: int, n: int) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            prompt_token_ids=gateway_pb2.TokenIds(ids=ids), max_new_tokens=N, n=n,
            sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed), speculation=spec,
        )  # fmt: skip

    seed = (1 << 64) - 2  # the derived seeds wrap around
    got = stub.Generate(request(seed, 4), timeout=300)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    singles = [stub.Generate(request((seed + i) % (1 << 64), 1), timeout=300) for i in range(4)]
    for choice, single in zip(got.choices, singles, strict=True):
        assert list(choice.token_ids) == list(single.token_ids), choice.index
        assert choice.text == single.text and choice.finish_reason == single.finish_reason
    assert len({tuple(c.token_ids) for c in got.choices}) > 1  # the choices differ
    # Every fork found its source: no choice resent the prompt.
    assert [c.stats.cache_misses for c in got.choices] == [0, 0, 0, 0]
    assert list(got.token_ids) == list(got.choices[0].token_ids)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in got.choices)
    assert got.usage.prompt_tokens == len(ids)
    # Streamed: each message names its choice; per choice the deltas add up.
    messages = list(stub.GenerateStream(request(seed, 4), timeout=300))
    for choice in got.choices:
        mine = [m for m in messages if m.index == choice.index]
        assert [t for m in mine for t in m.token_ids] == list(choice.token_ids)
        assert [m.finish_reason for m in mine if m.finish_reason] == [choice.finish_reason]
    assert messages[-1].usage == got.usage


def test_n_streams_over_http_with_indices(oai, tokenizer, reference):
    ids = tokenizer(PROMPTS[0]).input_ids
    chunks = list(
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=N,
            temperature=0, n=3, stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert texts[0] == texts[1] == texts[2] and texts[0]
    assert chunks[-1].usage.completion_tokens == 3 * N
    del ids, reference


def test_sdk_logprobs_and_choices(stack, tokenizer, reference, scores):
    ids = tokenizer(PROMPTS[5]).input_ids
    with Client(stack["gateway"].address, timeout=300) as client:
        got = client.generate(
            token_ids=ids, max_new_tokens=N, k=3, logprobs=True, top_logprobs=2,
            prompt_logprobs=True, n=2,
        )  # fmt: skip
        assert list(got.tokens) == reference(ids, N)
        assert [c.index for c in got.choices] == [0, 1]
        assert got.choices[1].tokens == got.tokens and got.choices[1].logprobs is not None
        assert [r.token_id for r in got.logprobs] == list(got.tokens)
        ref = scores([*ids, *got.tokens])
        check_rows(ref, len(ids), list(got.tokens), [r.logprob for r in got.logprobs])
        assert all(len(r.top) == 2 and r.top[0][0] == r.token_id for r in got.logprobs)
        assert got.prompt_logprobs[0].logprob is None
        check_rows(ref, 1, ids[1:], [r.logprob for r in got.prompt_logprobs[1:]])
        assert got.usage.completion_tokens == 2 * N
        chunks = list(client.stream(token_ids=ids, max_new_tokens=N, k=3, logprobs=True))
        assert [r.logprob for c in chunks for r in c.logprobs or ()] == pytest.approx(
            [r.logprob for r in got.logprobs], abs=ATOL
        )
        assert chunks[-1].final.logprobs == tuple(r for c in chunks for r in c.logprobs or ())
        with pytest.raises(ValueError, match="use generate"):
            client.stream(token_ids=ids, n=2)
