"""Render helm/specdec with real Helm (helm_python wraps Helm's Go SDK; no cluster, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python
import yaml
from helm_python import _native

CHART = Path(__file__).resolve().parents[2] / "helm" / "specdec"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "sd", "specdec"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion); schemas of this version
# ship inside kubernetes-validate.
KUBE_VERSION = "1.29.0"
# Kinds that come from CRDs (KEDA, Gateway API, Prometheus Operator): kubernetes-validate
# has no schema for them.
CRD_KINDS = {
    "ScaledObject",
    "GRPCRoute",
    "HTTPRoute",
    "PrometheusRule",
    "ServiceMonitor",
    "PodMonitor",
}


# The APIs of those kinds, as `.Capabilities.APIVersions.Has` asks for them: a cluster with
# KEDA, Gateway API and the Prometheus Operator. The chart renders each such kind only where
# the cluster serves its API.
OPTIONAL_APIS = (
    "keda.sh/v1alpha1/ScaledObject",
    "gateway.networking.k8s.io/v1/GRPCRoute",
    "gateway.networking.k8s.io/v1/HTTPRoute",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
# A plain cluster: Kubernetes' own APIs only (what `helm template` assumes with no
# --api-versions).
PLAIN: tuple[str, ...] = ()


def values_sets() -> dict[str, dict]:
    """The default values and every shipped example, by name."""
    sets = {"default": {}}
    for path in EXAMPLES:
        sets[path.stem] = yaml.safe_load(path.read_text()) or {}
    return sets


def render(
    values: dict | None = None,
    api_versions: tuple[str, ...] = OPTIONAL_APIS,
    kube_version: str | None = None,
) -> dict[str, str]:
    """Template path -> rendered text (real Helm, values checked by values.schema.json), for
    a cluster that serves `api_versions` besides Kubernetes' own (`helm template
    --api-versions ... --kube-version ...`). helm_python's Chart.render does not take these
    two options; its C library does (the same options as `helm template`), so they go to it
    directly."""
    chart = helm_python.Chart.load(str(CHART))
    opts: dict = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True}
    opts["api_versions"] = list(api_versions)
    if kube_version:
        opts["kube_version"] = f"v{kube_version}"
    rendered = _native.call_string(
        "helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)
    )
    return json.loads(rendered)


def objects(values: dict | None = None, **caps) -> list[dict]:
    """Every Kubernetes object the chart renders with `values` (`caps`: render's
    api_versions, kube_version)."""
    out = []
    for path, text in sorted(render(values, **caps).items()):
        if not path.endswith(".yaml"):
            continue
        out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} rendered"
    return hits[0]


def role_name(role: str) -> str:
    return f"{RELEASE}-specdec-{role}"


def container(deployment: dict, name: str) -> dict:
    spec = deployment["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def env_of(c: dict) -> dict[str, str]:
    """A container's literal environment (values only; valueFrom entries are skipped)."""
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def write_rendered(directory: Path) -> list[Path]:
    """Render every values set into directory/<set>/<template>.yaml (for checkov)."""
    written = []
    for set_name, values in values_sets().items():
        folder = directory / set_name
        folder.mkdir(parents=True, exist_ok=True)
        for path, text in render(values).items():
            if path.endswith(".yaml") and text.strip():
                target = folder / Path(path).name
                target.write_text(text)
                written.append(target)
    return written


if __name__ == "__main__":  # python -m tests.chart.render DIR
    import sys

    files = write_rendered(Path(sys.argv[1]))
    print(f"rendered {len(files)} files into {sys.argv[1]}")
