"""The chart on a plain Kubernetes cluster: no KEDA, no Gateway API, no Prometheus Operator.

Every example renders there (`helm template` with only Kubernetes' own APIs), every object
it renders is a built-in kind that validates against the oldest supported Kubernetes, and
the default values need no CRD, no ReadWriteMany claim and no registry of one's own.
"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from tests.chart.render import (
    CRD_KINDS,
    KUBE_VERSION,
    OPTIONAL_APIS,
    PLAIN,
    container,
    find,
    objects,
    render,
    role_name,
    values_sets,
)

SETS = values_sets()
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def plain(values: dict) -> list[dict]:
    return objects(values, api_versions=PLAIN, kube_version=KUBE_VERSION)


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_every_example_renders_on_a_plain_cluster(set_name):
    objs = plain(SETS[set_name])
    assert {"Deployment", "Service"} <= {o["kind"] for o in objs}
    for obj in objs:
        assert obj["kind"] not in CRD_KINDS, f"{set_name}: {obj['kind']}"
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_default_values_need_no_crd_no_rwx_and_no_local_registry():
    objs = plain({})
    assert not CRD_KINDS & {o["kind"] for o in objs}
    # images: the published ones, pulled only when absent
    for dep in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        spec = dep["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert not c["image"].startswith("localhost/"), c["image"]
            assert c["imagePullPolicy"] == "IfNotPresent", c["name"]
            if c["name"] in ("drafter", "verifier", "gateway", "fetch-model"):
                assert c["image"].startswith("ghcr.io/"), c["image"]
    # storage: no ReadWriteMany anywhere, no models claim at all
    modes = []
    for o in objs:
        if o["kind"] == "PersistentVolumeClaim":
            modes += o["spec"]["accessModes"]
        for t in o["spec"].get("volumeClaimTemplates", []) if o["kind"] == "StatefulSet" else []:
            modes += t["spec"]["accessModes"]
    assert "ReadWriteMany" not in modes
    assert not [o for o in objs if o["kind"] in ("PersistentVolumeClaim", "Job")]
    # models: hub ids, each pod fetching its own; the API serves the target's hub id
    for role in ("drafter", "verifier"):
        (fetch,) = find(objs, "Deployment", role_name(role))["spec"]["template"]["spec"][
            "initContainers"
        ]
        assert HUB_ID.match(fetch["command"][3]), fetch["command"][3]
    gateway = container(find(objs, "Deployment", role_name("gateway")), "gateway")
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["SPECDEC_SERVED_MODEL_NAME"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_served_model_name_value():
    def served(values: dict) -> str | None:
        gw = container(find(objects(values), "Deployment", role_name("gateway")), "gateway")
        return {e["name"]: e.get("value") for e in gw["env"]}.get("SPECDEC_SERVED_MODEL_NAME")

    assert served({"verifier": {"model": {"name": "Org/Target-7B"}}}) == "Org/Target-7B"
    assert served({"servedModelName": "chat"}) == "chat"
    # not from the hub: the gateway's own default (the model folder's name)
    assert served({"models": {"source": "hostPath"}}) is None
    assert served({"models": {"source": "hostPath"}, "servedModelName": "chat"}) == "chat"


def test_optional_kinds_render_where_their_api_is_served():
    """gpu-pools asks for KEDA and a GRPCRoute: with their APIs they render (and KEDA owns
    the replica count); without, they are left out, the pools keep their replicas, and the
    install notes name each one left out and the API it needs."""
    values = SETS["gpu-pools"]
    full = objects(values, api_versions=OPTIONAL_APIS)
    for role in ("drafter", "verifier"):
        assert find(full, "ScaledObject", role_name(role))
        assert "replicas" not in find(full, "Deployment", role_name(role))["spec"]
    assert find(full, "GRPCRoute", role_name("gateway"))
    bare = plain(values)
    for role in ("drafter", "verifier"):
        dep = find(bare, "Deployment", role_name(role))
        assert dep["spec"]["replicas"] == values[role]["replicas"]
    notes = render(values, api_versions=PLAIN)["specdec/templates/NOTES.txt"]
    skipped = [line for line in notes.splitlines() if line.startswith("Not rendered:")]
    assert skipped == [
        "Not rendered: drafter.keda.enabled is true but this cluster serves no "
        "keda.sh/v1alpha1/ScaledObject (install its CRDs, then helm upgrade)",
        "Not rendered: verifier.keda.enabled is true but this cluster serves no "
        "keda.sh/v1alpha1/ScaledObject (install its CRDs, then helm upgrade)",
        "Not rendered: gateway.grpcRoute.enabled is true but this cluster serves no "
        "gateway.networking.k8s.io/v1/GRPCRoute (install its CRDs, then helm upgrade)",
    ]
    assert "Not rendered" not in render(values)["specdec/templates/NOTES.txt"]


@pytest.mark.parametrize(
    ("values", "kind", "api"),
    [
        ({"monitoring": {"enabled": True}}, "ServiceMonitor", "monitoring.coreos.com/v1/ServiceMonitor"),
        ({"monitoring": {"enabled": True, "kind": "PodMonitor"}}, "PodMonitor", "monitoring.coreos.com/v1/PodMonitor"),
        ({"drafterAcceptanceAlert": {"enabled": True}}, "PrometheusRule", "monitoring.coreos.com/v1/PrometheusRule"),
        ({"gateway": {"httpPort": 8000, "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}}},
         "HTTPRoute", "gateway.networking.k8s.io/v1/HTTPRoute"),
    ],
)  # fmt: skip
def test_each_optional_kind_needs_its_api(values, kind, api):
    assert kind in {o["kind"] for o in objects(values, api_versions=(api,))}
    assert kind not in {o["kind"] for o in plain(values)}
    notes = render(values, api_versions=PLAIN)["specdec/templates/NOTES.txt"]
    assert f"this cluster serves no {api}" in notes
