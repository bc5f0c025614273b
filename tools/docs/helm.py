"""The Helm chart's values table, generated from helm/specdec/values.yaml (helm-docs style).

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

VALUES = Path("helm/specdec/values.yaml")
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


def render(root: Path) -> str:
    values = documented((root / VALUES).read_text())
    lines = [
        banner("the `# --` comments of `helm/specdec/values.yaml`"),
        "# Helm chart values",
        "",
        "Every value of the `helm/specdec` chart, with its default; "
        "`values.schema.json` beside `values.yaml` checks them at install. Set them with "
        "`--set key=value` or a values file (`-f`); `helm/specdec/examples/` holds complete "
        "values files. See [Kubernetes with Helm](../deploy/helm.md) for how the pieces fit.",
    ]
    section = None
    for v in values:
        top = f"`{v.path[0]}`" if len(v.path) > 1 else "Chart-wide"
        if top != section:
            section = top
            lines += ["", f"## {top}", "", "| key | type | default | description |"]
            lines.append("| --- | --- | --- | --- |")
        default = json.dumps(v.default, separators=(",", ":"))
        lines.append(
            f"| `{'.'.join(v.path)}` | {_type(v.default)} | {code(default)} "
            f"| {cell(v.description)} |"
        )
    return "\n".join(lines) + "\n"
