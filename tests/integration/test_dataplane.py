"""The data plane through real processes on loopback (protos/specdec/v1/dataplane.proto):
the gateway's DataPlaneTransport and raw frames against real replicas, compared with
their gRPC methods; TLS and mTLS; the gateway admitting replicas on it or on gRPC."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.request

import grpc
import pytest

from specdec.common.frames import PREFACE, FrameReader, encode
from specdec.common.prefix import PrefixChain
from specdec.common.tls import ClientTls
from specdec.gateway.fleet.dataplane import DataPlaneSettings, DataPlaneTransport
from specdec.gateway.fleet.transport import CallFailed, GrpcTransport, Method
from specdec.sdk import Client
from specdec.tools.bench.standin import build_standins
from specdec.tools.certs import make_pki
from specdec.tools.redisproc import free_port
from specdec.v1 import (
    common_pb2,
    dataplane_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

GREEDY = common_pb2.SamplingParams()
N = 24  # new tokens per exactness check


def data_port(proc) -> int:
    """The data port a replica reported in its "listening" line."""
    for line in proc.lines:
        if '"listening"' in line:
            return int(json.loads(line)["data_port"])
    raise AssertionError(f"{proc.name} logged no listening line:\n{proc.tail()}")


def prefix(tokens: list[int], length: int) -> common_pb2.CachedPrefix:
    return common_pb2.CachedPrefix(length=length, hash=PrefixChain().hash(tokens, length))


def stubs(proc, role: str):
    channel = grpc.aio.insecure_channel(proc.address)
    stub_type = drafter_pb2_grpc.DrafterServiceStub
    if role == "verifier":
        stub_type = verifier_pb2_grpc.VerifierServiceStub
    return channel, stub_type(channel)


def metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + (f"{{{labels}}}" if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def pair(test_models):
    """A drafter and a verifier (the tiny models) with their metrics served."""
    ports = {"drafter": free_port(), "verifier": free_port()}
    procs = {}
    try:
        procs["drafter"] = replica(
            "drafter", test_models.draft_noisy, "--metrics-port", str(ports["drafter"])
        )
        procs["verifier"] = replica(
            "verifier", test_models.target, "--metrics-port", str(ports["verifier"])
        )
        for p in procs.values():
            p.wait_healthy()
        yield {**procs, "metrics": ports}
    finally:
        for p in procs.values():
            p.stop()


async def greedy_rounds(drafter, verifier, session: str, prompt: list[int], n: int) -> list[int]:
    """Speculation rounds (Draft k = 4, then Verify) through two transports, as the
    gateway's loop runs them: each request names the prefix its replica caches."""
    seq, drafted, verified = list(prompt), 0, 0
    while len(seq) - len(prompt) < n:
        draft = await drafter.call(
            Method.DRAFT,
            drafter_pb2.DraftRequest(
                session_id=session,
                prefix=prefix(seq, drafted),
                new_tokens=seq[drafted:],
                num_draft_tokens=4,
                sampling=GREEDY,
            ),
            30,
        )
        verdict = await verifier.call(
            Method.VERIFY,
            verifier_pb2.VerifyRequest(
                session_id=session,
                prefix=prefix(seq, verified),
                new_tokens=seq[verified:],
                draft_tokens=draft.draft_tokens,
                sampling=GREEDY,
            ),
            30,
        )
        accepted = verdict.accepted_count
        drafted = min(draft.cached_length, len(seq) + accepted)  # its rejected drafts drop
        verified = verdict.cached_length
        seq += [*draft.draft_tokens[:accepted], verdict.next_token]
    return seq[len(prompt) :]


async def test_greedy_rounds_on_the_data_plane_equal_generate(pair, tokenizer, reference):
    d = DataPlaneTransport("127.0.0.1", data_port(pair["drafter"]))
    v = DataPlaneTransport("127.0.0.1", data_port(pair["verifier"]))
    before = metric(pair["metrics"]["verifier"], "specdec_verifier_data_plane_calls_total",
                    'method="Verify"')  # fmt: skip
    try:
        for i, text in enumerate(PROMPTS[:3]):
            ids = tokenizer(text).input_ids
            want = reference(ids, N)
            got = await greedy_rounds(d, v, f"s/exact-{i}", ids, N)
            assert got[: len(want)] == want, text
    finally:
        await d.close(), await v.close()
    port = pair["metrics"]["verifier"]
    assert metric(port, "specdec_verifier_data_plane_calls_total", 'method="Verify"') > before
    assert metric(port, "specdec_verifier_requests_total", 'code="OK",method="Verify"') > 0


async def test_speculate_and_errors_are_the_same_as_grpc(pair, tokenizer):
    """The same requests through gRPC and the data plane: the same responses, and the same
    status codes and messages when they fail."""
    d_channel, d_stub = stubs(pair["drafter"], "drafter")
    v_channel, v_stub = stubs(pair["verifier"], "verifier")
    transports = {
        "grpc": (GrpcTransport(d_stub), GrpcTransport(v_stub)),
        "data": (
            DataPlaneTransport("127.0.0.1", data_port(pair["drafter"])),
            DataPlaneTransport("127.0.0.1", data_port(pair["verifier"])),
        ),
    }
    ids = tokenizer(PROMPTS[0]).input_ids
    seq = [*ids, 11, 12, 13]
    speculate = drafter_pb2.SpeculateRequest(
        prefix=prefix(seq, 0), new_tokens=seq, draft_length=3, num_draft_tokens=2,
        sampling=GREEDY, fan_out=4,
    )  # fmt: skip
    failing = [
        (Method.VERIFY, verifier_pb2.VerifyRequest(session_id="s/none", prefix=prefix(seq, 5),
                                                   new_tokens=[1], sampling=GREEDY)),
        (Method.VERIFY, verifier_pb2.VerifyRequest(session_id="s/v", new_tokens=[10**9])),
        (Method.VERIFY, verifier_pb2.VerifyRequest(session_id="s/v", new_tokens=[1],
                                                   draft_tokens=[1] * 99)),
        (Method.VERIFY, verifier_pb2.VerifyRequest(session_id="", new_tokens=[1])),
        (Method.DRAFT, drafter_pb2.DraftRequest(session_id="s/d", new_tokens=[1])),
        (Method.DRAFT, drafter_pb2.DraftRequest(session_id="x" * 257, new_tokens=[1],
                                                num_draft_tokens=2)),
        (Method.DRAFT, drafter_pb2.DraftRequest(session_id="s/d", new_tokens=[1],
                                                num_draft_tokens=2, sampling=common_pb2.SamplingParams(temperature=-1))),
        (Method.SPECULATE, drafter_pb2.SpeculateRequest(session_id="s/d", new_tokens=[1, 2],
                                                        draft_length=0, num_draft_tokens=2)),
    ]  # fmt: skip
    answers: dict[str, list] = {}
    try:
        for name, (drafter, verifier) in transports.items():
            speculate.session_id = f"s/speculate-{name}"
            prepared = await drafter.call(Method.SPECULATE, speculate, 30)
            prepared.forward_ms = 0  # a time, not an answer
            got = [prepared]
            for method, request in failing:
                target = verifier if method is Method.VERIFY else drafter
                with pytest.raises(CallFailed) as failed:
                    await target.call(method, request, 30)
                got.append((failed.value.code, failed.value.details, failed.value.reason))
            answers[name] = got
    finally:
        for drafter, verifier in transports.values():
            await drafter.close(), await verifier.close()
        await d_channel.close(), await v_channel.close()
    assert answers["data"][0].branches, "Speculate prepared no branch"
    assert answers["data"] == answers["grpc"]
    codes = [code for code, _, _ in answers["data"][1:]]
    assert codes[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert answers["data"][1][1].startswith("cache miss")
    # The reason travels too: the error frame's field, gRPC's trailing metadata.
    reasons = [reason for _, _, reason in answers["data"][1:]]
    assert reasons == ["REASON_CACHE_MISS"] + ["REASON_UNSPECIFIED"] * (len(reasons) - 1)
    assert set(codes[1:]) == {grpc.StatusCode.INVALID_ARGUMENT}


async def test_a_method_the_replica_does_not_serve(pair):
    verifier = DataPlaneTransport("127.0.0.1", data_port(pair["verifier"]))
    try:
        with pytest.raises(CallFailed) as failed:
            await verifier.call(Method.DRAFT, drafter_pb2.DraftRequest(session_id="s/x"), 10)
    finally:
        await verifier.close()
    assert failed.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert failed.value.details == "the verifier does not serve Draft"


# -- a slow replica: backpressure, cancellation, deadlines, SIGKILL ----------------------------

FORWARD_MS = 400.0


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return build_standins(tmp_path_factory.mktemp("standins"), target_ms=FORWARD_MS)


def slow_verifier(standins):
    """A stand-in verifier whose forward takes FORWARD_MS, one job at a time, at most one
    waiting (--max-queue 1), one forward per new token (--prefill-chunk 1: a call of 3
    tokens runs 3 forwards, and the data plane reads what arrived between them)."""
    return replica("verifier", standins.target, "--trust-remote-code",
                   "--max-queue", "1", "--max-batch-size", "1",
                   "--prefill-chunk", "1")  # fmt: skip


@pytest.fixture(scope="module")
def slow(standins):
    proc = slow_verifier(standins)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def verify(session: str, tokens=(5, 6, 7)) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(session_id=session, new_tokens=list(tokens), sampling=GREEDY)


async def call_or_error(transport, request, delay: float) -> CallFailed | None:
    await asyncio.sleep(delay)
    try:
        await transport.call(Method.VERIFY, request, 30)
    except CallFailed as e:
        return e
    return None


async def test_a_full_replica_is_busy_on_both_transports(slow):
    """Four calls, 50 ms apart, to a replica whose forward takes 400 ms and that lets one
    wait: each transport has some refused with the same code and message. (The data
    plane reads the calls that arrive during a forward after it, so fewer wait behind it
    there than through gRPC's event loop.)"""
    channel, stub = stubs(slow, "verifier")
    refused = {}
    try:
        for name, transport in (
            ("grpc", GrpcTransport(stub)),
            ("data", DataPlaneTransport("127.0.0.1", data_port(slow))),
        ):
            results = await asyncio.gather(
                *(
                    call_or_error(transport, verify(f"s/busy-{name}-{i}"), 0.05 * i)
                    for i in range(4)
                )
            )
            await transport.close()
            refused[name] = {(e.code, e.details, e.busy) for e in results if e is not None}
    finally:
        await channel.close()
    message = "replica busy: 1 requests queued for the model (at most 1 wait, --max-queue)"
    assert (
        refused["data"] == refused["grpc"] == {(grpc.StatusCode.RESOURCE_EXHAUSTED, message, True)}
    )


def raw_connection(port: int) -> tuple[socket.socket, FrameReader]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PREFACE)
    return sock, FrameReader()


def read_replies(sock: socket.socket, reader: FrameReader, n: int) -> list:
    replies: list = []
    while len(replies) < n:
        data = sock.recv(65536)
        assert data, "the replica closed the connection"
        replies += [dataplane_pb2.DataReply.FromString(f) for f in reader.feed(data)]
    return replies


def test_a_cancel_frame_stops_a_queued_call(slow):
    """Call 1 runs (3 forwards); call 2, on the same session, waits behind it; a cancel
    frame for call 2 gets it answered CANCELLED while call 1 still runs, and call 1 is
    answered as usual."""
    sock, reader = raw_connection(data_port(slow))
    with sock:
        frame = lambda **kw: encode(dataplane_pb2.DataCall(**kw).SerializeToString())  # noqa: E731
        sock.sendall(frame(id=1, verify=verify("s/cancel")))
        time.sleep(0.1)  # call 1 is in its first forward
        sock.sendall(frame(id=2, verify=verify("s/cancel", (8,))))
        sock.sendall(frame(id=2, cancel=dataplane_pb2.CancelCall()))
        first, second = read_replies(sock, reader, 2)
        # a cancel of a call that is not in flight (answered, or never sent) changes nothing
        sock.sendall(frame(id=1, cancel=dataplane_pb2.CancelCall()))
        sock.sendall(frame(id=3, cancel=dataplane_pb2.CancelCall()))
        sock.sendall(frame(id=4, verify=verify("s/cancel-after", (9,))))
        (third,) = read_replies(sock, reader, 1)
    assert first.id == 2 and first.WhichOneof("reply") == "error"
    assert first.error.code == grpc.StatusCode.CANCELLED.value[0]
    assert first.error.message == "cancelled by the caller"
    assert second.id == 1 and second.WhichOneof("reply") == "verify"
    assert second.verify.cached_length == 3  # call 2 (one more token) never ran
    assert third.id == 4 and third.WhichOneof("reply") == "verify"


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "does not speak the data plane"),
        (b"SPECDEC/DATA/1\r\n", "the peer speaks data plane version 1, this side speaks version 2"),
    ],
)
def test_a_wrong_peer_is_disconnected(slow, first, why):
    """Another protocol, or another version of this one (whose error names both)."""
    with socket.create_connection(("127.0.0.1", data_port(slow)), timeout=10) as sock:
        sock.sendall(first)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert data == PREFACE  # the replica's own preface, then it closed
    deadline = time.monotonic() + 10  # the log line is read by another thread
    while not any(why in line for line in slow.lines):
        assert time.monotonic() < deadline, slow.tail()
        time.sleep(0.05)


async def test_deadline_then_sigkill_fails_calls_with_unavailable(slow):
    """A call past its deadline: DEADLINE_EXCEEDED (and a cancel frame). Then the replica
    is killed with calls in flight: each fails with UNAVAILABLE at once, and so does the
    next call (during the reconnect back-off, or after an attempt that failed). (Last in
    the module: it kills `slow`.)"""
    transport = DataPlaneTransport("127.0.0.1", data_port(slow))
    try:
        running = asyncio.ensure_future(transport.call(Method.VERIFY, verify("s/kill-1"), 30))
        await asyncio.sleep(0.05)
        with pytest.raises(CallFailed) as late:
            await transport.call(Method.VERIFY, verify("s/kill-2"), 0.1)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not running.done()
        waiting = asyncio.ensure_future(transport.call(Method.VERIFY, verify("s/kill-3"), 30))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        slow.kill()
        for call in (running, waiting):
            with pytest.raises(CallFailed) as lost:
                await call
            assert lost.value.code == grpc.StatusCode.UNAVAILABLE
            assert "connection" in lost.value.details
        assert time.monotonic() - started < 5
        with pytest.raises(CallFailed) as again:
            await transport.call(Method.VERIFY, verify("s/kill-4"), 30)
        assert again.value.code == grpc.StatusCode.UNAVAILABLE
        assert again.value.reason == "REASON_DISCONNECTED"
        assert "next attempt in" in again.value.details or "unreachable" in again.value.details
    finally:
        await transport.close()


def test_sigterm_finishes_running_calls_and_refuses_new_ones(standins):
    """SIGTERM while a call runs: a call sent afterwards is answered UNAVAILABLE "the
    service is stopping", the running one is answered as usual, then the connection
    closes and the process exits 0."""
    proc = slow_verifier(standins)
    try:
        proc.wait_healthy()
        sock, reader = raw_connection(data_port(proc))
        with sock:
            frame = lambda **kw: encode(dataplane_pb2.DataCall(**kw).SerializeToString())  # noqa: E731
            sock.sendall(frame(id=1, verify=verify("s/term")))  # 3 forwards
            time.sleep(0.2)
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            sock.sendall(frame(id=2, verify=verify("s/other")))
            replies = {r.id: r for r in read_replies(sock, reader, 2)}
            assert sock.recv(4096) == b""  # closed once nothing was in flight
        assert replies[2].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert replies[2].error.message == "the service is stopping"
        assert replies[1].verify.cached_length == 3
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_replicas(test_models, tmp_path_factory):
    """Two verifiers serving a throwaway CA's certificate: one TLS only, one requiring
    client certificates (mTLS)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"), "ca")
    server = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    procs = {}
    try:
        procs["tls"] = replica("verifier", test_models.target, *server)
        procs["mtls"] = replica(
            "verifier", test_models.target, *server, "--tls-client-ca", str(pki.ca)
        )
        client = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        )
        for p in procs.values():
            p.wait_healthy(credentials=client)
        yield {**procs, "pki": pki}
    finally:
        for p in procs.values():
            p.stop()


def client_tls(pki, certificate: bool, server_name: str = "") -> DataPlaneSettings:
    tls = ClientTls(
        ca=pki.ca.read_bytes(),
        cert=pki.client_cert.read_bytes() if certificate else None,
        key=pki.client_key.read_bytes() if certificate else None,
    )
    return DataPlaneSettings(tls=tls.ssl_context(), server_name=server_name)


async def test_tls_and_mtls(tls_replicas):
    pki = tls_replicas["pki"]
    cases = [  # (replica, client certificate, name checked, answers)
        ("tls", False, "", True),
        ("tls", True, "localhost", True),
        ("mtls", True, "", True),
        ("mtls", False, "", False),  # no client certificate
        ("tls", False, "not-in-the-certificate", False),
    ]
    for name, certificate, server_name, answers in cases:
        port = data_port(tls_replicas[name])
        transport = DataPlaneTransport("127.0.0.1", port, client_tls(pki, certificate, server_name))
        try:
            if answers:
                response = await transport.call(Method.VERIFY, verify(f"s/{name}"), 30)
                assert response.cached_length == 3
            else:
                with pytest.raises(CallFailed) as refused:
                    await transport.call(Method.VERIFY, verify(f"s/{name}"), 30)
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            await transport.close()
    # plaintext to a TLS data port: no preface, no reply, only a closed connection
    for name in ("tls", "mtls"):
        plain = DataPlaneTransport("127.0.0.1", data_port(tls_replicas[name]))
        with pytest.raises(CallFailed) as refused:
            await plain.call(Method.VERIFY, verify("s/plain"), 30)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        await plain.close()


# -- the gateway ------------------------------------------------------------------------------


def transports_logged(proc) -> dict[str, str]:
    """replica address -> the transport the gateway logged for it."""
    found = {}
    for line in proc.lines:
        if '"replica transport"' in line:
            record = json.loads(line)
            found[record["replica"]] = record["transport"]
    return found


@pytest.fixture(scope="module")
def gateways(pair):
    """Two gateways over the pair: the default (data plane) and --replica-transport grpc."""
    procs = {}
    try:
        procs["dataplane"] = gateway([pair["drafter"]], [pair["verifier"]])
        procs["grpc"] = gateway(
            [pair["drafter"]], [pair["verifier"]], None, "--replica-transport", "grpc"
        )
        for p in procs.values():
            p.wait_healthy()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.parametrize("transport", ["dataplane", "grpc"])
def test_gateway_admits_replicas_on_its_transport_and_stays_exact(
    gateways, pair, transport, tokenizer, reference
):
    g = gateways[transport]
    assert transports_logged(g) == {
        pair["drafter"].address: transport,
        pair["verifier"].address: transport,
    }
    with Client(g.address, timeout=120) as client:
        for text in PROMPTS[3:5]:
            ids = tokenizer(text).input_ids
            result = client.generate(token_ids=ids, max_new_tokens=N, k=3)
            assert list(result.tokens) == reference(ids, N)


def test_gateway_rounds_go_over_the_data_plane(gateways, pair, tokenizer):
    port = pair["metrics"]["verifier"]
    name, labels = "specdec_verifier_data_plane_calls_total", 'method="Verify"'
    before = metric(port, name, labels)
    with Client(gateways["dataplane"].address, timeout=120) as client:
        client.generate(token_ids=tokenizer(PROMPTS[5]).input_ids, max_new_tokens=8, k=3)
    assert metric(port, name, labels) > before
