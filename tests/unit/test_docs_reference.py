"""The generated reference pages in docs/reference/ are fresh and complete.

Fresh: each committed page equals what `make docs-gen` writes now (as tests/unit/test_protos.py
does for the stubs). Complete: checked against the source itself, not against the generator:
every RPC, message, field, enum and enum value in the .proto text; every command and flag of
the argparse parsers, with its environment variable; every key of values.yaml; every name the
SDK exports.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from specdec.tools.docs.__main__ import pages

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


@pytest.mark.parametrize("page", sorted(str(p) for p in pages(ROOT)))
def test_generated_page_is_fresh(page):
    render = pages(ROOT)[Path(page)]
    committed = (ROOT / page).read_text()
    assert committed == render(), f"{page} is stale: run `make docs-gen`"


def _sections(text: str, level: str) -> dict[str, str]:
    """Heading title (without its {#id}) -> the text under it, up to the next such heading."""
    out: dict[str, str] = {}
    parts = re.split(rf"^{level} (.+)$", text, flags=re.M)
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        out[re.sub(r"\s*\{#[^}]*\}$", "", title).strip("`")] = body
    return out


def _proto_elements(text: str):
    """(kind, scope, name) of every service, rpc, message, field, enum and enum value in a
    .proto file's text: a brace-counting reading of the source, independent of protoc."""
    text = re.sub(r"//.*", "", text)
    stack: list[tuple[str, str]] = []
    for token in re.finditer(
        r"\b(service|message|enum|oneof)\s+(\w+)\s*\{|\brpc\s+(\w+)\s*\(|"
        r"^\s*(?:repeated\s+|optional\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+|"
        r"^\s*([A-Z][A-Z0-9_]+)\s*=\s*-?\d+|(\})",
        text,
        flags=re.M,
    ):
        kind, name, rpc, field, value, close = token.groups()
        if kind:
            scope = stack[-1][1] if stack and stack[-1][0] == "message" else ""
            if kind != "oneof":
                yield kind, scope, name
            full = f"{scope}.{name}" if scope else name
            stack.append((kind, full if kind != "oneof" else stack[-1][1]))
        elif rpc:
            yield "rpc", stack[-1][1], rpc
        elif field and stack and stack[-1][0] in ("message", "oneof"):
            yield "field", stack[-1][1], field
        elif value and stack and stack[-1][0] == "enum":
            yield "value", stack[-1][1], value
        elif close and stack:
            stack.pop()


def test_grpc_reference_is_complete():
    page = (REFERENCE / "grpc.md").read_text()
    headings = _sections(page, "###")
    protos = sorted((ROOT / "protos" / "specdec" / "v1").glob("*.proto"))
    assert protos
    seen = 0
    for proto in protos:
        for kind, scope, name in _proto_elements(proto.read_text()):
            seen += 1
            where = f"{proto.name}: {kind} {scope}.{name}".replace(": .", ": ")
            if kind in ("service", "message", "enum"):
                full = f"{scope}.{name}" if scope else name
                assert full in headings, f"{where} has no section in docs/reference/grpc.md"
            else:
                assert scope in headings, f"{where}: no section {scope}"
                assert f"| `{name}` |" in headings[scope], f"{where} missing from its table"
    assert seen > 100  # the reading found the protos' elements, not nothing


def _parsers():
    from specdec.tools.docs.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, (*path, name))

    return list(walk(build_parser(), ()))


def test_cli_reference_is_complete():
    page = (REFERENCE / "cli.md").read_text()
    sections = _sections(page, "##")
    parsers = _parsers()
    names = {" ".join(("specdec", *path)) for path, _ in parsers if path}
    assert {"specdec serve drafter", "specdec serve verifier", "specdec serve gateway"} <= names
    assert {"specdec generate", "specdec loadtest", "specdec up", "specdec models install"} <= names
    flags = 0
    for path, parser in parsers:
        if not path:
            continue
        name = " ".join(("specdec", *path))
        assert name in sections, f"`{name}` has no section in docs/reference/cli.md"
        body = sections[name]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.help == argparse.SUPPRESS:  # an old spelling, still read, not shown
                continue
            for option in action.option_strings or [action.metavar or action.dest]:
                flags += 1
                rows = [line for line in body.splitlines() if f"`{option}" in line]
                assert rows, f"`{name} {option}` missing from docs/reference/cli.md"
                env = re.search(r"\[env ([A-Z0-9_]+)", action.help or "")
                if env:
                    assert any(f"`{env.group(1)}`" in r for r in rows), (
                        f"`{name} {option}`: its variable {env.group(1)} is not beside it"
                    )
    assert flags > 100


def _leaves(data, path=()):
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from _leaves(value, (*path, str(key)))
    else:
        yield path


def test_helm_values_reference_is_complete():
    text = (ROOT / "helm" / "specdec" / "values.yaml").read_text()
    page = (REFERENCE / "helm-values.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    comments = sum(1 for line in text.splitlines() if line.strip().startswith("# --"))
    assert len(rows) == comments, "one row per `# --` comment of values.yaml"
    undocumented = [
        ".".join(leaf)
        for leaf in _leaves(yaml.safe_load(text))
        if not any(".".join(leaf[:i]) in rows for i in range(1, len(leaf) + 1))
    ]
    assert not undocumented, f"values without a `# --` comment: {undocumented}"


def test_sdk_reference_names_every_export():
    import specdec.sdk

    page = (REFERENCE / "sdk.md").read_text()
    documented = set(re.findall(r"^::: specdec\.sdk\.(\w+)$", page, flags=re.M))
    missing = sorted(set(specdec.sdk.__all__) - documented)
    assert not missing, f"docs/reference/sdk.md lacks `::: specdec.sdk.X` for {missing}"


def test_configuration_reference_is_complete():
    """docs/reference/configuration.md has every setting of `specdec serve gateway`,
    `drafter` and `verifier`, read from the parsers themselves: a row with its flag, its
    variable beside it, and the default the flag has (a role's own port in its role's
    words)."""
    page = (REFERENCE / "configuration.md").read_text()
    rows: dict[str, list[str]] = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            rows.setdefault(cells[0].strip("`"), []).append(line)
    parsers = dict(_parsers())
    checked = 0
    for role in ("gateway", "drafter", "verifier"):
        for action in parsers[("serve", role)]._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[0]
            assert flag in rows, f"`serve {role} {flag}` missing from configuration.md"
            env = re.search(r"\[env ([A-Z0-9_]+)", action.help).group(1)
            default = action.default
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            stated = [
                line
                for line in rows[flag]
                if f"`{env}`" in line
                and (
                    f"| `{shown}` |" in line
                    or (default in (None, "") and "| none |" in line)
                    or (default is None and "| required |" in line)
                    or f"{shown} ({role})" in line
                )
            ]
            assert stated, f"`serve {role} {flag}`: no row with {env} and default {shown!r}"
            checked += 1
    assert checked > 80
