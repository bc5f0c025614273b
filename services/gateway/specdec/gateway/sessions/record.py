"""A session's record and its Redis hash format.

One Redis hash per session at ``key_prefix + session_id``::

    v                1 (record format version)
    tokens           the full history, int32 little-endian bytes (a 100k history is 400 KB)
    drafter          address of the drafter replica holding the session's KV cache ("" = none)
    verifier         same for the verifier
    drafter_cached   tokens that drafter caches for the session
    verifier_cached  same for the verifier
    turns            completed turns
    updated_at       unix time of the last put
    fence            the fencing token of the turn that wrote it (0: none; turns.py)
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from dataclasses import dataclass

MAX_SESSION_ID_LEN = 256
RECORD_VERSION = b"1"


@dataclass
class SessionRecord:
    session_id: str
    tokens: list[int]  # full history: every turn's prompt and completion tokens, in order
    drafter: str | None = None  # address of the drafter replica that holds its KV cache
    verifier: str | None = None
    drafter_cached: int = 0  # tokens that replica caches for this session (its last answer)
    verifier_cached: int = 0
    turns: int = 0
    updated_at: float = 0.0  # unix time
    # The fencing token of the turn lock's lease that wrote this record (0: written without
    # one: no Redis when its turn ran, or a record of an earlier version).
    fence: int = 0

    def copy(self) -> SessionRecord:
        return dataclasses.replace(self, tokens=list(self.tokens))


def validate_session_id(session_id: object) -> str:
    """A non-empty str of at most 256 characters; ValueError otherwise."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError("session_id must be a non-empty string")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise ValueError(
            f"session_id is {len(session_id)} characters; at most {MAX_SESSION_ID_LEN} allowed"
        )
    return session_id


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids -> int32 little-endian bytes; ValueError for ids outside int32."""
    try:
        arr = array("i", tokens)
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of 4")
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def encode_record(record: SessionRecord) -> dict[str, bytes | str]:
    """Record -> hash fields (ValueError if its tokens cannot be stored)."""
    return {
        "v": RECORD_VERSION,
        "tokens": pack_tokens(record.tokens),
        "drafter": record.drafter or "",
        "verifier": record.verifier or "",
        "drafter_cached": str(int(record.drafter_cached)),
        "verifier_cached": str(int(record.verifier_cached)),
        "turns": str(int(record.turns)),
        "updated_at": repr(float(record.updated_at)),
        "fence": str(int(record.fence)),
    }


def decode_record(session_id: str, raw: dict[bytes, bytes]) -> SessionRecord:
    """Hash fields -> record; ValueError (or KeyError) when the hash is not a valid record."""
    if raw.get(b"v") != RECORD_VERSION:
        raise ValueError(f"unknown record version {raw.get(b'v')!r}")

    def text(name: bytes) -> str | None:
        value = raw.get(name, b"").decode()
        return value or None

    return SessionRecord(
        session_id=session_id,
        tokens=unpack_tokens(raw[b"tokens"]),
        drafter=text(b"drafter"),
        verifier=text(b"verifier"),
        drafter_cached=int(raw.get(b"drafter_cached", b"0")),
        verifier_cached=int(raw.get(b"verifier_cached", b"0")),
        turns=int(raw.get(b"turns", b"0")),
        updated_at=float(raw.get(b"updated_at", b"0")),
        fence=int(raw.get(b"fence", b"0")),
    )
