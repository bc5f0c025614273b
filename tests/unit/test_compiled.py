"""Compiled forwards (--compile, specdec.replica.compiled) in-process on the tiny fp32
target: the compiled forwards of every kind (decode, a verify of k + 1 tokens, a feed padded
up to its bucket, a batch of two sessions and an SSD branch group) against the same
forwards eager, their KV and rollback, and the graphs bounded while the caches grow; the
refusals (the paged engine, no C++ compiler)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec.drafter.config import DrafterConfig
from specdec.replica.batching import BranchGroup, BranchStep, ForwardRequest
from tests.unit.test_batching import TOL, _runtime, _seq


@pytest.fixture(scope="module")
def pair(test_models):
    torch._dynamo.reset()
    eager = _runtime(test_models, DrafterConfig, max_draft_tokens=3, cost_probe=False)
    compiled = _runtime(
        test_models, DrafterConfig, max_draft_tokens=3, cost_probe=False, compile=True
    )
    yield eager, compiled
    eager.shutdown()
    compiled.shutdown()


def _session(rt, name, tokens):
    session = rt.store.acquire(name, 0, 0, 4096)
    rt.forward(session, tokens)
    return session


def _same_kv(a, b):
    assert a.tokens == b.tokens
    for mine, theirs in zip(a.kv.layers, b.kv.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys, theirs.keys, **TOL)
        torch.testing.assert_close(mine.values, theirs.values, **TOL)


def test_compiled_forwards_equal_eager_and_graphs_stay_bounded(pair):
    from torch._dynamo.utils import counters

    eager, compiled = pair
    assert compiled.compiled is not None and eager.compiled is None
    assert compiled.compiled.buckets == (1, 2, 4)
    # Every shape compiled at load: each bucket, for one row and for several.
    shapes = {(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)}
    assert compiled.compiled.shapes.keys() == shapes
    graphs = counters["stats"]["unique_graphs"]
    vocab = eager.vocab_size
    seqs = [_seq(40 + i, 200, vocab) for i in range(2)]
    both = [
        [_session(rt, f"s{i}", seqs[i][: 9 + 4 * i]) for i in range(2)] for rt in (eager, compiled)
    ]
    at = [9, 13]
    # Feeds of 1, 3 (padded to 4) and 4 tokens, one session, then both in one forward,
    # each forward at a longer cache than the last.
    for step, n in enumerate([1, 3, 4, 1, 3, 1, 1, 4]):
        for rt, sessions in zip((eager, compiled), both, strict=True):
            if step % 2:
                requests = [
                    ForwardRequest(s, seqs[i][at[i] : at[i] + n], n, False)
                    for i, s in enumerate(sessions)
                ]
            else:
                requests = [ForwardRequest(sessions[0], seqs[0][at[0] : at[0] + n], n, False)]
            if rt is eager:
                want = rt._run_batch(requests)
            else:
                got = rt._run_batch(requests)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, **TOL)
        at = [a + n for a in at] if step % 2 else [at[0] + n, at[1]]
    for mine, theirs in zip(*both, strict=True):
        _same_kv(mine, theirs)
    # A rollback, then an SSD branch group of three rows and the other session's decode.
    for rt, sessions in zip((eager, compiled), both, strict=True):
        rt.store.truncate(sessions[0], at[0] - 2)
    groups = [BranchGroup(sessions[0], [at[0] - 4, at[0] - 3, at[0] - 2]) for sessions in both]
    for _ in range(3):
        outs = []
        for rt, sessions, group in zip((eager, compiled), both, groups, strict=True):
            step = BranchStep(group, _seq(100 + group.fed, 3, vocab))
            outs.append(rt._run_batch([step, ForwardRequest(sessions[1], [7], 1, False)]))
        for w, g in zip(*outs, strict=True):
            torch.testing.assert_close(g, w, **TOL)
        for i in (0, 1):
            torch.testing.assert_close(groups[1].keys[i], groups[0].keys[i], **TOL)
    # No graph since: one per (bucket, one row or several), whatever the cache lengths.
    assert compiled.compiled.shapes.keys() == shapes
    assert counters["stats"]["unique_graphs"] == graphs <= compiled.compiled.graph_limit


def test_compile_is_refused_on_the_paged_engine(test_models):
    with pytest.raises(ValueError, match="--compile runs on --engine dense"):
        _runtime(test_models, engine="paged", compile=True, cost_probe=False)


def test_no_cxx_compiler_is_a_start_up_error(test_models, tmp_path):
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-g++"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
    }
    code = (
        "from specdec.replica.runtime import ModelRuntime\n"
        "from specdec.verifier.config import VerifierConfig\n"
        f"ModelRuntime(VerifierConfig(role='verifier', model={str(test_models.target)!r}, "
        "compile=True, cost_probe=False)).load()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "--compile: no C++ compiler for torch.compile's CPU kernels" in result.stderr
