"""The OpenAI-compatible HTTP API through real processes, with the official `openai` client.

A drafter, a verifier, a real Redis and a gateway serving gRPC and HTTP (--http-port,
--auth-tokens-file); tiny fp32 models, so greedy output must equal transformers' generate().
The verifier's KV cache bound (--max-cached-tokens) is set low enough that one long
prompt exceeds it: the replica's RESOURCE_EXHAUSTED, which the HTTP API answers as OpenAI
does a prompt over the context, 400 context_length_exceeded (never 429, which the `openai`
client retries). Backpressure (429 with Retry-After) comes from a verifier that lets
nothing wait (--max-queue 0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.otlpsink import OtlpReceiver
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS
from tests.integration.test_gateway import replica

pytestmark = pytest.mark.integration

N = 16  # new tokens per exactness check
KEY = "sk-test-key"
VERIFIER_CACHE = 320  # tokens the verifier may cache over all sessions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_gateway(
    drafter: str, verifier: str, http_port: int, *flags: str, env: dict | None = None
) -> ServiceProcess:
    return ServiceProcess.specdec(
        "gateway", "serve", "gateway", "--port", "0", "--host", "127.0.0.1",
        "--drafter", drafter, "--verifier", verifier, "--http-port", str(http_port),
        "--method", "model", "--k-policy", "fixed", *flags,
        env=env,
    ).start()  # fmt: skip


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/gRPC receiver on loopback: the gateway exports its traces here."""
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(test_models, receiver, tmp_path_factory):
    procs = []
    tokens = tmp_path_factory.mktemp("secrets") / "tokens"
    tokens.write_text(f"# bearer tokens, one per line\n{KEY}\nsk-another\n")
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with RedisProcess() as redis:
        try:
            d = replica("drafter", test_models.draft_noisy)
            v = replica("verifier", test_models.target, "--max-cached-tokens", str(VERIFIER_CACHE))
            procs += [d, v]
            d.wait_healthy(), v.wait_healthy()
            port, metrics_port = free_port(), free_port()
            g = http_gateway(
                d.address, v.address, port, "--redis", redis.url, "--auth-tokens-file", str(tokens),
                "--served-model-name", "tiny", "--metrics-port", str(metrics_port), env=otel,
            )  # fmt: skip
            procs.append(g)
            g.wait_healthy()
            yield {
                "gateway": g,
                "drafter": d,
                "verifier": v,
                "http": f"http://127.0.0.1:{port}",
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            }
        finally:
            for p in procs:
                p.stop()


@pytest.fixture(scope="module")
def oai(stack):
    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key=KEY, max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(stack):
    with Client(stack["gateway"].address, timeout=300, token=KEY) as c:
        yield c


def ext(obj) -> dict:
    """The `specdec` extension of a response or chunk."""
    return obj.model_extra["specdec"]


def streamed_ids(chunks) -> list[int]:
    """The token ids a stream carried (the role and usage chunks carry none)."""
    return [
        t for c in chunks for t in (c.model_extra or {}).get("specdec", {}).get("token_ids", [])
    ]


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def post(stack, path: str, body, key: str | None = KEY) -> tuple[int, dict]:
    """A raw HTTP POST (for the cases the client would not send); returns status, JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(stack["http"] + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(stack, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert oai.models.retrieve("tiny").id == "tiny"
    with urllib.request.urlopen(stack["http"] + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


@pytest.fixture(scope="module")
def strict(stack, test_models):
    """A second gateway over the same replicas: --strict-fields, no --served-model-name
    (the model's folder name), no bearer tokens."""
    port = free_port()
    g = http_gateway(stack["drafter"].address, stack["verifier"].address, port, "--strict-fields")
    try:
        g.wait_healthy()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300
        )
        yield client
        client.close()
    finally:
        g.stop()


def test_the_default_model_name_is_the_folders(strict, test_models):
    """Without --served-model-name the model is named by its folder (vLLM-style short
    names); the verifier's whole model path stays accepted as an alias."""
    folder = test_models.target.name
    assert [m.id for m in strict.models.list().data] == [folder]
    assert strict.models.retrieve(folder).id == folder
    whole = str(test_models.target)
    got = strict.completions.create(model=whole, prompt="x", max_tokens=2)
    assert got.model == folder and got.usage.completion_tokens == 2


def test_unknown_fields_are_ignored_unless_strict(stack, oai, strict, test_models):
    """Benchmark tools and SDKs send fields the gateway does not know: ignored, as vLLM and
    SGLang do; --strict-fields refuses them, naming the field in `param`."""
    extras = {"frobnicate": True, "service_tier": "auto"}
    got = oai.completions.create(
        model="tiny", prompt="x", max_tokens=2, extra_body=extras,
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
    )  # fmt: skip
    assert [c for c in got if not c.choices][-1].usage.completion_tokens == 2
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extras
    )
    assert chat.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        strict.completions.create(
            model=test_models.target.name, prompt="x", max_tokens=2, extra_body=extras
        )
    assert e.value.status_code == 400 and _error(e)["param"] == "frobnicate"
    assert "unsupported field(s): frobnicate, service_tier" in _error(e)["message"]
    # A field the gateway knows but cannot honour is refused either way.
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", extra_body={"best_of": 3})
    assert _error(e)["param"] == "best_of"


@pytest.mark.parametrize("k", [0, 4])
def test_completion_equals_generate(oai, tokenizer, reference, k):
    for text in PROMPTS[:2]:
        ids = tokenizer(text).input_ids
        expected = reference(ids, N)
        got = oai.completions.create(
            model="tiny", prompt=text, max_tokens=N, temperature=0, extra_body={"k": k}
        )
        assert ext(got)["token_ids"] == expected, f"k={k} prompt={text!r}"
        assert got.choices[0].text == tokenizer.decode(expected)
        assert got.choices[0].finish_reason == "length"
        assert ext(got)["stats"]["num_draft_tokens"] == k
        chunks = list(
            oai.completions.create(
                model="tiny", prompt=text, max_tokens=N, temperature=0, stream=True,
                extra_body={"k": k},
            )
        )  # fmt: skip
        assert streamed_ids(chunks) == expected
        assert "".join(c.choices[0].text for c in chunks) == got.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len(chunks) > 2  # it really streamed


def test_chat_equals_generate_with_the_template(oai, tokenizer, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a loop in Python."},
    ]
    ids = chat_ids(tokenizer, messages)
    expected = reference(ids, N)
    got = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0)
    assert ext(got)["token_ids"] == expected
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == N
    stream = oai.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed_ids(chunks) == expected
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == got.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + N
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences(oai):
    full = oai.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=N, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    assert stop, text
    cut = text.index(stop)
    for stream in (False, True):
        resp = oai.completions.create(
            model="tiny", prompt=PROMPTS[2], max_tokens=N, temperature=0, stop=[stop, "\x00"],
            stream=stream,
        )  # fmt: skip
        if stream:
            chunks = list(resp)
            got = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert (got, finish) == (text[:cut], "stop")
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=N, temperature=0
    )
    content = chat.choices[0].message.content
    stop = content[4:7]
    stopped = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=N, temperature=0,
        stop=stop,
    )  # fmt: skip
    assert stopped.choices[0].message.content == content[: content.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_usage_equals_grpc(oai, grpc_client):
    http = oai.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=N, temperature=0, extra_body={"k": 2}
    )
    native = grpc_client.generate(PROMPTS[3], max_new_tokens=N, k=2, temperature=0.0)
    assert http.usage.prompt_tokens == native.usage.prompt_tokens
    assert http.usage.completion_tokens == native.usage.completion_tokens
    assert http.usage.total_tokens == native.usage.prompt_tokens + native.usage.completion_tokens
    assert ext(http)["token_ids"] == list(native.tokens)
    assert http.choices[0].text == native.text


def _two_turns(oai, tokenizer, reference, session: str):
    """Turn 1 of a chat session, then turn 2 extending it; returns the second's input."""
    first = [{"role": "user", "content": "Tell me about foxes."}]
    one = oai.chat.completions.create(
        model="tiny", messages=first, max_tokens=N, temperature=0,
        extra_body={"session_id": session, "k": 3},
    )  # fmt: skip
    ids = chat_ids(tokenizer, first)
    assert ext(one)["token_ids"] == reference(ids, N)
    assert ext(one)["session"] == {
        "id": session, "history_tokens": 0, "turns": 1, "continued": False, "restarted": None,
    }  # fmt: skip
    history = ids + ext(one)["token_ids"]
    second = [
        *first,
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And about owls?"},
    ]
    # The new tokens: the rendered chat after the history's own text, tokenized alone.
    rendered = tokenizer.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
    history_text = tokenizer.decode(history, skip_special_tokens=False)
    assert rendered.startswith(history_text)
    new = tokenizer(rendered[len(history_text) :], add_special_tokens=False).input_ids
    return second, history, new


def test_chat_session_two_turns_reuse_the_cache(oai, tokenizer, reference):
    second, history, new = _two_turns(oai, tokenizer, reference, "http-chat-1")
    two = oai.chat.completions.create(
        model="tiny", messages=second, max_tokens=N, temperature=0,
        extra_body={"session_id": "http-chat-1", "k": 3},
    )  # fmt: skip
    assert ext(two)["token_ids"] == reference(history + new, N)
    assert ext(two)["session"]["continued"] is True
    assert ext(two)["session"]["history_tokens"] == len(history)
    assert ext(two)["session"]["turns"] == 2
    assert ext(two)["stats"]["cache_misses"] == 0
    assert two.usage.prompt_tokens_details.cached_tokens == len(history)
    assert two.usage.prompt_tokens == len(history) + len(new)
    # Another conversation under the same id starts afresh and says so.
    other = [{"role": "user", "content": "Something else entirely."}]
    three = oai.chat.completions.create(
        model="tiny", messages=other, max_tokens=4, temperature=0,
        extra_body={"session_id": "http-chat-1"},
    )  # fmt: skip
    assert ext(three)["session"]["continued"] is False
    assert "do not extend session 'http-chat-1'" in ext(three)["session"]["restarted"]
    assert ext(three)["token_ids"] == reference(chat_ids(tokenizer, other), 4)


def _error(exc_info) -> dict:
    """The error object of an openai.APIStatusError (the client unwraps "error")."""
    body = exc_info.value.body
    return body.get("error", body)


def test_errors(stack, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400
    assert "temperature must be a finite number >= 0" in _error(e)["message"]
    assert _error(e)["type"] == "invalid_request_error" and _error(e)["code"] == "invalid_argument"
    assert _error(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="n > 1 cannot be used with a session id"):
        oai.completions.create(model="tiny", prompt="x", n=2, extra_body={"session_id": "n"})
    with pytest.raises(
        openai.BadRequestError, match=r"max_new_tokens must be in \[1, 4096\], got 0"
    ):
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="num_draft_tokens must be in") as e:
        oai.completions.create(model="tiny", prompt="x", extra_body={"k": 999})
    assert _error(e)["param"] == "k"
    status, body = post(stack, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]

    # A body over the gRPC message limit is refused from its Content-Length, unread.
    host, port = stack["http"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {1 << 30}\r\n\r\n".encode()
        )
        answer = b""
        while b"bytes" not in answer and (part := s.recv(65536)):
            answer += part  # the status line and headers, then the body
    assert answer.startswith(b"HTTP/1.1 413") and b"over 67108864 bytes" in answer, answer

    bad_key = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.completions.create(model="tiny", prompt="x")
    assert e.value.status_code == 401 and _error(e)["code"] == "invalid_api_key"
    status, body = post(stack, "/v1/chat/completions", {"messages": []}, key=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"

    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and _error(e)["code"] == "model_not_found"
    assert (_error(e)["type"], _error(e)["param"]) == ("invalid_request_error", "model")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    # An unknown path, an unknown method: OpenAI's shape, the status's name as code.
    status, body = post(stack, "/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["code"] == "not_found"
    assert body["error"]["type"] == "invalid_request_error"
    req = urllib.request.Request(stack["http"] + "/v1/models", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(req, timeout=30)
    assert raw.value.code == 405 and set(raw.value.headers["Allow"].split(", ")) == {"GET", "HEAD"}
    assert json.loads(raw.value.read())["error"]["code"] == "method_not_allowed"

    # A deadline that cannot be met: 504 (unary); a stream that has started ends with the
    # same error as an event (the openai client raises it while iterating).
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(
            model="tiny", prompt="x", max_tokens=200, temperature=0,
            extra_body={"timeout": 0.01, "k": 0},
        )  # fmt: skip
    assert e.value.status_code == 504 and _error(e)["type"] == "timeout_error"
    assert "did not finish within timeout=0.01s" in _error(e)["message"]
    with pytest.raises(openai.APIError, match=r"did not finish within timeout=0.01s"):
        for _ in oai.completions.create(
            model="tiny", prompt="x", max_tokens=200, temperature=0, stream=True,
            extra_body={"timeout": 0.01, "k": 0},
        ):  # fmt: skip
            pass
    # The gateway still serves.
    assert (
        oai.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
    )


def test_a_prompt_that_cannot_fit_is_400_and_not_retried(stack):
    """Over the model's context or over a replica's KV cache bound: 400
    context_length_exceeded naming the prompt's field, as OpenAI answers. The `openai`
    client with its default retries raises at once: the gateway answers it exactly once."""
    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key=KEY, timeout=300)
    assert client.max_retries == 2  # retries 408, 409, 429 and 5xx, never a 400
    cases = [
        # the verifier's KV cache bound (its RESOURCE_EXHAUSTED)
        ("/v1/completions", "prompt", {"prompt": [5] * (VERIFIER_CACHE + 20), "max_tokens": 2}),
        # the model's context (512 tokens), checked by the gateway
        ("/v1/completions", "prompt", {"prompt": "x", "max_tokens": 4000}),
        ("/v1/chat/completions", "messages", {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 4000}),
    ]  # fmt: skip
    for path, param, body in cases:
        before = _answers(stack, path, 400)
        create = client.completions.create if "prompt" in body else client.chat.completions.create
        with pytest.raises(openai.BadRequestError) as e:
            create(model="tiny", temperature=0, **body)
        assert _error(e)["code"] == "context_length_exceeded", _error(e)
        assert (_error(e)["type"], _error(e)["param"]) == ("invalid_request_error", param)
        assert _settled(stack, path, 400, before + 1) == before + 1  # no retry
    assert "512 tokens" in _error(e)["message"]
    client.close()


@pytest.fixture(scope="module")
def busy(stack, test_models):
    """A gateway whose only verifier lets nothing wait (--max-queue 0): concurrent
    requests find its queue full, which is backpressure."""
    v = replica("verifier", test_models.target, "--max-queue", "0")
    g = None
    try:
        v.wait_healthy()
        port = free_port()
        g = http_gateway(stack["drafter"].address, v.address, port)
        g.wait_healthy()
        yield {"http": f"http://127.0.0.1:{port}", "model": test_models.target.name}
    finally:
        if g is not None:
            g.stop()
        v.stop()


def test_backpressure_is_429_with_retry_after(busy):
    """Every verifier's queue full: 429 rate_limit_error with Retry-After (the `openai`
    client waits that long before its retry); the gateway keeps serving."""
    client = openai.OpenAI(base_url=busy["http"] + "/v1", api_key="x", max_retries=0, timeout=300)
    results: list = [None] * 16

    def one(i: int) -> None:
        try:
            results[i] = client.completions.create(
                model=busy["model"], prompt=PROMPTS[i % len(PROMPTS)] * 3, max_tokens=8,
                temperature=0, extra_body={"k": 0},
            )  # fmt: skip
        except openai.APIStatusError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert refused, "a verifier that lets nothing wait refused nothing"
    for e in refused:
        assert e.status_code == 429, e
        assert e.response.headers["retry-after"] == "1"
        assert e.body["type"] == "rate_limit_error" and e.body["code"] == "resource_exhausted"
        assert "replica busy" in e.body["message"] and "@" not in e.body["message"]
    assert client.completions.create(model=busy["model"], prompt="x", max_tokens=2).usage
    client.close()


def test_not_ready_is_503():
    """A gateway whose replicas never answer: HTTP is up, every generation is 503."""
    port = free_port()
    g = http_gateway("127.0.0.1:9", "127.0.0.1:9", port, "--startup-timeout", "600")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.completions.create(model="m", prompt="x")
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, g.tail()
                time.sleep(0.3)
                continue
            except openai.InternalServerError as e:
                assert e.status_code == 503
                assert "the gateway is starting" in e.body["message"]
                assert e.body["type"] == "service_unavailable_error"
                break
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)
            raise AssertionError("health answered 200 before the replicas did")
        except urllib.error.HTTPError as e:
            assert e.code == 503
    finally:
        g.stop()


def test_disconnect_cancels_and_the_session_stays_usable(stack, oai, tokenizer, reference):
    session = "http-chat-cut"
    second, history, new = _two_turns(oai, tokenizer, reference, session)
    long_turn = oai.chat.completions.create(
        model="tiny", messages=second, max_tokens=400, temperature=0, stream=True,
        extra_body={"session_id": session, "k": 0},
    )  # fmt: skip
    chunks = iter(long_turn)
    next(chunks), next(chunks)  # the role chunk and the first tokens: the turn is running
    # A stalled verifier holds the turn open however fast the machine is (400 tokens of a
    # tiny model take about a second, less than the turn lock's wait): SIGSTOP is what a
    # verifier stuck in a long forward looks like to the gateway.
    verifier = stack["verifier"].proc
    verifier.send_signal(signal.SIGSTOP)
    try:
        # Its turn lock is held: a second turn of the session is refused meanwhile.
        with pytest.raises(openai.ConflictError) as e:
            oai.chat.completions.create(
                model="tiny", messages=second, max_tokens=2, extra_body={"session_id": session}
            )
        assert e.value.status_code == 409 and "has a turn in progress" in _error(e)["message"]
        assert e.value.response.headers["retry-after"] == "1"  # a live turn: a short hint
        long_turn.close()  # the client goes away mid-stream
        gateway = stack["gateway"]
        deadline = time.monotonic() + 120
        while not any("generation cancelled" in line for line in gateway.lines):
            assert time.monotonic() < deadline, gateway.tail()
            time.sleep(0.2)
    finally:
        verifier.send_signal(signal.SIGCONT)
    line = next(json.loads(x) for x in gateway.lines if "generation cancelled" in x)
    assert line["session_id"] == session and line["tokens"] < 400
    # The gateway still serves, and the session continues from its last finished turn.
    again = oai.chat.completions.create(
        model="tiny", messages=second, max_tokens=N, temperature=0,
        extra_body={"session_id": session, "k": 3},
    )  # fmt: skip
    assert ext(again)["session"]["continued"] is True
    assert ext(again)["token_ids"] == reference(history + new, N)


def test_concurrent_requests(oai, tokenizer, reference):
    """Several HTTP generations at once share the event loop with gRPC and stay exact."""
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        got = oai.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=8, temperature=0)
        results[i] = ext(got)["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert results[i] == reference(tokenizer(PROMPTS[i]).input_ids, 8)


def test_unary_disconnect_cancels(stack, oai):
    """A non-streamed request whose client goes away is cancelled too."""
    gateway = stack["gateway"]
    before = sum("generation cancelled" in line for line in gateway.lines)
    gone_before = _answers(stack, "/v1/completions", 499)
    body = json.dumps(
        {"model": "tiny", "prompt": "unary", "max_tokens": 400, "temperature": 0, "k": 0}
    ).encode()
    host, port = stack["http"].removeprefix("http://").split(":")
    verifier = stack["verifier"].proc
    try:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.3)  # the generation is under way
            # Freeze the verifier so the generation cannot finish before the client leaves,
            # whatever the machine's speed (400 tiny-model tokens can take under a second).
            verifier.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while sum("generation cancelled" in line for line in gateway.lines) == before:
            assert time.monotonic() < deadline, gateway.tail()
            time.sleep(0.2)
    finally:
        verifier.send_signal(signal.SIGCONT)
    line = [json.loads(x) for x in gateway.lines if "generation cancelled" in x][-1]
    assert line["session_id"] is None and line["tokens"] < 400
    assert _answers(stack, "/v1/completions", 499) == gone_before + 1  # no answer was sent
    assert (
        oai.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
    )


def test_ssd_and_seed_extensions(oai, tokenizer, reference):
    ids = tokenizer(PROMPTS[4]).input_ids
    got = oai.completions.create(
        model="tiny", prompt=PROMPTS[4], max_tokens=N, temperature=0,
        extra_body={"k": 2, "ssd": True},
    )  # fmt: skip
    stats = ext(got)["stats"]
    assert ext(got)["token_ids"] == reference(ids, N)
    assert stats["ssd"] is True and stats["num_draft_tokens"] == 2
    assert stats["ssd_hits"] + stats["ssd_misses"] > 0
    # Sampling with a seed is reproducible through the HTTP API as through gRPC.
    a, b = (
        oai.completions.create(
            model="tiny", prompt=PROMPTS[4], max_tokens=N, temperature=1.0, seed=7,
            extra_body={"k": 3, "top_k": 50},
        )
        for _ in range(2)
    )  # fmt: skip
    assert ext(a)["token_ids"] == ext(b)["token_ids"]


def _loadtest(stack, out, key: str, *argv: str) -> tuple[int, dict | None, str]:
    env = {**os.environ, "OPENAI_API_KEY": key}
    run = subprocess.run(
        [sys.executable, "-m", "specdec", "loadtest", "--api", "openai", "--gateway",
         stack["http"], "--out", str(out), "--no-progress", *argv],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    path = out / "loadtest.json"
    return run.returncode, json.loads(path.read_text()) if path.exists() else None, run.stderr


def test_loadtest_over_the_openai_api(stack, tmp_path):
    """`specdec loadtest --api openai`: every response equal to the same request run alone
    at k = 0 (--check-exact), and failures counted by the gRPC code the error body names."""
    rc, doc, err = _loadtest(
        stack, tmp_path / "ok", KEY, "--concurrency", "1,2", "--num-requests", "4",
        "--max-new-tokens", "8", "--temperature", "0", "--modes", "k0,k3", "--check-exact",
    )  # fmt: skip
    assert rc == 0, err
    assert doc["config"]["api"] == "openai"
    assert doc["exact"]["checked"] > 0 and doc["exact"]["mismatches"] == 0
    for r in doc["results"]:
        assert r["failed"] == 0 and r["completed"] >= 4, r
        assert r["total_output_tokens"] == 8 * r["completed"]
    k3 = [r for r in doc["results"] if r["mode"] == "k3"]
    assert all(r["k"] == 3 for r in k3)
    rc, doc, err = _loadtest(
        stack, tmp_path / "bad", "wrong-key", "--concurrency", "1", "--num-requests", "2",
        "--max-new-tokens", "4",
    )  # fmt: skip
    (result,) = doc["results"]
    assert result["completed"] == 0 and result["errors"] == {"UNAUTHENTICATED": result["failed"]}


def test_a_request_is_one_trace_under_the_callers_context(oai, receiver):
    """The HTTP request's SERVER span continues the caller's `traceparent`; the turn's
    spans (rounds, replica calls) hang under it, and the response names the trace."""
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    got = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "trace me"}], max_tokens=4,
        temperature=0, extra_body={"k": 2},
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )  # fmt: skip
    assert ext(got)["trace_id"] == trace_id

    def done(spans) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"POST /v1/chat/completions", "speculation round"} <= names

    spans = [s for s in receiver.wait_for(done, timeout=60) if s.trace_id == trace_id]
    (server,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert server.kind == "SERVER" and server.parent_id == parent
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["url.path"] == "/v1/chat/completions"
    assert server.attributes["gen_ai.usage.output_tokens"] == 4
    by_id = {s.span_id: s for s in spans}
    rounds = [s for s in spans if s.name == "speculation round"]
    for r in rounds:  # every round is a descendant of the request's span
        up = r
        while up.parent_id and up.parent_id in by_id:
            up = by_id[up.parent_id]
        assert up.span_id == server.span_id


def _answers(stack, path: str, status: int) -> float:
    """specdec_gateway_http_responses_total{path, status} from the gateway's /metrics."""
    with urllib.request.urlopen(stack["metrics"], timeout=30) as r:
        text = r.read().decode()
    want = f'specdec_gateway_http_responses_total{{path="{path}",status="{status}"}} '
    lines = [x for x in text.splitlines() if x.startswith(want)]
    return float(lines[0].split()[-1]) if lines else 0.0


def _settled(stack, path: str, status: int, least: float) -> float:
    """_answers once it has reached `least` (an answer is counted just after it has left)."""
    deadline = time.monotonic() + 30
    while (n := _answers(stack, path, status)) < least and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_answers_are_counted_by_path_and_status(stack, oai):
    before_ok = _answers(stack, "/v1/completions", 200)
    before_404 = _answers(stack, "/v1/completions", 404)
    oai.completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", max_tokens=2)
    assert _answers(stack, "/v1/completions", 200) == before_ok + 1
    assert _answers(stack, "/v1/completions", 404) == before_404 + 1


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_metrics_on_the_http_port(stack):
    """GET /metrics on the API port, as vLLM serves it: the registry --metrics-port
    serves, in Prometheus' text format, behind the bearer tokens like the API."""
    req = urllib.request.Request(
        stack["http"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    with urllib.request.urlopen(stack["metrics"], timeout=30) as r:
        port_text = r.read().decode()
    assert "specdec_gateway_http_responses_total{" in text
    assert "specdec_gateway_requests_total{" in text
    assert _families(text) == _families(port_text)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(stack["http"] + "/metrics", timeout=30)
    assert e.value.code == 401
    assert _settled(stack, "/metrics", 200, 1) >= 1  # the API counts its own scrapes


def test_https_with_the_gateways_tls_settings(tmp_path):
    """--tls-cert/--tls-key (and --tls-client-ca) cover the HTTP port as the gRPC one: a
    gateway whose replicas never answer still serves /health (503) over TLS only."""
    import ssl

    from specdec.tools.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    port = free_port()
    own_tmp = tmp_path / "tmp"  # the gateway's temp dir: this test's own, nobody else's
    own_tmp.mkdir()
    g = http_gateway(
        "127.0.0.1:9", "127.0.0.1:9", port, "--startup-timeout", "600",
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), env={"TMPDIR": str(own_tmp)},
    )  # fmt: skip
    try:
        url = f"https://127.0.0.1:{port}/health"
        trusted = ssl.create_default_context(cafile=str(pki.ca))
        trusted.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=30, context=trusted)
                raise AssertionError("health answered 200 before the replicas did")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and "starting" in json.loads(e.read())["error"]["message"]
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, g.tail()
                time.sleep(0.3)
        no_cert = ssl.create_default_context(cafile=str(pki.ca))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=30, context=no_cert).read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plaintext
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).read()
        # uvicorn loads the PEM bytes from memory: nothing of them is written to disk.
        assert not list(own_tmp.iterdir())
    finally:
        g.stop()
