"""The chained prefix hash: the same value however it is reached, and per-round cost that
does not grow with the context (counted in bytes hashed, not in time)."""

from __future__ import annotations

import hashlib
import random

import pytest

from specdec.common import prefix as prefix_module
from specdec.common.prefix import BLOCK, PrefixChain, prefix_hash
from specdec.replica.runtime import CacheStore, SessionCache
from tests.unit.test_loop_faults import FakeDrafter, FakeVerifier, make, speculator


class HashedBytes:
    """Counts the bytes fed to blake2b inside specdec.common.prefix."""

    def __init__(self, monkeypatch):
        self.total = 0
        real = hashlib.blake2b
        counter = self

        class Counting:
            def __init__(self, data=b"", **kw):
                counter.total += len(data)
                self._h = real(data, **kw)

            def update(self, data):
                counter.total += len(data)
                self._h.update(data)

            def digest(self):
                return self._h.digest()

        class FakeHashlib:
            blake2b = Counting

        monkeypatch.setattr(prefix_module, "hashlib", FakeHashlib)


def test_chain_equals_from_scratch_after_growth_and_crops():
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(3 * BLOCK + 17)]
    chain = PrefixChain()
    for n in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, len(tokens), 5]:
        assert chain.hash(tokens, n) == prefix_hash(tokens[:n]), n
    # Crop and rewrite the tail (a rollback, then other tokens): the chain follows.
    chain.crop(BLOCK + 3)
    del tokens[BLOCK + 3 :]
    tokens += [7] * (2 * BLOCK)
    for n in [BLOCK + 3, BLOCK + 4, 2 * BLOCK, 3 * BLOCK + 3]:
        assert chain.hash(tokens, n) == prefix_hash(tokens[:n]), n
    # Different tokens, different hashes; and the length is part of the identity.
    assert prefix_hash([1, 2, 3]) != prefix_hash([1, 2, 4])
    assert prefix_hash([0]) != prefix_hash([])
    with pytest.raises(ValueError):
        chain.hash(tokens, len(tokens) + 1)


async def test_gateway_round_cost_does_not_grow_with_context(monkeypatch):
    hashed = HashedBytes(monkeypatch)
    drafter, verifier = FakeDrafter(), FakeVerifier()
    drafter.release.set()
    fleet, _ = await make(drafter, verifier)
    try:
        per_round = {}
        for size in (8_192, 131_072):
            ctx = [i % 100 for i in range(size)]
            s = speculator(fleet, "s/y")
            s.ssd.enabled = False  # no Speculate: the Draft and Verify alone
            for _ in range(2):  # the first calls send everything, then hash it once
                ctx.extend((await s.round(ctx, 2, 10)).tokens)
            hashed.total = 0
            ctx.extend((await s.round(ctx, 2, 10)).tokens)
            per_round[size] = hashed.total
        assert per_round[131_072] == per_round[8_192]
        assert per_round[131_072] <= 2 * 2 * BLOCK * 4  # Draft + Verify: a tail each
    finally:
        await fleet.close()


class FakeKV:
    def crop(self, n: int) -> None:
        pass


def test_replica_prefix_check_cost_does_not_grow_with_context(monkeypatch):
    hashed = HashedBytes(monkeypatch)
    store = CacheStore(1 << 20, FakeKV)
    per_call = {}
    for size in (8_192, 131_072):
        sid = f"s/{size}"
        session: SessionCache = store.acquire(sid, 0, 0, size)
        session.tokens.extend(i % 100 for i in range(size))  # what a forward appends
        store.acquire(sid, size, prefix_hash(session.tokens), 4)  # chains it once
        session.tokens.extend([1, 2, 3])
        full = prefix_hash(session.tokens)
        hashed.total = 0
        store.acquire(sid, size + 3, full, 4)  # the next round
        per_call[size] = hashed.total
    assert per_call[131_072] == per_call[8_192] <= 2 * BLOCK * 4
