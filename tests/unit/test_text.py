"""The gateway's Completion: EOS, token limit, stop strings and what may be streamed."""

from __future__ import annotations

import zlib

import pytest

from specdec.gateway.text import Completion, TextCodec


@pytest.fixture(scope="module")
def codec(test_models):
    from transformers import AutoTokenizer

    from specdec.common.runtime import _canonical_tokenizer_json

    tok = AutoTokenizer.from_pretrained(test_models.tokenizer)
    return TextCodec(_canonical_tokenizer_json(tok))


def completion(codec, stop=(), max_new=100, eos=(2,)):
    return Completion(codec, max_new, frozenset(eos), tuple(stop))


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
