"""Structured output through real processes: the output equals constrained decoding of the
target alone (`transformers` generate() with the same grammar mask as a logits processor,
`GrammarProcessor`, built from the transformers tokenizer with the same engine, llguidance,
independently of the gateway's code), with k = 0, k = 3 and SSD, for a JSON
schema, a regex and a choice; the sampled distribution under a grammar is the target's
masked one; a bad grammar is INVALID_ARGUMENT / HTTP 400 before any replica works."""

from __future__ import annotations

import json
import math

import grpc
import llguidance
import openai
import pytest
import torch
from transformers import LogitsProcessorList

from specdec.common.prefix import prefix_hash
from specdec.sdk import Client, InvalidArgument
from specdec.tools.bench.structured import GrammarProcessor
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica
from tests.integration.test_http import free_port
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [a-z]{2,6}\."
CHOICES = ["apple", "banana", "cherry pie"]
# A Lark grammar embedding a JSON schema, shaped as the one that forces a tool call
# (specdec.gateway.front.http.tools).
LARK = "\n".join(
    (
        'start: "<tool_call>\\n" body "\\n</tool_call>"',
        "body: %json "
        + json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
                "x-guidance": {"whitespace_flexible": False},
            }
        ),
    )
)
SPECS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": LARK},
}


def grammar_of(kind: str) -> str:
    """The llguidance grammar of SPECS[kind], built here as a user of llguidance would (JSON
    compact, the gateway's default)."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False}
        )
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": False}
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(REGEX)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(LARK)
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in CHOICES)
    )


@pytest.fixture(scope="module")
def constrained(target_model, tokenizer):
    """constrained(prompt_ids, kind, n) -> the target's greedy generate() under the grammar."""
    cache: dict = {}

    def generate(ids: list[int], kind: str, n: int) -> list[int]:
        key = (tuple(ids), kind, n)
        if key not in cache:
            processor = GrammarProcessor(
                tokenizer, target_model.config.vocab_size, grammar_of(kind), len(ids)
            )
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = target_model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=n,
                    logits_processor=LogitsProcessorList([processor]),
                )
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def stack(test_models):
    """A verifier, the noisy drafter, a gateway with SSD off (gRPC and HTTP) and one with
    SSD on (one branch per round: both SSD paths in the sampled test)."""
    procs = []
    try:
        v = replica("verifier", test_models.target)
        d = replica("drafter", test_models.draft_noisy)
        procs += [v, d]
        v.wait_healthy(), d.wait_healthy()
        http_port = free_port()
        plain = gateway(
            [d], [v], None, "--http-port", str(http_port), "--served-model-name", "tiny"
        )
        ssd = gateway([d], [v], None, "--ssd", "--ssd-fan-out", "1")
        procs += [plain, ssd]
        plain.wait_healthy(), ssd.wait_healthy()
        yield {
            "verifier": v.address,
            "plain": plain.address,
            "ssd": ssd.address,
            "http": f"http://127.0.0.1:{http_port}/v1",
        }
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("mode", ["k0", "k3", "ssd"])
def test_greedy_equals_constrained_generate(stack, tokenizer, constrained, kind, mode):
    address = stack["ssd" if mode == "ssd" else "plain"]
    k = 0 if mode == "k0" else 3
    drafted = accepted = 0
    with Client(address, timeout=120) as client:
        for text in PROMPTS[:3]:
            ids = tokenizer(text).input_ids
            out = client.generate(
                token_ids=ids, max_new_tokens=N, k=k, structured_output=SPECS[kind]
            )
            expected = constrained(ids, kind, N)
            assert list(out.tokens) == expected, (text, out.text)
            # The grammar completed: EOS, and the text is what the grammar describes.
            assert out.finish_reason == "eos" and expected[-1] == tokenizer.eos_token_id
            if kind == "json_schema":
                value = json.loads(out.text)
                assert set(value) == {"name", "age"} and 0 <= value["age"] <= 150
            elif kind == "choice":
                assert out.text in CHOICES
            elif kind == "grammar":
                assert out.text.startswith("<tool_call>\n") and out.text.endswith("\n</tool_call>")
                assert json.loads(out.text[12:-13])["ok"] in (True, False)
            drafted += out.stats.draft_tokens
            accepted += out.stats.accepted_tokens
            assert out.stats.ssd is (mode == "ssd")
    if k:
        assert drafted > 0
        # The drafter drafts without the grammar: its drafts of free text inside the JSON
        # or the regex are accepted; a choice of words or a grammar's fixed text (tags, a
        # boolean) it would never write is not.
        assert accepted > 0 or kind in ("choice", "grammar")


def test_grammar_changes_the_output(stack, tokenizer, reference):
    """The unconstrained output is no JSON: the grammar is what made it one."""
    ids = tokenizer(PROMPTS[0]).input_ids
    with Client(stack["plain"], timeout=120) as client:
        plain = client.generate(token_ids=ids, max_new_tokens=N, k=3)
    assert list(plain.tokens) == reference(ids, N)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.text)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"json_schema": "{"}, "json_schema is not valid JSON"),
        ({"json_schema": {"type": "nonsense"}}, "nonsense"),
        ({"json_schema": {"$ref": "#/nowhere"}}, "nowhere"),
        ({"regex": "(a"}, "unclosed group"),
        ({"choice": []}, "choice needs at least one"),
        ({"grammar": " "}, "grammar is empty"),
        ({"grammar": "start: nothing_defined"}, "nothing_defined"),
    ],
)
def test_invalid_grammar_is_invalid_argument(stack, spec, named):
    with (
        Client(stack["plain"], timeout=60) as client,
        pytest.raises(InvalidArgument, match="structured_output") as e,
    ):
        client.generate("hello", max_new_tokens=4, structured_output=spec)
    assert named in str(e.value)


@pytest.mark.parametrize(
    ("masks", "named"),
    [
        ([verifier_pb2.GrammarMask(allowed_ids=[1])], "1 masks for 2"),
        ([verifier_pb2.GrammarMask(allowed_ids=[10**6])] * 2, "outside"),
        ([verifier_pb2.GrammarMask(allowed_bits=b"\x01")] * 2, "bytes"),
        ([verifier_pb2.GrammarMask(allowed_bits=b"\x00" * 48)] * 2, "no token"),
    ],
)
def test_verifier_refuses_bad_masks_and_keeps_serving(stack, masks, named):
    with grpc.insecure_channel(stack["verifier"]) as channel:
        verifier = verifier_pb2_grpc.VerifierServiceStub(channel)
        request = verifier_pb2.VerifyRequest(
            session_id="s/bad-masks",
            prefix=common_pb2.CachedPrefix(length=0, hash=prefix_hash([])),
            new_tokens=[5, 6],
            draft_tokens=[7],
            grammar_masks=masks,
        )
        with pytest.raises(grpc.RpcError) as e:
            verifier.Verify(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grammar_masks" in e.value.details() and named in e.value.details()
        del request.grammar_masks[:]
        assert verifier.Verify(request, timeout=60).cached_length >= 2  # still serving


def test_server_info_names_the_engine(stack):
    with Client(stack["plain"], timeout=60) as client:
        info = client.server_info()
    assert info.structured_output_engine.startswith("llguidance ")
    assert set(info.structured_output_kinds) == {
        "json_object",
        "json_schema",
        "regex",
        "choice",
        "grammar",
    }


def test_http_response_format_and_guided_fields(stack, tokenizer, constrained):
    http = openai.OpenAI(base_url=stack["http"], api_key="none", timeout=120)
    prompt = PROMPTS[1]
    ids = tokenizer(prompt).input_ids
    body = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0)
    schema = http.completions.create(
        **body,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            }
        },
    )
    assert schema.model_extra["specdec"]["token_ids"] == constrained(ids, "json_schema", N)
    assert schema.choices[0].finish_reason == "stop"
    json.loads(schema.choices[0].text)
    regex = http.completions.create(**body, extra_body={"guided_regex": REGEX})
    assert regex.model_extra["specdec"]["token_ids"] == constrained(ids, "regex", N)
    choice = http.completions.create(**body, extra_body={"guided_choice": CHOICES})
    assert choice.choices[0].text in CHOICES
    # Any object: this random model opens one and never closes it within N tokens.
    obj = http.completions.create(**body, extra_body={"response_format": {"type": "json_object"}})
    assert obj.model_extra["specdec"]["token_ids"] == constrained(ids, "json_object", N)
    assert obj.choices[0].text.startswith('{"')
    chat = http.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Give me a JSON object"}],
        max_tokens=N,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    assert set(json.loads(chat.choices[0].message.content)) == {"name", "age"}
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        http.completions.create(**body, extra_body={"guided_regex": "(a"})
    with pytest.raises(openai.BadRequestError, match="not several"):
        http.completions.create(**body, extra_body={"guided_regex": "a", "guided_choice": ["a"]})


SAMPLE_REGEX = r"[a-z ]+"


def masked_by(tokenizer, vocab: int):
    """allowed(seq) -> [vocab] bool: what SAMPLE_REGEX allows after the tokens seq."""
    grammar = llguidance.LLMatcher.grammar_from_regex(SAMPLE_REGEX)

    def allowed(seq: tuple[int, ...]) -> torch.Tensor:
        processor = GrammarProcessor(tokenizer, vocab, grammar, 0)
        processor.advance(list(seq))
        return processor.allowed()

    return allowed


def test_sampling_distribution_under_a_grammar(stack, tokenizer, target_model):
    """Sampled 4-token sequences (temperature 1, top-k 2) through the SSD gateway at k = 3
    under a regex follow the target's masked distribution, every one within 5 sigma; the
    unmasked distribution (negative control) is rejected by the same samples."""
    ids = tokenizer(PROMPTS[0]).input_ids
    allowed = masked_by(tokenizer, target_model.config.vocab_size)
    exact = exact_sequence_probs(target_model, ids, 4, 2, allowed)
    unmasked = exact_sequence_probs(target_model, ids, 4, 2)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    assert unmasked != exact
    results = sample_top2(stack["ssd"], ids, 1200, k=3, structured_output={"regex": SAMPLE_REGEX})
    seqs = [tuple(r.tokens) for r in results]
    check_sequence_counts(seqs, exact)
    # The negative control: these samples are not the unconstrained target's.
    with pytest.raises(AssertionError):
        check_sequence_counts(seqs, unmasked)
    assert sum(r.stats.ssd_hits for r in results) > 0
