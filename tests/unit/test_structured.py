"""Structured output's pieces alone: the masks on the wire and on the logits
(specdec.replica.masks), the gateway's cut of a draft (specdec.gateway.round.grammar), and why the
cut keeps the first forbidden draft token (the rule stays exact)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.common.errors import InvalidRequest
from specdec.gateway.round.grammar import Grammars, encode_mask
from specdec.replica.masks import InvalidMask, apply_masks, decode_mask, stack_masks
from specdec.replica.sampling import rejection_sample
from specdec.v1 import gateway_pb2, verifier_pb2


def bits_of(allowed: list[int], vocab: int) -> bytes:
    out = bytearray((vocab + 7) // 8)
    for t in allowed:
        out[t >> 3] |= 1 << (t & 7)
    return bytes(out)


def test_bitset_and_ids_decode_to_the_same_mask():
    vocab = 21
    allowed = [0, 3, 8, 20]
    from_bits = decode_mask(bits_of(allowed, vocab), [], vocab)
    from_ids = decode_mask(b"", allowed, vocab)
    assert torch.equal(from_bits, from_ids)
    assert torch.nonzero(from_bits).flatten().tolist() == allowed
    assert decode_mask(b"", [], vocab) is None  # unconstrained


@pytest.mark.parametrize(
    ("bits", "ids", "match"),
    [
        (b"\x01", [], "needs 3"),
        (b"\x00\x00\x00", [], "no token"),
        (b"", [21], "outside"),
        (b"", [-1], "outside"),
        (b"\x01\x00\x00", [1], "both"),
    ],
)
def test_bad_masks_are_refused(bits, ids, match):
    with pytest.raises(InvalidMask, match=match):
        decode_mask(bits, ids, 21)


def test_apply_masks_sets_forbidden_logits_to_minus_infinity():
    logits = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    allowed = stack_masks([decode_mask(b"", [1, 2], 4), None], 4)
    out = apply_masks(logits, allowed)
    assert out[0].tolist() == [float("-inf"), 1.0, 2.0, float("-inf")]
    assert out[1].tolist() == logits[1].tolist()
    assert apply_masks(logits, None) is logits


def test_encode_mask_picks_the_smaller_form():
    vocab = 1024
    few = encode_mask(bits_of([5, 700], vocab))
    assert list(few.allowed_ids) == [5, 700] and not few.allowed_bits
    many = encode_mask(bits_of(list(range(0, vocab, 2)), vocab))
    assert len(many.allowed_bits) == vocab // 8 and not many.allowed_ids


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.backend_tokenizer.to_str(), len(tokenizer), [tokenizer.eos_token_id])


def allowed_ids(mask: verifier_pb2.GrammarMask, vocab: int) -> list[int]:
    m = decode_mask(mask.allowed_bits, mask.allowed_ids, vocab)
    return [] if m is None else torch.nonzero(m).flatten().tolist()


def test_cut_keeps_the_first_forbidden_token_and_leaves_the_matcher(grammars, tokenizer):
    choice = gateway_pb2.StructuredOutput(
        choice=gateway_pb2.StructuredChoice(choices=["yes", "no"])
    )
    c = grammars.matcher(grammars.compile(choice))
    yes = tokenizer("yes").input_ids
    draft = [*yes[:-1], tokenizer("x").input_ids[0], *yes[-1:]]
    cut = c.cut(draft)
    assert cut.keep == len(yes) and cut.forbidden  # "ye", then "x" (rejected for certain)
    assert len(cut.masks) == cut.keep + 1
    assert draft[1] in allowed_ids(cut.masks[1], grammars.vocab_size)
    assert draft[cut.keep - 1] not in allowed_ids(cut.masks[cut.keep - 1], grammars.vocab_size)
    assert c.cut(draft) == cut  # the matcher is where it was
    c.advance(yes)
    eos = tokenizer.eos_token_id
    assert allowed_ids(c.cut([]).masks[0], grammars.vocab_size) == [eos]  # complete: EOS only
    done = c.cut([eos, 7, 8])
    assert done.keep == 1 and not done.forbidden  # nothing after EOS is used


def test_cut_of_an_allowed_draft_masks_every_position(grammars, tokenizer):
    spec = gateway_pb2.StructuredOutput(regex="[a-z ]+")
    c = grammars.matcher(grammars.compile(spec))
    draft = tokenizer("the fox").input_ids
    cut = c.cut(draft)
    assert cut.keep == len(draft) and not cut.forbidden and len(cut.masks) == len(draft) + 1
    for i, mask in enumerate(cut.masks[:-1]):
        assert draft[i] in allowed_ids(mask, grammars.vocab_size)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (gateway_pb2.StructuredOutput(), "names no kind"),
        (gateway_pb2.StructuredOutput(json_schema="[1"), "not valid JSON"),
        (gateway_pb2.StructuredOutput(json_schema="[1]"), "must be a JSON object"),
        (gateway_pb2.StructuredOutput(json_schema=json.dumps({"type": 3})), "json_schema"),
        (gateway_pb2.StructuredOutput(regex="a{2,1}"), "regex is invalid"),
        (gateway_pb2.StructuredOutput(regex=""), "regex is empty"),
        (
            gateway_pb2.StructuredOutput(choice=gateway_pb2.StructuredChoice(choices=["a", ""])),
            "non-empty",
        ),
    ],
)
def test_invalid_grammars_name_the_problem(grammars, spec, named):
    with pytest.raises(InvalidRequest, match=named):
        grammars.compile(spec)


def test_keeping_the_forbidden_draft_token_is_exact():
    """Sampling: a draft token the grammar forbids must still be verified (rejected for
    certain, the recovered token drawn from the residual). Cutting the draft before it
    instead (the position then sampled from the masked target) is not exact whenever the
    draft put mass on forbidden tokens: the same samples tell the two apart."""
    torch.manual_seed(0)
    n = 400_000
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    allowed = torch.tensor([True, True, False, True])
    masked = torch.where(allowed, target, 0.0)
    masked = masked / masked.sum()  # the constrained target p'
    draft = torch.tensor([0.5, 0.1, 0.3, 0.1])  # q: 0.3 on the forbidden token
    drafts = torch.multinomial(draft, n, replacement=True)  # [n]
    gen = torch.Generator().manual_seed(1)
    accepted, recovered = rejection_sample(
        drafts[:, None], draft.expand(n, 1, 4), masked.expand(n, 2, 4), gen, False
    )
    kept = torch.where(accepted == 1, drafts, recovered)
    forbidden = ~allowed[drafts]
    assert (accepted[forbidden] == 0).all()  # rejected for certain
    dropped = torch.where(forbidden, torch.multinomial(masked, n, True, generator=gen), kept)
    sigma = (masked * (1 - masked) / n).sqrt()
    kept_freq = torch.bincount(kept, minlength=4) / n
    dropped_freq = torch.bincount(dropped, minlength=4) / n
    assert ((kept_freq - masked).abs() <= 5 * sigma + 1e-9).all()
    assert ((dropped_freq - masked).abs() > 5 * sigma).any()


def test_sdk_builds_each_kind():
    from specdec.sdk.client import build_generate_request

    def spec(**kw):
        return build_generate_request("x", **kw).structured_output

    assert json.loads(spec(structured_output={"json_schema": {"type": "object"}}).json_schema) == {
        "type": "object"
    }
    assert spec(structured_output={"json_schema": '{"type":"string"}'}).json_schema == (
        '{"type":"string"}'
    )
    assert spec(structured_output={"regex": "a+"}).regex == "a+"
    assert list(spec(structured_output={"choice": ["a", "b"]}).choice.choices) == ["a", "b"]
    assert spec(structured_output={"json_object": True}).HasField("json_object")
    assert spec(structured_output={"grammar": 'start: "a"'}).grammar == 'start: "a"'
    assert not build_generate_request("x").HasField("structured_output")
    for bad in ({"regex": "a", "choice": ["a"]}, {"lark": "x"}, "json"):
        with pytest.raises(ValueError, match="structured_output"):
            build_generate_request("x", structured_output=bad)


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", None),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object"}},
                }
            },
            "json_schema",
            '{"type": "object"}',
        ),
        ({"guided_json": {"type": "object"}}, "json_schema", '{"type": "object"}'),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["a", "b"]}, "choice", None),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
def test_http_fields_become_structured_output(fields, kind, value):
    from specdec.gateway.front.http import api

    req, _ = api.completion_request({"prompt": "x", **fields}, "m")
    grammar = req.output.grammar  # the StructuredOutput the grammar engine compiles
    if kind is None:
        assert grammar is None
        return
    assert grammar.WhichOneof("kind") == kind
    if value is not None:
        assert getattr(grammar, kind) == value


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"response_format": {"type": "yaml"}}, "json_object"),
        ({"response_format": "json"}, "type"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "schema"),
        ({"guided_regex": 3}, "guided_regex must be a string"),
        ({"guided_choice": "a"}, "list of strings"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not several"),
    ],
)
def test_bad_http_fields_are_400(fields, match):
    from specdec.gateway.front.http import api

    with pytest.raises(InvalidRequest, match=match):
        api.completion_request({"prompt": "x", **fields}, "m")
