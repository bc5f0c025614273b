"""The data plane's wire format (protos/specdec/v1/dataplane.proto), both ends' framing.

A connection starts with PREFACE from each side (after the TLS handshake, if any):
"SPECDEC/DATA/", the protocol's VERSION (one digit), "\r\n". A peer whose preface names
another version is refused with VersionMismatch, which names both versions. Then it
carries frames: a 4-byte little-endian length, then that many bytes of a serialized
DataCall (client to replica) or DataReply (replica to client). A frame longer than
MAX_FRAME_BYTES, the gRPC message limit of every service, is a protocol error, and so is
a wrong preface: the receiving side closes the connection. Torch-free (the gateway uses it).
"""

from __future__ import annotations

import struct

from specdec.common.serving import MAX_MESSAGE_BYTES

VERSION = 2  # 2: keepalive pings and typed reasons in error frames
MAGIC = b"SPECDEC/DATA/"
PREFACE = MAGIC + b"%d\r\n" % VERSION
HEADER = struct.Struct("<I")  # the payload's length in bytes
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def with_message(head: bytes, field: int, message: bytes) -> bytes:
    """A serialized message `head` with one more field: the serialized sub-message
    `message` as field number `field` (protobuf encodes a message as the concatenation of
    its fields, so this is the message with that field set, without copying the
    sub-message object into it)."""
    return head + _varint(field << 3 | 2) + _varint(len(message)) + message


class ProtocolError(Exception):
    """The peer broke the protocol (wrong preface, oversized or unparsable frame): the
    connection closes."""


class VersionMismatch(ProtocolError):
    """The peer speaks another version of the data plane."""

    def __init__(self, theirs: int):
        super().__init__(
            f"the peer speaks data plane version {theirs}, this side speaks version {VERSION}"
        )
        self.theirs = theirs


def _refuse(sent: bytes) -> None:
    """Raise for a preface that is not ours: VersionMismatch when it is the data plane's
    with another version (known once its version digit has arrived), else ProtocolError."""
    head = len(MAGIC)
    digit, rest = sent[head : head + 1], sent[head + 1 :]
    if sent[:head] == MAGIC and digit.isdigit() and b"\r\n".startswith(rest):
        raise VersionMismatch(int(digit))
    raise ProtocolError(f"the peer does not speak the data plane: it sent {sent!r}")


def encode(payload: bytes) -> bytes:
    """A frame of `payload` (a serialized message)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"a message of {len(payload)} bytes exceeds the data plane's {MAX_FRAME_BYTES}"
        )
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Splits what one side receives into frame payloads: checks the peer's preface first
    (byte by byte, so a wrong peer is refused on its first bytes), then returns each
    complete frame's payload as it arrives, however the bytes were split into reads."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        self.max_frame = max_frame
        self._buffer = bytearray()
        self._preface = 0  # bytes of the peer's preface received so far

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the frames `data` completes (raises ProtocolError)."""
        buffer = self._buffer
        buffer += data
        start = 0
        if self._preface < len(PREFACE):
            seen = min(len(buffer), len(PREFACE))
            if buffer[:seen] != PREFACE[:seen]:
                _refuse(bytes(buffer[:seen]))
            self._preface = seen
            if seen < len(PREFACE):
                return []
            start = seen
        frames = []
        end = len(buffer)
        while end - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            if size > self.max_frame:
                raise ProtocolError(
                    f"a frame of {size} bytes exceeds the data plane's {self.max_frame}"
                )
            stop = start + HEADER.size + size
            if stop > end:
                break
            frames.append(bytes(buffer[start + HEADER.size : stop]))
            start = stop
        if start:
            del buffer[:start]
        return frames

    @property
    def preface_seen(self) -> bool:
        """The peer's whole preface has arrived."""
        return self._preface == len(PREFACE)

    @property
    def buffered(self) -> int:
        """Bytes received that do not make a complete frame yet."""
        return len(self._buffer)
