"""Lookup drafts through real processes (issue 21): ngram, suffix and hybrid are exact
against transformers' generate() on the tiny fp32 models, with and without SSD, over
several turns and under concurrency; one-hot lookup drafts keep the sampled distribution;
a prediction is accepted through the official `openai` client; metrics by method.

A tiny random model rarely copies its input, so the grounded prompts here are ones whose
greedy output repeats itself (found on these models: a loop such as `42 373 42 373`); the
tests assert from the statistics by source that lookup drafts were made and accepted.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import openai
import pytest

from specdec.sdk import AsyncClient, Client
from specdec.sdk.errors import InvalidArgument
from specdec.tools.launcher import ServiceProcess
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica
from tests.integration.test_http import free_port
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 48
# Prompts whose greedy continuation on the tiny target repeats itself (lookups hit).
GROUNDED = [";;;;;;;;;;", "    \n    \n    \n    \n", "x = x + 1\n" * 4, "\n\n\n\n\n\n"]
LOOKUP_METHODS = ("ngram", "suffix", "hybrid")


@pytest.fixture(scope="module")
def lookup_stack(test_models):
    """One verifier (the target), one drafter (the noisy copy), and gateways: `own` (no
    cache of outputs: lookups over the request's own text), `ssd` (SSD by default, the
    global cache), `http` (HTTP API, metrics, the cache per tenant)."""
    procs: list[ServiceProcess] = []
    try:
        verifier = replica("verifier", test_models.target)
        drafter = replica("drafter", test_models.draft_noisy)
        procs += [verifier, drafter]
        for p in procs:
            p.wait_healthy()
        http_port, metrics_port = free_port(), free_port()
        hybrid = ["--method", "hybrid"]  # the gateway's own default, said (gateway() sets model)
        http = [
            "--http-port", str(http_port), "--metrics-port", str(metrics_port),
            "--suffix-cache-scope", "tenant", "--served-model-name", "tiny",
        ]  # fmt: skip
        gws = {
            "own": gateway([drafter], [verifier], None, *hybrid, "--suffix-cache-scope", "off"),
            "ssd": gateway([drafter], [verifier], None, *hybrid, "--ssd"),
            "http": gateway([drafter], [verifier], None, *hybrid, *http),
            # n-grams of at most 2 tokens: never a confident lookup match (3), so every
            # ngram draft is the extension of a model draft
            "ext": gateway(
                [drafter], [verifier], None, *hybrid, "--suffix-cache-scope", "off",
                "--prompt-lookup-max", "2",
            ),
        }  # fmt: skip
        procs += gws.values()
        for g in gws.values():
            g.wait_healthy()
        out = {name: g.address for name, g in gws.items()}
        out["http_url"] = f"http://127.0.0.1:{http_port}"
        out["metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
        yield out
    finally:
        for p in procs:
            p.stop()


def by_source(results) -> dict[str, list[int]]:
    total: dict[str, list[int]] = {}
    for r in results:
        for source, row in r.stats.by_source.items():
            acc = total.setdefault(source, [0, 0, 0])
            for i, v in enumerate(row):
                acc[i] += v
    return total


@pytest.mark.parametrize("ssd", [False, True], ids=["plain", "ssd"])
@pytest.mark.parametrize("method", ["model", *LOOKUP_METHODS])
def test_greedy_equals_generate(lookup_stack, tokenizer, reference, method, ssd):
    """Every method, with and without SSD, gives generate()'s tokens; the lookup methods
    drafted and had drafts accepted; the drafter's cache, left behind by lookup rounds,
    catches up through the prefix without a full resend. With SSD, hybrid speculates on
    its lookup rounds as well, and the lookup methods never do."""
    results = []
    with Client(lookup_stack["own"], timeout=300) as client:
        for text in [*GROUNDED, *PROMPTS[:2]]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=3, method=method, ssd=ssd)
            assert list(got.tokens) == reference(ids, N), (method, text)
            assert got.stats.method == method and got.stats.ssd is ssd
            assert got.stats.cache_misses == 0
            results.append(got)
    sources = by_source(results)
    if method == "model":
        assert set(sources) == {"model"}
        return
    lookup = "suffix" if method == "suffix" else "ngram"
    drafts, _, accepted = sources[lookup]
    assert drafts > 0 and accepted > 0, sources
    if method == "hybrid":
        assert sources["model"][0] > 0  # the drafter where the lookup was not confident
        mixed = [r for r in results if {"model", "ngram"} <= set(r.stats.by_source)]
        assert mixed  # one request went from the drafter to lookups and back
        if ssd:
            assert sum(r.stats.ssd_hits + r.stats.ssd_misses for r in results) > 0
            # lookup rounds send a Speculate too (the next round may need the drafter):
            # more Speculates than rounds the draft model drafted
            assert sum(r.stats.ssd_speculates for r in results) > sources["model"][0]
    else:
        assert "model" not in sources  # a lookup method never calls the drafter
        assert sum(r.stats.lookup_no_match_rounds for r in results) > 0
        assert sum(r.stats.ssd_speculates for r in results) == 0  # nor Speculates


def test_lookup_drafts_respect_max_new_tokens_and_context(lookup_stack, tokenizer, reference):
    """A lookup draft is never longer than what is left before max_new_tokens, nor than
    the context (512 tokens on the tiny models): the verifier would refuse it."""
    ids = tokenizer(GROUNDED[0]).input_ids
    with Client(lookup_stack["own"], timeout=300) as client:
        for n in (1, 2, 5):
            got = client.generate(token_ids=ids, max_new_tokens=n, method="ngram")
            assert list(got.tokens) == reference(ids, n)
            assert len(got.stats.rounds_by_k) <= n  # k <= n - 1
        long = (ids * 60)[: 512 - 20]
        got = client.generate(token_ids=long, max_new_tokens=20, method="suffix")
        assert list(got.tokens) == reference(long, 20)
        assert got.stats.by_source["suffix"][0] > 0


def test_suffix_cache_serves_a_repeated_request(lookup_stack, tokenizer, reference):
    """The gateway's cache of recent outputs: the same request again is drafted from it."""
    ids = tokenizer(PROMPTS[3]).input_ids
    with Client(lookup_stack["ssd"], timeout=300) as client:
        first = client.generate(token_ids=ids, max_new_tokens=N, method="model")
        again = client.generate(token_ids=ids, max_new_tokens=N, method="suffix")
    assert list(first.tokens) == list(again.tokens) == reference(ids, N)
    accepted = again.stats.by_source["suffix"][2]
    assert accepted >= N // 2 and again.stats.rounds < first.stats.rounds


def test_suffix_cache_per_tenant(lookup_stack, tokenizer, reference):
    """Under --suffix-cache-scope tenant one tenant's outputs never draft for another."""
    ids = tokenizer(PROMPTS[4]).input_ids
    address = lookup_stack["http"]
    with Client(address, timeout=300, tenant="alice") as alice:
        alice.generate(token_ids=ids, max_new_tokens=N, method="model")
        again = alice.generate(token_ids=ids, max_new_tokens=N, method="suffix")
    with Client(address, timeout=300, tenant="bob") as bob:
        other = bob.generate(token_ids=ids, max_new_tokens=N, method="suffix")
    assert list(again.tokens) == list(other.tokens) == reference(ids, N)
    assert again.stats.by_source["suffix"][2] >= N // 2
    assert other.stats.by_source.get("suffix", (0, 0, 0))[2] < N // 4


def test_multi_turn_quoting_itself(lookup_stack, tokenizer, reference):
    """Three turns of a session under hybrid with SSD: the third quotes the first's output,
    which the lookups find in the history."""
    a = tokenizer(GROUNDED[2]).input_ids
    b = tokenizer(PROMPTS[1]).input_ids
    with Client(lookup_stack["ssd"], timeout=300) as client:
        first = client.generate(token_ids=a, max_new_tokens=24, session_id="quote", k=3)
        second = client.generate(token_ids=b, max_new_tokens=24, session_id="quote", k=3)
        quote = list(first.tokens[:12])
        third = client.generate(token_ids=quote, max_new_tokens=24, session_id="quote", k=3)
    assert list(first.tokens) == reference(a, 24)
    history = [*a, *first.tokens, *b]
    assert list(second.tokens) == reference(history, 24)
    history = [*history, *second.tokens, *quote]
    assert list(third.tokens) == reference(history, 24)
    assert third.stats.cache_misses == 0
    assert third.stats.method == "hybrid"


def test_concurrent_requests_of_every_method(lookup_stack, tokenizer, reference):
    prompts = [tokenizer(t).input_ids for t in [*GROUNDED, *PROMPTS[:4]]]
    methods = ["model", *LOOKUP_METHODS]

    async def run():
        async with AsyncClient(lookup_stack["ssd"], timeout=300) as client:
            jobs = [
                client.generate(token_ids=ids, max_new_tokens=32, method=methods[i % 4], k=3)
                for i, ids in enumerate(prompts * 2)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, (ids, got) in enumerate(zip(prompts * 2, results, strict=True)):
        assert list(got.tokens) == reference(ids, 32), i
    assert {"model", "ngram", "suffix"} <= set(by_source(results))


def test_sampling_distribution_with_one_hot_lookup_drafts(lookup_stack, tokenizer, target_model):
    """Sampled through the stack with drafts from a prediction (one-hot q): all 16
    sequences of 4 tokens (top-k 2) within 5 sigma, and the negative control of
    check_sequence_counts fails a distribution 0.1 off. The prediction is the likeliest
    sequence, so its drafts are accepted and rejected often."""
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    likeliest = list(max(exact, key=exact.get))
    results = sample_top2(lookup_stack["own"], ids, 1200, k=3, method="model", prediction=likeliest)
    drafts, draft_tokens, accepted = by_source(results)["prediction"]
    assert drafts >= 1200 and accepted > 300 and draft_tokens - accepted > 300
    assert sum(r.usage.accepted_prediction_tokens for r in results) == accepted
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_sampling_distribution_with_extended_model_drafts(lookup_stack, tokenizer, target_model):
    """The same with model drafts of one token that prompt lookup extends (hybrid): each
    Verify mixes the drafter's q and one-hot q. The tiny random target never continues a
    token the way its context did, so the extensions here are proposed and rejected (the
    residual path); their acceptance is checked on the rule itself
    (test_sampled_model_draft_then_one_hot_extension_in_one_call)."""
    ids = tokenizer(PROMPTS[0]).input_ids
    # The likeliest continuations ahead of the prompt: a drafted token then occurred
    # earlier (a 1-gram match) and the lookup has something to propose after it.
    first = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    ids = [t for seq in sorted(first, key=first.get, reverse=True)[:8] for t in seq] + ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    results = sample_top2(lookup_stack["ext"], ids, 1200, k=1, method="hybrid")
    sources = by_source(results)
    assert set(sources) == {"model", "ngram"}, sources
    drafts, draft_tokens, _ = sources["ngram"]
    assert drafts > 300 and draft_tokens > 600, sources
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_sampling_distribution_with_suffix_drafts(lookup_stack, tokenizer, target_model):
    """The same with drafts from the gateway's cache of outputs (method suffix, one-hot q)."""
    ids = tokenizer(PROMPTS[1]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    with Client(lookup_stack["ssd"], timeout=300) as client:  # fill the cache
        for seq in exact:
            client.generate(token_ids=[*ids, *seq[:1]], max_new_tokens=3, k=0)
    results = sample_top2(lookup_stack["ssd"], ids, 1200, k=3, method="suffix")
    drafts, draft_tokens, accepted = by_source(results)["suffix"]
    assert drafts > 300 and accepted > 100 and draft_tokens - accepted > 100
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_prediction_with_the_openai_client(lookup_stack, tokenizer, reference):
    """OpenAI's Predicted Outputs: a prediction equal to the expected output is accepted
    almost entirely, and the output is the same as without it."""
    client = openai.OpenAI(
        base_url=lookup_stack["http_url"] + "/v1", api_key="none", max_retries=0, timeout=300
    )
    messages = [{"role": "user", "content": "Repeat the file."}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, temperature=0,
        extra_body={"method": "model"},
    )  # fmt: skip
    expected = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, temperature=0,
        prediction={"type": "content", "content": expected}, extra_body={"method": "model"},
    )  # fmt: skip
    assert predicted.choices[0].message.content == expected
    ids = predicted.model_extra["specdec"]["token_ids"]
    assert ids == plain.model_extra["specdec"]["token_ids"]
    details = predicted.usage.completion_tokens_details
    share = details.accepted_prediction_tokens / predicted.usage.completion_tokens
    print(
        f"accepted prediction share: {share:.2f} ({details.accepted_prediction_tokens} of "
        f"{predicted.usage.completion_tokens}; rejected {details.rejected_prediction_tokens})"
    )
    assert share >= 0.8
    completion = client.completions.create(
        model="tiny", prompt=GROUNDED[0], max_tokens=16, temperature=0,
        extra_body={"prediction": {"type": "content", "content": "no such text"}},
    )  # fmt: skip
    assert completion.model_extra["specdec"]["token_ids"] == reference(
        tokenizer(GROUNDED[0]).input_ids, 16
    )
    with pytest.raises(openai.BadRequestError, match="prediction must be"):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"prediction": "text"}
        )
    with pytest.raises(openai.BadRequestError, match="method must be one of"):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"method": "eagle"}
        )
    client.close()


def test_server_info_metrics_and_bad_input(lookup_stack):
    with Client(lookup_stack["http"], timeout=60) as client:
        info = client.server_info()
        assert info.default_method == "hybrid"
        assert info.lookup["suffix_cache_scope"] == "tenant"
        assert info.lookup["prompt_lookup_min"] == 1 and info.lookup["prompt_lookup_max"] == 5
        client.generate(token_ids=[5, 6, 7, 5, 6, 7, 5, 6, 7], max_new_tokens=8, method="suffix")
        with pytest.raises(InvalidArgument, match=r"prediction\.token_ids holds 999999"):
            client.generate(token_ids=[5], max_new_tokens=2, prediction=[999999])
    with grpc.insecure_channel(lookup_stack["http"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(prompt="x", max_new_tokens=2)
        request.speculation.method = 9
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.method" in e.value.details()
    with urllib.request.urlopen(lookup_stack["metrics"], timeout=30) as r:
        text = r.read().decode()
    for name in (
        'specdec_gateway_spec_decode_num_drafts_by_method_total{method="suffix"}',
        "specdec_gateway_suffix_cache_tokens ",
        "specdec_gateway_suffix_cache_lookups_total ",
    ):
        lines = [x for x in text.splitlines() if x.startswith(name)]
        assert lines and float(lines[0].split()[-1]) > 0, name


def test_seeded_sampling_stays_reproducible_with_the_cache(lookup_stack, tokenizer):
    """A seeded request drafts from its own text only: the cache of other outputs, which
    changes between two identical requests, cannot change its seeded draws."""
    ids = tokenizer(PROMPTS[5]).input_ids
    with Client(lookup_stack["ssd"], timeout=300) as client:
        client.generate(token_ids=ids, max_new_tokens=N, method="model")  # fills the cache
        a, b = (
            client.generate(
                token_ids=ids, max_new_tokens=N, method="suffix", temperature=1.0, seed=11
            )
            for _ in range(2)
        )
    assert list(a.tokens) == list(b.tokens)
