"""The CLI reference page, generated from the `specdec` command's argparse parsers.

Every command and subcommand (`generate`, `loadtest`, `serve drafter|verifier|gateway`,
`up`, `demo`, `models ...`, `bench`) with every flag: its default, the environment variable
that sets it, and its help. The parsers are built with every SPECDEC_* variable unset, so
the defaults are the code's, not the environment's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from specdec.tools.docs.common import banner, cell, code

# `add_setting` (specdec.common.settings) ends a help with "[env NAME; default VALUE]".
SETTING = re.compile(r"\s*\[env (?P<env>[A-Z0-9_]+); default .*\]$")
MENTIONED_ENV = re.compile(r"(?:\$|\[env )(?P<env>(?:SPECDEC|OPENAI|REDIS)_[A-Z0-9_]+)")


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("serve", "drafter")
    parser: argparse.ArgumentParser
    help: str

    @property
    def name(self) -> str:
        return " ".join(("specdec", *self.path))


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # option strings, or the positional's metavar
    metavar: str
    default: str
    env: str
    help: str


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """SPECDEC_* unset while the parsers are built: their defaults read the environment."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPECDEC_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    from specdec.cli import build_parser as specdec_parser

    with _clean_environment():
        return specdec_parser()


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help: str = ""):
    """Every command under `parser`, depth first, subcommands in the order they were added."""
    sub = _subparsers(parser)
    if path:
        yield Command(path, parser, parser.description or help)
    if sub is None:
        return
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, child in sub.choices.items():
        yield from commands(child, (*path, name), helps.get(name, ""))


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """The parser's own arguments (no -h, no subcommand choice)."""
    required_groups = {
        id(a): g for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions
    }
    out = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help = action.help or ""
        if help == argparse.SUPPRESS:
            continue
        if "%(" in help:
            help = help % {**vars(action), "prog": parser.prog}
        env = ""
        if m := SETTING.search(help):
            env, help = m.group("env"), help[: m.start()]
        elif m := MENTIONED_ENV.search(help):
            env = m.group("env")
        if action.choices and not isinstance(action.choices, range):
            choices = ", ".join(map(str, action.choices))
            if choices not in help:
                help = f"{help} (one of: {choices})" if help else f"one of: {choices}"
        shown = action.metavar if isinstance(action.metavar, str) else None
        names = tuple(action.option_strings) or (shown or action.dest,)
        out.append(
            Flag(
                names=names,
                metavar=_metavar(action),
                default=_default(action, required_groups.get(id(action))),
                env=env,
                help=help,
            )
        )
    return out


def _metavar(action: argparse.Action) -> str:
    if not action.option_strings or action.nargs == 0:
        return ""
    if isinstance(action.metavar, str):
        return action.metavar
    return action.dest.upper()


def _default(action: argparse.Action, group) -> str:
    if group is not None:
        others = [a.option_strings[0] for a in group._group_actions if a is not action]
        return "required (or " + " / ".join(others) + ")"
    if not action.option_strings and action.nargs in ("*", "?"):
        return "optional"
    if action.required:
        return "required"
    value = action.default
    if value is None or value == argparse.SUPPRESS or value == []:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else '""'


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or build_parser()
    cmds = list(commands(parser))
    lines = [
        banner("the argparse parsers of the `specdec` command"),
        "# CLI reference",
        "",
        "`specdec` is one command with subcommands. `generate` and `loadtest` come with the "
        "SDK (`specdec-sdk`), `serve` with the services (`specdec-common`, which runs the services installed beside it), `up`, `demo`, "
        "`models` and `bench` with the tooling (`specdec-tools`). Every flag of `specdec serve` can also be set by the environment "
        "variable beside it (the flag wins); a malformed value stops start-up with a message "
        "naming the setting. See [Configuration](configuration.md) for what the settings do.",
        "",
        "Every boolean is a pair of flags, `--flag` and `--no-flag` (the environment variable "
        "of a `serve` setting reads `true` or `false`). `specdec --version` prints the "
        "version.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for c in cmds:
        lines.append(f"| [`{c.name}`](#{anchor(c)}) | {cell(c.help)} |")
    for c in cmds:
        lines += ["", f"## `{c.name}` {{#{anchor(c)}}}", ""]
        if c.help:
            lines += [cell(c.help), ""]
        fs = flags(c.parser)
        sub = _subparsers(c.parser)
        if sub is not None:
            names = ", ".join(f"[`{n}`](#{anchor_of((*c.path, n))})" for n in sub.choices)
            lines += [f"Subcommands: {names}.", ""]
        if not fs:
            continue
        lines += ["| flag | default | environment | description |", "| --- | --- | --- | --- |"]
        for f in fs:
            name = ", ".join(code(f"{n} {f.metavar}".strip()) for n in f.names)
            env = code(f.env) if f.env else ""
            lines.append(f"| {name} | {code(f.default)} | {env} | {cell(f.help)} |")
    envs = sorted(
        {(f.env, c.name, f.names[0]) for c in cmds for f in flags(c.parser) if f.env},
    )
    lines += [
        "",
        "## Environment variables {#environment}",
        "",
        "| variable | sets |",
        "| --- | --- |",
    ]
    by_env: dict[str, list[str]] = {}
    for env, name, flag in envs:
        by_env.setdefault(env, []).append(f"`{name} {flag}`")
    for env, where in sorted(by_env.items()):
        lines.append(f"| `{env}` | {', '.join(where)} |")
    return "\n".join(lines) + "\n"


def anchor(c: Command) -> str:
    return anchor_of(c.path)


def anchor_of(path: tuple[str, ...]) -> str:
    return "specdec-" + "-".join(path)
