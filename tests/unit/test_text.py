"""The gateway's TextOutput: EOS, token limit, stop strings and what may be streamed."""

from __future__ import annotations

import zlib

import pytest

from specdec.gateway.text import TextCodec, TextOutput


@pytest.fixture(scope="module")
def codec(test_models):
    from transformers import AutoTokenizer

    from specdec.replica.loading import canonical_tokenizer_json

    tok = AutoTokenizer.from_pretrained(test_models.tokenizer)
    return TextCodec(canonical_tokenizer_json(tok))


def completion(codec, stop=(), max_new=100, eos=(2,)):
    return TextOutput(codec, max_new, frozenset(eos), tuple(stop))


def test_from_info_checks_fingerprint(codec, test_models):
    import hashlib

    from specdec.v1 import common_pb2

    raw = codec.tokenizer.to_str().encode()
    info = common_pb2.ModelInfo(tokenizer_json_zlib=zlib.compress(raw), replica_id="r")
    info.tokenizer_fingerprint = hashlib.sha256(raw).hexdigest()
    assert TextCodec.from_info(info).encode("hello") == codec.encode("hello")
    info.tokenizer_fingerprint = "0" * 64
    with pytest.raises(ValueError, match="fingerprint"):
        TextCodec.from_info(info)


def test_length_and_eos(codec):
    ids = codec.encode("hello world, this is text")
    c = completion(codec, max_new=3)
    text, tokens = c.push(ids[:5])
    assert c.finish_reason == "length" and tokens == ids[:3] and text == codec.decode(ids[:3])
    c = completion(codec)
    _, tokens = c.push([ids[0], 2, ids[1]])  # EOS ends it; what follows is dropped
    assert c.finish_reason == "eos" and c.tokens == [ids[0], 2] and tokens == [ids[0], 2]


def test_stop_string_across_rounds_never_leaks(codec):
    text = "alpha beta STOP gamma delta"
    ids = codec.encode(text)
    c = completion(codec, stop=["STOP"])
    streamed = ""
    for i in range(0, len(ids), 2):  # rounds of two tokens
        delta, _ = c.push(ids[i : i + 2])
        streamed += delta
        if c.finish_reason:
            break
    assert c.finish_reason == "stop"
    assert c.text == streamed == "alpha beta "
    # Tokens end with the one that completed the stop string.
    assert "STOP" in codec.decode(c.tokens) and "STOP" not in codec.decode(c.tokens[:-1])


def test_text_held_back_only_while_it_could_start_a_stop(codec):
    c = completion(codec, stop=["XYZW"])
    ids = codec.encode("hello there")
    delta, _ = c.push(ids)
    assert delta == "hello there"[: len("hello there") - 3]  # last 3 chars may start "XYZW"
    rest, _ = c.push(codec.encode("!"))
    assert delta + rest == "hello there!"[: len("hello there!") - 3]


def test_incomplete_utf8_is_held_back(codec):
    ids = codec.encode("caf\u00e9 ok")
    c = completion(codec)
    streamed = ""
    for t in ids:
        delta, _ = c.push([t])
        assert "\ufffd" not in delta
        streamed += delta
    assert streamed == "caf\u00e9 ok"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("a\U0001f600b and more", ["a\U0001f600"]),
        ("xx abcd yy", ["abcd", "c"]),
        ("caf\u00e9 au lait, s'il vous pla\u00eet", ["au l", "\u00eet"]),
        ("def f(x):\n    return x\n\ndef g", ["\n\n", "return"]),
        ("no stop here at all", ["zzz"]),
    ],
)
def test_result_does_not_depend_on_round_sizes(codec, text, stop):
    """Speculation delivers tokens in rounds of any size: the outcome must not change."""
    import random

    ids = codec.encode(text)
    outcomes = set()
    for seed in range(40):
        rng = random.Random(seed)
        c = completion(codec, stop=stop, max_new=len(ids))
        streamed, i = "", 0
        while c.finish_reason is None:
            n = 1 if seed == 0 else rng.randint(1, 5)  # seed 0: one token at a time (k = 0)
            delta, _ = c.push(ids[i : i + n])
            streamed += delta
            i += n
        assert streamed == c.text
        outcomes.add((c.text, tuple(c.tokens), c.finish_reason))
    assert len(outcomes) == 1, outcomes
    final_text, _, reason = outcomes.pop()
    if reason == "length":
        assert final_text == codec.decode(ids)


def test_special_tokens_only_when_asked(codec):
    """A new conversation gets the post-processor's BOS, a continuation none."""
    import json

    spec = json.loads(codec.tokenizer.to_str())
    bos = "<|bos|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
    }
    with_bos = TextCodec(json.dumps(spec).encode())
    plain = with_bos.encode("hello")
    assert with_bos.encode("hello", add_special_tokens=True) == [1, *plain]
    assert 1 not in plain
