"""Every template renders with every switch on, and every value the docs name exists.

The renderings below flip every boolean of values.yaml away from its default at least once
(a new switch without a rendering here fails `test_every_switch_is_flipped`), every template
must produce an object in at least one of them, and each object must be one the cluster
accepts: kubernetes-validate's schema for core kinds, a structural check for CRD kinds.
"""

from __future__ import annotations

import re
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.chart.render import CHART, CRD_KINDS, KUBE_VERSION, render

ROOT = CHART.parents[1]
TEMPLATES = sorted(
    p.relative_to(CHART.parent).as_posix()
    for p in (CHART / "templates").iterdir()
    if not p.name.startswith("_")
)
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())

TRUST = {
    "tls": {
        "gateway": {"secretName": "gw-tls", "requireClientCert": True},
        "replicas": {"secretName": "replica-tls", "serverName": "replicas.specdec.svc"},
    },
    "auth": {"tokensSecretName": "gw-tokens"},
}
PARENT = [{"name": "public", "namespace": "gateway-system"}]

# name -> values: together they turn on every switch of the chart.
RENDERINGS: dict[str, dict] = {
    "defaults": {},
    "everything-on": {
        **TRUST,
        "drafter": {"keda": {"enabled": True}, "compile": True},
        "verifier": {"keda": {"enabled": True}, "compile": True},
        "gateway": {
            "httpPort": 8000,
            "ingress": {"enabled": True, "tlsSecretName": "gw-ingress-tls"},
            "httpIngress": {"enabled": True, "tlsSecretName": "api-tls"},
            "grpcRoute": {"enabled": True, "parentRefs": PARENT},
            "httpRoute": {"enabled": True, "parentRefs": PARENT, "hostnames": ["api.example.com"]},
        },
        "monitoring": {"enabled": True},
        "drafterAcceptanceAlert": {"enabled": True},
        "grafana": {"dashboard": {"enabled": True}},
        "tracing": {"enabled": True, "jaeger": {"enabled": True}},
    },
    "everything-off": {
        "serviceAccount": {"create": False},
        "drafter": {"pdb": {"enabled": False}},
        "verifier": {"pdb": {"enabled": False}},
        "gateway": {"pdb": {"enabled": False}, "autoscaling": {"enabled": False}},
        "redis": {"enabled": False, "external": {"secretName": "redis-url"}},
        "networkPolicy": {"enabled": False},
    },
    "pools-on-hpa-scraped-by-pod": {
        "drafter": {"autoscaling": {"enabled": True}},
        "verifier": {"autoscaling": {"enabled": True}},
        "gateway": {"httpPort": 8000, "httpIngress": {"enabled": True}},
        "monitoring": {"enabled": True, "kind": "PodMonitor"},
    },
    "builtin-redis-without-volume": {"redis": {"persistence": {"enabled": False}}},
    "replicas-only": {"gateway": {"enabled": False}},
    "gateway-only": {"drafter": {"enabled": False}, "verifier": {"enabled": False}},
    "models-from-the-hub": {"models": {"source": "hub", "hub": {"tokenSecret": {"name": "hub"}}}},
    "models-per-pod-claims": {"models": {"pod": {"volume": "ephemeral"}}},
    "models-filled-by-a-job": {
        "models": {"source": "install", "storage": "claim"},
        "drafter": {"model": {"name": "qwen2.5-coder-0.5b-instruct"}},
        "verifier": {"model": {"name": "qwen2.5-coder-1.5b-instruct"}},
    },
    "models-on-your-claim": {"models": {"source": "pvc", "pvc": {"existingClaim": "filled"}}},
    "models-on-the-nodes": {"models": {"source": "hostPath"}},
}


def _booleans(data, path=()):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _booleans(value, (*path, key))
    elif isinstance(data, bool):
        yield path, data


def _get(data, path):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def test_every_switch_is_flipped():
    unflipped = [
        ".".join(path)
        for path, default in _booleans(DEFAULTS)
        if not any(_get(values, path) is (not default) for values in RENDERINGS.values())
    ]
    assert unflipped == [], "switches no rendering below turns away from their default"


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {name: render(values) for name, values in RENDERINGS.items()}


def _check_crd_object(obj: dict) -> None:
    """What a CRD object needs whatever its schema: an API group/version, a name, a spec
    (a rule set for PrometheusRule), and no core kind that a typo would hide."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    group, _, version = obj["apiVersion"].rpartition("/")
    assert "." in group and version.startswith("v"), where
    assert isinstance(obj.get("spec"), dict) and obj["spec"], where
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_every_template_renders_and_validates(rendered):
    produced = set()
    for name, files in rendered.items():
        for path, text in files.items():
            if not text.strip():
                continue
            produced.add(path)
            if not path.endswith(".yaml"):
                continue
            for obj in (d for d in yaml.safe_load_all(text) if d):
                assert obj["metadata"]["namespace"] == "specdec", (name, path)
                if obj["kind"] in CRD_KINDS:
                    _check_crd_object(obj)
                else:
                    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert sorted(set(TEMPLATES) - produced) == [], "templates no rendering produces"


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_renderings_lint_strict(name):
    report = helm_python.lint(
        str(CHART), RENDERINGS[name], strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- every chart value the docs name exists in values.schema.json ---------------------------

# The pages about deploying and operating, and every other page that mentions the chart.
DOCS = sorted(
    p
    for p in (ROOT / "docs").rglob("*.md")
    if p.parent.name in ("deploy", "operate") or re.search(r"helm|chart", p.read_text(), re.I)
)
CODE = re.compile(r"`([A-Za-z<][\w<>-]*(?:\.[\w<>-]+)+)`")
SET = re.compile(r"--set(?:-string)?[ =]([A-Za-z][\w.-]*)=")
# A code span whose last part is one of these names a file (`drafter.proto`, `tls.crt`).
FILE_SUFFIXES = {"crt", "key", "json", "md", "png", "proto", "py", "tpl", "txt", "yaml", "yml"}
ROLES = ("drafter", "verifier")  # what `<role>.x` in the docs stands for


def _top_level_names() -> set[str]:
    """Top-level value names the chart knows: values.yaml's and the templates' `.Values.X`
    (a template reading a value that values.yaml and the schema lack still counts)."""
    names = set(DEFAULTS)
    for path in (CHART / "templates").iterdir():
        names |= set(re.findall(r"\.Values\.(\w+)", path.read_text()))
    return names


def named_values(text: str, top: set[str]) -> set[str]:
    """Dotted chart value paths a Markdown text names in code spans or `--set` options."""
    out = set()
    for name in [*CODE.findall(text), *SET.findall(text)]:
        first, _, rest = name.partition(".")
        if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue
        if first == "<role>":
            out |= {f"{role}.{rest}" for role in ROLES}
        elif first in top:
            out.add(name)
    return out


def in_schema(schema: dict, path: str) -> bool:
    node = schema
    for key in path.split("."):
        props = node.get("properties")
        if props is None:  # a free-form map (resources, settings, labels, ...)
            return node.get("type") == "object" and node.get("additionalProperties") is not False
        if key not in props:
            return False
        node = props[key]
    return True


def test_named_values_finds_chart_values_only():
    top = {"gateway", "drafter", "verifier", "tls"}
    text = (
        "Set `gateway.ingress.enabled` and `<role>.keda.enabled`; see `drafter.proto`, "
        "`tls.crt`, `grpc.health.v1` and `specdec.v1.GatewayService`.\n"
        "helm upgrade --set gateway.httpPort=8000 --set-string tls.healthPort=1\n"
    )
    assert named_values(text, top) == {
        "gateway.ingress.enabled",
        "drafter.keda.enabled",
        "verifier.keda.enabled",
        "gateway.httpPort",
        "tls.healthPort",
    }
    schema = {"properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    assert in_schema(schema, "a.b") and not in_schema(schema, "a.c")
    assert not in_schema(schema, "grafana.dashboard.enabled")


def test_every_value_the_docs_name_is_in_the_schema():
    schema = helm_python.Chart.load(str(CHART)).schema
    top = _top_level_names()
    missing = []
    seen = 0
    for doc in DOCS:
        for name in sorted(named_values(doc.read_text(), top)):
            seen += 1
            if not in_schema(schema, name):
                missing.append(f"{Path(doc).relative_to(ROOT)}: {name}")
    assert seen > 40  # the extraction still finds the chart's values in the docs
    assert missing == []
