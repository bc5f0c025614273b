"""The Helm chart's values table (docs/reference/helm-values.md) and its README
(helm/specdec/README.md), generated from helm/specdec/values.yaml (helm-docs style).

A key documented with a `# --` comment (continued by the `#` lines after it, up to the key)
is one row: its dotted path, type, default (the YAML value, a map or list in one piece) and
description. Keys inside a documented map are part of its default, not rows of their own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from specdec.tools.docs.common import banner, cell, code

CHART = Path("helm/specdec")
VALUES = CHART / "values.yaml"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+|\"[^\"]+\"):(?:\s|$)")


@dataclass(frozen=True)
class Value:
    path: tuple[str, ...]
    description: str
    default: object


def documented(text: str) -> list[Value]:
    """Every `# --` documented key of a values.yaml text, in file order."""
    data = yaml.safe_load(text)
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing maps
    pending: list[str] | None = None  # the `# --` comment being read
    out: list[Value] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[len("# --") :].strip()]
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending.append(stripped[1:].strip())
            continue
        m = KEY.match(line)
        if not m:
            if stripped and not stripped.startswith("-"):
                pending = None
            continue
        indent, key = len(m.group("indent")), m.group("key").strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(k for _, k in stack), key)
        stack.append((indent, key))
        if pending is not None:
            out.append(Value(path, " ".join(p for p in pending if p), _lookup(data, path)))
            pending = None
    return out


def _lookup(data, path: tuple[str, ...]):
    for key in path:
        data = data[key]
    return data


def leaves(data, path: tuple[str, ...] = ()):
    """Dotted paths of every value that is not a non-empty map."""
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from leaves(value, (*path, str(key)))
    else:
        yield path


def _type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def tables(root: Path, heading: str = "##") -> list[str]:
    """The values as Markdown tables, one per top-level key (chart-wide values first)."""
    lines: list[str] = []
    section = None
    for v in documented((root / VALUES).read_text()):
        top = f"`{v.path[0]}`" if len(v.path) > 1 else "Chart-wide"
        if top != section:
            section = top
            lines += ["", f"{heading} {top}", "", "| key | type | default | description |"]
            lines.append("| --- | --- | --- | --- |")
        default = json.dumps(v.default, separators=(",", ":"))
        lines.append(
            f"| `{'.'.join(v.path)}` | {_type(v.default)} | {code(default)} "
            f"| {cell(v.description)} |"
        )
    return lines


def render(root: Path) -> str:
    lines = [
        banner("the `# --` comments of `helm/specdec/values.yaml`"),
        "# Helm chart values",
        "",
        "Every value of the `helm/specdec` chart, with its default; "
        "`values.schema.json` beside `values.yaml` checks them at install. Set them with "
        "`--set key=value` or a values file (`-f`); `helm/specdec/examples/` holds complete "
        "values files. See [Kubernetes with Helm](../deploy/helm.md) for how the pieces fit.",
        *tables(root),
    ]
    return "\n".join(lines) + "\n"


def readme(root: Path) -> str:
    """helm/specdec/README.md: what the chart is, how to install it, every value (as
    helm-docs would write it from the same comments)."""
    chart = yaml.safe_load((root / CHART / "Chart.yaml").read_text())
    examples = sorted(p.name for p in (root / CHART / "examples").glob("*.yaml"))
    lines = [
        banner("`helm/specdec/Chart.yaml` and the `# --` comments of `values.yaml`"),
        f"# {chart['name']}",
        "",
        f"Version: {chart['version']} · AppVersion: {chart['appVersion']} · "
        f"Kubernetes: `{chart['kubeVersion']}`",
        "",
        " ".join(chart["description"].split()),
        "",
        "## Before you install",
        "",
        "- **Images.** The images are not published: build them with `make images` and push "
        "them to a registry the cluster pulls from, then set `images.prefix` "
        "([Container images](../../docs/deploy/images.md)). The drafter and verifier images "
        "carry a CUDA build of torch by default (`<role>.image.torchVariant: cu128`).",
        "- **Models.** By default a Job downloads the models once into a ReadWriteMany "
        "PersistentVolumeClaim that every replica mounts read-only (`models.*`).",
        "- **Optional CRDs.** KEDA, the Gateway API and the Prometheus Operator are needed "
        "only by the values that render their objects.",
        "",
        "## Install",
        "",
        "```bash",
        "make images IMAGE_PREFIX=registry.example.com/specdec   # then push the three images",
        "helm install specdec helm/specdec -n specdec --create-namespace \\",
        "  --set images.prefix=registry.example.com/specdec",
        "```",
        "",
        "Complete values files in `examples/`: "
        + ", ".join(f"[`{name}`](examples/{name})" for name in examples)
        + ". How the pieces fit: [Kubernetes with Helm](../../docs/deploy/helm.md).",
        "",
        "## Values",
        *tables(root, heading="###"),
    ]
    return "\n".join(lines) + "\n"
