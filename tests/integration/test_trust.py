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


def client_credentials(p):
    """Channel credentials that trust CA p and show its client certificate."""
    return tls_credentials(str(p.ca), str(p.client_cert), str(p.client_key))


def replica_pair(test_models, p) -> tuple:
    """A drafter and a verifier serving p's server certificate, requiring p's clients."""
    return (
        replica("drafter", test_models.draft_noisy, *server_flags(p)),
        replica("verifier", test_models.target, *server_flags(p)),
    )


@pytest.fixture(scope="module")
def stack(test_models, pki):
    """Replicas that require client certificates of the good CA; a gateway that shows one,
    serves TLS requiring client certificates, and checks bearer tokens."""
    good = pki["good"]
    mtls = client_credentials(good)
    procs = []
    try:
        d, v = replica_pair(test_models, good)
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


def test_up_tls_makes_a_throwaway_ca(test_models, tokenizer, reference):
    """`specdec up --tls`: TLS on the gateway, mTLS to the replicas, one throwaway CA."""
    import argparse

    from specdec.tools.stack import LocalStack, add_up_parser

    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["up", "--dtype", "float32", "--draft-model", str(test_models.draft_noisy), "--target-model",
         str(test_models.target), "--port", "0", "--tls", "--draft-threads", "1",
         "--target-threads", "1"]
    )  # fmt: skip
    with LocalStack(args) as stack:
        ca = str(stack.pki.ca)
        ids = tokenizer(PROMPTS[3]).input_ids
        got = generate(stack.gateway.address, tls_credentials(ca), None, ids)
        assert list(got.tokens) == reference(ids, 8)
        with pytest.raises(SpecdecError):  # plaintext is refused
            generate(stack.gateway.address, None, None, ids)
        with grpc.insecure_channel(stack.procs[0].address) as channel:  # so is the drafter's
            from specdec.v1 import common_pb2, drafter_pb2_grpc

            with pytest.raises(grpc.RpcError):
                drafter_pb2_grpc.DrafterServiceStub(channel).Info(
                    common_pb2.InfoRequest(), timeout=10
                )
    assert not stack.pki.ca.exists()  # removed with the stack


def test_health_port_is_plaintext_health_only(test_models, pki):
    """--health-port: the kubelet's gRPC probe cannot speak TLS, so a TLS replica can also
    answer health checks, and nothing else, in plaintext on a second port."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.tools.redisproc import free_port
    from specdec.v1 import common_pb2, verifier_pb2_grpc

    good = pki["good"]
    port = free_port()
    v = replica("verifier", test_models.target, *server_flags(good), "--health-port", str(port))
    try:
        mtls = client_credentials(good)
        v.wait_healthy(credentials=mtls)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="specdec.v1.VerifierService"), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:  # the model is not behind this port
                verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                    common_pb2.InfoRequest(), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(v.address) as channel, pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the main port stays TLS only
    finally:
        v.stop()


def test_replica_server_name_checks_one_name_for_a_pool(
    test_models, tmp_path, tokenizer, reference
):
    """Replicas found by discovery are pod IPs; their certificate names the pool
    (`--replica-server-name`), not each address. Without the name the gateway's TLS check
    of 127.0.0.1 fails against such a certificate; with it the turn runs, exactly."""
    from specdec.v1 import common_pb2, verifier_pb2_grpc

    named = make_pki(tmp_path, "pool", server_names="DNS:verifier.specdec.test")
    creds = client_credentials(named)
    procs = []
    try:
        d, v = replica_pair(test_models, named)
        procs += [d, v]
        override = (("grpc.ssl_target_name_override", "verifier.specdec.test"),)
        d.wait_healthy(credentials=creds, options=override)
        v.wait_healthy(credentials=creds, options=override)
        with grpc.secure_channel(v.address, creds, options=override) as channel:
            info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=120, wait_for_ready=True
            )
            assert info.vocab_size > 0
        with grpc.secure_channel(v.address, creds) as channel, pytest.raises(grpc.RpcError) as err:
            verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=10
            )  # 127.0.0.1 is not in the certificate
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        g = gateway(
            [d], [v], None,
            "--replica-ca", str(named.ca), "--replica-cert", str(named.client_cert),
            "--replica-key", str(named.client_key),
            "--replica-server-name", "verifier.specdec.test",
        )  # fmt: skip
        procs.append(g)
        g.wait_healthy()
        ids = tokenizer(PROMPTS[3]).input_ids
        with Client(g.address, timeout=60) as client:
            assert list(client.generate(token_ids=ids, max_new_tokens=8, k=2).tokens) == reference(
                ids, 8
            )
    finally:
        for p in procs:
            p.stop()


def test_gateway_reaches_the_replicas_data_planes_over_mtls(stack):
    """The gateway's data-plane connections to mTLS replicas: its replica CA, certificate
    and key, the same as its gRPC channels (a failed TLS handshake would leave it on gRPC)."""
    from tests.integration.test_dataplane import transports_logged

    assert transports_logged(stack["gateway"]) == {
        stack["drafter"].address: "dataplane",
        stack["verifier"].address: "dataplane",
    }
