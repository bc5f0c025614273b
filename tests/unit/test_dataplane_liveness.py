"""The gateway's end of the data plane (specdec.gateway.fleet.dataplane) against an in-process
peer over a socket pair (tests/fakewire.py): keepalive, bounded write buffer, version
handshake, reconnect back-off, typed reasons. No wall-clock limit: each test waits for an
outcome and asserts on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.common.frames import PREFACE
from specdec.gateway.fleet.dataplane import DataPlaneSettings, DataPlaneTransport
from specdec.gateway.fleet.transport import CallFailed, Method
from specdec.v1 import dataplane_pb2, verifier_pb2
from tests.fakewire import FakeReplica

FAST = DataPlaneSettings(
    keepalive_interval=0.02,
    keepalive_timeout=0.2,
    reconnect_initial=0.01,
    reconnect_max=0.04,
)


def verify(tokens: int = 1) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(session_id="s/x", new_tokens=[5] * tokens)


def answer(call: dataplane_pb2.DataCall) -> dataplane_pb2.DataReply:
    return dataplane_pb2.DataReply(
        id=call.id, verify=verifier_pb2.VerifyResponse(next_token=len(call.verify.new_tokens))
    )


async def connected(peer: FakeReplica, settings=FAST) -> DataPlaneTransport:
    transport = DataPlaneTransport("fake", 1, settings, connector=peer.connector)
    await transport.connect()
    return transport


async def test_pings_flow_on_an_idle_connection_and_it_stays_up():
    peer = FakeReplica(answer)
    transport = await connected(peer)
    protocol = transport._protocol
    while protocol.pongs < 20:  # 20 intervals: twice the keepalive timeout
        await asyncio.sleep(0.02)
    assert transport.connected
    pings = [c for c in peer.calls if c.WhichOneof("call") == "ping"]
    assert len(pings) >= 20 and all(c.id == 0 for c in pings)
    assert (await transport.call(Method.VERIFY, verify(3), 5.0)).next_token == 3
    await transport.close()
    await peer.close()


async def test_a_silent_peer_fails_the_calls_in_flight_with_keepalive_timeout():
    """The peer keeps its socket open and stops sending anything (a stopped process): the
    call in flight fails UNAVAILABLE, reason KEEPALIVE_TIMEOUT, long before its 60 s
    timeout would (the call awaits no timer of its own shorter than that)."""
    peer = FakeReplica(lambda call: None)  # never answers the call
    transport = await connected(peer)
    peer.answering = False  # and no more pongs
    with pytest.raises(CallFailed) as failed:
        await transport.call(Method.VERIFY, verify(), 60.0)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert failed.value.reason == "REASON_KEEPALIVE_TIMEOUT"
    assert "keepalive timeout 0.2 s" in failed.value.details
    assert not transport.connected
    await transport.close()
    await peer.close()


async def test_a_busy_peer_that_answers_pings_keeps_its_slow_call():
    """A call whose reply comes after several keepalive timeouts succeeds: the pongs (sent
    between the replica's forwards) show the replica alive."""
    peer = FakeReplica(lambda call: None)
    transport = await connected(peer)
    call = asyncio.ensure_future(transport.call(Method.VERIFY, verify(2), 60.0))
    while transport._protocol.pongs < 30:  # three keepalive timeouts
        await asyncio.sleep(0.02)
    assert not call.done()
    (sent,) = [c for c in peer.calls if c.WhichOneof("call") == "verify"]
    peer.send(answer(sent))
    assert (await call).next_token == 2
    await transport.close()
    await peer.close()


@pytest.mark.parametrize(
    ("preface", "reason", "why"),
    [
        (
            b"SPECDEC/DATA/1\r\n",
            "REASON_VERSION_MISMATCH",
            "the peer speaks data plane version 1, this side speaks version 2",
        ),
        (b"HTTP/1.1 400 Bad Request\r\n", "REASON_PROTOCOL_ERROR", "does not speak the data plane"),
    ],
)
async def test_a_peer_with_another_preface_is_refused_clearly(preface, reason, why):
    """Another version of the data plane is named as such (both versions), anything else
    is a protocol error; the connect fails UNAVAILABLE either way."""
    assert PREFACE == b"SPECDEC/DATA/2\r\n"
    peer = FakeReplica(answer, preface=preface)
    transport = DataPlaneTransport("fake", 1, FAST, connector=peer.connector)
    with pytest.raises(CallFailed) as failed:
        await transport.connect()
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert failed.value.reason == reason and why in failed.value.details
    await transport.close()
    await peer.close()


async def test_a_full_write_buffer_holds_the_next_call_until_the_peer_reads():
    """The peer stops reading: the first large call fills the socket and the transport's
    buffer past its bound; the next call waits unsent (the buffer does not grow), and
    both go and are answered once the peer reads again."""
    settings = DataPlaneSettings(max_buffered=64 * 1024, keepalive_timeout=60.0)
    peer = FakeReplica(answer)
    transport = await connected(peer, settings)
    protocol = transport._protocol
    peer.reading.clear()
    big = 512 * 1024  # tokens of 1 byte each: more than the socket pair's buffers
    first = asyncio.ensure_future(transport.call(Method.VERIFY, verify(big), 60.0))
    while not protocol.paused:
        await asyncio.sleep(0.01)
    second = asyncio.ensure_future(transport.call(Method.VERIFY, verify(7), 60.0))
    for _ in range(10):  # passes of the event loop: the second call stays unsent
        await asyncio.sleep(0.01)
    assert len(protocol.pending) == 1 and not second.done()
    held = protocol.buffered
    assert 0 < held <= big + 64  # at most one frame over the bound: the first one
    peer.reading.set()
    assert (await first).next_token == big
    assert (await second).next_token == 7
    assert protocol.buffered == 0
    await transport.close()
    await peer.close()


async def test_a_call_waiting_for_room_past_its_timeout_is_never_sent():
    settings = DataPlaneSettings(max_buffered=64 * 1024, keepalive_timeout=60.0)
    peer = FakeReplica(answer)
    transport = await connected(peer, settings)
    peer.reading.clear()
    first = asyncio.ensure_future(transport.call(Method.VERIFY, verify(512 * 1024), 60.0))
    while not transport._protocol.paused:
        await asyncio.sleep(0.01)
    with pytest.raises(CallFailed) as failed:
        await transport.call(Method.VERIFY, verify(7), 0.05)
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "write buffer" in failed.value.details
    peer.reading.set()
    await first
    assert [c.id for c in peer.calls if c.WhichOneof("call") == "verify"] == [1]
    await transport.close()
    await peer.close()


async def test_reconnect_backs_off_exponentially_and_resets_once_connected():
    peer = FakeReplica(lambda call: answer(call) if len(call.verify.new_tokens) > 1 else None)
    transport = await connected(peer)
    peer.connected.clear()
    peer.refuse = 4  # the next four attempts fail
    call = asyncio.ensure_future(transport.call(Method.VERIFY, verify(), 60.0))
    while not peer.calls or peer.calls[-1].WhichOneof("call") != "verify":
        await asyncio.sleep(0.005)
    peer.drop()  # the replica closes the connection under the call
    with pytest.raises(CallFailed) as failed:
        await call
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert failed.value.reason == "REASON_DISCONNECTED"
    await peer.connected.wait()  # the background reconnect got through
    while not transport.connected:
        await asyncio.sleep(0.005)
    # The loss, then four refusals: 0.01, 0.02, 0.04 and the ceiling.
    assert transport.delays == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert peer.attempts == 1 + 4 + 1 and transport.delay == 0.0
    assert (await transport.call(Method.VERIFY, verify(4), 5.0)).next_token == 4
    await transport.close()
    await peer.close()


async def test_a_call_during_the_back_off_fails_at_once_naming_the_next_attempt():
    """No connect attempt (and no connect timeout) per call while a replica is down."""
    settings = DataPlaneSettings(reconnect_initial=30.0, reconnect_max=60.0)
    peer = FakeReplica(answer)
    transport = await connected(peer, settings)
    peer.drop()
    while transport.connected:
        await asyncio.sleep(0.005)
    with pytest.raises(CallFailed, match=r"down \(.*\); next attempt in 2\d\.\d\d s") as failed:
        await transport.call(Method.VERIFY, verify(), 60.0)
    assert failed.value.reason == "REASON_DISCONNECTED"
    assert peer.attempts == 1 and transport.delays == [30.0]
    await transport.close()
    await peer.close()


async def test_error_frames_carry_their_reason_and_the_caller_acts_on_it():
    """A cache miss is told by its Reason, not by its message: the same code and message
    without the reason is not a miss."""

    def refuse(call):
        reason = dataplane_pb2.REASON_CACHE_MISS if call.verify.new_tokens[0] == 1 else 0
        error = dataplane_pb2.CallError(
            code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
            message="cache miss: session 's/x' is not cached here",
            reason=reason,
        )
        return dataplane_pb2.DataReply(id=call.id, error=error)

    peer = FakeReplica(refuse)
    transport = await connected(peer)
    for first, miss in ((1, True), (2, False)):
        request = verifier_pb2.VerifyRequest(session_id="s/x", new_tokens=[first])
        with pytest.raises(CallFailed) as failed:
            await transport.call(Method.VERIFY, request, 5.0)
        assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert failed.value.cache_miss is miss
    await transport.close()
    await peer.close()


def test_settings_refuse_a_keepalive_interval_not_below_its_timeout():
    with pytest.raises(ValueError, match="shorter than the keepalive timeout"):
        DataPlaneSettings(keepalive_interval=5.0, keepalive_timeout=5.0)


def test_the_gateways_keepalive_flags_reach_its_settings():
    from specdec.cli import build_parser
    from specdec.common.settings import ConfigError
    from specdec.gateway.config import GatewayConfig
    from specdec.gateway.front.turn import data_plane_settings

    def gateway(*argv):
        base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
        return GatewayConfig.from_args(build_parser().parse_args([*base, *argv]))

    settings = data_plane_settings(gateway())
    assert (settings.keepalive_interval, settings.keepalive_timeout) == (1.0, 10.0)
    settings = data_plane_settings(
        gateway("--data-keepalive", "0.5", "--data-keepalive-timeout", "3")
    )
    assert (settings.keepalive_interval, settings.keepalive_timeout) == (0.5, 3.0)
    with pytest.raises(ConfigError, match=r"--data-keepalive .* must be shorter than"):
        gateway("--data-keepalive", "5", "--data-keepalive-timeout", "5")
    with pytest.raises(ConfigError, match="--data-keepalive-timeout"):
        gateway("--data-keepalive-timeout", "0")
