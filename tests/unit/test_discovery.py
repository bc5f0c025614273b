"""Discovery targets (--drafter / --verifier) and what counts as a ready EndpointSlice endpoint."""

from __future__ import annotations

import pytest

from specdec.cli import build_parser
from specdec.common.settings import ConfigError
from specdec.gateway.config import GatewayConfig
from specdec.gateway.fleet.discovery import DnsTarget, K8sDiscovery, K8sTarget, parse_target


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("10.0.0.1:50061,10.0.0.2:50061", None),
        (
            "dns:drafter.ns.svc.cluster.local:50061",
            DnsTarget("drafter.ns.svc.cluster.local", 50061),
        ),
        ("dns://10.96.0.10:53/d.ns.svc:7", DnsTarget("d.ns.svc", 7, ("10.96.0.10", 53))),
        ("dns://[fd00::a]:5353/d:7", DnsTarget("d", 7, ("fd00::a", 5353))),
        ("k8s:ns/sd-specdec-drafter:50061", K8sTarget("ns", "sd-specdec-drafter", 50061)),
        ("k8s:verifier:grpc", K8sTarget(None, "verifier", "grpc")),
    ],
)
def test_parse_target(raw, want):
    assert parse_target(raw) == want
    if want is not None:
        assert str(want) == raw


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("dns:name", "expected dns:NAME:PORT"),
        ("dns:name:99999", "not a port number"),
        ("dns://resolver.local:53/name:1", "must be an IP address"),
        ("dns://10.0.0.1/name:1", "expected dns://DNS_SERVER:PORT/NAME:PORT"),
        ("k8s:Bad_Service:1", "expected k8s:"),
        ("k8s:NS/svc:1", "not a namespace name"),
        ("k8s:svc", "expected k8s:"),
        ("consul:svc:1", "unknown discovery scheme"),
    ],
)
def test_bad_targets_fail_naming_the_setting(raw, why):
    args = build_parser().parse_args(["serve", "gateway", "--drafter", raw, "--verifier", "h:1"])
    with pytest.raises(ConfigError, match=f"--drafter / SPECDEC_DRAFTER.*{why}"):
        GatewayConfig.from_args(args)


def test_config_keeps_a_target_whole_and_reads_dns_interval(monkeypatch):
    monkeypatch.setenv("SPECDEC_DNS_INTERVAL", "0.5")
    args = build_parser().parse_args(
        ["serve", "gateway", "--drafter", "dns:d.ns.svc:1", "--verifier", "k8s:ns/v:2"]
    )
    cfg = GatewayConfig.from_args(args)
    assert cfg.drafters == ("dns:d.ns.svc:1",) and cfg.verifiers == ("k8s:ns/v:2",)
    assert cfg.dns_interval == 0.5
    args = build_parser().parse_args(
        ["serve", "gateway", "--drafter", "a:1", "--verifier", "b:2", "--dns-interval", "0"]
    )
    with pytest.raises(ConfigError, match="--dns-interval"):
        GatewayConfig.from_args(args)


def endpoint_slice(address_type="IPv4", ports=None, endpoints=()):
    return {
        "metadata": {"name": "s"},
        "addressType": address_type,
        "ports": ports if ports is not None else [{"name": "grpc", "port": 50061}],
        "endpoints": list(endpoints),
    }


def test_only_ready_endpoints_on_the_named_port_count():
    by_number = K8sDiscovery(K8sTarget("ns", "svc", 50061))
    by_name = K8sDiscovery(K8sTarget("ns", "svc", "grpc"))
    s = endpoint_slice(
        endpoints=[
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"], "conditions": {}},  # unknown: ready, as documented
            {"addresses": ["10.0.0.4"]},
            {"addresses": ["10.0.0.5"], "conditions": {"ready": False, "terminating": True}},
        ]
    )
    want = {"10.0.0.1:50061", "10.0.0.3:50061", "10.0.0.4:50061"}
    assert by_number.addresses(s) == want == by_name.addresses(s)
    other_port = K8sDiscovery(K8sTarget("ns", "svc", 9090))
    assert other_port.addresses(s) == frozenset()
    v6 = endpoint_slice("IPv6", endpoints=[{"addresses": ["fd00::1"]}])
    assert by_name.addresses(v6) == {"[fd00::1]:50061"}
    fqdn = endpoint_slice("FQDN", endpoints=[{"addresses": ["pod.example"]}])
    assert by_name.addresses(fqdn) == frozenset()


def test_k8s_target_without_namespace_outside_a_pod_says_so():
    with pytest.raises(ValueError, match="k8s:NAMESPACE/SERVICE:PORT"):
        K8sDiscovery(K8sTarget(None, "svc", 1))
