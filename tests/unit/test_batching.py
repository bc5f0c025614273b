"""Batching across sessions (specdec.replica.batching) in-process on the tiny fp32 target:
the padded forward against each row's own forward, the write-back of each row's KV, and the
scheduler (continuous batching, per-session order, limits, one job's failure alone)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from specdec.common.errors import CacheMiss
from specdec.common.prefix import prefix_hash
from specdec.drafter.config import DrafterConfig
from specdec.replica.batching import ForwardRequest, Scheduler, _Task
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.replica.sampling import SamplingParams
from specdec.verifier.config import VerifierConfig
from specdec.verifier.scorer import VerifyCall, verify

TOL = {"atol": 1e-4, "rtol": 1e-4}


def p(tokens, n):
    return Prefix(n, prefix_hash(tokens[:n]))


def _runtime(test_models, config=VerifierConfig, **settings) -> ModelRuntime:
    """A loaded runtime of the tiny target, as a verifier (or under `config`'s role), on
    the dense engine unless `engine` says otherwise: these tests compare its padded batch
    with each row alone (tests/unit/test_paged.py compares the engines)."""
    settings.setdefault("engine", "dense")
    role = "drafter" if config is DrafterConfig else "verifier"
    rt = ModelRuntime(config(role=role, model=str(test_models.target), **settings))
    rt.load()
    return rt


@pytest.fixture(scope="module")
def runtime(test_models):
    rt = _runtime(test_models)
    yield rt
    rt.shutdown()


def _seq(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# (cached tokens, new tokens, logits kept): empty caches, unequal caches and inputs.
ROWS = [(0, 7, 7), (12, 1, 1), (5, 4, 4), (0, 1, 1), (30, 3, 2), (9, 6, 1)]


def test_padded_forward_equals_each_rows_own_forward(runtime):
    vocab = runtime.vocab_size
    seqs = [_seq(i, cached + new + 5, vocab) for i, (cached, new, _) in enumerate(ROWS)]
    batched, alone = [], []
    for i, (cached, _, _) in enumerate(ROWS):
        for name, group in ((f"b{i}", batched), (f"a{i}", alone)):
            session = runtime.store.acquire(name, 0, 0, len(seqs[i]))
            if cached:
                runtime.forward(session, seqs[i][:cached])
            group.append(session)
    requests = [
        ForwardRequest(s, seqs[i][c : c + n], keep, False)
        for i, (s, (c, n, keep)) in enumerate(zip(batched, ROWS, strict=True))
    ]
    got = runtime._run_batch(requests)
    for i, (cached, new, keep) in enumerate(ROWS):
        want = runtime.forward(alone[i], seqs[i][cached : cached + new], keep)
        assert got[i].shape == (keep, vocab)
        torch.testing.assert_close(got[i], want, **TOL)
        # Each row's new KV went back to its own session: same tokens, same cache...
        assert batched[i].tokens == alone[i].tokens == seqs[i][: cached + new]
        for mine, theirs in zip(batched[i].kv.layers, alone[i].kv.layers, strict=True):
            assert mine.keys.shape == theirs.keys.shape == (1, *theirs.keys.shape[1:])
            torch.testing.assert_close(mine.keys, theirs.keys, **TOL)
            torch.testing.assert_close(mine.values, theirs.values, **TOL)
        # ...which continues (and rolls back) like the unbatched one.
        runtime.store.truncate(batched[i], cached + new - 1)
        runtime.store.truncate(alone[i], cached + new - 1)
        rest = seqs[i][cached + new - 1 :]
        torch.testing.assert_close(
            runtime.forward(batched[i], rest), runtime.forward(alone[i], rest), **TOL
        )
    for i in range(len(ROWS)):
        runtime.release(f"b{i}")
        runtime.release(f"a{i}")


def _verify_call(rt, sid, tokens, draft) -> VerifyCall:
    return VerifyCall(rt, sid, p(tokens, 0), tokens, draft, None, SamplingParams(temperature=0.0))


async def _verify_all(rt, jobs):
    return await asyncio.gather(
        *(rt.run(verify, _verify_call(rt, sid, toks, d), session=sid) for sid, toks, d in jobs),
        return_exceptions=True,
    )


def _sessions_hist(rt) -> tuple[float, float]:
    """(forwards, sessions summed over them) of the sessions-per-forward histogram."""
    h = rt.obs.metrics.forward_sessions
    samples = {s.name: s.value for s in h.collect()[0].samples}
    return samples["specdec_verifier_model_forward_sessions_count"], samples[
        "specdec_verifier_model_forward_sessions_sum"
    ]


async def _held(rt):
    """Occupy the model thread with a plain call until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        gate.wait()

    task = asyncio.ensure_future(rt.run(hold))
    await asyncio.to_thread(started.wait)
    return gate, task


async def _queued_together(rt, jobs, other=None):
    """Verify every job (and await `other`, a coroutine), all queued while the model thread
    is held, so that they meet in the queue; the results (exceptions returned)."""
    gate, hold = await _held(rt)
    other = asyncio.ensure_future(other) if other is not None else None
    pending = asyncio.ensure_future(_verify_all(rt, jobs))
    await asyncio.sleep(0.1)
    gate.set()
    await hold
    if other is not None:
        await asyncio.wait([other])
    return await pending, other


async def test_concurrent_verifies_run_as_one_forward_and_equal_unbatched(runtime):
    vocab = runtime.vocab_size
    jobs = [(f"v{i}", _seq(100 + i, 4 + 3 * i, vocab), _seq(200 + i, 3, vocab)) for i in range(6)]
    before = _sessions_hist(runtime)
    batched, _ = await _queued_together(runtime, jobs)
    after = _sessions_hist(runtime)
    assert after[0] - before[0] == 1 and after[1] - before[1] == 6  # one forward of 6
    for sid, _, _ in jobs:
        runtime.release(sid)
    for (sid, toks, draft), verdict in zip(jobs, batched, strict=True):
        alone = runtime.drive(verify(_verify_call(runtime, sid, toks, draft)))
        assert (verdict.accepted, verdict.next_token) == (alone.accepted, alone.next_token)
        assert verdict.cached_length == alone.cached_length
        runtime.release(sid)


async def test_a_cache_miss_fails_alone(runtime):
    vocab = runtime.vocab_size
    jobs = [(f"m{i}", _seq(300 + i, 5 + i, vocab), _seq(400 + i, 2, vocab)) for i in range(3)]
    missing = runtime.run(
        verify,
        VerifyCall(
            runtime,
            "m-missing",
            p(jobs[0][1], 3),
            jobs[0][1][3:],
            [],
            None,
            SamplingParams(temperature=0.0),
        ),
        session="m-missing",
    )
    results, miss = await _queued_together(runtime, jobs, missing)
    with pytest.raises(CacheMiss):
        miss.result()
    for (sid, toks, _), verdict in zip(jobs, results, strict=True):
        assert not isinstance(verdict, BaseException), verdict
        assert runtime.store.tokens(sid)[: len(toks)] == toks
        runtime.release(sid)


async def test_limits_bound_each_forward(test_models):
    rt = _runtime(test_models, max_batch_size=2, max_batch_tokens=64)
    try:
        vocab = rt.vocab_size
        jobs = [(f"l{i}", _seq(500 + i, 10, vocab), _seq(600 + i, 2, vocab)) for i in range(5)]
        seen: list[list[int]] = []
        run_batch = rt.scheduler.run_batch

        def recording(requests):
            seen.append([len(r.tokens) for r in requests])
            return run_batch(requests)

        rt.scheduler.run_batch = recording
        results, _ = await _queued_together(rt, jobs)
        assert all(not isinstance(r, BaseException) for r in results)
        assert max(len(b) for b in seen) == 2  # --max-batch-size
        assert all(len(b) * max(b) <= 64 for b in seen if len(b) > 1)  # --max-batch-tokens
        seen.clear()
        # 40 new tokens a row: two rows (80 padded tokens) exceed 64, so each runs alone.
        long = [(f"t{i}", _seq(700 + i, 38, vocab), _seq(800 + i, 2, vocab)) for i in range(2)]
        results, _ = await _queued_together(rt, long)
        assert all(not isinstance(r, BaseException) for r in results)
        assert seen == [[40], [40]]
    finally:
        rt.shutdown()


def test_selection_keeps_padding_below_half():
    """Oldest first; a request joins while rows x longest fits and at least half the padded
    tokens are real: one-token steps do not ride along a long prefill chunk."""
    scheduler = Scheduler("unit-select", max_batch_size=8, max_batch_tokens=2048)
    try:

        def tasks(*lengths):
            out = []
            for i, n in enumerate(lengths):
                task = _Task(i, lambda: None, None, None)
                task.request = ForwardRequest(None, [1] * n, 1, False)
                out.append(task)
            return out

        def lengths(batch):
            return [len(t.request.tokens) for t in batch]

        assert lengths(scheduler._select(tasks(512, 1, 4, 1))) == [512, 1]  # 513 of 1024 real
        assert lengths(scheduler._select(tasks(512, 500, 1, 2))) == [512, 500, 1]
        assert lengths(scheduler._select(tasks(1, 4, 512, 1, 3))) == [1, 4, 1, 3]
        assert lengths(scheduler._select(tasks(1, 512, 1))) == [1, 512]  # 513 of 1024 real
        assert lengths(scheduler._select(tasks(*[4] * 10))) == [4] * 8  # max_batch_size
        assert lengths(scheduler._select(tasks(512, 500, 510, 505, 300))) == [512, 500, 510, 505]
    finally:
        scheduler.shutdown()


async def test_batch_size_one_runs_one_job_at_a_time(test_models):
    rt = _runtime(test_models, max_batch_size=1)
    try:
        vocab = rt.vocab_size
        jobs = [(f"o{i}", _seq(900 + i, 6, vocab), _seq(950 + i, 2, vocab)) for i in range(3)]
        before = _sessions_hist(rt)
        results = await _verify_all(rt, jobs)
        assert all(not isinstance(r, BaseException) for r in results)
        after = _sessions_hist(rt)
        assert after[0] - before[0] == after[1] - before[1] == 3  # three forwards of one
    finally:
        rt.shutdown()


def test_one_session_runs_one_job_at_a_time():
    """Plain calls and one job whose forward fails (this scheduler has no model): a
    session's second call waits until its first has ended; another session's does not."""
    scheduler = Scheduler("unit-order", max_batch_size=4, max_batch_tokens=64)
    order: list[str] = []
    gate = threading.Event()

    def call(name: str) -> str:
        order.append(name)
        return name

    def stepping(name: str):
        order.append(name + ":start")
        try:
            yield ForwardRequest(None, [1], 1, False)
        finally:
            order.append(name + ":end")

    try:
        held = scheduler.submit(gate.wait)  # all three are queued before the thread is free
        futures = [
            scheduler.submit(lambda: stepping("a1"), key="a"),
            scheduler.submit(lambda: call("a2"), key="a"),
            scheduler.submit(lambda: call("b1"), key="b"),
        ]
        gate.set()
        held.result(10)
        with pytest.raises(RuntimeError, match="no model"):
            futures[0].result(10)
        assert futures[1].result(10) == "a2" and futures[2].result(10) == "b1"
        assert order == ["a1:start", "b1", "a1:end", "a2"]
    finally:
        scheduler.shutdown()


def test_config_flags(monkeypatch):
    import argparse

    from specdec.common.settings import ConfigError

    parser = argparse.ArgumentParser()
    VerifierConfig.add_arguments(parser, 50062)
    cfg = VerifierConfig.from_args(parser.parse_args(["--model", "m"]))
    assert (cfg.max_batch_size, cfg.max_batch_tokens) == (16, 2048)
    monkeypatch.setenv("SPECDEC_MAX_BATCH_TOKENS", "512")
    parser = argparse.ArgumentParser()
    VerifierConfig.add_arguments(parser, 50062)
    args = parser.parse_args(["--model", "m", "--max-batch-size", "1"])
    cfg = VerifierConfig.from_args(args)
    assert (cfg.max_batch_size, cfg.max_batch_tokens) == (1, 512)
    with pytest.raises(ConfigError, match="--max-batch-size"):
        VerifierConfig.from_args(argparse.Namespace(**{**vars(args), "max_batch_size": "0"}))


def test_a_failed_forward_drops_the_session_of_a_job(runtime):
    """A job's forward that fails reaches the job (driven here, or by the scheduler), whose
    guarded block drops the session: the next request misses."""
    toks = _seq(42, 8, runtime.vocab_size)
    runtime.drive(verify(_verify_call(runtime, "f", toks, [])))
    assert "f" in runtime.store
    bad = verify(
        VerifyCall(runtime, "f", p(toks, 8), [runtime.vocab_size + 5], [], None, SamplingParams())
    )
    with pytest.raises(IndexError):
        runtime.drive(bad)
    assert "f" not in runtime.store


def test_gathering_awaits_the_sessions_that_come_back_quickly():
    """A forward waits for the sessions of the last one to come back (gathering), but not
    for one whose last turnaround was longer than a wait can cover (one that drafts
    between its Verifies): waiting for it would only delay the others."""
    scheduler = Scheduler("unit-gather", max_batch_size=8, max_batch_tokens=64, max_batch_wait=0.02)
    try:
        scheduler._last_forward = 0.2  # a wait: at most min(20 ms, 50 ms)

        def back(key: str, at: float) -> None:
            task = _Task(0, lambda: None, key, None)
            task.queued = at
            scheduler._note_back(task)

        for key in ("quick", "drafts", "new"):
            scheduler._job_ended(key, 10.0)
        assert scheduler._expected == {"quick", "drafts", "new"}  # none measured yet
        back("quick", 10.004)  # the gateway's handling of its reply: 4 ms
        back("drafts", 10.150)  # a Draft before its next Verify: 150 ms
        scheduler._expected.clear()
        for key in ("quick", "drafts"):
            scheduler._job_ended(key, 11.0)
        assert scheduler._expected == {"quick"}
        back("drafts", 11.003)  # a plain round this time: awaited again
        scheduler._expected.clear()
        scheduler._job_ended("drafts", 12.0)
        assert scheduler._expected == {"drafts"}
    finally:
        scheduler.shutdown()


def test_gathering_keeps_sessions_in_one_forward():
    """Two sessions whose next jobs come back a few milliseconds apart (a busy gateway
    handles one reply after the other) stay in one forward each round rather than
    splitting into two groups that alternate."""
    rows: list[list[str]] = []

    def run_batch(requests):
        rows.append(sorted(r.session for r in requests))
        time.sleep(0.1)  # a forward's time: gathering may wait up to a quarter of it
        return [torch.zeros(1, 4) for _ in requests]

    scheduler = Scheduler("unit-gather2", 8, 64, run_batch=run_batch, max_batch_wait=0.025)

    def job(key: str):
        yield ForwardRequest(key, [1], 1, False)  # the session: its name, for run_batch

    def session(key: str, delay: float) -> None:
        for _ in range(6):
            scheduler.submit(lambda: job(key), key=key).result(10)
            time.sleep(delay)  # the gateway's handling of the reply

    try:
        threads = [
            threading.Thread(target=session, args=("a", 0.0)),
            threading.Thread(target=session, args=("b", 0.004)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        together = sum(r == ["a", "b"] for r in rows)
        assert together >= 5, rows  # the first may run one alone, then both, each round
    finally:
        scheduler.shutdown()
