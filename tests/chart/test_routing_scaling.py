"""The gateway's HTTP API behind an Ingress or an HTTPRoute, Prometheus Operator scraping,
and each pool's autoscaling: KEDA on its own queue, or a plain HorizontalPodAutoscaler."""

from __future__ import annotations

import re

import helm_python
import pytest

from tests.chart.render import container, env_of, find, objects, role_name

ROLES = ("drafter", "verifier", "gateway")
PARENT = [{"name": "public", "namespace": "gateway-system"}]


def _service_port(objs: list[dict], name: str, port_name: str) -> dict:
    ports = {p["name"]: p for p in find(objs, "Service", name)["spec"]["ports"]}
    assert port_name in ports, f"Service {name} has no port {port_name}"
    return ports[port_name]


def test_http_api_through_an_ingress_beside_the_grpc_one():
    gw = role_name("gateway")
    objs = objects(
        {
            "gateway": {
                "httpPort": 8000,
                "ingress": {"enabled": True},
                "httpIngress": {"enabled": True, "host": "api.example.com", "tlsSecretName": "t"},
            }
        }
    )
    grpc, http = find(objs, "Ingress", gw), find(objs, "Ingress", f"{gw}-http")
    for ingress, port_name in ((grpc, "grpc"), (http, "http")):
        (rule,) = ingress["spec"]["rules"]
        (path,) = rule["http"]["paths"]
        backend = path["backend"]["service"]
        assert backend["name"] == gw and backend["port"] == {"name": port_name}
        _service_port(objs, gw, port_name)
    assert http["spec"]["rules"][0]["host"] == "api.example.com"
    assert http["spec"]["tls"] == [{"hosts": ["api.example.com"], "secretName": "t"}]
    # the gRPC Ingress keeps its backend-protocol annotation; the HTTP one has none by default
    assert "backend-protocol" in str(grpc["metadata"]["annotations"])
    assert "annotations" not in http["metadata"]


def test_http_api_through_an_httproute():
    gw = role_name("gateway")
    values = {"gateway": {"httpPort": 8000, "httpRoute": {"enabled": True, "parentRefs": PARENT}}}
    objs = objects(values)
    route = find(objs, "HTTPRoute", gw)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == PARENT
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    assert backend == {"name": gw, "port": _service_port(objs, gw, "http")["port"]}
    assert not [o for o in objs if o["kind"] == "GRPCRoute"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gateway": {"httpPort": 0, "httpIngress": {"enabled": True}}},
            "gateway.httpIngress.enabled needs gateway.httpPort",
        ),
        (
            {"gateway": {"httpPort": 0, "httpRoute": {"enabled": True, "parentRefs": PARENT}}},
            "gateway.httpRoute.enabled needs gateway.httpPort",
        ),
        (
            {"gateway": {"httpPort": 8000, "httpRoute": {"enabled": True}}},
            "gateway.httpRoute.parentRefs",
        ),
        (
            {"drafter": {"keda": {"enabled": True}, "autoscaling": {"enabled": True}}},
            "drafter.keda.enabled and drafter.autoscaling.enabled are both true",
        ),
        ({"verifier": {"keda": {"enabled": True}, "metricsPort": 0}}, "verifier.metricsPort"),
    ],
)
def test_contradictions_fail_naming_the_values(values, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        objects(values)


def test_replica_metrics_are_on_by_default():
    objs = objects()
    for role in ROLES:
        c = container(find(objs, "Deployment", role_name(role)), role)
        port = int(env_of(c)["SPECDEC_METRICS_PORT"])
        assert port > 0, role
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
        assert _service_port(objs, role_name(role), "metrics")["port"] == port


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_monitors_select_each_role_and_its_metrics_port(kind):
    objs = objects({"monitoring": {"enabled": True, "kind": kind, "labels": {"release": "prom"}}})
    monitors = [o for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert {o["kind"] for o in monitors} == {kind} and len(monitors) == 3
    for role in ROLES:
        mon = find(objs, kind, role_name(role))
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        assert mon["metadata"]["labels"]["release"] == "prom"
        assert mon["spec"]["namespaceSelector"] == {"matchNames": ["specdec"]}
        selector = mon["spec"]["selector"]["matchLabels"]
        dep = find(objs, "Deployment", role_name(role))
        if kind == "ServiceMonitor":
            (endpoint,) = mon["spec"]["endpoints"]
            targets = [
                o
                for o in objs
                if o["kind"] == "Service" and selector.items() <= o["metadata"]["labels"].items()
            ]
            assert [t["metadata"]["name"] for t in targets] == [role_name(role)]
            _service_port(objs, role_name(role), endpoint["port"])
        else:
            (endpoint,) = mon["spec"]["podMetricsEndpoints"]
            assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
            assert endpoint["port"] in [p["name"] for p in container(dep, role)["ports"]]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
    # a role without a metrics port is not scraped
    off = objects({"monitoring": {"enabled": True}, "drafter": {"metricsPort": 0}})
    assert [o["metadata"]["name"] for o in off if o["kind"] == "ServiceMonitor"] == [
        role_name("verifier"),
        role_name("gateway"),
    ]


def test_keda_default_query_is_each_pools_own_queue():
    from specdec.replica.metrics import ReplicaMetrics

    objs = objects(
        {"drafter": {"keda": {"enabled": True}}, "verifier": {"keda": {"enabled": True}}}
    )
    queries = {}
    for role in ("drafter", "verifier"):
        (trigger,) = find(objs, "ScaledObject", role_name(role))["spec"]["triggers"]
        queries[role] = trigger["metadata"]["query"]
        metrics = ReplicaMetrics.for_role(role)  # the names the replicas really export
        used = set(re.findall(r"\b(specdec_\w+)\{", queries[role]))
        assert used == {metrics.running._name, metrics.waiting._name}, role
        assert '{namespace="specdec"}' in queries[role]
        assert "replicas" not in find(objs, "Deployment", role_name(role))["spec"]
    assert queries["drafter"] != queries["verifier"]
    mine = objects({"drafter": {"keda": {"enabled": True, "prometheus": {"query": "sum(up)"}}}})
    (trigger,) = find(mine, "ScaledObject", role_name("drafter"))["spec"]["triggers"]
    assert trigger["metadata"]["query"] == "sum(up)"


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_plain_hpa_scales_a_pool_without_keda(role):
    objs = objects({role: {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}})
    hpa = find(objs, "HorizontalPodAutoscaler", role_name(role))
    target = hpa["spec"]["scaleTargetRef"]
    assert find(objs, target["kind"], target["name"]) is find(objs, "Deployment", role_name(role))
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 80}
    assert "replicas" not in find(objs, "Deployment", role_name(role))["spec"]
    assert not [o for o in objs if o["kind"] == "ScaledObject"]
    pods_metric = {
        "type": "Pods",
        "pods": {
            "metric": {"name": f"specdec_{role}_num_requests_waiting"},
            "target": {"type": "AverageValue", "averageValue": "4"},
        },
    }
    custom = objects({role: {"autoscaling": {"enabled": True, "metrics": [pods_metric]}}})
    assert find(custom, "HorizontalPodAutoscaler", role_name(role))["spec"]["metrics"] == [
        pods_metric
    ]
    other = "verifier" if role == "drafter" else "drafter"
    assert not [
        o
        for o in objs
        if o["kind"] == "HorizontalPodAutoscaler" and o["metadata"]["name"] == role_name(other)
    ]
