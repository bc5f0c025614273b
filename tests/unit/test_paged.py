"""The paged engine (specdec.replica.paged): the block store's operations on a real pool
(fork shares blocks, copy on write of the partial last block, rollback, prefix reuse,
eviction, capacity, growth), and its forwards on the tiny fp32 target against the dense
engine's (batched rows, a fork, SSD branch groups)."""

from __future__ import annotations

import time

import pytest
import torch

from specdec.common.errors import CacheMiss, CapacityExceeded
from specdec.common.prefix import prefix_hash
from specdec.replica.batching import BranchGroup, BranchStep, ForwardRequest
from specdec.replica.paged import NULL_BLOCK, BlockPool, PagedStore
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig
from tests.unit.test_batching import ROWS, _seq  # the padded forward's rows

BS = 4  # tokens per block in the store tests
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _store(max_tokens: int = 1000, blocks: int = 8) -> PagedStore:
    pool = BlockPool(layers=2, block_size=BS, blocks=blocks)
    pool.tensors(0, torch.zeros(1, 2, 1, 3))
    pool.tensors(1, torch.zeros(1, 2, 1, 3))
    return PagedStore(max_tokens, pool)


def _feed(store: PagedStore, session, tokens: list[int]) -> None:
    """What a forward does to the store: slots reserved, keys/values written (the token
    id, in every layer), tokens appended."""
    start = len(session.tokens)
    store.reserve(session, len(tokens))
    slots = store.slots(session, start + len(tokens))[start:]
    for layer in range(store.pool.layers):
        for pool in (store.pool.keys[layer], store.pool.values[layer]):
            pool[:, slots] = torch.tensor(tokens, dtype=pool.dtype)[None, :, None]
    session.append(tokens)


def _read(store: PagedStore, session) -> list[int]:
    """The token ids the session's slots hold (layer 1's values)."""
    slots = store.slots(session, len(session.tokens))
    return store.pool.values[1][0, slots, 0].long().tolist()


def test_fork_shares_blocks_and_copies_only_the_written_partial_block():
    store = _store()
    a = store.acquire("a", 0, 0, 20)
    _feed(store, a, list(range(1, 11)))  # 10 tokens: blocks of 4, 4, 2
    b = store.acquire("b", 10, prefix_hash(a.tokens), 10, fork_from="a")
    assert b.blocks == a.blocks and b is not a
    assert [store.pool.refs[x] for x in a.blocks] == [2, 2, 2]
    used = store.pool.used
    _feed(store, b, [50])  # b writes into the shared partial block: b copies it
    assert store.pool.used == used + 1
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [store.pool.refs[x] for x in a.blocks] == [2, 2, 1]
    assert _read(store, b) == [*range(1, 11), 50]
    _feed(store, a, [60, 61])  # a's last block is its own again: written in place
    assert _read(store, a) == [*range(1, 11), 60, 61]
    assert _read(store, b) == [*range(1, 11), 50]
    # A fork at a block boundary shares full blocks only; its next token takes a new block.
    c = store.acquire("c", 8, prefix_hash(a.tokens[:8]), 4, fork_from="a")
    assert c.blocks == a.blocks[:2]
    _feed(store, c, [70])
    assert c.blocks[:2] == a.blocks[:2] and store.pool.refs[c.blocks[2]] == 1
    assert _read(store, c) == [*range(1, 9), 70]


def test_rollback_and_prefix_reuse_drop_blocks_without_copying():
    store = _store()
    a = store.acquire("a", 0, 0, 20)
    _feed(store, a, list(range(1, 14)))  # 13 tokens: 4 blocks
    blocks = list(a.blocks)
    store.truncate(a, 9)  # rejected drafts: 3 blocks kept, the 4th free again
    assert a.blocks == blocks[:3] and store.pool.refs[blocks[3]] == 0
    again = store.acquire("a", 6, prefix_hash(a.tokens[:6]), 4)  # a shorter prefix
    assert again is a and a.blocks == blocks[:2] and a.tokens == list(range(1, 7))
    _feed(store, a, [90, 91, 92])
    assert _read(store, a) == [1, 2, 3, 4, 5, 6, 90, 91, 92]
    with pytest.raises(CacheMiss):
        store.acquire("a", 9, prefix_hash([1, 2, 3, 4, 5, 6, 7, 8, 9]), 1)
    # A forked session that rolls back into the shared block still copies before writing.
    b = store.acquire("b", 9, prefix_hash(a.tokens), 4, fork_from="a")
    store.truncate(b, 5)
    _feed(store, b, [40])
    assert _read(store, b) == [1, 2, 3, 4, 5, 40] and _read(store, a)[5] == 6


def test_keep_path_gathers_the_accepted_nodes_in_either_store():
    """SessionStore.keep_path after a tree's forward: the accepted nodes' KV and tokens
    follow the tokens before the tree, the rest is rolled back; the paged store moves
    slots within the session's blocks, the dense one within its DynamicCache."""
    from transformers import DynamicCache

    from specdec.replica.kvstore import CacheStore

    before, nodes, path = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], [1, 3, 4]
    kept = [*before, *(nodes[i] for i in path)]
    paged = _store()
    a = paged.acquire("a", 0, 0, 20)
    _feed(paged, a, before)
    _feed(paged, a, nodes)  # the tree's forward: every node after the plain tokens
    paged.keep_path(a, len(before), path)
    assert a.tokens == kept and _read(paged, a) == kept
    assert len(a.blocks) == -(-len(kept) // BS)  # the blocks past the path are dropped
    again = paged.acquire("a", len(kept), prefix_hash(kept), 1)  # its prefix hash holds
    assert again is a

    dense = CacheStore(1000, DynamicCache)
    d = dense.acquire("d", 0, 0, 20)
    ids = torch.tensor([*before, *nodes], dtype=torch.float32)
    for layer in range(2):  # what a forward writes: [1, heads, n, dim], the token id
        kv = ids[None, None, :, None].expand(1, 2, len(ids), 3).clone()
        d.kv.update(kv, kv.clone(), layer)
    d.append([*before, *nodes])
    dense.keep_path(d, len(before), path)
    assert d.tokens == kept and d.kv.get_seq_length() == len(kept)
    for layer in d.kv.layers:
        assert layer.values[0, 0, :, 0].long().tolist() == kept
        assert layer.keys[0, 1, :, 0].long().tolist() == kept
    # A path that is the first nodes in order moves nothing: a rollback alone.
    dense.keep_path(d, len(before), [0])
    assert d.tokens == kept[: len(before) + 1] and d.kv.get_seq_length() == len(before) + 1


def test_release_eviction_and_capacity_free_blocks():
    store = _store(max_tokens=24, blocks=4)
    a = store.acquire("a", 0, 0, 12)
    _feed(store, a, list(range(1, 13)))
    b = store.acquire("b", 12, prefix_hash(a.tokens), 4, fork_from="a")
    assert store.pool.used == 3
    c = store.acquire("c", 0, 0, 12)  # 12 + 12 + 12 > 24: a (least recent) goes
    assert "a" not in store and "b" in store
    assert [store.pool.refs[x] for x in b.blocks] == [1, 1, 1]
    _feed(store, c, list(range(5)))  # the pool grows when no block is free
    assert store.pool.blocks > 4 and NULL_BLOCK not in c.blocks
    assert store.release("b") and store.pool.used == 2
    assert not store.release("b")
    with pytest.raises(CapacityExceeded):
        store.acquire("d", 0, 0, 25)
    store.release("c")
    assert store.pool.used == 0 and len(store) == 0


def test_eviction_passes_over_a_session_in_use():
    """A job's session keeps its blocks while the job works on it (its forwards write
    them); the least recently used session not in use goes instead."""
    store = _store(max_tokens=24)
    with store.held("a"):
        a = store.acquire("a", 0, 0, 8)
        _feed(store, a, list(range(1, 9)))
        b = store.acquire("b", 0, 0, 8)
        _feed(store, b, list(range(11, 19)))
        store.acquire("c", 0, 0, 12)  # 8 + 8 + 12 > 24: b goes, not a (older, held)
        assert "a" in store and "b" not in store and not b.blocks
        _feed(store, a, [9])
        assert _read(store, a) == list(range(1, 10))
    store.acquire("d", 0, 0, 20)  # a is not held any more: it goes now
    assert "a" not in store


# -- forwards on the tiny target against the dense engine -----------------------------------


def _runtime(test_models, engine: str, **settings) -> ModelRuntime:
    rt = ModelRuntime(
        VerifierConfig(
            role="verifier",
            model=str(test_models.target),
            engine=engine,
            cost_probe=False,
            kv_block_size=4,
            **settings,
        )
    )
    rt.load()
    return rt


@pytest.fixture(scope="module")
def engines(test_models):
    rts = {e: _runtime(test_models, e) for e in ("dense", "paged")}
    yield rts
    for rt in rts.values():
        rt.shutdown()


def test_paged_forwards_equal_the_dense_engines(engines):
    paged = engines["paged"]
    assert type(paged.store) is PagedStore
    vocab = paged.vocab_size
    seqs = [_seq(i, c + n + 5, vocab) for i, (c, n, _) in enumerate(ROWS)]
    sessions = {}
    for name, rt in engines.items():
        sessions[name] = []
        for i, (cached, _, _) in enumerate(ROWS):
            s = rt.store.acquire(f"r{i}", 0, 0, len(seqs[i]) + 8)
            if cached:
                rt.forward(s, seqs[i][:cached])
            sessions[name].append(s)
    got = {
        name: rt._run_batch(
            [
                ForwardRequest(s, seqs[i][c : c + n], keep, False)
                for i, (s, (c, n, keep)) in enumerate(zip(sessions[name], ROWS, strict=True))
            ]
        )
        for name, rt in engines.items()
    }
    for i, (cached, new, keep) in enumerate(ROWS):
        assert got["paged"][i].shape == (keep, vocab)
        torch.testing.assert_close(got["paged"][i], got["dense"][i], **TOL)
        assert sessions["paged"][i].tokens == seqs[i][: cached + new]
    # A fork of a session, then both go on (copy on write), and a rollback.
    for name, rt in engines.items():
        s = sessions[name][4]
        rt.store.acquire("fork", 20, prefix_hash(s.tokens[:20]), 8, fork_from="r4")
    for name, rt in engines.items():
        s, f = sessions[name][4], rt.store.acquire("fork", 20, prefix_hash(seqs[4][:20]), 8)
        rt.store.truncate(s, 31)
        got[name] = rt._run_batch(
            [ForwardRequest(s, seqs[4][31:35], 4, False), ForwardRequest(f, [5, 6, 7], 3, False)]
        )
    for mine, theirs in zip(got["paged"], got["dense"], strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)
    for rt in engines.values():
        for i in range(len(ROWS)):
            rt.release(f"r{i}")
        rt.release("fork")
    assert paged.store.pool.used == 0


def test_paged_branch_groups_equal_the_dense_engines(engines):
    """SSD branch steps (rows over one session's first visible slots, then their own fed
    tokens), alone and batched with another session's request."""
    vocab = engines["paged"].vocab_size
    seq = _seq(7, 40, vocab)
    other = _seq(8, 20, vocab)
    got = {}
    for name, rt in engines.items():
        s = rt.store.acquire("s", 0, 0, 50)
        rt.forward(s, seq[:13])
        o = rt.store.acquire("o", 0, 0, 30)
        rt.forward(o, other[:10])
        group = BranchGroup(s, [10, 12, 13])
        out = []
        for step in range(3):
            tokens = seq[20 + 3 * step : 23 + 3 * step]
            requests = [BranchStep(group, tokens)]
            if step == 1:
                requests.append(ForwardRequest(o, [other[10 + step]], 1, False))
            out.extend(rt._run_batch(requests))
        assert group.fed == 3 and len(s.tokens) == 13
        got[name] = out
        rt.release("s")
        rt.release("o")
    for mine, theirs in zip(got["paged"], got["dense"], strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


# -- the start-up probe of batched forwards -------------------------------------------------


@pytest.mark.parametrize("engine", ["dense", "paged"])
def test_the_probe_times_batched_forwards_into_the_buckets(test_models, engine):
    """A batching replica's start-up probe runs batched forwards of 2 to 8 rows through its
    engine (--max-batch-size 8 stops it there): each bucket it reaches reports a step and
    wide forwards it measured (not the one-row line read at rows x tokens), at its rows;
    the scratch sessions are gone and the probe is no load."""
    rt = _runtime(test_models, engine, max_batch_size=8)
    try:
        measured = rt.probe_batches()
        assert sorted({rows for rows, _ in measured}) == [2, 4, 8]
        assert sorted({n for _, n in measured}) == [1, 2, 8]
        lines = dict(rt.cost.buckets())
        assert sorted(lines) == [2, 4, 8]  # no one-row bucket: the one-row probe is the prior
        for rows, line in lines.items():
            assert line.rows == rows
            assert line.step_samples == 1.0  # the 1-token forward, not the warm-up
            assert line.samples == pytest.approx(1.0 + 1.98)  # the 2 and 8 (decayed once)
            assert line.widest == 8
        assert len(rt.ready_store) == 0
        assert rt.load_window.load(time.perf_counter(), 0).forwards == 0
    finally:
        rt.shutdown()


def test_the_probe_fits_what_the_replica_can_hold(test_models):
    """Batch sizes whose scratch sessions the cache bound (or --max-batch-tokens) cannot
    hold are not probed, with none left nothing is; no forward of the probe, its scratch
    sessions' prefills included, is wider than --max-batch-tokens."""
    rt = _runtime(test_models, "paged", max_batch_size=16, max_cached_tokens=4 * 40)
    try:
        assert sorted({rows for rows, _ in rt.probe_batches()}) == [2, 4]
    finally:
        rt.shutdown()
    rt = _runtime(test_models, "paged", max_batch_size=16, max_batch_tokens=8)
    try:
        assert rt.probe_batches() == {}
    finally:
        rt.shutdown()
    rt = _runtime(test_models, "paged", max_batch_size=16, max_batch_tokens=64)
    forwards = []  # (rows, tokens a row) of every forward the probe ran, its prefills too
    run_batch = rt._run_batch

    def counted(requests):
        forwards.append((len(requests), max(len(r.tokens) for r in requests)))
        return run_batch(requests)

    rt._run_batch = counted
    try:
        assert sorted({rows for rows, _ in rt.probe_batches()}) == [2, 4, 8]
        assert forwards and all(rows * width <= 64 for rows, width in forwards)
        assert (2, rt.PROBE_CONTEXT) in forwards  # the prefills, two sessions a forward
    finally:
        rt.shutdown()
