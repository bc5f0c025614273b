"""Prefix identity shared by the gateway and the replicas (torch-free).

Every Draft / Verify names the cached prefix it builds on by (length, hash). The hash is
blake2b-64 over the tokens as little-endian int32, so both sides compute it from their own
copy of the tokens and a replica can tell, cheaply and for certain, whether its cache holds
the prefix the caller means.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_LITTLE = array("i").itemsize == 4 and __import__("sys").byteorder == "little"


def prefix_hash(tokens: Sequence[int]) -> int:
    """blake2b-64 of tokens (int32, little-endian), as an unsigned 64-bit integer."""
    buf = array("i", tokens)
    if not _LITTLE:
        buf.byteswap()
    return int.from_bytes(hashlib.blake2b(buf.tobytes(), digest_size=8).digest(), "little")
