"""Trust through real processes on loopback (issue 11, item 8): TLS on the gateway's port
with client certificates, mTLS between the gateway and its replicas, bearer tokens.
Certificates come from throwaway CAs made in the test (specdec.tools.certs)."""

from __future__ import annotations

import grpc
import pytest

from specdec.sdk import Client, SpecdecError, read_token, tls_credentials
from specdec.tools.certs import make_pki
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, replica

pytestmark = pytest.mark.integration

TOKEN = "t0k3n-for-the-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    good, other = make_pki(root, "ca"), make_pki(root, "other")
    tokens = root / "tokens"
    tokens.write_text(f"# tokens the gateway accepts\n{TOKEN}\nsecond-token\n")
    return {"good": good, "other": other, "tokens": tokens}


def server_flags(p, client_ca=True) -> list[str]:
    flags = ["--tls-cert", str(p.server_cert), "--tls-key", str(p.server_key)]
    return [*flags, "--tls-client-ca", str(p.ca)] if client_ca else flags


@pytest.fixture(scope="module")
def stack(test_models, pki):
    """Replicas that require client certificates of the good CA; a gateway that shows one,
    serves TLS requiring client certificates, and checks bearer tokens."""
    good = pki["good"]
    mtls = tls_credentials(str(good.ca), str(good.client_cert), str(good.client_key))
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy, *server_flags(good))
        v = replica("verifier", test_models.target, *server_flags(good))
        procs += [d, v]
        d.wait_healthy(credentials=mtls), v.wait_healthy(credentials=mtls)
        g = gateway(
            [d],
            [v],
            None,
            *server_flags(good),
            "--replica-ca",
            str(good.ca),
            "--replica-cert",
            str(good.client_cert),
            "--replica-key",
            str(good.client_key),
            "--auth-tokens-file",
            str(pki["tokens"]),
        )
        procs.append(g)
        g.wait_healthy(credentials=mtls)  # health needs no token
        yield {"drafter": d, "verifier": v, "gateway": g}
    finally:
        for p in procs:
            p.stop()


def generate(address: str, credentials, token: str | None, ids: list[int]):
    with Client(address, timeout=60, credentials=credentials, token=token) as client:
        return client.generate(token_ids=ids, max_new_tokens=8, k=2)


def test_right_certificate_and_token_pass(stack, pki, tokenizer, reference, tmp_path):
    good = pki["good"]
    creds = tls_credentials(str(good.ca), str(good.client_cert), str(good.client_key))
    ids = tokenizer(PROMPTS[0]).input_ids
    assert list(generate(stack["gateway"].address, creds, TOKEN, ids).tokens) == reference(ids, 8)
    token_file = tmp_path / "token"
    token_file.write_text("second-token\n")
    assert generate(stack["gateway"].address, creds, read_token(str(token_file)), ids).tokens


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(stack, pki, tokenizer, token):
    good = pki["good"]
    creds = tls_credentials(str(good.ca), str(good.client_cert), str(good.client_key))
    with pytest.raises(SpecdecError) as err:
        generate(stack["gateway"].address, creds, token, tokenizer(PROMPTS[1]).input_ids)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with (
        Client(stack["gateway"].address, timeout=30, credentials=creds, token=token) as client,
        pytest.raises(SpecdecError) as err,
    ):
        client.server_info()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_wrong_or_missing_client_certificate_is_refused(stack, pki, tokenizer):
    good, other = pki["good"], pki["other"]
    ids = tokenizer(PROMPTS[2]).input_ids
    wrong_cert = tls_credentials(str(good.ca), str(other.client_cert), str(other.client_key))
    no_cert = tls_credentials(str(good.ca))
    untrusted_server = tls_credentials(str(other.ca), str(good.client_cert), str(good.client_key))
    for creds in (wrong_cert, no_cert, untrusted_server):
        with pytest.raises(SpecdecError) as err:
            generate(stack["gateway"].address, creds, TOKEN, ids)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(SpecdecError) as err:  # plaintext to a TLS port
        generate(stack["gateway"].address, None, TOKEN, ids)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_replicas_refuse_a_gateway_without_their_client_certificate(stack, pki):
    """mTLS between gateway and replicas: only the right client certificate gets in."""
    from specdec.v1 import common_pb2, verifier_pb2_grpc

    good, other = pki["good"], pki["other"]
    address = stack["verifier"].address
    right = tls_credentials(str(good.ca), str(good.client_cert), str(good.client_key))
    with grpc.secure_channel(address, right) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=10
        )
        assert info.vocab_size > 0
    for creds in (
        tls_credentials(str(good.ca), str(other.client_cert), str(other.client_key)),
        tls_credentials(str(good.ca)),
    ):
        with grpc.secure_channel(address, creds) as channel, pytest.raises(grpc.RpcError) as err:
            verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        verifier_pb2_grpc.VerifierServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
