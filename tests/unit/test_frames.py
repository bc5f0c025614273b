"""The data plane's framing (specdec.common.frames): a preface, then 4-byte little-endian
lengths and payloads, however the bytes are split into reads."""

from __future__ import annotations

import struct

import pytest

from specdec.common.frames import (
    MAX_FRAME_BYTES,
    PREFACE,
    VERSION,
    FrameReader,
    ProtocolError,
    VersionMismatch,
    encode,
)
from specdec.v1 import dataplane_pb2, verifier_pb2


def call(i: int, tokens: list[int]) -> bytes:
    message = dataplane_pb2.DataCall(
        id=i, verify=verifier_pb2.VerifyRequest(session_id="s/x", new_tokens=tokens)
    )
    return message.SerializeToString()


def test_a_frame_is_its_length_then_its_payload():
    payload = call(7, [1, 2, 3])
    frame = encode(payload)
    assert frame[:4] == struct.pack("<I", len(payload))
    assert frame[4:] == payload
    assert encode(b"") == b"\0\0\0\0"  # an empty message is a frame too


def test_preface_then_several_frames_in_one_read():
    payloads = [call(i, [i] * i) for i in range(1, 5)] + [b""]
    reader = FrameReader()
    assert reader.feed(PREFACE + b"".join(encode(p) for p in payloads)) == payloads
    assert reader.buffered == 0


@pytest.mark.parametrize("step", [1, 3, 4, 5, 17])
def test_frames_split_anywhere(step):
    """Byte by byte, and splits that cut headers, payloads and the preface."""
    payloads = [call(i, list(range(i * 10))) for i in range(1, 6)]
    stream = PREFACE + b"".join(encode(p) for p in payloads)
    reader = FrameReader()
    got = []
    for start in range(0, len(stream), step):
        got += reader.feed(stream[start : start + step])
    assert got == payloads
    assert dataplane_pb2.DataCall.FromString(got[2]).verify.new_tokens[-1] == 29


def test_a_partial_frame_waits_for_the_rest():
    payload = call(1, [5] * 100)
    frame = encode(payload)
    reader = FrameReader()
    assert reader.feed(PREFACE + frame[:2]) == []  # half a header
    assert reader.feed(frame[2:50]) == []  # the header and part of the payload
    assert reader.buffered == 50  # 4 header bytes and 46 of the payload
    assert reader.feed(frame[50:] + frame[:3]) == [payload]  # the end, and the next's start
    assert reader.buffered == 3


@pytest.mark.parametrize(
    "first",
    [
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # a gRPC (HTTP/2) client
        b"\x16\x03\x01\x02\x00",  # a TLS ClientHello to a plaintext port
        b"X",  # refused on the first wrong byte
    ],
)
def test_a_wrong_preface_is_refused_at_once(first):
    with pytest.raises(ProtocolError, match="does not speak the data plane"):
        FrameReader().feed(first)


@pytest.mark.parametrize("sent", [b"SPECDEC/DATA/1\r\n", b"SPECDEC/DATA/1", b"SPECDEC/DATA/9\r"])
def test_another_version_is_named_as_soon_as_its_digit_arrives(sent):
    with pytest.raises(VersionMismatch, match=r"speaks data plane version [19], this side") as e:
        FrameReader().feed(sent)
    assert e.value.theirs == int(sent[13:14]) and PREFACE == b"SPECDEC/DATA/%d\r\n" % VERSION


def test_a_preface_in_pieces_is_accepted():
    reader = FrameReader()
    for i in range(len(PREFACE)):
        assert reader.feed(PREFACE[i : i + 1]) == []
        assert reader.preface_seen == (i == len(PREFACE) - 1)
    assert reader.feed(encode(b"abc")) == [b"abc"]


def test_an_oversize_frame_is_refused_from_its_header():
    """Refused when its length arrives, before any of its payload is buffered."""
    reader = FrameReader()
    with pytest.raises(ProtocolError, match="exceeds"):
        reader.feed(PREFACE + struct.pack("<I", MAX_FRAME_BYTES + 1))
    small = FrameReader(max_frame=8)
    assert small.feed(PREFACE + encode(b"12345678")) == [b"12345678"]
    with pytest.raises(ProtocolError, match="a frame of 9 bytes exceeds"):
        small.feed(encode(b"123456789"))


def test_encode_refuses_what_the_peer_would_refuse():
    assert MAX_FRAME_BYTES == 64 * 1024 * 1024  # the gRPC message limit of the services
    with pytest.raises(ProtocolError):
        encode(bytes(MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 70_000])
def test_with_message_is_the_message_with_that_field_set(size):
    """A DataCall built as its head plus the serialized request parses as the DataCall
    built with the request set (whatever the request's length: 1-, 2- and 3-byte length
    prefixes), and so does a DataReply."""
    from specdec.common.frames import with_message
    from specdec.v1 import dataplane_pb2, drafter_pb2, verifier_pb2

    request = verifier_pb2.VerifyRequest(session_id="s/" + "x" * size, new_tokens=[1, 2, 3])
    head = dataplane_pb2.DataCall(id=7, traceparent="00-ab-cd-01").SerializeToString()
    built = dataplane_pb2.DataCall.FromString(with_message(head, 5, request.SerializeToString()))
    assert built == dataplane_pb2.DataCall(id=7, traceparent="00-ab-cd-01", verify=request)
    response = drafter_pb2.DraftResponse(draft_tokens=list(range(size % 50)), cached_length=9)
    head = dataplane_pb2.DataReply(id=2**40).SerializeToString()
    reply = dataplane_pb2.DataReply.FromString(with_message(head, 2, response.SerializeToString()))
    assert reply == dataplane_pb2.DataReply(id=2**40, draft=response)
