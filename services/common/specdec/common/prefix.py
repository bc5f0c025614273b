"""Prefix identity shared by the gateway and the replicas (torch-free).

Every Draft / Speculate / Verify names the cached prefix it builds on by (length, hash), so
both sides compute the hash from their own copy of the tokens and a replica can tell,
cheaply and for certain, whether its cache holds the prefix the caller means.

The hash is chained over fixed blocks, so that it costs O(new tokens) per call instead of
O(context): with the tokens as little-endian int32,

    chain_0     = 0
    chain_{i+1} = blake2b-64(chain_i as 8 bytes LE || block_i)   (block_i = tokens[256 i : 256 (i + 1)])
    hash(n)     = blake2b-64(chain_m as 8 bytes LE || tokens[256 m : n]),  m = n // 256

A `PrefixChain` keeps chain_0..chain_m for one sequence that grows at its end and is
cropped (the gateway's context; a replica's session cache): a call hashes at most the
blocks completed since the last call plus a tail of under 256 tokens.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BLOCK = 256

_LITTLE = array("i").itemsize == 4 and sys.byteorder == "little"


def _digest(chain: int, tokens: Sequence[int]) -> int:
    buf = array("i", tokens)
    if not _LITTLE:
        buf.byteswap()
    h = hashlib.blake2b(chain.to_bytes(8, "little"), digest_size=8)
    h.update(buf.tobytes())
    return int.from_bytes(h.digest(), "little")


class PrefixChain:
    """Block hashes of one sequence's prefix, extended on demand.

    The caller owns the tokens and tells the chain when tokens before the end change
    (`crop`); appending needs no call.
    """

    __slots__ = ("_chain",)

    def __init__(self) -> None:
        self._chain: list[int] = [0]  # _chain[i]: hash of the first i blocks

    def hash(self, tokens: Sequence[int], n: int, tail: Sequence[int] = ()) -> int:
        """prefix_hash((tokens + tail)[:n]), in O(n - blocks already chained).

        tail: tokens that follow `tokens` for this call only (a draft): blocks that reach
        into it are hashed but never kept, so the chain stays the chain of `tokens`.
        """
        if not 0 <= n <= len(tokens) + len(tail):
            raise ValueError(f"prefix of {n} tokens out of a sequence of {len(tokens) + len(tail)}")
        m = n // BLOCK
        kept = min(m, len(tokens) // BLOCK)  # blocks made of `tokens` alone
        chain = self._chain
        while len(chain) <= kept:
            i = len(chain) - 1
            chain.append(_digest(chain[i], tokens[i * BLOCK : (i + 1) * BLOCK]))
        if n <= len(tokens):
            return _digest(chain[m], tokens[m * BLOCK : n])

        def part(start: int, end: int) -> list[int]:  # (tokens + tail)[start:end]
            return [
                *tokens[start:end],
                *tail[max(0, start - len(tokens)) : max(0, end - len(tokens))],
            ]

        value = chain[kept]
        for i in range(kept, m):
            value = _digest(value, part(i * BLOCK, (i + 1) * BLOCK))
        return _digest(value, part(m * BLOCK, n))

    def crop(self, n: int) -> None:
        """Tokens from position n on changed (or were dropped): forget blocks past n."""
        del self._chain[n // BLOCK + 1 :]

    @property
    def blocks(self) -> int:
        """Full blocks chained so far."""
        return len(self._chain) - 1


def prefix_hash(tokens: Sequence[int]) -> int:
    """The prefix hash of all of tokens, as an unsigned 64-bit integer (O(len(tokens)))."""
    return PrefixChain().hash(tokens, len(tokens))
