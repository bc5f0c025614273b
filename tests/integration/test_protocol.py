"""Protocol hygiene through real processes on loopback (issue 11, item 7).

Raw bytes are sent with serializer-less generic calls, as a client in another language
would send them: malformed messages, and token ids wider than 32 bits.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from specdec.sdk import Client, InvalidArgument
from specdec.v1 import common_pb2, gateway_pb2
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack

pytestmark = pytest.mark.integration

# Not a protobuf message: field 1 as a length-delimited field whose length runs past the end.
MALFORMED = [b"\x0a\xff\xff\xff\x0f", b"\xff\xff\xff", b"\x12\x05ab"]


@pytest.fixture(scope="module")
def stack(test_models):
    with small_stack(test_models.draft_noisy, test_models.target) as procs:
        yield procs


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    key = varint(number << 3 | wire_type)
    if wire_type == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def packed(number: int, values: list[int]) -> bytes:
    return field(number, 2, b"".join(varint(v) for v in values))


def call_raw(address: str, method: str, payload: bytes, streaming: bool = False):
    """Send payload as the request bytes of method; the raw response bytes (or raises)."""
    with grpc.insecure_channel(address) as channel:
        if streaming:
            return list(channel.unary_stream(method)(payload, timeout=60))
        return channel.unary_unary(method)(payload, timeout=60)


UNARY = {
    "gateway": [
        "/specdec.v1.GatewayService/Generate",
        "/specdec.v1.GatewayService/GetServerInfo",
    ],
    "drafter": [
        "/specdec.v1.DrafterService/Draft",
        "/specdec.v1.DrafterService/Speculate",
        "/specdec.v1.DrafterService/Info",
        "/specdec.v1.DrafterService/Release",
    ],
    "verifier": [
        "/specdec.v1.VerifierService/Verify",
        "/specdec.v1.VerifierService/Info",
        "/specdec.v1.VerifierService/Release",
    ],
}


def test_malformed_bytes_are_invalid_argument_without_traceback(stack):
    calls = [(role, m, False) for role, methods in UNARY.items() for m in methods]
    calls += [("gateway", "/specdec.v1.GatewayService/GenerateStream", True)]
    calls += [(role, "/grpc.health.v1.Health/Check", False) for role in stack]
    for role, method, streaming in calls:
        for payload in MALFORMED:
            with pytest.raises(grpc.RpcError) as err:
                call_raw(stack[role].address, method, payload, streaming)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload)
            assert "do not parse" in err.value.details()
    for proc in stack.values():
        assert proc.alive()
        assert "Traceback" not in proc.tail(400), proc.tail(400)
        with grpc.insecure_channel(proc.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_token_id_wider_than_32_bits_is_refused(stack, tokenizer):
    ids = tokenizer(PROMPTS[0]).input_ids
    # GenerateRequest{prompt_token_ids{ids: [...ids, 2^40]}, max_new_tokens: 4}: the id's
    # low 32 bits are 0, so a 32-bit parse would have read it as token 0.
    request = field(2, 2, packed(1, [*ids, 2**40])) + field(3, 0, varint(4))
    with pytest.raises(grpc.RpcError) as err:
        call_raw(stack["gateway"].address, "/specdec.v1.GatewayService/Generate", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(2**40) in err.value.details()
    # The same on a replica: VerifyRequest{session_id, new_tokens: [...ids, 2^40]}.
    request = field(1, 2, b"s/raw") + packed(3, [*ids, 2**40])
    with pytest.raises(grpc.RpcError) as err:
        call_raw(stack["verifier"].address, "/specdec.v1.VerifierService/Verify", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(2**40) in err.value.details()
    # A draft token too: DraftRequest is refused on its new_tokens the same way.
    request = field(1, 2, b"s/raw") + packed(3, [2**33 + 5]) + field(4, 0, varint(2))
    with pytest.raises(grpc.RpcError) as err:
        call_raw(stack["drafter"].address, "/specdec.v1.DrafterService/Draft", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # An int32 negative id (10-byte varint) still parses, and is refused as out of range.
    with Client(stack["gateway"].address, timeout=60) as client, pytest.raises(InvalidArgument):
        client.generate(token_ids=[*ids, -1], max_new_tokens=2)


def list_services(address: str, version: str) -> list[str]:
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (response,) = list(
            call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        )
    return [s.name for s in response.list_services_response.service]


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_v1_and_v1alpha(stack, version):
    names = list_services(stack["gateway"].address, version)
    assert "specdec.v1.GatewayService" in names
    assert "grpc.reflection.v1.ServerReflection" in names
    assert "specdec.v1.VerifierService" in list_services(stack["verifier"].address, version)


def test_server_info(stack, test_models, tokenizer):
    with grpc.insecure_channel(stack["verifier"].address) as channel:
        from specdec.v1 import verifier_pb2_grpc

        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=10
        )
    with Client(stack["gateway"].address, timeout=60) as client:
        got = client.server_info()
    assert got.model_id == info.model_id == str(test_models.target)
    assert got.draft_model_id == str(test_models.draft_noisy)
    assert got.vocab_size == info.vocab_size == len(tokenizer)
    assert got.max_context == info.max_context
    assert got.max_k == info.max_draft_tokens
    assert 0 <= got.default_k <= got.max_k
    assert got.tokenizer_fingerprint == info.tokenizer_fingerprint
    assert got.eos_token_ids == tuple(sorted(info.eos_token_ids))
    assert got.bos_token_id == info.bos_token_id
    assert got.max_new_tokens > 0 and got.max_stop_strings == 16
    assert got.max_session_ttl_seconds >= got.default_session_ttl_seconds > 0


def test_stream_fields_as_documented(stack, tokenizer):
    """GenerateStreamResponse: deltas first, everything else on the last message only."""
    ids = tokenizer(PROMPTS[1]).input_ids
    request = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=ids),
        max_new_tokens=12,
        speculation=gateway_pb2.SpeculationParams(num_draft_tokens=4),
    )
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        from specdec.v1 import gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        messages = list(stub.GenerateStream(request, timeout=60))
        whole = stub.Generate(request, timeout=60)
    *deltas, last = messages
    assert deltas, "12 tokens at k = 4 take several rounds"
    assert deltas[0].timings.time_to_first_token_ms > 0  # progress: the first token is out
    for i, m in enumerate(deltas):
        assert m.text or m.token_ids
        assert not m.HasField("usage") and not m.HasField("stats")
        assert m.HasField("timings") == (i == 0)
        assert m.finish_reason == gateway_pb2.FINISH_REASON_UNSPECIFIED
    assert last.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
    assert last.HasField("usage") and last.HasField("stats") and last.HasField("timings")
    assert [t for m in messages for t in m.token_ids] == list(whole.token_ids)
    assert "".join(m.text for m in messages) == whole.text
    with Client(stack["gateway"].address, timeout=60) as client:
        chunks = list(client.stream(token_ids=ids, max_new_tokens=12, k=4))
    assert chunks[0].time_to_first_token_ms and chunks[0].time_to_first_token_ms > 0
    assert all(c.time_to_first_token_ms is None for c in chunks[1:])
