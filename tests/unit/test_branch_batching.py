"""SSD branch steps batched across sessions (specdec.replica.batching, issue 14 item 2)
in-process on the tiny fp32 target: two sessions' branch groups (different lengths,
different accepted counts) and a session's own row in one padded forward against each run
alone and against a plain forward of each branch's own sequence; the scheduler running two
Speculates' branch steps as one forward, within --max-batch-size rows and
--max-batch-tokens; a failing branch forward failing the jobs in it alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.common.params import SamplingParams
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.speculate import BranchStore, SpeculateCall, speculate
from specdec.replica.batching import BranchGroup, BranchStep, ForwardRequest, Scheduler, _Task
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from tests.unit.test_batching import TOL, _held, _runtime, _seq


def _drafter(test_models, **settings) -> ModelRuntime:
    return _runtime(test_models, DrafterConfig, **settings)


@pytest.fixture(scope="module")
def drafter(test_models):
    rt = _drafter(test_models)
    yield rt
    rt.shutdown()


def _cached(rt, name: str, tokens: list[int]):
    session = rt.store.acquire(name, 0, 0, len(tokens))
    rt.forward(session, tokens)
    return session


# Per session: cached tokens (ending with a draft of k), k, and the branches (a, t_index).
GROUPS = [(23, 3, [(0, 0), (2, 1), (3, 2)]), (9, 2, [(1, 3), (2, 4), (0, 5), (0, 6)])]
STEPS = 3


def test_two_sessions_branch_groups_in_one_forward_equal_each_alone(drafter):
    vocab = drafter.vocab_size
    picks = _seq(77, 7, vocab)  # the branches' next tokens t
    seqs = [_seq(10 + i, n, vocab) for i, (n, _, _) in enumerate(GROUPS)]
    sessions = [_cached(drafter, f"bg{i}", seq) for i, seq in enumerate(seqs)]
    visible = [[n - k + a for a, _ in keys] for n, k, keys in GROUPS]  # base + a per row
    batched = [BranchGroup(s, v) for s, v in zip(sessions, visible, strict=True)]
    alone = [BranchGroup(s, v) for s, v in zip(sessions, visible, strict=True)]
    # Each row's tokens after its base + a session tokens: t, then what it drafted.
    fed = [[[picks[i]] for _, i in keys] for _, _, keys in GROUPS]
    # A third session's own row in the same forwards: 3 tokens (the branch rows are
    # right-padded), then one a step.
    plain = _seq(30, 14, vocab)
    other, other_alone = _cached(drafter, "bg-o", plain), _cached(drafter, "bg-oa", plain)
    feeds = [(_seq(31, 3, vocab), 2), *((_seq(32 + i, 1, vocab), 1) for i in range(STEPS - 1))]
    for step in range(STEPS):
        inputs = [[row[-1] for row in group] for group in fed]
        got = drafter._run_batch(
            [
                BranchStep(batched[0], inputs[0]),
                ForwardRequest(other, feeds[step][0], feeds[step][1], False),
                BranchStep(batched[1], inputs[1]),
            ]
        )
        mine = [got[0], got[2]]
        torch.testing.assert_close(got[1], drafter.forward(other_alone, *feeds[step]), **TOL)
        for g, (n, k, keys) in enumerate(GROUPS):
            assert mine[g].shape == (len(keys), vocab) and mine[g].dtype == torch.float32
            want = drafter._run_batch([BranchStep(alone[g], inputs[g])])[0]
            torch.testing.assert_close(mine[g], want, **TOL)
            for row, (a, _) in enumerate(keys):  # the branch's own sequence, unmasked
                sequence = [*seqs[g][: n - k + a], *fed[g][row]]
                with torch.inference_mode():
                    full = drafter.model(input_ids=torch.tensor([sequence])).logits[0, -1]
                torch.testing.assert_close(mine[g][row], full.float(), **TOL)
                fed[g][row].append(int(mine[g][row].argmax()))
    for g, (seq, session) in enumerate(zip(seqs, sessions, strict=True)):
        # The sessions' own caches were read, never changed; each group kept its rows' slots.
        assert session.tokens == seq
        assert all(layer.keys.shape[2] == len(seq) for layer in session.kv.layers)
        assert batched[g].fed == alone[g].fed == STEPS
        for mine, theirs in zip(batched[g].keys, alone[g].keys, strict=True):
            assert mine.shape == theirs.shape == (len(visible[g]), *theirs.shape[1:])
            assert mine.shape[2] == STEPS
            torch.testing.assert_close(mine, theirs, **TOL)
    assert other.tokens == other_alone.tokens == [*plain, *(t for f, _ in feeds for t in f)]
    for name in ("bg0", "bg1", "bg-o", "bg-oa"):
        drafter.release(name)


def test_selection_counts_a_branch_step_as_its_rows():
    """--max-batch-size counts rows: a group of n branches is n rows; a group that does not
    fit waits until it is the oldest, then runs, alone if it must."""

    def tasks(*specs):
        out = []
        for i, spec in enumerate(specs):
            task = _Task(i, lambda: None, None, None)
            if isinstance(spec, tuple):  # ("b", rows): a branch step
                task.request = BranchStep(None, [1] * spec[1])
            else:  # a session's request of `spec` tokens
                task.request = ForwardRequest(None, [1] * spec, 1, False)
            out.append(task)
        return out

    def shape(batch):
        return [
            ("b", t.request.rows) if isinstance(t.request, BranchStep) else t.request.width
            for t in batch
        ]

    rows8 = Scheduler("unit-rows", max_batch_size=8, max_batch_tokens=2048)
    tokens8 = Scheduler("unit-tokens", max_batch_size=16, max_batch_tokens=8)
    try:
        select = rows8._select
        assert shape(select(tasks(("b", 6), 1, ("b", 6), 1, 1))) == [("b", 6), 1, 1]
        assert shape(select(tasks(("b", 3), ("b", 4), ("b", 2)))) == [("b", 3), ("b", 4)]
        assert shape(select(tasks(1, ("b", 12), 1))) == [1, 1]  # the wide group waits...
        assert shape(select(tasks(("b", 12), 1))) == [("b", 12)]  # ...and runs alone
        assert shape(select(tasks(4, ("b", 6)))) == [4]  # 10 real of 28 padded
        assert shape(select(tasks(("b", 6), 4))) == [("b", 6)]
        # --max-batch-tokens: rows x longest input.
        assert shape(tokens8._select(tasks(("b", 6), ("b", 3), 1, 1))) == [("b", 6), 1, 1]
        assert shape(tokens8._select(tasks(("b", 9), 1))) == [("b", 9)]
    finally:
        rows8.shutdown()
        tokens8.shutdown()


def _spec_call(rt, store, sid, tokens, draft_length, params, fan_out=4) -> SpeculateCall:
    return SpeculateCall(
        rt, store, sid, Prefix(0, 0), tokens, draft_length, STEPS, params, fan_out, 0.7, 3
    )


def _record(rt) -> list[list[tuple[str, int, int]]]:
    """Every forward the scheduler runs from now on: (kind, rows, session length) a request."""
    seen: list[list[tuple[str, int, int]]] = []
    run_batch = rt.scheduler.run_batch

    def recording(requests):
        seen.append([(type(r).__name__, r.rows, len(r.session.tokens)) for r in requests])
        return run_batch(requests)

    rt.scheduler.run_batch = recording
    return seen


async def _together(rt, calls):
    """Run every (fn, args, session) on the model thread, all queued while it is held so
    that they meet in the queue; the results (exceptions returned)."""
    gate, hold = await _held(rt)
    pending = asyncio.gather(
        *(rt.run(fn, *args, session=sid) for fn, args, sid in calls), return_exceptions=True
    )
    await asyncio.sleep(0.1)
    gate.set()
    await hold
    return await pending


def _shape(speculation):
    return [(b.accepted, b.next_token, b.tokens) for b in speculation.branches]


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=5)]
)
async def test_two_speculates_share_their_branch_forwards(test_models, params):
    rt = _drafter(test_models)
    try:
        vocab = rt.vocab_size
        jobs = [("sa", _seq(50, 17, vocab), 3), ("sb", _seq(51, 40, vocab), 2)]
        store = BranchStore()
        seen = _record(rt)
        results = await _together(
            rt,
            [(speculate, (_spec_call(rt, store, sid, t, d, params),), sid) for sid, t, d in jobs],
        )
        assert all(not isinstance(r, BaseException) for r in results), results
        # One forward feeds both drafts, then each branch step of both is one forward.
        assert seen[0] == [("ForwardRequest", 1, 0), ("ForwardRequest", 1, 0)]
        assert seen[1:] == [[("BranchStep", 4, 17), ("BranchStep", 4, 40)]] * STEPS
        for (sid, tokens, d), together in zip(jobs, results, strict=True):
            assert len(together.branches) == 4
            alone = rt.drive(
                speculate(_spec_call(rt, BranchStore(), sid + "-1", tokens, d, params))
            )
            assert _shape(together) == _shape(alone)
            if not params.greedy:
                for mine, theirs in zip(together.branches, alone.branches, strict=True):
                    assert len(mine.probs) == len(theirs.probs) == STEPS
            assert store.pop(sid) is not None  # the prepared branches were stored
    finally:
        rt.shutdown()


async def test_rows_bound_each_forward_and_a_wide_group_runs_alone(test_models):
    rt = _drafter(test_models, max_batch_size=4)
    try:
        vocab = rt.vocab_size
        store, params = BranchStore(), SamplingParams()
        jobs = [("ra", _seq(60, 12, vocab), 3), ("rb", _seq(61, 15, vocab), 3)]
        calls = [(speculate, (_spec_call(rt, store, s, t, d, params, 3),), s) for s, t, d in jobs]
        wide = (_spec_call(rt, store, "rc", _seq(62, 10, vocab), 2, params, 6),)
        seen = _record(rt)
        results = await _together(rt, [*calls, (speculate, wide, "rc")])
        assert all(not isinstance(r, BaseException) for r in results), results
        assert [len(r.branches) for r in results] == [3, 3, 6]
        for batch in seen:
            assert len(batch) == 1 or sum(rows for _, rows, _ in batch) <= 4
        assert [("BranchStep", 6, 10)] in seen  # wider than --max-batch-size: alone
        # Three rows each: the two groups never share a forward of at most 4 rows.
        assert not any(sum(kind == "BranchStep" for kind, _, _ in b) > 1 for b in seen)
    finally:
        rt.shutdown()


async def test_batch_size_one_runs_each_speculate_alone_as_before(test_models):
    rt = _drafter(test_models, max_batch_size=1)
    try:
        vocab = rt.vocab_size
        store, params = BranchStore(), SamplingParams()
        jobs = [("oa", _seq(70, 12, vocab), 3), ("ob", _seq(71, 20, vocab), 2)]
        seen = _record(rt)
        results = await _together(
            rt, [(speculate, (_spec_call(rt, store, s, t, d, params),), s) for s, t, d in jobs]
        )
        # One job at a time to completion: its feed, then its branch steps alone.
        assert seen == [
            [("ForwardRequest", 1, 0)],
            *[[("BranchStep", 4, 12)]] * STEPS,
            [("ForwardRequest", 1, 0)],
            *[[("BranchStep", 4, 20)]] * STEPS,
        ]
        for (sid, tokens, d), got in zip(jobs, results, strict=True):
            alone = rt.drive(
                speculate(_spec_call(rt, BranchStore(), sid + "-1", tokens, d, params))
            )
            assert _shape(got) == _shape(alone)
    finally:
        rt.shutdown()


async def test_a_failing_branch_forward_fails_the_jobs_in_it(test_models):
    """Both Speculates' branch steps share a forward that raises: both fail and drop their
    session (as unbatched); the Draft that shared only their first forward succeeds."""
    rt = _drafter(test_models)
    try:
        vocab = rt.vocab_size
        store, params = BranchStore(), SamplingParams()
        run_batch = rt.scheduler.run_batch

        def failing(requests):
            if any(isinstance(r, BranchStep) for r in requests):
                raise RuntimeError("boom: a branch forward failed")
            return run_batch(requests)

        rt.scheduler.run_batch = failing
        jobs = [("fa", _seq(80, 17, vocab), 3), ("fb", _seq(81, 20, vocab), 2)]
        calls = [(speculate, (_spec_call(rt, store, s, t, d, params),), s) for s, t, d in jobs]
        draft = (DraftCall(rt, store, "fc", Prefix(0, 0), _seq(82, 15, vocab), 1, params),)
        results = await _together(rt, [*calls, (propose, draft, "fc")])
        for failed in results[:2]:
            assert isinstance(failed, RuntimeError) and "boom" in str(failed)
        assert len(results[2].tokens) == 1
        assert "fa" not in rt.store and "fb" not in rt.store and "fc" in rt.store
        assert store.pop("fa") is None and store.pop("fb") is None
    finally:
        rt.shutdown()
