"""The release workflow (.github/workflows/release.yml), which cannot run here: its YAML is
read as GitHub Actions reads it, its matrix expanded, and the image references it pushes
are computed with the same script the workflow runs, then compared with what the chart's
defaults name."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from pathlib import Path

import yaml

from tests.chart.render import CHART, container, find, objects, role_name

ROOT = CHART.parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def _workflow() -> dict:
    doc = yaml.load(WORKFLOW.read_text(), Loader=yaml.BaseLoader)  # `on` stays a string
    assert isinstance(doc, dict)
    return doc


def expand_matrix(matrix: dict) -> list[dict]:
    """GitHub's matrix expansion for what the workflow uses: the product of the list keys,
    then each `include` entry extends the combinations it matches on their original keys, or
    is added as a combination of its own."""
    keys = [k for k in matrix if k not in ("include", "exclude")]
    combos = [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(matrix[k] for k in keys))
    ]
    for ex in matrix.get("exclude", []):
        combos = [c for c in combos if not ex.items() <= c.items()]
    for inc in matrix.get("include", []):
        matched = [c for c in combos if all(c[k] == inc[k] for k in keys if k in inc and k in c)]
        originals = {k: v for k, v in inc.items() if k in keys}
        if matched and all(c[k] == v for c in matched for k, v in originals.items()):
            for c in matched:
                c.update(inc)
        else:
            combos.append(dict(inc))
    return combos


def test_release_runs_on_a_version_tag_and_may_push_packages():
    wf = _workflow()
    assert wf["on"] == {"push": {"tags": ["v*.*.*"]}}
    assert wf["permissions"] == {"contents": "read", "packages": "write"}


def test_matrix_builds_three_roles_for_both_torch_variants():
    job = _workflow()["jobs"]["images"]
    combos = expand_matrix(job["strategy"]["matrix"])
    roles = {c["role"] for c in combos}
    assert roles == {"gateway", "drafter", "verifier"}
    for role in ("drafter", "verifier"):  # one image per torch build
        assert sorted(c["variant"] for c in combos if c["role"] == role) == ["cpu", "cu128"]
    # the gateway has no torch: one image, the one every variant runs beside
    assert [c["variant"] for c in combos if c["role"] == "gateway"] == ["any"]
    assert len(combos) == 5
    # each job builds its role's Dockerfile with its variant, and pushes to ghcr.io
    steps = {s.get("uses", s.get("name")): s for s in job["steps"]}
    build = steps["docker/build-push-action@v6"]["with"]
    assert build["file"] == "services/${{ matrix.role }}/Dockerfile"
    assert build["push"] == "true" and build["tags"] == "${{ steps.name.outputs.ref }}"
    assert "TORCH_VARIANT=${{ steps.name.outputs.variant }}" in build["build-args"]
    assert steps["docker/login-action@v3"]["with"]["registry"] == "ghcr.io"
    for combo in combos:
        assert (ROOT / "services" / combo["role"] / "Dockerfile").is_file()
    digest = steps["Digest"]
    assert digest["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert "$GITHUB_STEP_SUMMARY" in digest["run"] and 'echo "$REF@$DIGEST"' in digest["run"]


def _run_name_step(combo: dict, owner: str, tag: str, tmp_path: Path) -> dict[str, str]:
    """The workflow's `Image name` step, run by bash as the runner would, with the matrix
    values and GitHub's variables filled in; its outputs."""
    step = next(s for s in _workflow()["jobs"]["images"]["steps"] if s.get("id") == "name")
    script = re.sub(r"\$\{\{ matrix\.(\w+) \}\}", lambda m: combo[m.group(1)], step["run"])
    assert "${{" not in script
    out = tmp_path / "github_output"
    out.write_text("")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("IMAGE_", "TORCH_"))},
        "GITHUB_REF_NAME": tag,
        "GITHUB_REPOSITORY_OWNER": owner,
        "GITHUB_OUTPUT": str(out),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(line.split("=", 1) for line in out.read_text().splitlines())


def test_pushed_references_are_the_charts_defaults(tmp_path):
    """What the workflow pushes for the chart's appVersion under the owner of the chart's
    default prefix is, role by role and variant by variant, what the chart pulls."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    prefix = defaults["images"]["prefix"]
    assert not prefix.startswith("localhost/")
    registry, owner, name = prefix.split("/")
    assert (registry, name) == ("ghcr.io", "specdec")
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    combos = expand_matrix(_workflow()["jobs"]["images"]["strategy"]["matrix"])
    pushed = {
        (c["role"], c["variant"]): _run_name_step(c, owner.capitalize(), f"v{version}", tmp_path)[
            "ref"
        ]
        for c in combos
    }
    for variant in ("cu128", "cpu"):  # the chart's default (GPU) and its CPU builds
        values = {r: {"image": {"torchVariant": variant}} for r in ("drafter", "verifier")}
        if variant == "cpu":
            for role in ("drafter", "verifier"):
                values[role] |= {"device": "cpu", "gpus": 0}
        objs = objects(values)
        for role in ("drafter", "verifier"):
            image = container(find(objs, "Deployment", role_name(role)), role)["image"]
            assert image == pushed[(role, variant)]
        gateway = container(find(objs, "Deployment", role_name("gateway")), "gateway")
        assert gateway["image"] == pushed[("gateway", "any")]
    assert pushed[("gateway", "any")] == f"ghcr.io/{owner}/specdec-gateway:{version}"


def test_a_tag_that_is_not_the_charts_version_is_refused(tmp_path):
    step = next(s for s in _workflow()["jobs"]["images"]["steps"] if s.get("id") == "name")
    script = (
        step["run"].replace("${{ matrix.variant }}", "cpu").replace("${{ matrix.role }}", "drafter")
    )
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=ROOT,
        env={
            **os.environ,
            "GITHUB_REF_NAME": "v9.9.9",
            "GITHUB_REPOSITORY_OWNER": "specdec",
            "GITHUB_OUTPUT": str(tmp_path / "out"),
        },
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "tag v9.9.9 is not the chart's appVersion" in done.stdout
