"""The alerting rules in docs/operate/alerts.md load in Prometheus and name real metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "operate" / "alerts.md"


def _rules() -> str:
    text = PAGE.read_text()
    m = re.search(r"<!-- alerts:rules -->\n```yaml\n(.*?)```", text, flags=re.S)
    assert m, "docs/operate/alerts.md has no `<!-- alerts:rules -->` yaml block"
    return m.group(1)


def _exported_metrics() -> set[str]:
    """Metric names the services define, as Prometheus exposes them."""
    names = set()
    gateway = (
        ROOT / "services" / "gateway" / "specdec" / "gateway" / "observe" / "metrics.py"
    ).read_text()
    names |= {"specdec_gateway_" + n for n in re.findall(r'PREFIX \+ "(\w+)"', gateway)}
    for role in ("drafter", "verifier"):
        replica = (ROOT / "services" / "replica" / "specdec" / "replica" / "metrics.py").read_text()
        names |= {f"specdec_{role}_" + n for n in re.findall(r'p \+ "(\w+)"', replica)}
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r'"(specdec_\w+)"', path.read_text()))
    counters = {n + "_total" for n in names}
    return names | counters | {n.removesuffix("_total") for n in names}


def test_alert_rules_name_exported_metrics():
    exported = _exported_metrics()
    used = set(re.findall(r"\b(specdec_\w+)", _rules()))
    assert used, "the rules name no specdec metric"
    unknown = sorted(used - exported)
    assert not unknown, f"metrics the services do not export: {unknown}"


def test_alert_rules_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (Debian package prometheus; `make test-deps`)")
    rules = tmp_path / "specdec.rules.yaml"
    rules.write_text(_rules())
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
