"""helm/specdec/README.md is generated from values.yaml's `# --` comments: it must be current."""

from __future__ import annotations

import re

from specdec.tools.docs import helm
from tests.chart.render import CHART

ROOT = CHART.parents[1]


def test_committed_readme_is_up_to_date():
    committed = (CHART / "README.md").read_text()
    assert committed == helm.readme(ROOT), "helm/specdec/README.md is stale: run `make docs-gen`"


def test_readme_lists_every_documented_value_and_links_inside_the_repository():
    text = (CHART / "README.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    values = {".".join(v.path) for v in helm.documented((CHART / "values.yaml").read_text())}
    assert rows == values and len(rows) > 100
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert "://" not in target, target
        assert (CHART / target.split("#")[0]).resolve().exists(), target
