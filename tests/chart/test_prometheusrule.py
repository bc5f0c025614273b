"""The drafter acceptance alert (values-gated PrometheusRule), rendered by real Helm.

kubernetes-validate has no schema for the Prometheus Operator's CRD, so what is checked is:
the object is off by default, renders as a monitoring.coreos.com/v1 PrometheusRule with
the chart's metadata, its rule group passes `promtool check rules`, and its expression
names the gateway's per-version acceptance counters with the values given.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.chart.render import objects, role_name
from tests.unit.test_docs_alerts import _exported_metrics

ALERT = {
    "drafterAcceptanceAlert": {
        "enabled": True,
        "share": 0.7,
        "window": "20m",
        "trailing": "3d",
        "for": "5m",
        "labels": {"release": "kube-prometheus"},
    }
}


def rule_objects(values: dict) -> list[dict]:
    return [o for o in objects(values) if o["kind"] == "PrometheusRule"]


def test_off_by_default():
    assert rule_objects({}) == []


def test_renders_the_alert_with_the_values():
    (rule,) = rule_objects(ALERT)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == role_name("gateway")
    assert rule["metadata"]["namespace"] == "specdec"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specdec"
    (group,) = rule["spec"]["groups"]
    (alert,) = group["rules"]
    assert alert["alert"] == "SpecdecDrafterAcceptanceDrop"
    assert alert["for"] == "5m"
    expr = alert["expr"]
    assert "[20m]" in expr and "[3d]" in expr and "< 0.7 *" in expr
    assert "by (drafter_version)" in expr
    used = set(re.findall(r"\b(specdec_\w+)", expr))
    assert used == {
        "specdec_gateway_spec_decode_num_accepted_tokens_by_drafter_total",
        "specdec_gateway_spec_decode_num_draft_tokens_by_drafter_total",
    }
    assert used <= _exported_metrics()
    assert "{{ $labels.drafter_version }}" in alert["annotations"]["summary"]


def test_rule_group_passes_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (Debian package prometheus; `make test-deps`)")
    (rule,) = rule_objects(ALERT)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("bad", [{"share": 1.5}, {"window": "soon"}, {"severity": ""}])
def test_schema_refuses_bad_values(bad):
    with pytest.raises(Exception, match="drafterAcceptanceAlert"):
        objects({"drafterAcceptanceAlert": {"enabled": True, **bad}})
