"""A busy replica is not a dead one: the replica's data plane (specdec.replica.dataplane)
answers the gateway's keepalive pings while a forward holds the model thread (a stand-in
thread polls the selector, `Poller.stand_in_during_forwards`), and the calls read during
the forward are dispatched after it, in the order they came. The real verifier servicer
on the tiny target, the gateway's DataPlaneTransport over loopback TCP; the one forward
held waits on an Event. No wall-clock limit: each step waits for an outcome."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from specdec.common.prefix import PrefixChain
from specdec.gateway.fleet.dataplane import DataPlaneSettings, DataPlaneTransport
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.replica import dataplane
from specdec.replica.dataplane import DataPlaneServer
from specdec.replica.runtime import ModelRuntime
from specdec.v1 import common_pb2, verifier_pb2
from specdec.verifier.config import VerifierConfig
from specdec.verifier.server import SERVICE_NAME, VerifierServicer

# The gateway holds a replica silent for 0.5 s dead; the held forward lasts far longer,
# and the stand-in takes over from a forward of 0.02 s (at most 0.04 s in).
FAST = DataPlaneSettings(keepalive_interval=0.02, keepalive_timeout=0.5)
STAND_IN_AFTER = 0.02
GREEDY = common_pb2.SamplingParams()


@pytest.fixture
def verifier(test_models, monkeypatch):
    monkeypatch.setattr(dataplane, "STAND_IN_AFTER", STAND_IN_AFTER)
    runtime = ModelRuntime(VerifierConfig(role="verifier", model=str(test_models.target)))
    servicer = VerifierServicer(runtime)
    plane = DataPlaneServer(servicer, SERVICE_NAME, "127.0.0.1", 0)
    runtime.scheduler.submit(functools.partial(plane.while_loading, runtime.load)).result()
    yield runtime, plane
    runtime.shutdown()


def hold_next_forward(runtime) -> tuple[threading.Event, threading.Event]:
    """Make the model thread's next forward wait for `gate` (`entered` once it waits)."""
    entered, gate = threading.Event(), threading.Event()
    scheduler = runtime.scheduler
    run_batch = scheduler.run_batch

    def held(requests):
        scheduler.run_batch = run_batch
        entered.set()
        gate.wait()
        return run_batch(requests)

    scheduler.run_batch = held
    return entered, gate


def verify(session: str, seq: list[int], cached: int) -> verifier_pb2.VerifyRequest:
    prefix = common_pb2.CachedPrefix(length=cached, hash=PrefixChain().hash(seq, cached))
    return verifier_pb2.VerifyRequest(
        session_id=session, prefix=prefix, new_tokens=seq[cached:], sampling=GREEDY
    )


async def test_pings_are_answered_during_a_long_forward_and_calls_wait_in_order(verifier):
    runtime, plane = verifier
    transport = DataPlaneTransport("127.0.0.1", plane.port, FAST)
    await transport.connect()
    protocol = transport._protocol
    assert protocol is not None
    # The reference: session a's two rounds, the second continuing the first's cache.
    prompt = [3, 14, 15, 92, 65]
    first = await transport.call(Method.VERIFY, verify("s/a", prompt, 0), 60)
    seq = [*prompt, first.next_token]
    second = await transport.call(Method.VERIFY, verify("s/a", seq, first.cached_length), 60)

    entered, gate = hold_next_forward(runtime)
    held = asyncio.ensure_future(transport.call(Method.VERIFY, verify("s/b", prompt, 0), 60))
    await asyncio.to_thread(entered.wait)
    # Session c's two rounds sent during the forward: the second needs the first's cache,
    # so it succeeds only when they are dispatched in the order they came.
    one = asyncio.ensure_future(transport.call(Method.VERIFY, verify("s/c", prompt, 0), 60))
    two = asyncio.ensure_future(
        transport.call(Method.VERIFY, verify("s/c", seq, first.cached_length), 60)
    )
    pongs = protocol.pongs
    while protocol.pongs < pongs + 75:  # 75 intervals: three keepalive timeouts
        await asyncio.sleep(0.02)
    assert transport.connected and transport._protocol is protocol
    assert not held.done() and not one.done() and not two.done()
    assert len(plane.deferred) == 2  # read by the stand-in, waiting for the model thread

    gate.set()
    assert (await held).next_token == first.next_token
    assert (await one).next_token == first.next_token
    assert (await two).next_token == second.next_token
    assert not plane.deferred
    await transport.close()


async def test_without_the_stand_in_the_same_forward_looks_dead(verifier, monkeypatch):
    """The control: the same held forward with the stand-in never taking over (its
    threshold out of reach) fails the call in flight for want of pongs."""
    runtime, plane = verifier
    transport = DataPlaneTransport("127.0.0.1", plane.port, FAST)
    await transport.connect()
    entered, gate = hold_next_forward(runtime)
    monkeypatch.setattr(runtime.scheduler.io, "forward_begins", lambda: None)
    held = asyncio.ensure_future(transport.call(Method.VERIFY, verify("s/b", [3, 14], 0), 60))
    await asyncio.to_thread(entered.wait)
    with pytest.raises(CallFailed) as failed:
        await held
    gate.set()
    assert "keepalive" in str(failed.value).lower()
    await transport.close()
