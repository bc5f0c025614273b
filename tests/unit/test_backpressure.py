"""The replica's bounded model queue (ModelRuntime.run): the excess is refused at once with
ReplicaBusy (RESOURCE_EXHAUSTED), housekeeping is never refused, the count never leaks.

Model calls here are plain functions held on the runtime's real model thread by an event;
no model is loaded (run() does not need one)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from specdec.common.errors import CapacityExceeded, ReplicaBusy
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig


def _runtime(max_queue: int) -> ModelRuntime:
    return ModelRuntime(VerifierConfig(role="verifier", model="unused", max_queue=max_queue))


async def _hold(rt: ModelRuntime):
    """Occupy the model thread until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def hold() -> str:
        started.set()
        gate.wait()
        return "held"

    task = asyncio.ensure_future(rt.run(hold))
    await asyncio.get_running_loop().run_in_executor(None, started.wait)
    return gate, task


async def test_full_queue_refuses_the_excess_and_keeps_serving():
    rt = _runtime(max_queue=2)
    try:
        gate, running = await _hold(rt)
        waiting = [asyncio.ensure_future(rt.run(lambda i=i: i)) for i in range(2)]
        await asyncio.sleep(0)  # both submitted
        assert rt.pending == 3
        with pytest.raises(ReplicaBusy) as err:
            await rt.run(lambda: "excess")
        assert err.value.details.startswith("replica busy: 2 requests queued")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.busy
        assert rt.pending == 3  # the refused one never counted
        info = asyncio.ensure_future(rt.run(lambda: "info", bounded=False))
        await asyncio.sleep(0)
        assert rt.pending == 3  # housekeeping is neither refused nor counted
        gate.set()
        assert await running == "held"
        assert [await w for w in waiting] == [0, 1]
        assert await info == "info"
        assert rt.pending == 0
        assert await rt.run(lambda: "again") == "again"
    finally:
        rt.shutdown()


async def test_max_queue_zero_runs_one_at_a_time():
    rt = _runtime(max_queue=0)
    try:
        gate, running = await _hold(rt)
        with pytest.raises(ReplicaBusy, match="replica busy: 0 requests queued"):
            await rt.run(lambda: None)
        gate.set()
        await running
        assert await rt.run(lambda: 7) == 7
    finally:
        rt.shutdown()


async def test_cancelled_waiter_frees_its_place():
    rt = _runtime(max_queue=1)
    try:
        gate, running = await _hold(rt)
        waiter = asyncio.ensure_future(rt.run(lambda: "never"))
        await asyncio.sleep(0)
        assert rt.pending == 2
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert rt.pending == 1  # the job left the queue with its caller
        again = asyncio.ensure_future(rt.run(lambda: "next"))
        await asyncio.sleep(0)
        gate.set()
        await running
        assert await again == "next"
        assert rt.pending == 0
    finally:
        rt.shutdown()


async def test_failing_call_frees_its_place():
    rt = _runtime(max_queue=0)
    try:

        def boom():
            raise CapacityExceeded("session needs 9 cached tokens")

        with pytest.raises(CapacityExceeded):
            await rt.run(boom)
        assert rt.pending == 0
        assert await rt.run(lambda: 1) == 1
    finally:
        rt.shutdown()


def test_busy_and_capacity_are_told_apart():
    """Both are RESOURCE_EXHAUSTED; only the busy one is worth another replica, and their
    reasons (what callers act on, tests/unit/test_caller.py) say which."""
    from specdec.common.errors import CapacityExceeded, ReplicaBusy

    busy, full = ReplicaBusy("replica busy: 3 queued"), CapacityExceeded("needs 900 tokens")
    assert busy.code == full.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (busy.reason, full.reason) == ("REASON_BUSY", "REASON_CAPACITY")


def test_max_queue_setting(monkeypatch):
    from specdec.cli import build_parser
    from specdec.common.settings import ConfigError

    def parse(*argv: str) -> VerifierConfig:
        return VerifierConfig.from_args(
            build_parser().parse_args(["serve", "verifier", "--model", "m", *argv])
        )

    assert parse().max_queue == 64
    monkeypatch.setenv("SPECDEC_MAX_QUEUE", "3")
    assert parse().max_queue == 3
    assert parse("--max-queue", "0").max_queue == 0  # the flag wins
    with pytest.raises(ConfigError, match="--max-queue / SPECDEC_MAX_QUEUE"):
        parse("--max-queue", "-1")
